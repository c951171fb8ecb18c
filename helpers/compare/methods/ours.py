"""The registry's entries of this package's loss (``helpers.compare.methods``): ours, through
``helpers.cce.linear_cross_entropy``, and its presets (filter off; the sparse backward), with the
memory formula of its default "gemm" backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from helpers.cce import linear_cross_entropy, why_unavailable
from helpers.cce.kernels.configs import CCEConfigs, tier_for_capability
from helpers.cce.options import resolve_configs
from helpers.cce.schedules import choose_schedule
from helpers.compare.methods.entry import Method, Reason


# ---------------------------------------------------------------------------------------------
# ours: this package's Triton Cut Cross-Entropy (helpers.cce); its presets with the filter off and
# with the sparse backward.
# ---------------------------------------------------------------------------------------------


def _ours(**options) -> Callable[..., torch.Tensor]:
    def loss(E, C, x, *, bias=None, ignore_index=-100, reduction="mean", softcap=None, stats=None):
        return linear_cross_entropy(E, C, x, bias=bias, ignore_index=ignore_index, reduction=reduction,
                                    softcap=softcap, stats=stats, **options)

    return loss


def _ours_reason(device, dtype, softcap) -> Reason:
    return why_unavailable(device, dtype, softcap)


def ours_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None,
                    configs: CCEConfigs | None = None, memory_budget="default") -> int:
    # helpers.cce with its defaults (backward "gemm"): the forward keeps O(N) (lse per row and vocabulary
    # split); the backward allocates dE and dC, for 16-bit inputs dE's fp32 accumulator (n_chunk, D)
    # and, with several row chunks, dC rows staged in fp32 (v_chunk, D) before each fold. Each G chunk
    # lives in dE's or dC's rows not yet written, or in a buffer where neither has room (fp32):
    # helpers.cce.gemm_plan says which, with chunk sizes rounded to the BLOCK_V of the configuration
    # tier this capability gets. On the CPU the products run in fp32 ("upcast"): 16-bit operands
    # are copied to fp32 for each product, and the staged dC rows are used even for one row chunk.
    # ``configs``: linear_cross_entropy's launch configurations (None: the tier this capability gets).
    # ``memory_budget``: the loss's; the schedule it picks and its extra bytes are the loss's own
    # prediction (helpers.cce.schedules, the one place each schedule's formula lives).
    configs = configs or tier_for_capability(capability)
    dtype = torch.float32 if b == 4 else torch.float16
    device = torch.device("cuda" if capability is not None else "cpu")
    if memory_budget == "auto":  # what is free is the device's to say at run time: the least memory
        memory_budget = "min"
    # A default raised where it fits no three-product schedule (a T4 at a large head) is bounded at run time
    # by what is free too; this card's formula leaves that bound out (ask_free=False).
    schedule = choose_schedule(N, V, D, dtype, memory_budget, configs, need=(True, True, False), device=device,
                               ask_free=False)
    return schedule.predicted_peak_bytes


OURS = Method(
    name="ours",
    label="ours (Triton CCE)",
    summary="this package's Cut Cross-Entropy in Triton: logits rebuilt tile by tile on chip, "
    "gradient filter from the dtype, gradients accumulated in fp32; the backward chosen per problem "
    '(backward_impl="auto": the sparse one where the softmax lets it skip, else "gemm").',
    implementation=_ours(),
    availability=_ours_reason,
    kind="ours",
    counts_skips=True,
    supports_bias=True,
    peak_bytes=ours_peak_bytes,
    peak_formula=("(N·D + V·D)·b + 16-bit: dE's fp32 accumulator + fp32: a G chunk (16-bit G lives "
             "in dE's and dC's rows not yet written; helpers.cce.gemm_plan) + 24 bytes of per-row state "
             "(under a tier's default budget other than 'min', the schedule it picks: helpers.cce.schedules)"),
)


def _ours_budget(budget: int | str, label: str) -> Method:
    """ours under ``memory_budget=budget``: the fastest schedule whose predicted extra memory (beyond
    the inputs, dE and dC) fits ``budget`` bytes, "auto": a share of what is free when the loss runs
    (helpers.cce.schedules), or "min": the recompute design whatever the tier's default."""
    said = budget if isinstance(budget, str) else f"{label.upper()}iB"

    def peak(N, V, D, b, capability, configs=None):
        return ours_peak_bytes(N, V, D, b, capability, configs, memory_budget=budget)

    return Method(
        name=f"ours_budget_{label}",
        label=f"ours (budget {said})",
        summary=f"ours with memory_budget={said}: the fastest of its schedules whose predicted memory "
        "beyond dE and dC fits (three products from held logit chunks where they fit, else the recompute design).",
        implementation=_ours(memory_budget=budget),
        availability=_ours_reason,
        kind="ours",
        preset_of="ours",
        counts_skips=True,
        supports_bias=True,
        peak_bytes=peak,
        peak_formula="LB + the chosen schedule's extra bytes (helpers.cce.schedules: recompute, or forward_grads "
        "= R·V·b in one chunk, 4·V·D + max(R·V·b − V·D·b, 0) in several)",
    )


OURS_BUDGET_256M = _ours_budget(2**28, "256m")
OURS_BUDGET_512M = _ours_budget(2**29, "512m")
OURS_BUDGET_1G = _ours_budget(2**30, "1g")
OURS_BUDGET_4G = _ours_budget(2**32, "4g")
# As good as unlimited on one GPU: every row's logits at once up to N = 113,000 at the Qwen3 head.
OURS_BUDGET_64G = _ours_budget(2**36, "64g")
# Half of what is free when the loss runs (its memory formula: the least, what "auto" leaves when little is free).
OURS_BUDGET_AUTO = _ours_budget("auto", "auto")
# The least memory on every tier: ours itself but on a T4, whose default is 1 GiB (the T4 tier's comment).
OURS_BUDGET_MIN = _ours_budget("min", "min")
# The budgets of the trade-off curve (notebook 02), least first: ours itself (its default budget: "min",
# 1 GiB on a T4) to unlimited.
BUDGET_CURVE = ("ours", "ours_budget_256m", "ours_budget_512m", "ours_budget_1g", "ours_budget_4g", "ours_budget_64g")
OURS_NOFILTER = Method(
    name="ours_nofilter",
    label="ours (filter off)",
    summary="ours with the gradient filter off (filter_eps=None): every tile's gradient is kept.",
    implementation=_ours(filter_eps=None),
    availability=_ours_reason,
    kind="ours",
    preset_of="ours",
    supports_bias=True,
)
OURS_SPARSE = Method(
    name="ours_sparse",
    label="ours (sparse backward)",
    summary='ours with backward_impl="sparse": the forward marks the (row, tile) pairs that may carry '
    "gradient, the backward computes only those (a row loses at most 2^-7 of its gradient mass in "
    "bf16); it runs the 'gemm' backward when the softmax is too flat to skip.",
    implementation=_ours(backward_impl="sparse"),
    availability=_ours_reason,
    kind="ours",
    preset_of="ours",
    counts_skips=True,
    supports_bias=True,
)

OURS_GEMM = Method(
    name="ours_gemm",
    label="ours (gemm backward)",
    summary='ours with backward_impl="gemm" on every call: G per vocabulary chunk, its products in cuBLAS, '
    "whatever the softmax (ours chooses between it and the sparse backward).",
    implementation=_ours(backward_impl="gemm"),
    availability=_ours_reason,
    kind="ours",
    preset_of="ours",
    counts_skips=True,
    supports_bias=True,
)


@functools.cache
def _graphed_tier(device: str) -> CCEConfigs:
    """The device's tier with the loss's CUDA graphs at every size, one object per device: the
    graphs' and the plans' keys hold the tier by identity."""
    return resolve_configs(None, torch.device(device)).tuned(graphs_below_us=float("inf"))


def _ours_graphed(E, C, x, *, bias=None, ignore_index=-100, reduction="mean", softcap=None, stats=None):
    return linear_cross_entropy(E, C, x, bias=bias, ignore_index=ignore_index, reduction=reduction, softcap=softcap,
                                stats=stats, configs=_graphed_tier(str(E.device)))


def _ours_graphed_reason(device, dtype, softcap) -> Reason:
    if device.type != "cuda":
        return "CUDA graphs need a CUDA GPU (elsewhere this is ours itself)"
    return why_unavailable(device, dtype, softcap)


OURS_GRAPHS = Method(
    name="ours_graphs",
    label="ours (CUDA graphs)",
    summary="ours with its forward and \"gemm\" backward replayed from CUDA graphs whenever a call repeats one "
    "seen before (helpers.cce.graphs; at every size, where the tiers keep it off until measured): the host "
    "issues two replays instead of ~25 launches.",
    implementation=_ours_graphed,
    availability=_ours_graphed_reason,
    kind="ours",
    preset_of="ours",
    counts_skips=True,
    supports_bias=True,
    gate_calls=3,  # eager, captured, replayed: the replays are what is gated
)


__all__ = ["BUDGET_CURVE", "OURS", "OURS_BUDGET_1G", "OURS_BUDGET_256M", "OURS_BUDGET_4G", "OURS_BUDGET_512M",
           "OURS_BUDGET_AUTO",
           "OURS_BUDGET_64G", "OURS_GEMM", "OURS_GRAPHS", "OURS_NOFILTER", "OURS_SPARSE", "ours_peak_bytes"]
