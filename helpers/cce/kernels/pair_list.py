"""The marked (row, tile) pairs of the forward's activity bits, listed on the GPU, by tile.

The "sparse" backward computes packs: BLOCK_N rows of one vocabulary tile, all marked in the
forward's bits (``helpers.cce.activity``). Building those lists with torch ops cost host time per row
block (~30 small ops and a sync each), which at long contexts took most of the backward (measured:
docs/performance-history.md). Here the lists come from two kernels and a few scans over small
tables, with no host sync, for many row blocks at once.

The bits are (T8, N) uint8, byte b holding tiles 8b..8b+7 of every row. Rows are cut into
segments of at most ROWS rows (host: ``helpers.cce.backward.pair_index``), segments into groups (the
"sparse" backward's row blocks for dE; one group of every row for dC). The pairs are listed by
(group, tile, row):

    count_pairs_kernel   cnt[s, t] = marked rows of segment s in tile t          (S, Tp) int32
                         popcount[b, r] = marked tiles of row r in byte b        (optional)
    (host: scans)        off[s, t] = first list position of segment s's rows of tile t
    write_pairs_kernel   pair_row[off[s, t] + rank of r in s] = r     (ranks by tl.cumsum)
                         pair_slot[...] = the pair's rank among its row's pairs, plus the
                         row's first slot: the row-major slot the dE pass writes its product to

``locate_pack`` turns a program id into its pack: a binary search over the packs' first
positions per (group, tile).

Reference: ``tests/cce/test_sparse.py`` lists the pairs by unpacking the bits in torch.
"""

import triton
import triton.language as tl


@triton.jit
def _segment_bytes(bits_ptr, live_ptr, seg_start_ptr, s, byte, stride_bits, HAS_LIVE: tl.constexpr,
                   ROWS: tl.constexpr):
    """(rows, row_mask, bits of byte ``byte`` of segment s's rows as int32; 0 where not live)."""
    r0 = tl.load(seg_start_ptr + s)
    r1 = tl.load(seg_start_ptr + s + 1)
    rows = r0 + tl.arange(0, ROWS)
    row_mask = rows < r1
    b = tl.load(bits_ptr + byte.to(tl.int64) * stride_bits + rows, mask=row_mask, other=0).to(tl.int32)
    if HAS_LIVE:
        live = tl.load(live_ptr + rows, mask=row_mask, other=0)
        b = tl.where(live != 0, b, 0)
    return rows, row_mask, b


@triton.jit
def count_pairs_kernel(
    bits_ptr,  # (T8, N) uint8, rows contiguous
    live_ptr,  # (N,) uint8: rows whose bits count (HAS_LIVE only)
    seg_start_ptr,  # (S + 1,) int32: segment s is rows [seg_start[s], seg_start[s + 1])
    cnt_ptr,  # (S, 8 * bytes) int32 out: marked rows per (segment, tile of the byte range)
    popcount_ptr,  # (bytes, rows) int32 out: marked tiles per (byte, row - row0) (POPCOUNT only)
    byte0, row0,
    stride_bits, stride_cnt, stride_popcount,
    HAS_LIVE: tl.constexpr,
    POPCOUNT: tl.constexpr,
    ROWS: tl.constexpr,  # >= the longest segment, a power of two
):
    b = tl.program_id(0)
    s = tl.program_id(1)
    rows, row_mask, byte = _segment_bytes(bits_ptr, live_ptr, seg_start_ptr, s, byte0 + b, stride_bits,
                                          HAS_LIVE, ROWS)
    for k in tl.static_range(8):
        tl.store(cnt_ptr + s.to(tl.int64) * stride_cnt + 8 * b + k, tl.sum((byte >> k) & 1, axis=0))
    if POPCOUNT:
        p = byte - ((byte >> 1) & 0x55)
        p = (p & 0x33) + ((p >> 2) & 0x33)
        p = (p + (p >> 4)) & 0x0F
        tl.store(popcount_ptr + b.to(tl.int64) * stride_popcount + (rows - row0), p, mask=row_mask)


@triton.jit
def write_pairs_kernel(
    bits_ptr, live_ptr, seg_start_ptr,  # as ``count_pairs_kernel``'s
    off_ptr,  # (S, 8 * bytes) int64: first list position of (segment, tile), any strides
    rank_ptr,  # (bytes, rows) int32: marked tiles of the row in the bytes before (SLOTS only)
    row_slot_ptr,  # (N,) int64: the row's first slot (rows' pairs counted from its group's start) (SLOTS)
    seg_slot_base_ptr,  # (S,) int64: the slot of its group's first row, subtracted (SLOTS only)
    pair_row_ptr,  # (pairs,) int32 out: the pair's row
    pair_slot_ptr,  # (pairs,) int32 out: the pair's row-major slot in its group (SLOTS only)
    byte0, row0,
    stride_bits, stride_off_s, stride_off_t, stride_rank,
    HAS_LIVE: tl.constexpr,
    SLOTS: tl.constexpr,
    ROWS: tl.constexpr,
):
    b = tl.program_id(0)
    s = tl.program_id(1)
    rows, row_mask, byte = _segment_bytes(bits_ptr, live_ptr, seg_start_ptr, s, byte0 + b, stride_bits,
                                          HAS_LIVE, ROWS)
    if SLOTS:
        slot = tl.load(row_slot_ptr + rows, mask=row_mask, other=0) - tl.load(seg_slot_base_ptr + s)
        slot += tl.load(rank_ptr + b.to(tl.int64) * stride_rank + (rows - row0), mask=row_mask, other=0)
    for k in tl.static_range(8):
        m = (byte >> k) & 1
        # The segment's marked rows of this tile, in row order: position = first + exclusive rank.
        rank = tl.cumsum(m, axis=0) - m
        pos = tl.load(off_ptr + s.to(tl.int64) * stride_off_s + (8 * b + k) * stride_off_t) + rank
        marked = m != 0
        tl.store(pair_row_ptr + pos, rows, mask=marked)
        if SLOTS:
            tl.store(pair_slot_ptr + pos, slot.to(tl.int32), mask=marked)
            slot += m


@triton.jit
def locate_pack(
    pack_off_ptr,  # (groups * tiles + 1,) int64: first pack of (group, tile), flattened
    pair_off_ptr,  # (groups * tiles,) int64: first list position of (group, tile)
    pair_cnt_ptr,  # (groups * tiles,) int32: pairs of (group, tile)
    pair_row_ptr,  # (pairs,) int32
    group, pack, tiles, search_steps,
    BLOCK_N: tl.constexpr,
):
    """(live, tile, q, q_mask, rows) of pack ``pack`` (counted from the group's first): live = 0 past
    the group's last pack (launches are sized by a bound); tile within the index's tiles; q the
    list positions of its lanes, q_mask the lanes that hold a pair, rows their rows (int64)."""
    # Scalars as tensors: Triton makes an int argument equal to 1 a constant, which a loop cannot carry.
    zero = tl.program_id(0) * 0
    base = (zero + group).to(tl.int64) * tiles
    gp = tl.load(pack_off_ptr + base) + pack
    live = gp < tl.load(pack_off_ptr + base + tiles)
    # The last tile whose first pack is <= gp: invariant pack_off[lo] <= gp < pack_off[hi].
    lo = zero
    hi = zero + tiles
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        right = tl.load(pack_off_ptr + base + mid) <= gp
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    first = tl.load(pair_off_ptr + base + lo)
    q = first + (gp - tl.load(pack_off_ptr + base + lo)) * BLOCK_N + tl.arange(0, BLOCK_N)
    # (not ``& live``: the interpreter makes a scalar's & a vector an integer mask)
    q_mask = tl.where(live, q < first + tl.load(pair_cnt_ptr + base + lo), False)
    rows = tl.load(pair_row_ptr + q, mask=q_mask, other=0).to(tl.int64)
    return live, lo, q, q_mask, rows
