"""The one module that sets process state when ``helpers`` is imported; it runs first.

- ``KINETO_LOG_LEVEL=6`` (unless set): the CPU memory meter runs the torch profiler, whose Kineto
  backend otherwise logs two lines to stderr on every call. Read when torch first loads its
  profiler, which ``helpers`` never does at import, so the order of imports does not matter.
- ``TRITON_INTERPRET=1`` (unless set) on a machine without CUDA: Triton kernels run on a CPU only
  under its interpreter. Triton reads the variable when a kernel is defined (``@triton.jit``): ours
  are defined after this module runs, but Triton's own library functions (``tl.max``, ``tl.sum``,
  ...) are defined when triton is imported. If triton came first, they are defined again here so
  that an interpreted kernel can call them.
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

from helpers.cce.device import pretend, pretended_card  # noqa: E402

if pretended_card() is not None:
    pretend(pretended_card())
