"""helpers: memory-efficient linear cross-entropy, measured and taught.

Four layers, each importing only those below it: ``helpers.suite`` (runner, report, cold start,
Kaggle) → ``helpers.lab`` (what the notebooks need) → ``helpers.compare`` (the method registry,
the gate, measurement) → ``helpers.cce`` (our Cut Cross-Entropy: kernels and autograd) →
``helpers.spec`` (the float64 specification). The names a user wants are here:

    from helpers import linear_cross_entropy      # our loss: E (N, D), C (V, D), x (N,)
    loss = linear_cross_entropy(E, C, x)          # no (N, V) logits in memory
    get_method("liger")(E, C, x)                  # any registered method, one signature
    run_gate(["ours", "naive"], ...)              # against the float64 reference
    reference_loss_and_grads(E, C, x)             # the spec itself

Importing sets a few environment variables, in ``helpers.env`` only (see there).
"""

from helpers import env  # noqa: F401  (first: the environment, before any kernel is defined)
from helpers.cce import linear_cross_entropy, linear_cross_entropy_outputs, linear_kl_div
from helpers.cce.device import device_info, pretend, pretend_t4
from helpers.spec import reference_kl_div, reference_loss, reference_loss_and_grads, relative_error, validate_inputs

__version__ = "0.1.0"

# The comparison layer's names load on first use, so that ``import helpers.cce`` (which imports
# this package first) loads the library and the spec, not the registry of peers and the gate.
_LAZY = {name: "helpers.compare.gate" for name in ("GateCase", "GateReport", "gate_cases", "run_gate")}
_LAZY |= {name: "helpers.compare.methods" for name in ("METHODS", "Method", "MethodUnavailable", "get_method")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'helpers' has no attribute {name!r}")

__all__ = [
    "linear_cross_entropy",
    "linear_cross_entropy_outputs",
    "linear_kl_div",
    "METHODS",
    "Method",
    "MethodUnavailable",
    "get_method",
    "GateCase",
    "GateReport",
    "gate_cases",
    "run_gate",
    "reference_loss",
    "reference_kl_div",
    "reference_loss_and_grads",
    "relative_error",
    "validate_inputs",
    "device_info",
    "pretend",
    "pretend_t4",
]
