"""Distillation without either model's logits: ``linear_kl_div``, the divergence of a student head's
softmax from a teacher head's, with its gradient to the student.

Why. Distilling a teacher into a student at one vocabulary scores the student's softmax q against
the teacher's p at every token. The naive path forms both heads' logits: at a Qwen3-0.6B student
(V = 151,936, D_s = 1,024) and a teacher of D_t = 2,048 over N = 16,384 tokens, one N x V fp32 tensor
is 9.96 GB, and the two logits, their two log-softmaxes and the student's gradient are five of them
(~50 GB; in bf16 the logits alone are 2 x 4.98 GB). Liger-Kernel's ``LigerFusedLinearJSD`` cuts the
rows into chunks (128 rows there: ceil(V / D_s) = 149 chunks' worth, rounded to a power of two) and
holds ~7 fp32 (128, V) buffers a chunk (~0.5 GB), and the gradients N D_s + V D_s from its forward on.
Here neither head's logits exist beyond a tile: the forward keeps O(N) row statistics, and the
backward writes G = dloss / ds one vocabulary chunk at a time into the rows of dE_s or dC_s that it
has not yet written (the "gemm" backward's places, ``helpers.cce.backward.gemm``). Memory beyond the
inputs and the returned gradients: 5 SPLITS N + 6 N fp32 in the forward (SPLITS ~ 1-2 on an H200; and
the splits' merge's few (SPLITS, N) temporaries),
and the "gemm" backward's dE accumulator (16-bit inputs: N D_s 4 bytes, 67 MB at N = 16,384).

The price is arithmetic. Liger multiplies each head once (2 N V (D_s + D_t) FLOP) and makes the two
student products (4 N V D_s); here the forward rebuilds both tiles (2 N V (D_s + D_t)) and the
backward rebuilds them again before the same two products: 1.6x Liger's FLOP for the KLs at
D_t = 2 D_s, 2.2x for the JSD, whose forward walks the tiles twice (below).

The math. Row i (a kept token), s = cap(E_s C_s^T + b_s) / tau, t = cap(E_t C_t^T + b_t) / tau (one
soft cap and one temperature for both heads, the temperature after the cap, as the loss's), the
softmaxes q = exp(s - lse_s) and p = exp(t - lse_t) (each lse kept as its row's maximum m and
l = log sum_v exp(z_v - m), log q = (s - m_s) - l_s: ``helpers.cce.kernels.divergence``'s doc says why):

    "forward"  KL(p || q) = sum_v p (t - s) - (lse_t - lse_s)           dKL/ds_v = q_v - p_v
    "reverse"  KL(q || p) = (lse_t - lse_s) - sum_v q (t - s)           dKL/ds_v = q_v (log q_v - log p_v - KL)
                                                                        = q_v (sum_u q_u c_u - c_v)
    "jsd"      JSD = beta KL(p || M) + (1 - beta) KL(q || M),           dJSD/ds_v = (1 - beta) q_v (log q_v - log M_v - K)
               M = beta p + (1 - beta) q,  K = KL(q || M)

(torch's ``F.kl_div(input, target, log_target=True)`` is KL(target || input): "forward" is
``F.kl_div(log q, log p)``, "reverse" ``F.kl_div(log p, log q)``; beta as Liger's jsd_beta, whose
beta = 0 and 1 it special-cases to these two KLs.) The reverse gradient: d log q_u / ds_v = [u = v]
- q_v, so d/ds_v sum_u q_u (log q_u - log p_u) = q_v (log q_v - log p_v) - q_v KL + (q_v - q_v); the
JSD's the same with log M, whose own derivative's terms cancel (sum_u dM_u = 0). Then times 1 / tau
and the student's soft cap's 1 - (z / softcap)^2, and the row's upstream gradient g_i. The kernels
form the KLs' sums over c = (t - m_t) - (s - m_s), the gap of the two heads centred on their maxima:
log p - log q = c - l_t + l_s, so KL(p || q) = sum p c + (l_s - l_t), KL(q || p) = (l_t - l_s) - sum q c,
each term as small as a log-probability where t - s is ~1 / tau (kernels' doc). The JSD takes
g = log p - log q the same way, log q/M = -log(beta e^g + 1 - beta), and sums its value as
beta (p log p/M - p + M) + (1 - beta) (q log q/M - q + M), terms >= 0 and second order in g (the
same sum: beta (M - p) + (1 - beta) (M - q) = 0), so a JSD near zero keeps its relative precision.

The forward. The two KLs need, per row, both lse and one cross sum weighted by one head's softmax:
one pass, with the cross sum rescaled like its head's running sum (``divergence_forward_kernel``,
the online softmax of both heads). The JSD's log M needs both final lse inside each term, which no
rescaling gives: its first pass makes the lse, a second pass the sums. The backward saves both heads'
(m, l) and sum_v q c (reverse) or K (JSD): 5 N fp32 (4 N for the forward KL).

The teacher is a constant: no gradient reaches E_t, C_t or bias_t, whether they require grad or
not (as Liger's teacher inputs, and the usual ``with torch.no_grad()`` around a teacher's forward).
Reference: ``helpers.spec.reference_kl_div``. Caveats: one soft cap for both heads; no gradient
filter (G = q - p has no sparse structure the filter could count on: p's mass need not sit where
q's does); no tensor descriptors, no persistent G kernel; the kernels' tiles are the tier's with half
the columns (``pair_config``), not tuned on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton

from helpers.cce.backward.gemm import backward_gemm
from helpers.cce.backward.rows import RowGradient
from helpers.cce.forward import grid_order, split_grid, split_major
from helpers.cce.kernels.configs import CCEConfigs, LaunchConfig
from helpers.cce.kernels.divergence import (
    FORWARD_KL,
    JSD,
    REVERSE_KL,
    divergence_forward_kernel,
    divergence_gradient_chunk_kernel,
)
from helpers.cce.options import CCEOptions, check_temperature, dot_precision, fp_fusion, resolve_configs, why_unavailable
from helpers.spec import DIVERGENCES, validate_distill_inputs

KIND_CODES = {"forward": FORWARD_KL.value, "reverse": REVERSE_KL.value, "jsd": JSD.value}


@dataclass(frozen=True)
class DistillOptions:
    """The options of ``linear_kl_div``, validated."""

    kind: str = "forward"  # one of ``helpers.spec.DIVERGENCES``
    beta: float = 0.5  # the JSD's mixture weight of the teacher ("jsd" only)
    temperature: float = 1.0
    softcap: float | None = None
    reduction: str = "mean"


def pair_config(cfg: LaunchConfig) -> LaunchConfig:
    """The tier's configuration ``cfg`` for a kernel that holds two logit tiles at once: half the
    columns (registers for one tile's worth), pointer loads, one program per tile."""
    return replace(cfg, BLOCK_V=max(16, cfg.BLOCK_V // 2), tma=False, persistent=0, g_subtile=1)


class DivergenceRows(NamedTuple):
    """Each row's statistics from ``distill_forward``, fp32, every row (kept or not)."""

    loss: torch.Tensor  # (N,): the row's divergence
    norm_s: torch.Tensor  # (2, N): the student's row maximum m and l = log sum_v exp(s_v - m) (lse = m + l)
    norm_t: torch.Tensor  # the teacher's
    row_stat: torch.Tensor | None  # (N,), what G needs beyond (m, l): sum q c (reverse), K (jsd); None (forward)


def _heads(E_s, C_s, bias_s, E_t, C_t, bias_t):
    """The kernels' pointers, sizes and strides of both heads (a bias absent: any pointer)."""
    return ((E_s, C_s, bias_s if bias_s is not None else E_s, E_t, C_t, bias_t if bias_t is not None else E_t),
            (E_s.stride(0), E_s.stride(1), C_s.stride(0), C_s.stride(1),
             E_t.stride(0), E_t.stride(1), C_t.stride(0), C_t.stride(1)))


def _flags(o: DistillOptions, bias_s, bias_t, dtype, cfg) -> dict:
    """The kernels' constexprs and, for fp32 inputs, no multiply-add contraction (``fp_fusion``: on an H100
    with it, fp32 dE_s at a temperature of 0.1 erred 2.1-4.5x the naive path's error; without, within the
    tests' 2x, and on an H200 all of test_distill passed)."""
    return dict(KIND=KIND_CODES[o.kind], HAS_SOFTCAP=o.softcap is not None, HAS_BIAS_S=bias_s is not None,
                HAS_BIAS_T=bias_t is not None, DOT_PRECISION=dot_precision(dtype, cfg),
                enable_fp_fusion=fp_fusion(dtype))


def distill_forward(
    E_s: torch.Tensor,
    C_s: torch.Tensor,
    E_t: torch.Tensor,
    C_t: torch.Tensor,
    options: DistillOptions = DistillOptions(),
    configs: CCEConfigs | str | None = None,
    bias_s: torch.Tensor | None = None,
    bias_t: torch.Tensor | None = None,
    v_splits: int | None = None,
) -> DivergenceRows:
    """Each row's divergence and what its gradient needs (``DivergenceRows``), E_s (N, D_s), C_s (V, D_s),
    E_t (N, D_t), C_t (V, D_t): one pass over the vocabulary for the KLs, two for the JSD (module doc).
    ``v_splits``: vocabulary splits of the grid; None: enough to fill the device (``split_grid``)."""
    o = options
    N, D_s = E_s.shape
    V, D_t = C_s.shape[0], E_t.shape[1]
    configs = resolve_configs(configs, E_s.device)
    cfg = pair_config(configs.for_dtype(E_s.dtype)[0])
    # The L2 strip of a row block is both heads' rows of E.
    n_blocks, v_splits = split_grid(N, cfg, E_s.device, v_splits, D_s + D_t, E_s.element_size())
    v_blocks = triton.cdiv(V, cfg.BLOCK_V)
    blocks_per_split = triton.cdiv(v_blocks, max(1, min(v_splits, v_blocks)))
    splits = triton.cdiv(v_blocks, blocks_per_split)
    out = torch.empty(5, splits, N, dtype=torch.float32, device=E_s.device)
    pointers, strides = _heads(E_s, C_s, bias_s, E_t, C_t, bias_t)
    flags = dict(_flags(o, bias_s, bias_t, E_s.dtype, cfg), SPLIT_MAJOR=split_major(n_blocks),
                 **cfg.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D"), **cfg.launch)
    softcap = o.softcap if o.softcap is not None else 1.0

    def walk(norm_s, norm_t, second_pass: bool):
        divergence_forward_kernel[grid_order(n_blocks, splits)](
            *pointers, norm_s, norm_t, out, N, V, D_s, D_t, blocks_per_split, *strides, splits * N,
            norm_s.stride(0), softcap, 1.0 / o.temperature, float(o.beta), SECOND_PASS=second_pass, **flags)

    # 1. Both heads' (m, l) per split and, for the KLs, the mean of c = (t - m_t) - (s - m_s) under the
    # weighting head (``helpers.cce.kernels.divergence``).
    walk(out[0], out[2], False)
    (norm_s, share_s), (norm_t, share_t) = merge_normalisers(out[0:2]), merge_normalisers(out[2:4])
    (m_s, l_s), (m_t, l_t) = norm_s, norm_t
    # A split's c is centred on its own maxima: moved to the rows' by (m_t,k - m_t) - (m_s,k - m_s).
    moved = out[4] + ((out[2] - m_t) - (out[0] - m_s))
    if o.kind == "forward":
        # KL(p || q) = sum_v p (log p - log q) = sum_v p c + (l_s - l_t).
        return DivergenceRows((share_t * moved).sum(dim=0) + (l_s - l_t), norm_s, norm_t, None)
    if o.kind == "reverse":
        # KL(q || p) = (l_t - l_s) - sum_v q c; the backward's G is q (sum_v q c - c).
        mean_c = (share_s * moved).sum(dim=0)
        return DivergenceRows((l_t - l_s) - mean_c, norm_s, norm_t, mean_c)
    # 2. [JSD] the second pass, with both lse known: the divergence's sums, K's and sum q per split. K is
    # sum q (log q - log M) over the q the backward makes, sum q (1 up to rounding): G's row then sums to 0
    # as the exact one does (without it, 12x the naive path's error in the gradients at tau = 0.1 before
    # the (m, l) split; tests/cce/test_distill.py, the cold cases).
    walk(norm_s, norm_t, True)
    loss, k_sum, q_sum = out[:3].sum(dim=1)
    return DivergenceRows(loss, norm_s, norm_t, k_sum / q_sum)


def merge_normalisers(split: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((2, N) (m, l) of whole rows, (SPLITS, N) each split's share of the row's softmax) from the
    splits' (2, SPLITS, N) (m_k, l_k): m = max_k m_k, l = log sum_k exp(m_k - m + l_k)."""
    m_split, l_split = split
    m = m_split.amax(dim=0)
    terms = (m_split - m) + l_split
    l = torch.logsumexp(terms, dim=0)
    return torch.stack([m, l]), torch.exp(terms - l)


def distill_backward(
    E_s: torch.Tensor,
    C_s: torch.Tensor,
    E_t: torch.Tensor,
    C_t: torch.Tensor,
    rows: DivergenceRows,
    grad_rows: torch.Tensor,
    kept: torch.Tensor,
    options: DistillOptions = DistillOptions(),
    configs: CCEConfigs | str | None = None,
    bias_s: torch.Tensor | None = None,
    bias_t: torch.Tensor | None = None,
    need: tuple[bool, bool, bool] = (True, True, False),
    stats: dict | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dE_s, dC_s, db_s) in the inputs' dtype, None where ``need`` does not ask for it: the "gemm"
    backward (``backward_gemm``) with G from ``divergence_gradient_chunk_kernel``. ``grad_rows`` (N,):
    each row's upstream gradient (an expanded scalar for a mean or a sum); ``kept`` (N,) bool.
    ``stats``: as ``helpers.cce.cce_backward`` fills it."""
    o = options
    N, D_s = E_s.shape
    V, D_t = C_s.shape[0], E_t.shape[1]
    configs = resolve_configs(configs, E_s.device)
    cfg = pair_config(configs.backward_gemm_for(E_s.dtype))
    up = RowGradient.of_upstream(grad_rows, kept)
    sign = up.coef[0]
    row_stat = rows.row_stat if rows.row_stat is not None else rows.norm_s[0]  # not read for "forward"
    flags = dict(_flags(o, bias_s, bias_t, E_s.dtype, cfg), **cfg.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D", "GROUP_N"),
                 **cfg.launch)

    def g_chunk(G, n0, n1, v0, v1):
        """G of rows [n0, n1) and columns [v0, v1), unscaled by the rows' w (``backward_gemm``)."""
        tiles = triton.cdiv(n1 - n0, cfg.BLOCK_N) * triton.cdiv(v1 - v0, cfg.BLOCK_V)
        pointers, strides = _heads(E_s[n0:n1], C_s, bias_s, E_t[n0:n1], C_t, bias_t)
        divergence_gradient_chunk_kernel[(tiles,)](
            *pointers, rows.norm_s[:, n0:n1], rows.norm_t[:, n0:n1], row_stat[n0:n1], sign[n0:n1], G,
            n1 - n0, V, D_s, D_t, v0, v1 - v0, *strides, G.stride(0), G.stride(1), rows.norm_s.stride(0),
            o.softcap if o.softcap is not None else 1.0, 1.0 / o.temperature, float(o.beta), **flags)
        return tiles

    return backward_gemm(E_s, C_s, None, None, up, None, CCEOptions(), cfg, None, None, stats, bias_s, need,
                         host=configs.host, g_chunk=g_chunk)


@dataclass(frozen=True)
class DistillPlan:
    """One call of ``linear_kl_div``, resolved at its entry."""

    options: DistillOptions
    configs: CCEConfigs
    need: tuple[bool, bool, bool]  # (dE_s, dC_s, db_s)


class LinearKLDivFunction(torch.autograd.Function):
    """The reduced divergence of E_s (N, D_s), C_s against E_t (N, D_t), C_t by a ``DistillPlan``; the
    backward rebuilds both heads' tiles (it saves 5 N fp32). The teacher's tensors come in detached."""

    @staticmethod
    def forward(ctx, E_s, C_s, bias_s, E_t, C_t, bias_t, kept, plan: DistillPlan, stats=None):
        o = plan.options
        rows = distill_forward(E_s, C_s, E_t, C_t, o, plan.configs, bias_s, bias_t)
        loss_rows = torch.where(kept, rows.loss, 0.0)
        n_kept = kept.sum()
        if o.reduction == "none":
            loss = loss_rows
        elif o.reduction == "sum":
            loss = loss_rows.sum()
        else:
            loss = loss_rows.sum() / n_kept  # 0 / 0 = NaN when no token is kept, as torch's mean
        ctx.save_for_backward(E_s, C_s, bias_s, E_t, C_t, bias_t, kept, n_kept, rows.norm_s, rows.norm_t,
                              rows.row_stat)
        ctx.plan, ctx.stats = plan, stats
        ctx.set_materialize_grads(False)
        if stats is not None:
            stats["forward_passes"] = 2 if o.kind == "jsd" else 1
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        E_s, C_s, bias_s, E_t, C_t, bias_t, kept, n_kept, norm_s, norm_t, row_stat = ctx.saved_tensors
        plan = ctx.plan
        if grad_loss is None or not any(plan.need):
            return (None,) * 9
        N = kept.shape[0]
        reduction = plan.options.reduction
        if reduction == "none":
            grad_rows = grad_loss.to(torch.float32)
        elif reduction == "sum":
            grad_rows = grad_loss.to(torch.float32).expand(N)
        else:
            # No token kept: torch's gradients are 0, not NaN, so divide by at least 1.
            grad_rows = (grad_loss.to(torch.float32) / n_kept.clamp(min=1)).expand(N)
        rows = DivergenceRows(None, norm_s, norm_t, row_stat)
        dE, dC, db = distill_backward(E_s, C_s, E_t, C_t, rows, grad_rows, kept, plan.options, plan.configs,
                                      bias_s, bias_t, plan.need, ctx.stats)
        return dE, dC, db, None, None, None, None, None, None


def linear_kl_div(
    E_s: torch.Tensor,
    C_s: torch.Tensor,
    E_t: torch.Tensor,
    C_t: torch.Tensor,
    *,
    kind: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    x: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    bias_s: torch.Tensor | None = None,
    bias_t: torch.Tensor | None = None,
    softcap: float | None = None,
    configs: CCEConfigs | str | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """The divergence of the student's softmax q = softmax(cap(E_s C_s^T + bias_s) / temperature) from
    the teacher's p = softmax(cap(E_t C_t^T + bias_t) / temperature), summed over the vocabulary per
    token, without either head's (N, V) logits (module doc for the math and the memory).

    E_s (..., D_s) and C_s (V, D_s): the student's hidden states and head; E_t (..., D_t) and C_t
    (V, D_t): the teacher's, of E_s's leading shape and C_s's V (D_t may differ from D_s); fp32, fp16
    or bf16, all four (and the biases, (V,) or None) in one dtype. Returns fp32: a scalar for "mean" and
    "sum", E_s's leading shape for "none" (0 at tokens that do not count).

    kind: "forward" KL(p || q) (``F.kl_div(log q, log p, log_target=True)``: Hinton's distillation),
        "reverse" KL(q || p) or "jsd": beta KL(p || M) + (1 - beta) KL(q || M), M = beta p + (1 - beta) q
        (Liger-Kernel's generalized JSD; ``beta`` in (0, 1), 0.5 by default, read only for "jsd").
    temperature: tau > 0, dividing both heads' (soft-capped) logits. Scale the loss by tau^2 yourself
        if you follow Hinton's gradient scale.
    mask, x: which tokens count: ``mask`` (bool, True: the token counts) and/or targets ``x`` (a
        trainer's labels) whose ``ignore_index`` tokens do not; both given, a token counts where both
        say so; neither, every token.
    reduction: "mean" (the sum over counted tokens of each token's divergence over V, divided by their
        number: torch's "batchmean" over the kept tokens; NaN with zero gradients when none counts),
        "sum" or "none".
    softcap: s * tanh(z / s) on both heads' logits before the temperature (None: no cap).
    configs: a ``CCEConfigs`` or a tier's name (None: the device's); the kernels take its forward and
        "gemm" G tiles with half the columns (``pair_config``).
    stats: a dict that gets "forward_passes" and the backward's counts (``helpers.cce.cce_backward``).

    Gradients flow to E_s, C_s and bias_s, whichever require them; the teacher is a constant: E_t, C_t
    and bias_t get no gradient even when they require one.
    """
    validate_distill_inputs(E_s, C_s, E_t, C_t, bias_s=bias_s, bias_t=bias_t, mask=mask, x=x, kind=kind, beta=beta,
                            reduction=reduction, softcap=softcap, ignore_index=ignore_index)
    temperature = check_temperature(temperature)
    if stats is not None and not isinstance(stats, dict):
        raise ValueError(f"stats must be a dict (filled by the backward) or None, got {type(stats).__name__}")
    reason = why_unavailable(E_s.device, E_s.dtype)
    if reason:
        raise RuntimeError(f"helpers.linear_kl_div cannot run here: {reason}")
    options = DistillOptions(kind, float(beta), temperature, None if softcap is None else float(softcap), reduction)
    grad = torch.is_grad_enabled()
    need = (grad and E_s.requires_grad, grad and C_s.requires_grad,
            grad and bias_s is not None and bias_s.requires_grad)
    plan = DistillPlan(options, resolve_configs(configs, E_s.device), need)
    lead = E_s.shape[:-1]
    kept = torch.ones(lead, dtype=torch.bool, device=E_s.device)
    if mask is not None:
        kept = kept & mask
    if x is not None:
        kept = kept & (x != ignore_index)
    teacher = [t.detach() if t is not None else None for t in (E_t, C_t, bias_t)]
    loss = LinearKLDivFunction.apply(E_s.reshape(-1, E_s.shape[-1]), C_s, bias_s,
                                     teacher[0].reshape(-1, E_t.shape[-1]), teacher[1], teacher[2],
                                     kept.reshape(-1), plan, stats)
    return loss.reshape(lead) if reduction == "none" else loss


__all__ = ["linear_kl_div", "distill_forward", "distill_backward", "DistillOptions", "DivergenceRows",
           "LinearKLDivFunction", "DIVERGENCES", "pair_config"]
