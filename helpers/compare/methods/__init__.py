"""The one registry of loss methods: ours, the peers, and the baselines they are measured against.

Every method has one signature,

    method(E, C, x, *, bias=None, ignore_index=-100, reduction="mean", softcap=None) -> loss

with E (N, D), C (V, D), x (N,), bias (V,) or None, and the semantics of ``helpers.spec``
(``F.cross_entropy``'s loss on the soft-capped logits; how closely each comes to it in float64 is what
the gate measures). Autograd through the result gives dE and dC.
What a method can take is a field of its entry, read by every caller that must know: a bias
(``supports_bias``; a method without one refuses a bias), the skipped tiles (``counts_skips``).

A method that cannot run on the device at hand says why, in a sentence, through
``method.why_unavailable(device, dtype, softcap=...)``; calling it anyway raises
``MethodUnavailable`` with that sentence. Nothing is skipped or swapped silently.

Each entry also carries its memory theory (``peak_bytes``, ``peak_formula``): the bytes above
the inputs it holds at its peak, from the arithmetic and from reading its code; written beside
its loss so that a change to one is seen next to the other. ``helpers.compare.theory`` asks them.
A formula takes the options of its loss that change its memory, under the loss's own names
(chunked's ``rows``, ours' launch ``configs``): a test passes the same value to both.

Presets are methods too: a registered method with other options (``ours_nofilter``: our loss with
the filter off; ``exact``: the naive loss on inputs upcast to fp32, the convergence A/B's
yardstick). They say whose preset they are (``preset_of``); ``primary_methods`` leaves them out
of the comparisons that would only repeat their parent (the gate, the sweep, the benchmark).

Where a peer's own convention differs from torch's, its adapter maps it and says so in ``notes``
(Liger returns 0 for a mean over zero kept tokens; torch, and so every method here, returns NaN).

This module is the registry; what an entry is lives in ``entry``, the entries beside their kind,
each with its loss, availability and formula: ``baselines``, ``peers``, ``ours``.
"""

from __future__ import annotations

import torch

from helpers.compare.methods.baselines import CHUNKED, EXACT, NAIVE, TORCH_COMPILE
from helpers.compare.methods.entry import Method, MethodUnavailable, Reason
from helpers.compare.methods.ours import (
    BUDGET_CURVE,
    OURS,
    OURS_BUDGET_1G,
    OURS_BUDGET_4G,
    OURS_BUDGET_64G,
    OURS_BUDGET_256M,
    OURS_BUDGET_512M,
    OURS_BUDGET_AUTO,
    OURS_BUDGET_MIN,
    OURS_GEMM,
    OURS_GRAPHS,
    OURS_NOFILTER,
    OURS_SPARSE,
)
from helpers.compare.methods.peers import APPLE_CCE, APPLE_CCE_KAHAN_FULL_C, APPLE_CCE_NOFILTER, LIGER, TORCH_LCE
from helpers.spec import REDUCTIONS

METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"a method named {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def method_label(name: str) -> str:
    """A registered method's label (its name where it is not registered): the one name a person reads."""
    return METHODS[name].label if name in METHODS else name


def get_method(name: str) -> Method:
    if not isinstance(name, str):
        raise TypeError(f"name must be a method's name (a str), got {type(name).__name__}; registered: {', '.join(METHODS)}")
    if name not in METHODS:
        raise KeyError(f"no method {name!r}; registered: {', '.join(METHODS)}")
    return METHODS[name]


def primary_methods() -> list[str]:
    """Every registered method but the presets: what the gate, the sweep and the benchmark compare."""
    return [n for n, m in METHODS.items() if m.preset_of is None]


def availability(
    device: torch.device | str, dtype: torch.dtype, names: list[str] | None = None
) -> dict[str, Reason]:
    """{method name: None if it runs here, else why not} for each named method (default: the
    primary ones)."""
    return {n: get_method(n).why_unavailable(device, dtype) for n in (names or primary_methods())}


# The registration order is the order of every table and legend, and of the colours
# (plots.method_colors): the primary methods, then the presets. Later presets come last, after
# every colour the others already had, so that those stay put.
for _entry in (NAIVE, TORCH_COMPILE, CHUNKED, LIGER, APPLE_CCE, TORCH_LCE, OURS, OURS_NOFILTER, OURS_SPARSE, EXACT,
               APPLE_CCE_KAHAN_FULL_C, APPLE_CCE_NOFILTER, OURS_GEMM, OURS_BUDGET_256M, OURS_BUDGET_1G, OURS_BUDGET_4G, OURS_BUDGET_512M,
               OURS_BUDGET_64G, OURS_BUDGET_AUTO, OURS_GRAPHS, OURS_BUDGET_MIN):
    register(_entry)


__all__ = [
    "BUDGET_CURVE",
    "Method",
    "MethodUnavailable",
    "METHODS",
    "REDUCTIONS",
    "register",
    "get_method",
    "method_label",
    "primary_methods",
    "availability",
]
