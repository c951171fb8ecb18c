"""The "forward_grads" schedule's one kernel: a chunk of whole logit rows, already in memory, turned
into each row's lse and loss and, in place, into G = dloss / dz.

The schedule (``helpers.cce.forward_grads``) holds the logits of R rows at a time, Z = E_r C^T + b
(R, V), made by cuBLAS. Unlike the recompute kernels this one multiplies nothing: it reads each row
twice and writes it once, so it runs at memory bandwidth (6 R V bytes for a 16-bit chunk; one
product of the same chunk is 2 R V D FLOP, D / 3 FLOP per byte: ~340 at D = 1,024, well above
an H200's ~165 FLOP per byte, so the products, not this pass, set the schedule's time).

Per row i (one program), with z = cap(Z_i) / temperature:

    1. [Online softmax] m, s = running max and sum exp(z - m) over the row's blocks; also z_{x_i}
       and, with label smoothing, sum_v z_v.
    2. lse_i = m + log s;  loss_i = lse_i - (1 - ls) z_{x_i} - (ls / V) sum_v z_v + zl lse_i^2
       (0 at an ignored row), as ``helpers.cce.forward`` gives it: lse_i - z_{x_i} taken as
       -log1p(-r_i) where r_i = u / s < 1/2, u the running sum without the target's column.
    3. G_{i, v} = [a S_{i, v} - b [v = x_i] - c / V] / temperature * (1 - t^2 under the soft cap),
       its target column (a - b) - a r_i (``gradient_tile``'s module doc),
       S = exp(z - lse), a = 1 + 2 zl lse_i, b = 1 - ls, c = ls (0, 0, 0 at an ignored row): the
       coefficients of ``helpers.cce.backward.rows.RowGradient`` for an upstream gradient of 1
       (the loss's "sum"; a mean's 1 / N_kept is applied to the products' fp32 results, so G in
       16 bits never underflows). Written over the row's own logits.

G may alias Z (the same dtype: each block is read before it is overwritten), or, for fp32 logits of
fp16 inputs, live in the first half of each fp32 row's bytes (``stride_G`` = 2 V fp16 elements):
block [v0, v0 + B) of G then covers bytes [2 v0, 2 v0 + 2 B) of the row, logits this program has
already read. Reference: ``helpers.spec.reference_loss`` and autograd through it
(tests/cce/test_forward_grads.py).
"""

import triton
import triton.language as tl

from helpers.cce.kernels.logits import exp_of, log1p_neg, slope_from_gap, soft_cap, soft_cap_and_gap, target_complement


@triton.jit
def row_gradient_kernel(
    # Pointers: Z (R, V) logits in any float dtype; G (R, V) written in G's dtype (may alias Z);
    # x (R,) targets; lse, loss (R,) fp32 outputs.
    Z_ptr, G_ptr, x_ptr, lse_ptr, loss_ptr,
    # Sizes and strides (elements of each tensor's own dtype).
    V, stride_Z, stride_G, stride_x,
    # The loss's options.
    ignore_index, softcap, inv_temperature, z_loss, label_smoothing,
    # Meta-parameters.
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SUM_LOGITS: tl.constexpr,  # label smoothing: the row's sum of logits
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z_ptr + row * stride_Z
    g_row = G_ptr + row * stride_G
    x = tl.load(x_ptr + row * stride_x)
    kept = x != ignore_index
    # A target outside [0, V) matches no column (the host raises for it after the forward).
    x = tl.where(kept & (x >= 0) & (x < V), x, -1).to(tl.int32)
    offs = tl.arange(0, BLOCK_V)

    # 1. [Online softmax] over the row's blocks, in fp32.
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    u = tl.zeros((), tl.float32)  # sum_{v != x} exp(z_v - m): the non-target mass, rescaled with s
    z_target = tl.zeros((), tl.float32)
    z_sum = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = soft_cap(z, softcap, Z_ptr.dtype.element_ty == tl.float32)
        z = z * inv_temperature
        z_target += tl.sum(tl.where(cols == x, z, 0.0))
        if SUM_LOGITS:
            z_sum += tl.sum(tl.where(mask, z, 0.0))
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z))
        p = exp_of(z - m_new, Z_ptr.dtype.element_ty == tl.float32)
        alpha = exp_of(m - m_new, Z_ptr.dtype.element_ty == tl.float32)
        u = u * alpha + tl.sum(tl.where(cols == x, 0.0, p))
        s = s * alpha + tl.sum(p)
        m = m_new

    # 2. lse = m + log s, and the row's loss. The softmax below takes (z - m) - log s, not z - lse: lse's own
    # rounding (ulp(lse) / 2, ~1e-6 at lse ~ 30) would shift every entry of the row (fp32 gradients at
    # logits of rms 10 erred 2.7-3.0x the naive path's, which keeps (z - m) - log s too).
    log_s = tl.log(s)
    lse = m + log_s
    r = tl.math.div_rn(u, s)  # 1 - S_x to fp32's relative precision (``lse_forward_kernel``'s NONTARGET)
    nll = tl.where(r < 0.5, -log1p_neg(r), lse - z_target)
    r = tl.where(kept, target_complement(r, (z_target - m) - log_s), r)  # the target column's 1 - S_x
    loss = nll + label_smoothing * z_target + z_loss * lse * lse
    if SUM_LOGITS:
        loss -= label_smoothing / V * z_sum
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(kept, loss, 0.0))

    # 3. G over the row, in place: the coefficients of an upstream gradient of 1 (0 when ignored).
    a = tl.where(kept, 1.0 + 2.0 * z_loss * lse, 0.0)
    t_x = tl.where(kept, 2.0 * z_loss * lse + label_smoothing, 0.0) - a * r  # a S_x - b = (a - b) - a r
    c = tl.where(kept, label_smoothing, 0.0)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z, gap = soft_cap_and_gap(z, softcap, Z_ptr.dtype.element_ty == tl.float32)
        z = z * inv_temperature
        S = exp_of((z - m) - log_s, Z_ptr.dtype.element_ty == tl.float32)
        G = tl.where(cols == x, t_x, a * S) - c / V
        G = G * inv_temperature
        if HAS_SOFTCAP:
            G = G * slope_from_gap(gap)
        tl.store(g_row + cols, G.to(G_ptr.dtype.element_ty), mask=mask)
