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
(``target_complement``: there r's relative error is the target column's absolute one).

With REDUCE (up to ``ONE_PROGRAM_ROWS`` rows, one program walking every block) the launch also writes the
loss reduced: the rows' sum (REDUCE = 1) or that sum over the kept rows' count (REDUCE = 2: 0 / 0 = NaN
when every row is ignored, as torch), which were two more torch launches after it.

Reference: the forward's tests against float64 (tests/cce/test_cce.py).
"""

import triton
import triton.language as tl

from helpers.cce.kernels.logits import exp_of, log1p_neg, target_complement


ONE_PROGRAM_ROWS = 8192  # the most rows whose loss one program reduces (REDUCE)


@triton.jit
def row_loss_kernel(
    # lse_split, nontarget_split, logit_sum_split (SPLITS, N) fp32, rows stride_split apart
    # (logit_sum_split: any pointer without SMOOTHING); target logit (N,) fp32; x (N,) targets.
    lse_split_ptr, nontarget_split_ptr, logit_sum_split_ptr, target_ptr, x_ptr,
    # Outputs: lse, r (the non-target mass), loss (N,) fp32; with REDUCE the reduced loss, an fp32 scalar,
    # (REDUCE = 2) divided by count_ptr's int64 (the kept rows).
    lse_ptr, r_ptr, loss_ptr, reduced_ptr, count_ptr,
    N, splits, stride_split, stride_x, ignore_index,
    target_weight, smoothing_weight, z_loss,
    SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, BLOCK: tl.constexpr, REDUCE: tl.constexpr = 0,
):
    if REDUCE == 0:
        _block_loss(lse_split_ptr, nontarget_split_ptr, logit_sum_split_ptr, target_ptr, x_ptr, lse_ptr, r_ptr,
                    loss_ptr, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), N, splits, stride_split, stride_x,
                    ignore_index, target_weight, smoothing_weight, z_loss, SMOOTHING, Z_LOSS, BLOCK)
    else:
        total = 0.0
        for r0 in range(0, N, BLOCK):
            total += _block_loss(lse_split_ptr, nontarget_split_ptr, logit_sum_split_ptr, target_ptr, x_ptr, lse_ptr,
                                 r_ptr, loss_ptr, r0 + tl.arange(0, BLOCK), N, splits, stride_split, stride_x,
                                 ignore_index, target_weight, smoothing_weight, z_loss, SMOOTHING, Z_LOSS, BLOCK)
        if REDUCE == 2:
            total = tl.math.div_rn(total, tl.load(count_ptr).to(tl.float32))
        tl.store(reduced_ptr, total)


@triton.jit
def _block_loss(lse_split_ptr, nontarget_split_ptr, logit_sum_split_ptr, target_ptr, x_ptr, lse_ptr, r_ptr, loss_ptr,
                rows, N, splits, stride_split, stride_x, ignore_index, target_weight, smoothing_weight, z_loss,
                SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, BLOCK: tl.constexpr):
    """lse, r and loss of ``rows`` stored (module doc); returns the sum of their losses."""
    inside = rows < N
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for k in range(0, splits):
        m = tl.maximum(m, tl.load(lse_split_ptr + k * stride_split + rows, mask=inside, other=0.0))
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    nontarget = tl.zeros([BLOCK], dtype=tl.float32)  # in the same scale m (every split's u <= its s)
    logit_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, splits):
        # exp_of's precise form whatever the inputs' dtype: a few exps a row, and the lse every backward takes.
        total += exp_of(tl.load(lse_split_ptr + k * stride_split + rows, mask=inside, other=0.0) - m, True)
        nontarget += exp_of(tl.load(nontarget_split_ptr + k * stride_split + rows, mask=inside, other=0.0) - m, True)
        if SMOOTHING:
            logit_sum += tl.load(logit_sum_split_ptr + k * stride_split + rows, mask=inside, other=0.0)
    lse = m + tl.log(total)
    r = exp_of(tl.log(nontarget) - tl.log(total), True)  # exp(lse_u - lse): relative precision, no 1 - p
    x = tl.load(x_ptr + rows * stride_x, mask=inside, other=ignore_index)
    kept = x != ignore_index
    z_x = tl.load(target_ptr + rows, mask=inside, other=0.0)
    loss = tl.where(r < 0.5, -log1p_neg(r), lse - z_x)
    r = target_complement(r, z_x, lse)  # what the backward takes
    if SMOOTHING:
        loss = loss + (1.0 - target_weight) * z_x - smoothing_weight * logit_sum
    if Z_LOSS:  # only where asked: 0 x lse^2 would make an infinite lse's loss NaN
        loss = loss + z_loss * lse * lse
    tl.store(lse_ptr + rows, lse, mask=inside)
    tl.store(r_ptr + rows, r, mask=inside)
    loss = tl.where(kept & inside, loss, 0.0)
    tl.store(loss_ptr + rows, loss, mask=inside)
    return tl.sum(loss, axis=0)
