"""The one module that sets process state when ``helpers`` is imported; it runs first.

- ``KINETO_LOG_LEVEL=6`` (unless set): the CPU memory meter runs the torch profiler, whose Kineto
  backend otherwise logs two lines to stderr on every call. Read when torch first loads its
  profiler, which ``helpers`` never does at import, so the order of imports does not matter.
- ``TRITON_INTERPRET=1`` (unless set) on a machine without CUDA: Triton kernels run on a CPU only
  under its interpreter. Triton reads the variable when a kernel is defined (``@triton.jit``): ours
  are defined after this module runs, but Triton's own library functions (``tl.max``, ``tl.sum``,
  ...) are defined when triton is imported. If triton came first, they are defined again here so
  that an interpreted kernel can call them.
- Under the interpreter, ``interpreter_problem``: a Triton whose interpreter turns a scalar into a
  Python int with ``int(array)``, which NumPy 2.4 and later refuse for its one-element arrays
  (triton-lang/triton#9171: Triton 3.6 with NumPy 2.5 is one such pair), fails in every kernel that
  loops to a runtime bound, deep in the kernel ("only 0-dimensional arrays can be converted to
  Python scalars"). Importing ``helpers`` then raises at once, saying what to install instead. And NumPy's
  RuntimeWarnings from inside the interpreter for a division by zero or an overflow (log of 0, 2^x to inf:
  the kernels' IEEE arithmetic, deliberate) are silenced; "invalid value" (a NaN made) is not.
- Under the interpreter, ``patch_device_calls_once``: Triton's interpreter patches ``triton.language`` at every
  call of a ``@triton.jit`` helper inside a kernel (``exp_of``, ``soft_cap``: thousands a launch), though the
  patches of that helper's modules hold from its first call to the launch's end; a third of a CPU test's
  time. Each helper is patched at its first call in a launch, as before, and not again in that launch.
- ``HELPERS_PRETEND=<card>`` (set by ``python -m helpers run --pretend <card>``; the older
  ``HELPERS_PRETEND_T4=1`` means ``t4``): this process is a pretend card, its allocator capped at
  the card's memory and its kernels held to the card's shared memory
  (``helpers.cce.device.pretend``).
"""

import importlib
import os
import sys

os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402


def _define_triton_library_for_the_interpreter() -> None:
    """Triton was imported before TRITON_INTERPRET=1: re-run its library modules, whose functions
    are ``@triton.jit``, and rebind the names ``triton.language`` exported from them."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    for name in ("triton.language.standard", "triton.language.random"):
        module = sys.modules.get(name)
        if module is None:
            continue
        for key, value in vars(importlib.reload(module)).items():
            if isinstance(getattr(tl, key, None), JITFunction):
                setattr(tl, key, value)


if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:
        _define_triton_library_for_the_interpreter()


def interpreter_problem(numpy_version: str, interpreter_source: str) -> str | None:
    """Why the Triton interpreter whose module source is ``interpreter_source`` cannot run our kernels
    with this NumPy (None: it can): its tensors' ``__index__`` is ``int(self.handle.data)`` on a
    one-element array, an error from NumPy 2.4 on (later Triton squeezes the array first)."""
    major, minor = (int(part) for part in numpy_version.split(".")[:2])
    if (major, minor) < (2, 4) or "int(self.handle.data)" not in interpreter_source:
        return None
    return (f"the Triton interpreter (TRITON_INTERPRET=1, how Triton kernels run on a CPU) of this triton cannot run "
            f"with numpy {numpy_version}: it converts one-element arrays to Python ints, which numpy 2.4 and later "
            "refuse (triton-lang/triton#9171), so every kernel looping to a runtime bound fails. Install "
            "'numpy<2.4', or a triton whose interpreter squeezes the array first (3.9 does)")


def patch_device_calls_once(interpreter) -> bool:
    """Make the Triton ``interpreter`` module patch each ``@triton.jit`` helper's language modules once a
    launch instead of at every call (module doc); True when done. A launch (``GridExecutor``) patches and
    restores as before; within it (per thread, as launches run), a helper's first call patches as Triton
    does (its modules may be ones the kernel's do not import) and its later calls skip the repeat, which
    would set the same values again. Where the interpreter is not the shape this reads (a Triton whose
    launch or helper call is written otherwise), nothing is changed."""
    import inspect
    import threading

    original = getattr(interpreter, "_patch_lang", None)
    try:
        launch = inspect.getsource(interpreter.GridExecutor.__call__)
        helper = inspect.getsource(interpreter.InterpretedFunction.__call__)
    except (AttributeError, OSError, TypeError):
        return False
    if (original is None or getattr(original, "once_a_launch", False)
            or "patch_scope = _patch_lang(self.fn)" not in launch or "patch_scope.restore()" not in launch
            or "_patch_lang(self.fn)" not in helper):
        return False
    state = threading.local()

    class _Launch:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            state.patched = None
            self.scope.restore()

    def _patch_lang(fn):
        patched = getattr(state, "patched", None)
        if patched is None:  # a launch: patch, and restore at its end
            launch = _Launch(original(fn))
            state.patched = set()
            return launch
        if fn not in patched:  # a helper's first call in this launch: as Triton does (the scope is dropped)
            patched.add(fn)
            return original(fn)
        return None  # a repeat: its modules are patched until the launch restores them

    _patch_lang.once_a_launch = True
    _patch_lang.original = original
    interpreter._patch_lang = _patch_lang
    return True


if os.environ.get("TRITON_INTERPRET") == "1":
    import inspect

    import numpy

    try:
        import triton.runtime.interpreter as _interpreter

        _problem = interpreter_problem(numpy.__version__, inspect.getsource(_interpreter))
    except (ImportError, OSError, TypeError, ValueError):  # no triton, or its source is not readable: nothing to judge
        _problem = None
    if _problem:
        raise RuntimeError(_problem)
    # The kernels' IEEE arithmetic (log 0 = -inf for an empty row, 2^x overflowing to inf in the soft cap)
    # is deliberate; under the interpreter NumPy warns at each such value, in red under a notebook's cells.
    import warnings

    for deliberate in ("divide by zero encountered", "overflow encountered"):  # "invalid value" (a NaN made) stays
        warnings.filterwarnings("ignore", message=deliberate, category=RuntimeWarning, module="triton.runtime.interpreter")
    if "triton.runtime.interpreter" in sys.modules:
        patch_device_calls_once(sys.modules["triton.runtime.interpreter"])


from helpers.cce.device import pretend, pretended_card  # noqa: E402

if pretended_card() is not None:
    pretend(pretended_card())
