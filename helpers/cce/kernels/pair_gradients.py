"""The "sparse" backward's kernels: only the (row, vocabulary tile) pairs the forward marked.

The forward marked, per row, the tiles whose softmax mass may reach eps (``lse_forward.py``, bits
in ``helpers.cce.activity``). ``pair_list.py`` lists the marked pairs by (row block, tile, row) on
the GPU; a pack is BLOCK_N consecutive pairs of one tile (``locate_pack``), and these kernels
compute only packs. Every kernel writes each gradient element once, in a fixed order: no atomics
on the gradients, which are bitwise repeatable (the optional stats are summed with atomics).

``pack_gradient`` rebuilds a pack's (BLOCK_N, BLOCK_V) logit tile from the gathered rows of E and
the tile's rows of C (plus the tile's bias) and forms G (``gradient_and_softmax_tile``: the G of every other backward),
then applies the exact filter rule per row: a row whose |G| mass in the tile is below eps gets
G = 0 (the bits over-mark; what they let through is judged here, exactly).

dE, per block of rows (host: ``helpers.cce.backward.sparse``), a segmented reduction:

    sparse_dE_pack_kernel     Y[slot] = G_row C_tile         (one row of D per marked pair, fp16 for
                              16-bit inputs; a row's slots are consecutive, in tile order)
    sparse_dE_reduce_kernel   dE_i = w_i sum_{slots of i} Y[slot], in fp32, in tile order, rounded once

dC, per range of tiles, with the packs of every row:

    sparse_g_kernel           Gc[pack] = w_rel G             (BLOCK_N, BLOCK_V) in E's dtype
    sparse_dC_kernel          dC_tile = w_scale sum_packs Gc^T E[pack rows]   (fp32 accumulator,
                              one program per (tile, D block) owns its dC rows: written once),
                              db_tile = w_scale sum_packs Gc^T 1 (with a bias: its gradient)

G is computed twice per pack (once for dE, once for dC): four tile products instead of the
"gemm" backward's three, on the marked pairs only. Why not once: dC needs every row of a tile
before its rows can be written, dE every tile of a row; keeping G between the two would cost
pairs x BLOCK_V x itemsize bytes (0.1-0.3 LB at the heads), recomputing costs one product on a few
percent of the pairs. Reference: autograd through ``helpers.spec.reference_loss``.
"""

import triton
import triton.language as tl

from helpers.cce.kernels.gradient_tile import gradient_and_softmax_tile
from helpers.cce.kernels.pair_list import locate_pack
from helpers.cce.kernels.logits import dot


@triton.jit
def pack_gradient(
    E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr, vocab_order_ptr,
    rows, row_mask, tile,
    V, D,
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef,
    softcap, eps,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SORTED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """(G, keep, accounted, cols, col_mask) of the pack of ``rows`` (int64, ``row_mask`` the lanes
    that hold one) in vocabulary tile ``tile``: G is (BLOCK_N, BLOCK_V) fp32, zero in rows the
    filter drops (keep = 0), empty lanes and padding; ``accounted`` is each row's |a| x (softmax
    mass in the tile) less the |G| mass the filter dropped there (before the soft cap's derivative:
    ``gradient_tile``'s mass), so that |a| minus a row's sum of it over its marked tiles is the mass
    the row lost: what the filter's rule bounds. The softmax mass alone would not do: a row that
    predicts its target surely has |G| ~ 0 but S ~ 1 there."""
    local_v = tile.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)  # vocabulary positions
    col_mask = local_v < V
    if SORTED:
        cols = tl.load(vocab_order_ptr + local_v, mask=col_mask, other=0).to(tl.int64)
    else:
        cols = local_v
    G, S, g_mass = gradient_and_softmax_tile(E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr, rows, cols,
                                             row_mask, col_mask, V, D,
                                             stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef,
                                             softcap, BLOCK_N, BLOCK_V, BLOCK_D, HAS_SOFTCAP, HAS_BIAS,
                                             DOT_PRECISION)
    # [Gradient filter, per row] the rule of every backward, decided for each row on its own.
    keep = (g_mass >= eps) & row_mask
    G = tl.where(keep[:, None], G, 0.0)
    a = tl.load(coef_ptr + rows, mask=row_mask, other=0.0)
    accounted = tl.abs(a) * tl.sum(S, axis=1) - tl.where(keep, 0.0, g_mass)
    return G, keep, accounted, cols, col_mask


@triton.jit
def add_stats(kept_ptr, accounted_ptr, rows, row_mask, keep, accounted):
    """The filter's counts, for ``stats`` only: kept pairs, and each row's accounted |G| mass."""
    tl.atomic_add(kept_ptr, tl.sum(keep.to(tl.int32), axis=0))
    tl.atomic_add(accounted_ptr + rows, accounted, mask=row_mask)


@triton.jit
def sparse_dE_pack_kernel(
    E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr,  # as ``gradient_tile``'s: coef (3, N) fp32 a, t, c
    vocab_order_ptr,  # (V,) int64: C's row at each sorted position (SORTED only)
    pack_off_ptr, pair_off_ptr, pair_cnt_ptr, pair_row_ptr,  # the pair index (``locate_pack``)
    pair_slot_ptr,  # (pairs,) int32: each pair's row of Y
    Y_ptr,  # (slots, D) fp16 or fp32 (``helpers.cce.backward.sparse.y_dtype``): G_row C_tile of each marked pair
    kept_ptr, accounted_ptr,  # (1,) int32, (N,) fp32: ``add_stats`` (STATS only)
    group, tiles, search_steps,  # the row block's group in the index; the index's tiles
    V, D,
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef, stride_Y,
    softcap, eps,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SORTED: tl.constexpr,
    STATS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    live, tile, q, q_mask, rows = locate_pack(pack_off_ptr, pair_off_ptr, pair_cnt_ptr, pair_row_ptr,
                                              group, tl.program_id(0), tiles, search_steps, BLOCK_N)
    if live:  # the launch is sized by a bound on the block's packs
        G, keep, accounted, cols, col_mask = pack_gradient(
            E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr, vocab_order_ptr, rows, q_mask, tile,
            V, D, stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef, softcap, eps,
            BLOCK_N, BLOCK_V, BLOCK_D, HAS_SOFTCAP, HAS_BIAS, SORTED, DOT_PRECISION)
        if STATS:
            add_stats(kept_ptr, accounted_ptr, rows, q_mask, keep, accounted)
        # Y rows are pairs, not pack lanes: the empty lanes of half-full packs take no Y memory.
        slots = tl.load(pair_slot_ptr + q, mask=q_mask, other=0).to(tl.int64)
        # Y = G C_tile, walking D. Unscaled G in the input dtype (as every backward's dE product).
        G_dt = G.to(E_ptr.dtype.element_ty)
        offs_d = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs_d
            d_mask = d < D
            c = tl.load(C_ptr + cols[:, None] * stride_Cv + d[None, :] * stride_Cd,
                        mask=col_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_V, BLOCK_D)
            # (c^T G^T)^T, not tl.dot(G_dt, c): the form that keeps the logit accumulator's cast out
            # of sm_90's register operands across this loop (see ``atomic_gradients.py``: ptxas reused
            # those registers and dE came out wrong on the H200).
            y = tl.trans(dot(tl.trans(c), tl.trans(G_dt), None, DOT_PRECISION))
            tl.store(Y_ptr + slots[:, None] * stride_Y + d[None, :], y.to(Y_ptr.dtype.element_ty),
                     mask=q_mask[:, None] & d_mask[None, :])


@triton.jit
def sparse_dE_reduce_kernel(
    Y_ptr,  # (slots, D) fp16 or fp32
    row_slot_ptr,  # (N + 1,) int64: row i's slots are [row_slot[i], row_slot[i + 1]) - slot0, in tile order
    w_ptr,  # (N,) fp32 each row's weight w (``helpers.cce.backward.rows.RowGradient``)
    dE_ptr,  # (N, D) in E's dtype
    row0, slot0, D,
    stride_Y, stride_dEn, stride_dEd,
    BLOCK_R: tl.constexpr,
):
    row = row0 + tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    d_mask = d < D
    start = tl.load(row_slot_ptr + row) - slot0
    end = tl.load(row_slot_ptr + row + 1) - slot0
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for slot in range(start, end):  # a fixed order: the same sum, to the bit, on every run
        acc += tl.load(Y_ptr + slot * stride_Y + d, mask=d_mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + row)
    tl.store(dE_ptr + row * stride_dEn + d * stride_dEd, (acc * w).to(dE_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def sparse_g_kernel(
    E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr,  # as ``gradient_tile``'s: coef (3, N) fp32 a, t, c
    vocab_order_ptr,  # (V,) int64: C's row at each sorted position (SORTED only)
    pack_off_ptr, pair_off_ptr, pair_cnt_ptr, pair_row_ptr,  # the pair index (one group: every row)
    w_rel_ptr,  # (N,) fp32: w / w_scale
    Gc_ptr,  # (packs, BLOCK_N, BLOCK_V) in E's dtype: w_rel G of each pack of the range
    kept_ptr, accounted_ptr,  # ``add_stats`` (STATS only)
    pack0, tile0, tiles, search_steps,  # the range's first pack; the index's first tile and tiles
    V, D,
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef,
    softcap, eps,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SORTED: tl.constexpr,
    STATS: tl.constexpr,  # the filter's counts, when the dE pass (which makes them) does not run
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    live, tile, q, q_mask, rows = locate_pack(pack_off_ptr, pair_off_ptr, pair_cnt_ptr, pair_row_ptr,
                                              0, pack0 + pid, tiles, search_steps, BLOCK_N)
    G, keep, accounted, cols, col_mask = pack_gradient(
        E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr, vocab_order_ptr, rows, q_mask, tile0 + tile,
        V, D, stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef, softcap, eps,
        BLOCK_N, BLOCK_V, BLOCK_D, HAS_SOFTCAP, HAS_BIAS, SORTED, DOT_PRECISION)
    if STATS:
        add_stats(kept_ptr, accounted_ptr, rows, q_mask, keep, accounted)
    # dC's operand carries w relative to its maximum (w_rel <= 1: no fp16 underflow of w S).
    w_rel = tl.load(w_rel_ptr + rows, mask=q_mask, other=0.0)
    lanes = tl.arange(0, BLOCK_N)
    v = tl.arange(0, BLOCK_V)
    tl.store(Gc_ptr + pid.to(tl.int64) * BLOCK_N * BLOCK_V + lanes[:, None] * BLOCK_V + v[None, :],
             (G * w_rel[:, None]).to(Gc_ptr.dtype.element_ty))


@triton.jit
def sparse_dC_kernel(
    E_ptr,  # (N, D)
    Gc_ptr,  # (packs, BLOCK_N, BLOCK_V) from ``sparse_g_kernel``
    pack_off_ptr, pair_off_ptr, pair_cnt_ptr, pair_row_ptr,  # the pair index (one group: every row)
    vocab_order_ptr,
    w_scale_ptr,  # (1,) fp32: max w
    dC_ptr,  # (V, D) in E's dtype (NEED_DC only)
    db_ptr,  # (V,) in the bias's dtype (NEED_DB only)
    partial_ptr,  # (tiles, splits, BLOCK_V, D) fp32: each split's sum (PARTIAL only)
    partial_db_ptr,  # (tiles, splits, BLOCK_V) fp32 (PARTIAL and NEED_DB only)
    pack0, tile0, first_tile, splits,  # Gc's first pack; the index's first tile; this launch's first, in the index
    window_lo, window_hi,  # the packs in Gc now, in the index: a tile larger than Gc comes in windows
    V, D,
    stride_En, stride_Ed, stride_dCv, stride_dCd,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SORTED: tl.constexpr,
    NEED_DC: tl.constexpr,  # False: db only, one program per tile, E never read
    NEED_DB: tl.constexpr,
    PARTIAL: tl.constexpr,  # split the tile's packs over program_id(2); ``sparse_dC_finish_kernel`` sums
    ACCUMULATE: tl.constexpr,  # PARTIAL, a later window: each split goes on from its sum so far
    DOT_PRECISION: tl.constexpr,
):
    t = first_tile + tl.program_id(0)  # in the index
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    local_v = (tile0 + t).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = local_v < V
    if SORTED:
        cols = tl.load(vocab_order_ptr + local_v, mask=col_mask, other=0).to(tl.int64)
    else:
        cols = local_v
    p0 = tl.load(pack_off_ptr + t)
    p1 = tl.load(pack_off_ptr + t + 1)
    first = tl.load(pair_off_ptr + t)
    end = first + tl.load(pair_cnt_ptr + t)
    p_lo = tl.maximum(p0, window_lo)
    p_hi = tl.minimum(p1, window_hi)
    if PARTIAL:
        # A tile that every row marks has thousands of packs (2,048 at the Qwen3 head with N =
        # 131,072): one program per (tile, D block) would walk them alone, with a few tiles in flight.
        chunk = tl.cdiv(p_hi - p_lo, splits)
        p_lo = p_lo + tl.program_id(2) * chunk
        p_hi = tl.minimum(p_hi, p_lo + chunk)
    lanes = tl.arange(0, BLOCK_N)
    v = tl.arange(0, BLOCK_V)
    part = (tl.program_id(0).to(tl.int64) * splits + tl.program_id(2)) * BLOCK_V
    # ACCUMULATE: the split's sum over the earlier windows is read back as the accumulator (fp32,
    # exact), so windows of one split give the bits of the tile in one piece.
    acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    if ACCUMULATE:
        if NEED_DC:
            acc = tl.load(partial_ptr + (part + v[:, None]) * D + d[None, :], mask=d_mask[None, :], other=0.0)
        if NEED_DB:
            db_acc = tl.load(partial_db_ptr + part + v)
    for p in range(p_lo, p_hi):  # the tile's marked rows, pack by pack, in one fixed order
        gT = tl.load(Gc_ptr + (p - pack0) * BLOCK_N * BLOCK_V + lanes[None, :] * BLOCK_V + v[:, None])  # (BLOCK_V, BLOCK_N)
        if NEED_DC:
            q = first + (p - p0) * BLOCK_N + lanes
            q_mask = q < end
            rows = tl.load(pair_row_ptr + q, mask=q_mask, other=0).to(tl.int64)
            e = tl.load(E_ptr + rows[:, None] * stride_En + d[None, :] * stride_Ed,
                        mask=q_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
            acc = dot(gT, e, acc, DOT_PRECISION)
        if NEED_DB:
            # db_v = sum_i w_i G_{i, v}: the same operand as dC's, summed over the rows instead of
            # multiplied by E (empty lanes hold zeros).
            db_acc += tl.sum(gT.to(tl.float32), axis=1)
    if PARTIAL:
        if NEED_DC:
            tl.store(partial_ptr + (part + v[:, None]) * D + d[None, :], acc, mask=d_mask[None, :])
        if NEED_DB:
            if tl.program_id(1) == 0:
                tl.store(partial_db_ptr + part + v, db_acc)
    else:
        # A tile no row marked gets zeros: every row of dC (and entry of db) is written here, once.
        w_scale = tl.load(w_scale_ptr)
        if NEED_DC:
            tl.store(dC_ptr + cols[:, None] * stride_dCv + d[None, :] * stride_dCd,
                     (acc * w_scale).to(dC_ptr.dtype.element_ty), mask=col_mask[:, None] & d_mask[None, :])
        if NEED_DB:
            if tl.program_id(1) == 0:  # every D block summed the same db; the first writes it
                tl.store(db_ptr + cols, (db_acc * w_scale).to(db_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def sparse_dC_finish_kernel(
    partial_ptr, partial_db_ptr,  # as ``sparse_dC_kernel``'s
    vocab_order_ptr, w_scale_ptr, dC_ptr, db_ptr,
    tile0, first_tile, splits,  # the index's first tile; the launch's first, in the index
    V, D,
    stride_dCv, stride_dCd,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SORTED: tl.constexpr,
    NEED_DC: tl.constexpr,
    NEED_DB: tl.constexpr,
):
    """dC (and db) rows of a split tile: the splits' sums added in split order (the same bits on
    every run), scaled by w_scale and written once."""
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    v = tl.arange(0, BLOCK_V)
    local_v = (tile0 + first_tile + tl.program_id(0)).to(tl.int64) * BLOCK_V + v
    col_mask = local_v < V
    if SORTED:
        cols = tl.load(vocab_order_ptr + local_v, mask=col_mask, other=0).to(tl.int64)
    else:
        cols = local_v
    w_scale = tl.load(w_scale_ptr)
    base = tl.program_id(0).to(tl.int64) * splits * BLOCK_V
    if NEED_DC:
        acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
        for s in range(splits):
            acc += tl.load(partial_ptr + (base + s * BLOCK_V + v[:, None]) * D + d[None, :], mask=d_mask[None, :],
                           other=0.0)
        tl.store(dC_ptr + cols[:, None] * stride_dCv + d[None, :] * stride_dCd,
                 (acc * w_scale).to(dC_ptr.dtype.element_ty), mask=col_mask[:, None] & d_mask[None, :])
    if NEED_DB:
        if tl.program_id(1) == 0:
            db_acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
            for s in range(splits):
                db_acc += tl.load(partial_db_ptr + base + s * BLOCK_V + v)
            tl.store(db_ptr + cols, (db_acc * w_scale).to(db_ptr.dtype.element_ty), mask=col_mask)
