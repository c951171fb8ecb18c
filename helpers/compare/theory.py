"""The memory theory: what each loss method holds at its peak, and how many tokens fit a card.

- **theory** (``predicted_peak_bytes``): what each method holds at its peak, from the arithmetic
  and from reading its code (each method's formula lives on its registry entry,
  ``helpers.compare.methods.Method.peak_bytes``), checked against measurements (tests/compare/test_sweep.py on the CPU;
  the article's T4 table and our earlier H200 measurements on GPUs);
- **how many tokens fit** (``largest_n_that_fits``, ``fits_table``): the same theory asked the other
  way round, for this card, a T4 or any card (notebook 02's widget).

The sweep (``helpers.compare.sweep``) puts the theory beside each point it measures.
Bytes everywhere; GB means 10^9 bytes (the article's unit).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from helpers.compare.units import dtype_bytes, dtype_name, format_bytes, lower_bound_bytes, torch_dtype
from helpers.compare.measure import MemoryCap
from helpers.compare.methods import METHODS
from helpers.cce.device import T4_CAPABILITY, T4_MEMORY_BYTES, DeviceInfo

# ---------------------------------------------------------------------------------------------
# Theory: what each method holds at its peak (bytes above the inputs E, C, x)
# ---------------------------------------------------------------------------------------------


def input_bytes(N: int, V: int, D: int, dtype: torch.dtype | str) -> int:
    """E (N, D), C (V, D) and the int64 targets x (N,): resident before the loss runs."""
    return (N * D + V * D) * dtype_bytes(dtype) + N * 8


def predicted_peak_bytes(
    method: str,
    N: int,
    V: int,
    D: int,
    dtype: torch.dtype | str,
    capability: tuple[int, int] | None = None,
    **options,
) -> int | None:
    """Peak bytes above the inputs that ``method`` should need for one forward+backward, or None
    for a method with no formula (or none registered). ``capability``: the CUDA compute capability
    (None: CPU); it decides which code path Liger takes. ``options``: the loss's own options that
    change its memory (chunked's ``rows``, ours' launch ``configs``; left out: its defaults). The
    formula is the registry entry's (``Method.peak_bytes``)."""
    if method not in METHODS:
        return None
    return METHODS[method].predicted_peak_bytes(N, V, D, dtype, capability, **options)


def has_formula(method: str) -> bool:
    """Whether ``method`` is registered with a memory formula (``Method.peak_bytes``)."""
    return method in METHODS and METHODS[method].peak_bytes is not None


def capability_for(method: str, info) -> tuple[int, int] | None:
    """The compute capability whose code path ``method`` takes on the device ``info`` describes:
    on a pretend card our kernels take the card's (they choose through ``helpers.cce.device``), every
    other method the real card's (a peer picks its paths from the card itself)."""
    ours = method in METHODS and METHODS[method].kind == "ours"
    return info.capability if ours or not info.pretend else info.real_capability


def first_oom_n(
    method: str, Ns: Iterable[int], V: int, D: int, dtype, cap: MemoryCap, capability=None
) -> int | None:
    """The smallest N whose predicted peak does not fit under ``cap`` (None: every N fits)."""
    for N in sorted(Ns):
        need = predicted_peak_bytes(method, N, V, D, dtype, capability)
        room = cap.room_for(input_bytes(N, V, D, dtype))
        if need is not None and room is not None and need > room:
            return N
    return None


def sizes_that_fit(Ns: Iterable[int], V: int, D: int, dtype, cap: MemoryCap) -> list[int]:
    """The N at which the floor (dE + dC) fits under ``cap`` once the inputs are resident: where
    a method could run at all. Larger N are left out (no method can fit them on this card)."""
    fits = []
    for N in sorted(Ns):
        room = cap.room_for(input_bytes(N, V, D, dtype))
        if room is None or lower_bound_bytes(N, V, D, dtype) <= room:
            fits.append(N)
    return fits


# ---------------------------------------------------------------------------------------------
# How many tokens fit: the theory asked the other way round
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    """A card to ask "how many tokens fit?" about: what the process may use on it (``cap``), the
    dtype the loss runs in, and the compute capability whose code paths the methods take
    (``capabilities``: per method, where one differs, as ours does on a pretend card)."""

    label: str
    cap: MemoryCap
    dtype: str
    capability: tuple[int, int] | None
    capabilities: dict[str, tuple[int, int] | None] = field(default_factory=dict)

    def capability_of(self, method: str) -> tuple[int, int] | None:
        return self.capabilities.get(method, self.capability)

    def describe(self) -> str:
        usable = "no cap" if self.cap.usable_bytes is None else f"{format_bytes(self.cap.usable_bytes)} usable"
        return f"{self.label} ({usable}, {self.dtype})"


def card(label: str, memory_bytes: float, dtype: torch.dtype | str, capability: tuple[int, int] | None,
         memory_fraction: float = 0.9) -> Card:
    """A CUDA card of ``memory_bytes`` of which the process may use ``memory_fraction`` (the
    guardrail's share, as ``helpers.compare.measure.apply_memory_cap`` takes it). Bad values are
    refused with what was wrong."""
    if not (isinstance(memory_bytes, (int, float)) and math.isfinite(memory_bytes) and memory_bytes > 0):
        raise ValueError(f"the card's memory must be a positive number of bytes, got {memory_bytes!r}")
    if not (isinstance(memory_fraction, (int, float)) and 0 < memory_fraction <= 1):
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    if capability is not None and not (len(capability) == 2 and all(isinstance(c, int) for c in capability)):
        raise ValueError(f"capability must be (major, minor) or None, got {capability!r}")
    dtype = torch_dtype(dtype)
    if dtype == torch.bfloat16 and capability is not None and tuple(capability) < (8, 0):
        raise ValueError(f"bfloat16 needs bf16 tensor cores (sm_80 or newer); sm_{capability[0]}{capability[1]} "
                         "has none: train in float16 there")
    usable = int(memory_bytes * memory_fraction)
    cap = MemoryCap("cuda", usable, int(memory_bytes), memory_fraction)
    return Card(label, cap, dtype_name(dtype), tuple(capability) if capability else None)


def t4_card(memory_fraction: float = 0.9) -> Card:
    """A free Kaggle or Colab T4 in fp16 (it has no bf16 tensor cores), under the same guardrail."""
    return card("T4", T4_MEMORY_BYTES, "float16", T4_CAPABILITY, memory_fraction)


def this_card(info: DeviceInfo, cap: MemoryCap, dtype: torch.dtype | str, methods: Iterable[str]) -> Card:
    """The device the sweep ran on, under the sweep's own cap (on the CPU the simulated budget)."""
    label = f"this {info.name}" if info.is_cuda else "this CPU (simulated cap)"
    return Card(label, cap, dtype_name(dtype), info.capability, {m: capability_for(m, info) for m in methods})


def largest_n_that_fits(method: str, V: int, D: int, dtype: torch.dtype | str, cap: MemoryCap,
                        capability: tuple[int, int] | None = None) -> int | None:
    """The largest N whose loss step (forward and backward) fits under ``cap`` by the theory, with
    the inputs resident (``MemoryCap.room_for``); 0 when not even one token fits; None for a method
    with no formula. Only the loss step: weights, optimizer state and activations are not counted.

    Doubling, then bisection to one token: the theory grows with N, and where a chunk size steps
    (ours) the N returned fits and N + 1 does not."""
    for name, value in (("V", V), ("D", D)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    torch_dtype(dtype)  # refuses an unknown dtype by name
    if cap.usable_bytes is None:
        raise ValueError("no memory cap: every N fits; give the card's memory")
    if not has_formula(method):
        return None

    def fits(N: int) -> bool:
        room = cap.room_for(input_bytes(N, V, D, dtype))
        return room >= 0 and predicted_peak_bytes(method, N, V, D, dtype, capability) <= room

    if not fits(1):
        return 0
    good, bad = 1, 2
    while fits(bad):
        good, bad = bad, bad * 2
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def _tokens(N: int) -> str:
    """A token count to read: exact below 10,000, else rounded down to three significant digits
    (rounded down, so that what is printed still fits)."""
    if N < 10_000:
        return f"{N:,}"
    scale = 10 ** (len(str(N)) - 3)
    return f"{N // scale * scale:,}"


def fits_table(methods: Iterable[str], V: int, D: int, cards: list[Card], labels: dict[str, str] | None = None,
               cannot_run: dict[str, dict[str, str]] | None = None) -> str:
    """Markdown: per method (rows) and card (columns), the largest N whose loss step fits at the head
    (V, D), by the theory, under a line naming the head. ``cannot_run``: {card label: {method: why}} for methods a card cannot run at all."""
    labels, cannot_run = labels or {}, cannot_run or {}
    lines = [f"The largest N at this head (V = {V:,}, D = {D:,}), per card:", "",
             "| method | " + " | ".join(c.describe() for c in cards) + " |", "|---|" + "---:|" * len(cards)]
    notes = []
    for method in methods:
        cells = []
        for c in cards:
            why = cannot_run.get(c.label, {}).get(method)
            if why:
                notes.append(f"{labels.get(method, method)} on {c.label}: {why}")
                cells.append(f"cannot run [{len(notes)}]")
                continue
            n = largest_n_that_fits(method, V, D, c.dtype, c.cap, c.capability_of(method))
            cells.append("no formula" if n is None else "not one token" if n == 0 else _tokens(n))
        lines.append(f"| {labels.get(method, method)} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- [{i}] {note}" for i, note in enumerate(notes, 1)] if notes else []
    return "\n".join(lines)


__all__ = [
    "T4_CAPABILITY",
    "Card",
    "capability_for",
    "card",
    "first_oom_n",
    "fits_table",
    "has_formula",
    "input_bytes",
    "largest_n_that_fits",
    "lower_bound_bytes",
    "predicted_peak_bytes",
    "sizes_that_fit",
    "t4_card",
    "this_card",
]
