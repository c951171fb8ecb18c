"""Algorithm 1 of the CCE paper: the indexed dot z_{i, x_i} = cap(E_i . C_{x_i} + b_{x_i}) / temperature, (N,).

The target logit of each row, read without forming the row of logits: one gather of C's target
row per token, N * D multiply-adds in all. Reference: ``reference_logits(E, C, softcap)[i, x[i]]``.
With COUNTS it also counts the kept rows (a mean's divisor) and the targets outside [0, V) that are
not ignored (the host's check), as the first launch of the forward, so that the host waits for it
alone before it raises or goes on. With TILE_FLAGS it marks, for the LSE kernel that runs next, each
(row block, vocabulary tile) of that kernel's tiling that holds a kept row's target
(``lse_forward_kernel``'s TILE_FLAGS): a byte per pair, the buffer zeroed by the host.
"""

import triton
import triton.language as tl

from helpers.cce.kernels.logits import soft_cap


@triton.jit
def indexed_dot_kernel(
    # pointers
    E_ptr, C_ptr, x_ptr, out_ptr,  # E (N, D), C (V, D), x (N,), out (N,) fp32
    bias_ptr,  # (V,) the head's bias (HAS_BIAS only)
    counts_ptr,  # (2,) int64 zeros: kept rows, targets out of range (COUNTS only)
    tile_flags_ptr,  # (row blocks x tiles,) int8 zeros of the forward's tiling (TILE_FLAGS only)
    # sizes
    N, V, D,
    # strides
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x,
    # options
    ignore_index, softcap, inv_temperature,
    flag_rows, flag_cols, flag_tiles,  # the forward's BLOCK_N, BLOCK_V and tiles a row block (TILE_FLAGS)
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    COUNTS: tl.constexpr,
    TILE_FLAGS: tl.constexpr = False,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    x = tl.load(x_ptr + rows * stride_x, mask=row_mask, other=ignore_index).to(tl.int64)
    kept = row_mask & (x != ignore_index)
    # Ignored rows read C's row 0 instead of an out-of-range one; their value is never used. So
    # does a target outside [0, V): the host reads the count below once this launch is done and
    # raises before returning anything (``helpers.cce.ops``), so no launch may read out of bounds.
    inside = (x >= 0) & (x < V)
    if COUNTS:  # exact in any order: int64 atomics
        tl.atomic_add(counts_ptr, tl.sum(kept.to(tl.int64), axis=0))
        tl.atomic_add(counts_ptr + 1, tl.sum((kept & ~inside).to(tl.int64), axis=0))
    if TILE_FLAGS:
        flag = (rows // flag_rows) * flag_tiles + tl.where(kept & inside, x, 0) // flag_cols
        tl.store(tile_flags_ptr + flag, tl.full((BLOCK_N,), 1, tl.int8), mask=kept & inside)
    x = tl.where(kept & inside, x, 0)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs_d
        mask = kept[:, None] & (d < D)[None, :]
        e = tl.load(E_ptr + rows[:, None] * stride_En + d[None, :] * stride_Ed, mask=mask, other=0.0)
        c = tl.load(C_ptr + x[:, None] * stride_Cv + d[None, :] * stride_Cd, mask=mask, other=0.0)
        acc += tl.sum(e.to(tl.float32) * c.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + x, mask=kept, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        acc = soft_cap(acc, softcap, E_ptr.dtype.element_ty == tl.float32)
    acc = acc * inv_temperature  # the temperature divides the capped logit (1.0: exact, no change)
    tl.store(out_ptr + rows, acc, mask=row_mask)
