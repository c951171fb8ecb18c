"""The registry's entries of this package's loss (``helpers.compare.methods``): ours, through
``helpers.cce.linear_cross_entropy``, and its presets (filter off; the sparse backward), with the
memory formula of its default "gemm" backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from helpers.cce import linear_cross_entropy, why_unavailable
from helpers.cce.kernels.configs import CCEConfigs, tier_for_capability
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


def _ours_gemm_plan(N: int, V: int, D: int, dtype: torch.dtype, configs: CCEConfigs):
    """helpers.cce's chunk plan for the "gemm" backward under ``configs`` (its G kernel's BLOCK_V,
    its host's chunks): the one place the registry reads cce's planning internals."""
    from helpers.cce.backward.gemm import gemm_plan

    return gemm_plan(N, V, D, dtype, configs.backward_gemm_for(dtype).BLOCK_V, host=configs.host)


def ours_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None,
                    configs: CCEConfigs | None = None) -> int:
    # helpers.cce with its defaults (backward "gemm"): the forward keeps O(N) (lse per row and vocabulary
    # split); the backward allocates dE and dC, for 16-bit inputs dE's fp32 accumulator (n_chunk, D)
    # and, with several row chunks, dC rows staged in fp32 (v_chunk, D) before each fold. Each G chunk
    # lives in dE's or dC's rows not yet written, or in a buffer where neither has room (fp32):
    # helpers.cce.gemm_plan says which, with chunk sizes rounded to the BLOCK_V of the configuration
    # tier this capability gets. On the CPU the products run in fp32 ("upcast"): 16-bit operands
    # are copied to fp32 for each product, and the staged dC rows are used even for one row chunk.
    # ``configs``: linear_cross_entropy's launch configurations (None: the tier this capability gets).
    configs = configs or tier_for_capability(capability)
    plan = _ours_gemm_plan(N, V, D, torch.float32 if b == 4 else torch.float16, configs)
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
    # coefficients of G, helpers.cce.backward.rows.RowGradient).
    per_row = 24 * N
    return (N * D + V * D) * b + scratch + per_row


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
             "in dE's and dC's rows not yet written; helpers.cce.gemm_plan) + 24 bytes of per-row state"),
)
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


__all__ = ["OURS", "OURS_GEMM", "OURS_NOFILTER", "OURS_SPARSE", "ours_peak_bytes"]
