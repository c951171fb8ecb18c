"""helpers: memory-efficient linear cross-entropy, measured and taught.

The package behind the notebooks in ``notebooks/``:

- ``helpers.reference``: the specification and the float64 reference;
- ``helpers.methods``: the one registry of loss methods (ours, Liger, Apple CCE, torch, baselines);
- ``helpers.gate``: the correctness gate every method passes before it is measured;
- ``helpers.profiles``: the hardware found and the run sizes for it;
- ``helpers.runner``: ``python -m helpers run`` executes the suite headless with papermill.
"""

import os as _os

# The CPU memory measurement runs the torch profiler, whose Kineto backend otherwise logs two lines
# to stderr on every call. Read when torch loads its profiler, so set before torch is imported.
_os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch as _torch  # noqa: E402

# Triton kernels run on a CPU only under the interpreter, which must be switched on before triton is
# imported. On a machine without CUDA we switch it on, so "import helpers" is all a CPU user needs.
if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

from .device import pretend_t4 as _pretend_t4, pretending_t4 as _pretending_t4  # noqa: E402

if _pretending_t4():  # a process started by `python -m helpers run --pretend-t4`: cap it as a T4
    _pretend_t4()

from .methods import METHODS, Method, MethodUnavailable, available_methods, get_method  # noqa: E402
from .profiles import device_info, get_profile  # noqa: E402
from .reference import reference_loss, reference_loss_and_grads, validate_inputs  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "Method",
    "MethodUnavailable",
    "available_methods",
    "get_method",
    "device_info",
    "get_profile",
    "reference_loss",
    "reference_loss_and_grads",
    "validate_inputs",
]
