"""The forward's last step in one launch: each row's lse from its vocabulary splits, and its loss.

With few tokens the forward is bound by the host's launches (docs/PERFORMANCE.md, "1,024 tokens"):
the merge of the splits (``torch.logsumexp``: several kernels) and the loss's assembly were ~10
element-wise torch launches of N elements. Per row i (one program per BLOCK rows):

    m = max_k lse_split[k, i] (0 where every split is -inf);  lse_i = m + log sum_k exp(lse_split[k, i] - m)
    lse_u,i likewise from nontarget_split (the splits' non-target mass);  r_i = exp(lse_u,i - lse_i)
    nll_i = -log1p(-r_i) where r_i < 1/2, else lse_i - z_{i, x_i}
    loss_i = nll_i + ls z_{i, x_i} - (ls / V) sum_k logit_sum_split[k, i] + zl lse_i^2,  0 at an ignored row

r_i = 1 - p(target) comes to fp32's relative precision from the forward's masked sum; lse - z_x, two
separately rounded numbers of |z|'s size, would be wrong by ~ulp(|z|) (~4e-6 at |z| ~ 30) where the
loss itself is ~r (a confident token). Where r >= 1/2 the loss is >= log 2 and lse - z_x is exact enough.
r is stored for the backward (``helpers.cce.backward.rows``), as 1 - exp(z_x - lse) where r >= 1/2
(``target_complement``: there r's relative error is the target column's absolute one), and beside it lo,
the lse's rounding (``sum_rounding``; with the splits' own, HAS_LO: fp32 inputs), which the backward folds
into each row's softmax: one fp32 lse a row shifts every entry by up to ulp(lse) / 2 (~1e-6 at 30), and
fp32 gradients at logits of rms 10 erred 1.4-2.7x the naive path's.

With REDUCE (up to ``ONE_PROGRAM_ROWS`` rows, one program walking every block) the launch also writes the
loss reduced: the rows' sum (REDUCE = 1) or that sum over the kept rows' count (REDUCE = 2: 0 / 0 = NaN
when every row is ignored, as torch), which were two more torch launches after it.

Reference: the forward's tests against float64 (tests/cce/test_cce.py).
"""

import triton
import triton.language as tl

from helpers.cce.kernels.logits import exp_of, log1p_neg, sum_rounding, target_complement


ONE_PROGRAM_ROWS = 8192  # the most rows whose loss one program reduces (REDUCE)


@triton.jit
def row_loss_kernel(
    # lse_split, nontarget_split, logit_sum_split (SPLITS, N) fp32, rows stride_split apart
    # (logit_sum_split: any pointer without SMOOTHING); target logit (N,) fp32; x (N,) targets.
    lse_split_ptr, nontarget_split_ptr, logit_sum_split_ptr, target_ptr, x_ptr,
    # Outputs: lse (N,) fp32; r (2N,) fp32, the rows the backward takes: r (the target column's 1 - p) and
    # lo (the lse's rounding: lse + lo is the row's lse to ~1e-14); loss (N,) fp32; with REDUCE the reduced
    # loss, an fp32 scalar, (REDUCE = 2) divided by count_ptr's int64 (the kept rows).
    lse_ptr, r_ptr, loss_ptr, reduced_ptr, count_ptr,
    N, splits, stride_split, stride_x, ignore_index,
    target_weight, smoothing_weight, z_loss,
    SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, BLOCK: tl.constexpr, REDUCE: tl.constexpr = 0,
    lse_lo_split_ptr=None,  # (SPLITS, N) fp32: each split's lse rounding (``lse_forward_kernel``'s LSE_LO; HAS_LO)
    HAS_LO: tl.constexpr = False,
):
    if REDUCE == 0:
        _block_loss(lse_split_ptr, nontarget_split_ptr, logit_sum_split_ptr, target_ptr, x_ptr, lse_ptr, r_ptr,
                    loss_ptr, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), N, splits, stride_split, stride_x,
                    ignore_index, target_weight, smoothing_weight, z_loss, SMOOTHING, Z_LOSS, BLOCK,
                    lse_lo_split_ptr, HAS_LO)
    else:
        total = 0.0
        for r0 in range(0, N, BLOCK):
            total += _block_loss(lse_split_ptr, nontarget_split_ptr, logit_sum_split_ptr, target_ptr, x_ptr, lse_ptr,
                                 r_ptr, loss_ptr, r0 + tl.arange(0, BLOCK), N, splits, stride_split, stride_x,
                                 ignore_index, target_weight, smoothing_weight, z_loss, SMOOTHING, Z_LOSS, BLOCK,
                                 lse_lo_split_ptr, HAS_LO)
        if REDUCE == 2:
            total = tl.math.div_rn(total, tl.load(count_ptr).to(tl.float32))
        tl.store(reduced_ptr, total)


@triton.jit
def _block_loss(lse_split_ptr, nontarget_split_ptr, logit_sum_split_ptr, target_ptr, x_ptr, lse_ptr, r_ptr, loss_ptr,
                rows, N, splits, stride_split, stride_x, ignore_index, target_weight, smoothing_weight, z_loss,
                SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, BLOCK: tl.constexpr, lse_lo_split_ptr,
                HAS_LO: tl.constexpr):
    """lse, r and loss of ``rows`` stored (module doc); returns the sum of their losses."""
    inside = rows < N
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for k in range(0, splits):
        m = tl.maximum(m, tl.load(lse_split_ptr + k * stride_split + rows, mask=inside, other=0.0))
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    nontarget = tl.zeros([BLOCK], dtype=tl.float32)  # in the same scale m (every split's u <= its s)
    plain = tl.zeros([BLOCK], dtype=tl.float32)  # the splits' sums without their lo: r's denominator
    logit_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, splits):
        # exp_of's precise form whatever the inputs' dtype: a few exps a row, and the lse every backward takes.
        split_lse = tl.load(lse_split_ptr + k * stride_split + rows, mask=inside, other=0.0) - m
        plain += exp_of(split_lse, True)
        if HAS_LO:  # the split's lse is split_lse + lo: its rounding too
            split_lse += tl.load(lse_lo_split_ptr + k * stride_split + rows, mask=inside, other=0.0)
        total += exp_of(split_lse, True)
        nontarget += exp_of(tl.load(nontarget_split_ptr + k * stride_split + rows, mask=inside, other=0.0) - m, True)
        if SMOOTHING:
            logit_sum += tl.load(logit_sum_split_ptr + k * stride_split + rows, mask=inside, other=0.0)
    log_total = tl.log(total)
    lse = m + log_total
    lo = sum_rounding(m, log_total, lse)
    # r from the sums as the splits stored them (the non-target sums carry no lo): both rounded alike, an ignored
    # or certain row's r stays exactly its ratio.
    r = exp_of(tl.log(nontarget) - tl.log(plain), True)  # exp(lse_u - lse): relative precision, no 1 - p
    x = tl.load(x_ptr + rows * stride_x, mask=inside, other=ignore_index)
    kept = x != ignore_index
    z_x = tl.load(target_ptr + rows, mask=inside, other=0.0)
    log_p = (z_x - lse) - lo
    loss = tl.where(r < 0.5, -log1p_neg(r), -log_p)
    # What the backward takes; an ignored row keeps r = 1 (its t = a - a r = 0: an ignore_index inside the
    # vocabulary is no target's column).
    r = tl.where(kept, target_complement(r, log_p), r)
    if SMOOTHING:
        loss = loss + (1.0 - target_weight) * z_x - smoothing_weight * logit_sum
    if Z_LOSS:  # only where asked: 0 x lse^2 would make an infinite lse's loss NaN
        loss = loss + z_loss * lse * lse
    tl.store(lse_ptr + rows, lse, mask=inside)
    tl.store(r_ptr + rows, r, mask=inside)
    tl.store(r_ptr + N + rows, lo, mask=inside)
    loss = tl.where(kept & inside, loss, 0.0)
    tl.store(loss_ptr + rows, loss, mask=inside)
    return tl.sum(loss, axis=0)
