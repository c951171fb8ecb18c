"""The memory theory: what each loss method holds at its peak, and how many tokens fit a card.

- **theory** (``predicted_peak_bytes``): what each method holds at its peak, from the arithmetic
  and from reading its code, checked against measurements (tests/compare/test_sweep.py on the CPU;
  the article's T4 table and our earlier H200 measurements on GPUs);
- **how many tokens fit** (``largest_n_that_fits``, ``fits_table``): the same theory asked the other
  way round, for this card, a T4 or any card (notebook 02's widget).

The sweep (``helpers.compare.sweep``) puts the theory beside each point it measures.
Bytes everywhere; GB means 10^9 bytes (the article's unit).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from helpers.compare.units import dtype_bytes, dtype_name, format_bytes, lower_bound_bytes, torch_dtype
from helpers.compare.measure import MemoryCap
from helpers.compare.methods import chunk_rows
from helpers.cce.device import T4_CAPABILITY, T4_MEMORY_BYTES, DeviceInfo

# ---------------------------------------------------------------------------------------------
# Theory: what each method holds at its peak (bytes above the inputs E, C, x)
# ---------------------------------------------------------------------------------------------


def input_bytes(N: int, V: int, D: int, dtype: torch.dtype | str) -> int:
    """E (N, D), C (V, D) and the int64 targets x (N,): resident before the loss runs."""
    return (N * D + V * D) * dtype_bytes(dtype) + N * 8


def _naive(N, V, D, b, capability):
    # Forward: z = E @ C.T in the input dtype (N V b) is upcast to fp32 (N V 4) and dies right
    # after the cast; log_softmax saves its fp32 output (N V 4) for backward. Backward, inside
    # log_softmax's backward, three fp32 N×V tensors are alive at once: the saved log-softmax, the
    # gradient nll_loss hands it (dense, N V 4) and the gradient it returns (N V 4). That is the
    # peak: 12 bytes per logit in every input dtype. After it: the fp32 gradient, its cast to the
    # input dtype (16-bit inputs only), then dE and dC.
    after = (4 + (b if b < 4 else 0)) * N * V + (N * D + V * D) * b
    return max(12 * N * V, after)


def _torch_compile(N, V, D, b, capability):
    # Inductor fuses upcast, softmax and the loss into one kernel that keeps only the input-dtype
    # logits (N V b) for backward; backward writes the logits' gradient over them (same size,
    # same dtype), then the two matmuls add dE and dC. Peak: one N×V tensor in the input dtype.
    return N * V * b + (N * D + V * D) * b


def _chunked(N, V, D, b, capability):
    # methods.ChunkedLinearCrossEntropy. Backward holds dE (N D b), the fp32 accumulator dC32
    # (V D 4), for 16-bit inputs an fp32 copy of C (V D 4) and of the chunk's rows of E, and fp32
    # (rows, V) blocks at the peak: raw logits, (z - lse) and G = exp(z - lse); each chunk's G is
    # freed before the next chunk starts. The last step casts dC32 to the input dtype (V D b) while
    # dC32 and the copy of C are still alive.
    rows = min(N, chunk_rows(V))
    blocks = 3
    upcast = b < 4
    per_chunk = N * D * b + V * D * 4 + upcast * (V * D * 4 + rows * D * 4) + blocks * rows * V * 4
    last_step = N * D * b + V * D * 4 + upcast * (V * D * 4 + V * D * b)
    return max(per_chunk, last_step)


def _liger(N, V, D, b, capability):
    # liger_kernel.ops.fused_linear_cross_entropy: dE and dC (input dtype) computed during the
    # forward pass, over row chunks whose (rows, V) logits are about the size of E:
    # rows = next_pow2(ceil(N / ceil(V / D))). The kernel writes the logits' gradient over the
    # logits. dC accumulates in place (addmm) only on CUDA sm_80+ in fp16/bf16. Elsewhere each
    # chunk adds `mm(G^T, E_chunk).float()` to dC: a (V, D) matmul result and its fp32 copy (one
    # tensor in fp32). On the CPU, adding that fp32 tensor into a 16-bit dC in place allocates two
    # more fp32 (V, D) temporaries (CUDA casts inside the kernel instead).
    rows = min(N, _next_power_of_2(math.ceil(N / math.ceil(V / D))))
    if capability is not None and capability >= (8, 0) and b == 2:
        temporaries = 0
    elif b == 4:
        temporaries = V * D * 4
    elif capability is not None:
        temporaries = V * D * (b + 4)
    else:
        temporaries = V * D * (4 + 2 * 4)
    return (N * D + V * D) * b + rows * V * b + temporaries + N * 4


def _ours(N, V, D, b, capability):
    # helpers.cce with its defaults (backward "gemm"): the forward keeps O(N) (lse per row and vocabulary
    # split); the backward allocates dE and dC, for 16-bit inputs dE's fp32 accumulator (n_chunk, D)
    # and, with several row chunks, dC rows staged in fp32 (v_chunk, D) before each fold. Each G chunk
    # lives in dE's or dC's rows not yet written, or in a buffer where neither has room (fp32):
    # helpers.cce.gemm_plan says which, with chunk sizes rounded to the BLOCK_V of the configuration
    # tier this capability gets. On the CPU the products run in fp32 ("upcast"): 16-bit operands
    # are copied to fp32 for each product, and the staged dC rows are used even for one row chunk.
    from helpers.cce.backward_gemm import gemm_plan
    from helpers.cce.kernels.configs import tier_for_capability

    dtype = torch.float32 if b == 4 else torch.float16
    block_v = tier_for_capability(capability).backward_gemm_for(dtype).BLOCK_V
    plan = gemm_plan(N, V, D, dtype, block_v)
    n_chunk, widest = plan.n_chunk, plan.widest
    staged = min(plan.v_chunk, widest)  # dC's rows staged in fp32, a piece of a chunk at a time
    low = b < 4
    several = N > n_chunk
    scratch = plan.buffer_elements * b + low * n_chunk * D * 4
    if low and (several or capability is None):
        scratch += staged * D * 4
    if low and capability is None:  # the larger of the two products' fp32 operand copies
        scratch += max(n_chunk * widest + widest * D, n_chunk * staged + n_chunk * D) * 4
    # Per row, fp32: the forward's lse, and the backward's row gradient (w, w / max w and the three
    # coefficients of G, helpers.cce.gradients.RowGradient).
    per_row = 24 * N
    return (N * D + V * D) * b + scratch + per_row


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _floor(N, V, D, b, capability):
    # No formula beyond the floor: the gradients plus O(N) per-row state, which is what these
    # methods are designed to reach (Apple CCE measured within 0.5% of it on an H200).
    return (N * D + V * D) * b


THEORY: dict[str, tuple[Callable[..., int], str]] = {
    "naive": (_naive, "12·N·V: three fp32 N×V tensors inside log_softmax's backward"),
    "torch_compile": (_torch_compile, "N·V·b + (N·D + V·D)·b: the input-dtype logits, then dE, dC"),
    "chunked": (_chunked, "dE + 2 fp32 (V, D) + 4 fp32 (chunk, V) blocks (3 if one chunk); chunk = 256 MiB / 4V rows"),
    "liger": (_liger, "(N·D + V·D)·b + a (chunk, V) logit block of about N·D elements, + (V, D) "
              "temporaries for dC except on sm_80+ in 16-bit"),
    "apple_cce": (_floor, "(N·D + V·D)·b: the floor (its O(N) LSE not counted)"),
    "ours": (_ours, "(N·D + V·D)·b + 16-bit: dE's fp32 accumulator + fp32: a G chunk (16-bit G lives "
             "in dE's and dC's rows not yet written; helpers.cce.gemm_plan) + 24 bytes of per-row state"),
}


def predicted_peak_bytes(
    method: str,
    N: int,
    V: int,
    D: int,
    dtype: torch.dtype | str,
    capability: tuple[int, int] | None = None,
) -> int | None:
    """Peak bytes above the inputs that ``method`` should need for one forward+backward, or None
    for a method with no formula here. ``capability``: the CUDA compute capability (None: CPU);
    it decides which code path Liger takes."""
    if method not in THEORY:
        return None
    formula, _ = THEORY[method]
    return int(formula(N, V, D, dtype_bytes(dtype), tuple(capability) if capability else None))


def capability_for(method: str, info) -> tuple[int, int] | None:
    """The compute capability whose code path ``method`` takes on the device ``info`` describes:
    on a pretend T4 our kernels take the T4's (they choose through ``helpers.cce.device``), every other
    method the real card's (a peer picks its paths from the card itself)."""
    return info.capability if method == "ours" or not info.pretend_t4 else info.real_capability


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
    (``capabilities``: per method, where one differs, as ours does on a pretend T4)."""

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
    if method not in THEORY:
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
    """Markdown: per method (rows) and card (columns), the largest N whose loss step fits, by the
    theory. ``cannot_run``: {card label: {method: why}} for methods a card cannot run at all."""
    labels, cannot_run = labels or {}, cannot_run or {}
    lines = ["| method | " + " | ".join(c.describe() for c in cards) + " |", "|---|" + "---:|" * len(cards)]
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
    "THEORY",
    "Card",
    "capability_for",
    "card",
    "first_oom_n",
    "fits_table",
    "input_bytes",
    "largest_n_that_fits",
    "lower_bound_bytes",
    "predicted_peak_bytes",
    "sizes_that_fit",
    "t4_card",
    "this_card",
]
