"""The end of dE made in the forward (``helpers.cce.forward_de``): each row's dE from its sums, rounded once.

The forward's pass leaves, per row i of a row chunk, A_i = sum_{v != x_i} P_{i, v} C_v in fp32 (P = exp(z - z_x)
rounded to the dtype, the products' fp32 sum) and S'_i = sum_{v != x_i} exp(z_{i, v} - z_{x_i}) in fp32 (the G
kernel's row sums, from the unrounded exponentials). With p_v = P_v / (1 + S') the softmax and p_x = 1 / (1 + S'),

    dE_i = w (sum_v p_v C_v - C_{x_i}) = w (A_i - S'_i C_{x_i}) / (1 + S'_i),

w the row's weight (a mean's 1 / N_kept, a sum's 1; 0 at an ignored row, whose dE is 0 and whose C row is not
read). One program per (BLOCK_R rows, BLOCK_D columns); the result is written once in dE's dtype.
Reference: autograd through ``helpers.spec.reference_loss`` (tests/cce/test_forward_de.py).
"""

import triton
import triton.language as tl


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
