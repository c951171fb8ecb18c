"""Algorithm 2 of the CCE paper: the linear-log-sum-exp lse_i = log sum_v exp(z_{i, v}), (N,).

Each program owns BLOCK_N rows and one split of the vocabulary. It walks its split in BLOCK_V
steps, rebuilds each (BLOCK_N, BLOCK_V) logit tile on chip (``logit_tile``) and folds it into a
running (max m, sum s) pair, the online softmax:

    m' = max(m, max_v z_v),   s' = s * exp(m - m') + sum_v exp(z_v - m'),   lse = m + log s.

Global memory written: one lse per (row, split), SPLITS * N * 4 bytes, instead of the N * V
logits. The splits exist only to give the GPU enough programs when N is small (N / BLOCK_N
programs would leave most SMs idle); the host merges them with a logsumexp over SPLITS.
With a bias, z = E C^T + b. With label smoothing the kernel also sums the logits of each row (the smoothing term needs
sum_v z_{i, v}). Reference: ``torch.logsumexp(reference_logits(E, C, softcap), dim=1)``.
"""

import triton
import triton.language as tl

from helpers.cce.kernels.logits import add_bias, logit_tile, tanh


@triton.jit
def lse_forward_kernel(
    # pointers
    E_ptr, C_ptr,  # E (N, D), C (V, D)
    bias_ptr,  # (V,) the head's bias (HAS_BIAS only)
    lse_split_ptr,  # (SPLITS, N) fp32: the lse of each row over one vocabulary split
    logit_sum_split_ptr,  # (SPLITS, N) fp32: sum_v z_{i, v} over the split (SUM_LOGITS only)
    # sizes
    N, V, D,
    blocks_per_split,  # vocabulary blocks of BLOCK_V per split
    # strides
    stride_En, stride_Ed, stride_Cv, stride_Cd,
    # options
    softcap,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SUM_LOGITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    # int64 before any product with a stride: row * stride_En overflows int32 past 2^31 elements.
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N

    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    logit_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)

    v_begin = split * blocks_per_split * BLOCK_V
    v_end = tl.minimum(V, v_begin + blocks_per_split * BLOCK_V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_mask = cols < V
        # 1. The logit tile, recomputed on chip: (BLOCK_N, BLOCK_V) fp32.
        z = logit_tile(E_ptr, C_ptr, rows, cols, row_mask, col_mask, D,
                       stride_En, stride_Ed, stride_Cv, stride_Cd,
                       BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION)
        if HAS_BIAS:
            z = add_bias(z, bias_ptr, cols, col_mask)
        if HAS_SOFTCAP:
            z = softcap * tanh(z / softcap)
        if SUM_LOGITS:
            logit_sum += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)
        # 2. [Online softmax] padding columns are -inf so they add exp(-inf) = 0. Every tile
        # holds at least one real column (v0 < V), so m' is finite after the first tile.
        z = tl.where(col_mask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new

    # 3. lse = m + log s; a split with no columns gives -inf, which the host's logsumexp ignores.
    out = split.to(tl.int64) * N + rows
    tl.store(lse_split_ptr + out, m + tl.log(s), mask=row_mask)
    if SUM_LOGITS:
        tl.store(logit_sum_split_ptr + out, logit_sum, mask=row_mask)
