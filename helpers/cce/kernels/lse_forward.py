"""Algorithm 2 of the CCE paper: the linear-log-sum-exp lse_i = log sum_v exp(z_{i, v}), (N,).

Each program owns BLOCK_N rows and one split of the vocabulary. It walks its split in BLOCK_V
steps, rebuilds each (BLOCK_N, BLOCK_V) logit tile on chip (``logit_tile``) and folds it into a
running (max m, sum s) pair, the online softmax:

    m' = max(m, max_v z_v),   s' = s * exp(m - m') + sum_v exp(z_v - m'),   lse = m + log s.

Global memory written: one lse per (row, split), SPLITS * N * 4 bytes, instead of the N * V
logits. The splits exist only to give the GPU enough programs when N is small (N / BLOCK_N
programs would leave most SMs idle); the host merges them with a logsumexp over SPLITS.
With a bias, z = E C^T + b; with a soft cap and a temperature tau, z = cap(E C^T + b) / tau. With label smoothing the kernel also sums the logits of each row (the smoothing term needs
sum_v z_{i, v}; with class weights w, sum_v w_v z_{i, v}: ``helpers.cce.class_weights``). Reference:
``torch.logsumexp(reference_logits(E, C, softcap), dim=1)``.

Row statistics (ROW_STATS, for ``helpers.cce.outputs``): the entropy of the split's softmax from one
more running sum t = sum_v exp(z_v - m) (z_v - m), rescaled with s (H = log s - t / s), the split's
largest logit and the target's logit as the same tile computed it (so that "the target is a maximum"
compares bits of one computation). The host merges the splits (``helpers.cce.forward.merge_row_stats``).

The non-target mass (NONTARGET, with the targets x): u = sum_{v != x} exp(z_v - m) over the split,
written as m + log u (-inf when the split holds nothing but the target). Merged over the splits like
the lse, it gives each row's r = 1 - p_x = exp(lse_u - lse) to fp32's relative precision however close
p_x is to 1, where 1 - exp(z_x - lse) is a difference of two rounded numbers of |z|'s size (absolute
error ~ulp(|z|)). The loss takes -log1p(-r) and the backward's target column (a - b) - a r from it
(``helpers.cce.backward.rows``). A target outside [0, V) or equal to ignore_index matches no column.
In the plain walk (no ROW_STATS, no bits) the running sum itself leaves the target's column out (one
compare and select per logit); with ROW_STATS or bits, which need every column's exp, u is a second,
masked row sum. In every walk the lse written is m + log(u + exp(z_x - m)), z_x Algorithm 1's target
logit (``target_logit_ptr``) where the split holds the target. Measured on an H200 (bf16,
``scripts/experiments/nontarget_cost.py``): a masked second sum in every tile cost the forward 11-16%,
a per-tile test for "a target in this tile" (a reduction across the program's warps, a barrier) 5-7%
even where no tile held one, the running sum masked in every tile 8-10%. With TILE_FLAGS the plain walk
masks only the tiles that Algorithm 1's launch flagged (``indexed_dot_kernel``: a byte per (row block,
tile) that holds a target, read as one scalar a tile), ~BLOCK_N x BLOCK_V / V of them. In the sorted
walk the host passes each target's sorted position.

Activity bits (EMIT_BITS, for the "sparse" backward, ``helpers/cce/backward/sparse.py``). For
every row and every sub-tile of BLOCK_V / SUB columns the kernel writes one bit: whether the
sub-tile's softmax mass may reach eps. It cannot know the final sum yet, so it compares against a
lower bound of it, in the running scale m':

    bit = sum_sub exp(z - m') >= eps * max(s' + exp(seed_add - m'), exp(seed_max - m'))

s' (the running sum, this tile included), seed_add (the lse of columns another launch has summed:
disjoint from this split's, so the two add) and seed_max (the target logit: one term of the sum)
are each at most the final sum, so a bit is never 0 for a sub-tile whose mass is >= eps: the bits
over-mark, never miss. The backward computes only the marked (row, sub-tile) pairs and applies the
exact rule there. Bits are packed 8 sub-tiles to a byte, (ceil(T / 8), N) uint8, byte-major, so
the host aligns splits to whole bytes; SORTED walks the vocabulary in ``vocab_order`` (positions,
so that the bits describe sorted tiles).

Tensor descriptors (E_DESC, the Hopper tier: ``helpers.cce.descriptors``): E's blocks, and C's
when the walk is not sorted, come through the copy engine (TMA) instead of pointer loads, with
zeros beyond the tensors' bounds. The arithmetic is the same, so are the bits. The per-column
masks are formed only in a vocabulary split's last, partial tile, and column indices are int32
(V < 2^31): at 128 x 256 tiles a thread holds 128 logits, and int64 indices or masks per column
held across the D loop spilled registers on sm_90.
"""

import triton
import triton.language as tl

from helpers.cce.kernels.logits import add_bias, exp_of, logit_tile, logit_tile_tma, soft_cap, sum_rounding


@triton.jit
def lse_forward_kernel(
    # pointers
    E_ptr, C_ptr,  # E (N, D), C (V, D)
    bias_ptr,  # (V,) the head's bias (HAS_BIAS only)
    lse_split_ptr,  # (SPLITS, N) fp32: the lse of each row over one vocabulary split
    logit_sum_split_ptr,  # (SPLITS, N) fp32: sum_v z_{i, v} over the split, w_v z_{i, v} with CLASS_WEIGHTS
    # (SUM_LOGITS only)
    bits_ptr,  # (ceil(T / 8), N) uint8: activity bits of sub-tiles of BLOCK_V / SUB (EMIT_BITS only)
    seed_add_ptr, seed_max_ptr,  # (N,) fp32 lower bounds of each row's lse, -inf for none (EMIT_BITS)
    vocab_order_ptr,  # (V,) int64: C's row at each sorted position (SORTED only)
    x_ptr,  # (N,) targets (ROW_STATS or NONTARGET); in the sorted walk, their sorted positions
    entropy_split_ptr,  # (SPLITS, N) fp32: the entropy of the split's softmax (ROW_STATS only)
    max_split_ptr,  # (SPLITS, N) fp32: the largest logit of the split (ROW_STATS only)
    target_split_ptr,  # (SPLITS, N) fp32: the target's logit if in the split, else 0 (ROW_STATS only)
    nontarget_split_ptr,  # (SPLITS, N) fp32: m + log sum_{v != x} exp(z_v - m) over the split (NONTARGET only)
    target_logit_ptr,  # (N,) fp32: Algorithm 1's z_x (NONTARGET in the plain walk)
    tile_flags_ptr,  # (row blocks x tiles,) int8: whether a (row block, tile) holds a target (TILE_FLAGS only)
    # sizes
    N, V, D,
    v_start,  # first vocabulary position of split 0 (the columns before it belong to another launch)
    ignore_index,  # a target equal to it matches no column (NONTARGET)
    blocks_per_split,  # vocabulary blocks of BLOCK_V per split
    # strides
    stride_En, stride_Ed, stride_Cv, stride_Cd,
    # options
    softcap, eps, inv_temperature,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SUM_LOGITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EMIT_BITS: tl.constexpr = False,
    SORTED: tl.constexpr = False,
    SUB: tl.constexpr = 1,  # bits per BLOCK_V tile: 1, 2, 4 or 8
    E_DESC: tl.constexpr = False,  # E_ptr is a tensor descriptor (and C_ptr too, unless SORTED)
    SPLIT_MAJOR: tl.constexpr = False,  # grid (SPLITS, N / BLOCK_N) instead of (N / BLOCK_N, SPLITS)
    ROW_STATS: tl.constexpr = False,  # also the entropy, the max and the target's logit (unsorted only)
    NONTARGET: tl.constexpr = False,  # also the non-target mass (module doc)
    TILE_FLAGS: tl.constexpr = False,  # the plain walk masks only the tiles flagged by Algorithm 1's launch
    class_weight_ptr=None,  # (V,) fp32 class weights w: SUM_LOGITS sums w_v z_{i, v} (CLASS_WEIGHTS only)
    CLASS_WEIGHTS: tl.constexpr = False,
    lse_lo_split_ptr=None,  # (SPLITS, N) fp32: the rounding of each split's lse, m + log s (LSE_LO only)
    LSE_LO: tl.constexpr = False,  # fp32 inputs: the lse as two words (``sum_rounding``)
    # The logits of columns [v_start, v_start + blocks_per_split BLOCK_V) already in memory, (N, that many)
    # with row stride stride_zn (a tier whose Triton products are FMAs has cuBLAS make them,
    # ``HostTuning.logits_in_cublas``): read, not rebuilt; one split a launch.
    z_ptr=None, stride_zn=0,
    Z_GIVEN: tl.constexpr = False,
):
    if SPLIT_MAJOR:  # the splits of one row block are consecutive programs: they share E's strip in L2
        split = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
    # int64 before any product with a stride: row * stride_En overflows int32 past 2^31 elements.
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N

    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    logit_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if ROW_STATS:
        t = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum_v exp(z_v - m) (z_v - m), rescaled with s
        target = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if ROW_STATS or NONTARGET:
        # Compared in int32 (a valid target is below V < 2^31; anything else matches no column).
        x = tl.load(x_ptr + rows, mask=row_mask, other=-1)
        x = tl.where((x >= 0) & (x < V) & (x != ignore_index), x, -1).to(tl.int32)
    # The plain walk's running sum s leaves the target out (module doc); otherwise u runs beside it.
    MASK_S: tl.constexpr = NONTARGET and not ROW_STATS and not EMIT_BITS
    if NONTARGET and not MASK_S:
        u = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum_{v != x} exp(z_v - m), rescaled with s
    if EMIT_BITS:
        seed_add = tl.load(seed_add_ptr + rows, mask=row_mask, other=float("-inf"))
        seed_max = tl.load(seed_max_ptr + rows, mask=row_mask, other=float("-inf"))
        byte = tl.zeros((BLOCK_N,), dtype=tl.int32)
        SUB_V: tl.constexpr = BLOCK_V // SUB
        sub_of_col = tl.arange(0, BLOCK_V) // SUB_V  # (BLOCK_V,): the sub-tile of each column

    v_begin = v_start + split * blocks_per_split * BLOCK_V
    v_end = tl.minimum(V, v_begin + blocks_per_split * BLOCK_V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        # C's rows for this tile, int64 for the pointer products (V * D may pass 2^31).
        cols = v0 + tl.arange(0, BLOCK_V)
        if SORTED:
            c_rows = tl.load(vocab_order_ptr + cols, mask=cols < V, other=0).to(tl.int64)
        else:
            c_rows = cols.to(tl.int64)
        # 1. The logit tile, recomputed on chip: (BLOCK_N, BLOCK_V) fp32.
        if Z_GIVEN:
            z = tl.load(z_ptr + rows[:, None] * stride_zn + (cols - v_start).to(tl.int64)[None, :],
                        mask=row_mask[:, None] & (cols < V)[None, :], other=0.0).to(tl.float32)
        elif E_DESC:
            z = logit_tile_tma(E_ptr, C_ptr, pid_n * BLOCK_N, v0, c_rows, cols < V, D, stride_Cv, stride_Cd,
                               BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION, not SORTED)
        else:
            z = logit_tile(E_ptr, C_ptr, rows, c_rows, row_mask, cols < V, D,
                           stride_En, stride_Ed, stride_Cv, stride_Cd,
                           BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION)
        if HAS_BIAS:
            z = add_bias(z, bias_ptr, c_rows, cols < V)  # C's rows: the bias follows the sort
        if HAS_SOFTCAP:
            z = soft_cap(z, softcap, DOT_PRECISION == "ieee")
        z = z * inv_temperature  # the temperature divides the capped logit (1.0: exact, no change)
        # Padding columns (the last tile only: a runtime branch, so full tiles carry no masks) are
        # -inf, so they add exp(-inf) = 0 below; the column indices are formed afresh after the
        # product, in int32, so that none stays live in registers across its D loop.
        if v0 + BLOCK_V > V:
            z = tl.where((v0 + tl.arange(0, BLOCK_V) < V)[None, :], z, float("-inf"))
        if SUM_LOGITS:
            if CLASS_WEIGHTS:  # torch's weighted smoothing term: w follows C's rows (and the sort)
                w_cols = c_rows if SORTED else (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
                w = tl.load(class_weight_ptr + w_cols, mask=(v0 + tl.arange(0, BLOCK_V)) < V, other=0.0)
                logit_sum += tl.sum(tl.where(z > float("-inf"), z, 0.0) * w[None, :], axis=1)
            else:
                logit_sum += tl.sum(tl.where(z > float("-inf"), z, 0.0), axis=1)
        # 2. [Online softmax] Every tile holds at least one real column (v0 < V), so m' is finite
        # after the first tile.
        m_new = tl.maximum(m, tl.max(z, axis=1))
        p = exp_of(z - m_new[:, None], DOT_PRECISION == "ieee")
        alpha = exp_of(m - m_new, DOT_PRECISION == "ieee")  # the running sums' rescale (0 before the first tile)
        if ROW_STATS:
            # [Entropy] t = sum_v p_v (z_v - m), kept relative to the running max so that H = log s - t / s
            # never subtracts two logit-sized numbers. On a new max m': sum p' (z - m') =
            # exp(m - m') (t + (m - m') s); the first tile has s = 0 (and m - m' = -inf). Padding: p = 0.
            shift = tl.where(s > 0, m - m_new, 0.0) * s  # (-inf) * 0 never formed: no NaN
            t = alpha * (t + shift) + tl.sum(p * tl.where(p > 0, z - m_new[:, None], 0.0), axis=1)
            # [Accuracy] the target's logit as this tile computed it: the same bits as the max's.
            hit = (v0 + tl.arange(0, BLOCK_V))[None, :] == x[:, None]
            target += tl.sum(tl.where(hit, z, 0.0), axis=1)
        if NONTARGET:
            if MASK_S:
                if TILE_FLAGS:  # one byte a tile, the same for every thread: no reduction across warps
                    if tl.load(tile_flags_ptr + pid_n * tl.cdiv(V, BLOCK_V) + v0 // BLOCK_V) != 0:
                        p = tl.where((v0 + tl.arange(0, BLOCK_V))[None, :] != x[:, None], p, 0.0)
                else:
                    p = tl.where((v0 + tl.arange(0, BLOCK_V))[None, :] != x[:, None], p, 0.0)
            else:
                u = u * alpha + tl.sum(tl.where((v0 + tl.arange(0, BLOCK_V))[None, :] != x[:, None], p, 0.0), axis=1)
        s = s * alpha + tl.sum(p, axis=1)
        m = m_new
        if EMIT_BITS:
            # 3. [Activity bits] each sub-tile's mass against a lower bound of the final sum.
            bound = tl.maximum(s + tl.exp(seed_add - m_new), tl.exp(seed_max - m_new))
            threshold = eps * bound  # (BLOCK_N,); inf when a seed dwarfs this tile: bit 0, rightly
            first = v0 // SUB_V  # global index of this tile's first sub-tile
            bits = tl.zeros((BLOCK_N,), dtype=tl.int32)
            for j in tl.static_range(SUB):
                mass = tl.sum(tl.where((sub_of_col == j)[None, :], p, 0.0), axis=1)
                bits = bits | tl.where(mass >= threshold, 1 << ((first + j) % 8), 0)
            # A byte holds 8 sub-tiles; the split starts on a byte, so its first tile starts one.
            byte = tl.where(first % 8 == 0, bits, byte | bits)
            tl.store(bits_ptr + (first // 8) * N + rows, byte.to(tl.uint8), mask=row_mask)

    # 4. lse = m + log s; a split with no columns gives -inf, which the host's logsumexp ignores.
    out = split.to(tl.int64) * N + rows
    lse_sum = s
    if NONTARGET:
        # The split's sum as the non-target sum plus the target's term from Algorithm 1's z_x where the
        # split holds it: in every walk, so that every walk's lse has the same bits (the "sparse"
        # backward's hand-over to "gemm" gives the gemm's gradients exactly).
        if MASK_S:
            u = s
        holds = (x >= v_begin) & (x < v_end)
        z_x = tl.load(target_logit_ptr + rows, mask=row_mask & holds, other=0.0)
        lse_sum = u + tl.where(holds, exp_of(z_x - m, DOT_PRECISION == "ieee"), 0.0)
    log_sum = tl.log(lse_sum)
    lse = m + log_sum
    tl.store(lse_split_ptr + out, lse, mask=row_mask)
    if LSE_LO:
        tl.store(lse_lo_split_ptr + out, sum_rounding(m, log_sum, lse), mask=row_mask)
    if SUM_LOGITS:
        tl.store(logit_sum_split_ptr + out, logit_sum, mask=row_mask)
    if ROW_STATS:
        # H = lse - sum p z = (m + log s) - (m + t / s).
        tl.store(entropy_split_ptr + out, tl.log(s) - t / s, mask=row_mask)
        tl.store(max_split_ptr + out, m, mask=row_mask)
        tl.store(target_split_ptr + out, target, mask=row_mask)
    if NONTARGET:
        tl.store(nontarget_split_ptr + out, m + tl.log(u), mask=row_mask)
