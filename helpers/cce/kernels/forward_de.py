"""The end of dE made in the forward (``helpers.cce.forward_de``): each row's dE from its sums, rounded once.

The forward's pass leaves, per row i of a row chunk, A_i = sum_{v != x_i} P_{i, v} C_v in fp32 (P = exp(z - z_x)
rounded to the dtype, the products' fp32 sum) and S'_i = sum_{v != x_i} exp(z_{i, v} - z_{x_i}) in fp32 (the G
kernel's row sums, from the unrounded exponentials). With p_v = P_v / (1 + S') the softmax and p_x = 1 / (1 + S'),

    dE_i = w (sum_v p_v C_v - C_{x_i}) = w (A_i - S'_i C_{x_i}) / (1 + S'_i),

w the row's weight (a mean's 1 / N_kept, a sum's 1; 0 at an ignored row, whose dE is 0 and whose C row is not
read). One program per (BLOCK_R rows, BLOCK_D columns); the result is written once in dE's dtype
(``forward_de_rows_kernel``). A row whose S' passed its range (P near overflow) is redone from E and C alone
(``forward_de_redo_kernel``). Reference: autograd through ``helpers.spec.reference_loss`` (tests/cce/test_forward_de.py).
"""

import triton
import triton.language as tl

from helpers.cce.kernels.logits import dot, exp_of, logit_tile


@triton.jit
def forward_de_rows_kernel(
    acc_ptr,  # (R, D) fp32: A of the chunk's rows, row stride stride_acc
    C_ptr,  # (V, D) the classifier
    x_ptr,  # (R,) the rows' targets (outside [0, V): an ignored row)
    sums_ptr,  # (R,) fp32: S'
    scale_ptr,  # (1,) fp32: w of a kept row
    out_ptr,  # (R, D) dE's rows in the inputs' dtype, row stride stride_out
    R, V, D,
    stride_acc, stride_Cv, stride_Cd, stride_x, stride_out,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < R
    x = tl.load(x_ptr + rows * stride_x, mask=row_mask, other=-1).to(tl.int64)
    kept = row_mask & (x >= 0) & (x < V)
    mask = row_mask[:, None] & (d < D)[None, :]
    s = tl.load(sums_ptr + rows, mask=row_mask, other=0.0)
    a = tl.load(acc_ptr + rows[:, None] * stride_acc + d[None, :], mask=mask, other=0.0)
    c = tl.load(C_ptr + tl.where(kept, x, 0)[:, None] * stride_Cv + d[None, :] * stride_Cd,
                mask=kept[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    w = tl.load(scale_ptr)
    g = (a - s[:, None] * c) / (1.0 + s[:, None]) * w
    g = tl.where(kept[:, None], g, 0.0)
    tl.store(out_ptr + rows[:, None] * stride_out + d[None, :], g.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def forward_de_redo_kernel(
    E_ptr, C_ptr, x_ptr,  # E (N, D), C (V, D), x (N,) targets (outside [0, V): an ignored row)
    sums_ptr,  # (N,) fp32: the P pass's S'; a row past max_sum (or NaN) is redone here
    z_x_ptr,  # (N,) fp32: the target's logit
    scale_ptr,  # (1,) fp32: w of a kept row
    dE_ptr,  # (N, D) in the dtype: the redone rows' dE
    lse_ptr, r_ptr, loss_ptr,  # (N,) fp32 each: the redone rows' lse, 1 - p_x, loss (r_ptr: r's first row)
    N, V, D, max_sum,
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_dE,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The rows whose P passed its range (S' > max_sum: a logit ~88 past the target's in bf16), redone without
    P: per block of BLOCK_R rows holding one, the lse by an online walk over the vocabulary, then dE a BLOCK_D
    column block at a time (each walk rebuilds the logits: D / BLOCK_D + 1 walks, slow, for rows that should
    not occur). A block without such a row returns after reading its S', so the common call pays one launch
    and no host read."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < N
    s = tl.load(sums_ptr + rows, mask=row_mask, other=0.0)
    x = tl.load(x_ptr + rows * stride_x, mask=row_mask, other=-1).to(tl.int64)
    kept = row_mask & (x >= 0) & (x < V)
    redo = kept & ~(s <= max_sum)
    if tl.max(redo.to(tl.int32), axis=0) > 0:
        z_x = tl.load(z_x_ptr + rows, mask=redo, other=0.0)
        offs_v = tl.arange(0, BLOCK_V)
        # 1. The lse and the non-target mass u (relative to the running max m), online.
        m = tl.full((BLOCK_R,), -float("inf"), tl.float32)
        total = tl.zeros((BLOCK_R,), tl.float32)
        u = tl.zeros((BLOCK_R,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = (v0 + offs_v).to(tl.int64)
            col_mask = cols < V
            z = logit_tile(E_ptr, C_ptr, rows, cols, redo, col_mask, D, stride_En, stride_Ed, stride_Cv, stride_Cd,
                           BLOCK_R, BLOCK_V, BLOCK_D, DOT_PRECISION)
            z = tl.where(col_mask[None, :], z, -float("inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            e = exp_of(z - m_safe[:, None])
            alpha = exp_of(m - m_safe)
            total = total * alpha + tl.sum(e, axis=1)
            u = u * alpha + tl.sum(tl.where(cols[None, :] == x[:, None], 0.0, e), axis=1)
            m = m_new
        lse = m + tl.log(total)
        r = u / total
        tl.store(lse_ptr + rows, lse, mask=redo)
        tl.store(r_ptr + rows, r, mask=redo)
        tl.store(loss_ptr + rows, lse - z_x, mask=redo)
        # 2. dE = w (sum_v p_v C_v - C_x) = w sum_v G_v C_v, G = p off the target and -r on it (as the shipped
        # G's target column), a BLOCK_D block of columns at a time.
        w = tl.load(scale_ptr)
        offs_d = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs_d
            acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
            for v0 in range(0, V, BLOCK_V):
                cols = (v0 + offs_v).to(tl.int64)
                col_mask = cols < V
                z = logit_tile(E_ptr, C_ptr, rows, cols, redo, col_mask, D, stride_En, stride_Ed, stride_Cv,
                               stride_Cd, BLOCK_R, BLOCK_V, BLOCK_D, DOT_PRECISION)
                G = tl.where(cols[None, :] == x[:, None], -r[:, None], exp_of(z - lse[:, None]))
                G = tl.where(col_mask[None, :] & redo[:, None], G, 0.0)
                c = tl.load(C_ptr + cols[:, None] * stride_Cv + d[None, :] * stride_Cd,
                            mask=col_mask[:, None] & (d < D)[None, :], other=0.0)
                acc = dot(G.to(c.dtype), c, acc, DOT_PRECISION)
            tl.store(dE_ptr + rows[:, None] * stride_dE + d[None, :], (acc * w).to(dE_ptr.dtype.element_ty),
                     mask=redo[:, None] & (d < D)[None, :])
