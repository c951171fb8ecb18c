"""Our Cut Cross-Entropy (Wijmans et al., arXiv 2411.09009): the loss of a linear head without
the (N, V) logits in global memory, as an autograd function and the public call.

The memory arithmetic. A language model's head computes logits z = E C^T from E (N, D) and
C (V, D). At the Gemma-2-2B head (N = 8,192, V = 256,000, D = 2,304) the fp32 logits are
N * V * 4 = 8.4 GB, and autograd keeps them plus their gradient: the naive path peaks at 24 GB
for a loss whose inputs are 1.2 GB. The gradients dE and dC alone are 1.22 GB (1,161 MiB) in
bf16: the lower bound (LB) of any method. CCE stays near LB by never writing a logit: every kernel
rebuilds the (BLOCK_N, BLOCK_V) logit tiles it needs from E and C in on-chip memory.

The math, in the paper's notation (x: targets, S = softmax(z), lse: log-sum-exp per row):

    loss_i = lse_i - z_{i, x_i}                                  (cross-entropy)
    z_{i, x_i} = E_i . C_{x_i}                                   Algorithm 1, indexed dot
    lse_i = log sum_v exp(E_i . C_v)                             Algorithm 2, online over V blocks
    G = dloss/dz = S - 1[v = x],  dE = G C,  dC = G^T E          Algorithms 3-4, tiles recomputed

plus the options: Gemma-2's soft cap z = s tanh(z / s), PaLM's z-loss (+ zl * lse_i^2, Liger's
``lse_square_scale``), torch's label smoothing (loss_i = lse_i - (1 - ls) z_{i, x_i} -
(ls / V) sum_v z_{i, v}) and ``ignore_index``, reduced exactly as ``F.cross_entropy`` does on fp32
logits (``helpers.spec`` is the specification).

Where each part lives: ``forward`` (Algorithms 1-2), ``backward`` (Algorithms 3-4, two
implementations), ``options`` (what a call may ask, and where it runs), ``kernels/`` (the Triton
kernels and their launch configurations, by shared memory per block).

Gradient filter (paper section 4.2): a tile whose |G| sums to less than eps in every row skips
its products. The paper bounds each entry; bounding the row mass also holds on a flat softmax,
where every entry is tiny and their sum is not (``helpers/cce/kernels/backward_atomic.py``). eps
defaults from the dtype ("auto"): 2^-12 for bf16 as in the paper (2^-5 of bf16's machine
epsilon), the same 2^-5 of fp16's (2^-15), off for fp32; off with label smoothing, whose uniform
-ls/V term sits below eps in every tile. ``full_c`` / ``full_e`` (the paper's CCE-Kahan-FullC/FullE)
keep the filter for one gradient only. In the "gemm" backward the filter zeroes tiles of G but the
cuBLAS products still multiply them, so it saves no time there (docs/PERFORMANCE.md).

Vocabulary sort (paper section 4.3): ``sort_vocab=True`` orders the vocabulary by average logit
(``helpers.cce.gradients.vocabulary_order``), so large softmax entries share tiles and more tiles
pass the filter. Off by default: it only pays when the filter has something to skip.

What it does not do: a bias on the head, vocabulary parallelism, returning lse, and the paper's
lock-free bf16 atomics (fp32 scratch instead: ~0.06-0.2 LB, for the naive path's accuracy).
"""

from __future__ import annotations

import torch

from helpers.cce.backward import cce_backward
from helpers.cce.forward import cce_forward
from helpers.cce.kernels.configs import CCEConfigs
from helpers.cce.options import CCEOptions, check_backward_impl, resolve_options, why_unavailable
from helpers.spec import validate_inputs


class LinearCrossEntropyFunction(torch.autograd.Function):
    """loss = CE(E C^T, x) with the CCE kernels; backward recomputes the logits (saves only lse)."""

    @staticmethod
    def forward(ctx, E, C, x, options: CCEOptions, configs, backward_impl="gemm", stats=None):
        loss_rows, lse = cce_forward(E, C, x, options, configs)
        kept = x != options.ignore_index
        n_kept = kept.sum()
        if options.reduction == "none":
            loss = loss_rows
        elif options.reduction == "sum":
            loss = loss_rows.sum()
        else:
            loss = loss_rows.sum() / n_kept  # 0 / 0 = NaN when every token is ignored, as torch
        ctx.save_for_backward(E, C, x, lse, n_kept)
        ctx.options, ctx.configs, ctx.backward_impl, ctx.stats = options, configs, backward_impl, stats
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        E, C, x, lse, n_kept = ctx.saved_tensors
        o = ctx.options
        grad_loss = grad_loss.to(torch.float32)
        if o.reduction == "none":
            grad_rows = grad_loss
        elif o.reduction == "sum":
            grad_rows = grad_loss.expand(x.shape[0])
        else:
            # All ignored: torch's gradients are 0, not NaN, so divide by at least 1.
            grad_rows = (grad_loss / n_kept.clamp(min=1)).expand(x.shape[0])
        dE, dC = cce_backward(E, C, x, lse, grad_rows, o, ctx.configs, stats=ctx.stats,
                              backward_impl=ctx.backward_impl)
        return (
            dE if ctx.needs_input_grad[0] else None,
            dC if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
    filter_eps: float | str | None = "auto",
    sort_vocab: bool = False,
    accumulation: str = "fp32",
    full_c: bool = False,
    full_e: bool = False,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    configs: CCEConfigs | str | None = None,
    backward_impl: str = "gemm",
    stats: dict | None = None,
) -> torch.Tensor:
    """Cross-entropy of the logits E C^T against x, without materialising the logits.

    E (N, D), C (V, D), x (N,) int targets; fp32, fp16 or bf16 (E and C alike). Returns an fp32
    loss: a scalar for "mean"/"sum", (N,) for "none" (0 at ignored rows); exactly
    ``F.cross_entropy(softcap(E C^T).float(), x, ...)`` up to rounding, NaN for a mean over zero
    kept tokens (with zero gradients), as torch gives.

    filter_eps: "auto" (2^-12 bf16, 2^-15 fp16, off for fp32; off with label smoothing), a number
        (0 = off) or None (off). sort_vocab: order the vocabulary by average logit for the filter.
    accumulation: "fp32" (fp32 scratch, rounded once per row chunk) or "kahan" (also compensates
        dC's folds across row chunks). With one row chunk (N * D * 4 <= max(64 MiB, LB / 16): all
        N up to 16,384 at the Qwen3 head, 8,192+ at Gemma's) "fp32" keeps bf16 dE and dC within
        1.5x of the naive bf16 path's error (0.55-1.0x measured on the H200); past it dC is rounded
        once per chunk (2.1x at N = 131,072) and "kahan" brings it back to 1.0x for a V * D buffer
        in the input dtype (+0.54 LB at N = 131,072, Qwen3 head). full_c / full_e: filter only
        dE / only dC.
    z_loss: adds z_loss * lse^2 per kept token. label_smoothing: torch's definition, in [0, 1].
    configs: a ``CCEConfigs`` or tier name from ``helpers.cce.kernels.configs``; None picks by the
        device's shared memory per block.
    backward_impl: "gemm" (the default: G per vocabulary chunk in scratch, its two products in
        cuBLAS) or "atomic" (fp32 atomics in one kernel; 1.9x slower on
        the H200); ``helpers/cce/backward_gemm.py``. fp32 "gemm" products follow torch's fp32
        matmul setting (default: no TF32).
    stats: a dict the backward fills with what its gradient filter did: "tiles" (logit tiles
        rebuilt), "skipped" (tiles whose gradient the filter dropped), "launches"; see
        ``cce_backward``. Counting costs one host sync per backward.
    """
    validate_inputs(E, C, x, ignore_index=ignore_index, reduction=reduction, softcap=softcap)
    options = resolve_options(
        E.dtype,
        filter_eps=filter_eps,
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=softcap,
        sort_vocab=sort_vocab,
        accumulation=accumulation,
        full_c=full_c,
        full_e=full_e,
        z_loss=z_loss,
        label_smoothing=label_smoothing,
    )
    check_backward_impl(backward_impl)
    reason = why_unavailable(E.device, E.dtype, softcap)
    if reason:
        raise RuntimeError(f"helpers.linear_cross_entropy cannot run here: {reason}")
    if stats is not None and not isinstance(stats, dict):
        raise ValueError(f"stats must be a dict (filled by the backward) or None, got {type(stats).__name__}")
    return LinearCrossEntropyFunction.apply(E, C, x, options, configs, backward_impl, stats)
