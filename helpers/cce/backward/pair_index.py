"""The "sparse" backward's list of marked (row, tile) pairs, built on the device without a host sync.

``build`` lists the pairs of a block of rows (cut into groups: the dE pass's row blocks) and a range
of the bits' bytes (8 tiles each) by (group, tile, row), with each group's packs of ``pack_rows``
consecutive pairs of one tile (kernels and layout: ``helpers/cce/kernels/pair_list.py``). The host
knows every size beforehand (the pair counts of ``helpers.cce.backward.sparse``'s plan), so a
backward pays one sync, in its plan, and the host runs ahead of the GPU from there.

Memory: 4 bytes per pair (8 with slots), 4 per (row, byte of bits) with slots, and ~28 per
(segment, tile) for the counts and offsets; ``index_bytes`` estimates it so callers can batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helpers.cce.kernels.pair_list import count_pairs_kernel, write_pairs_kernel


@dataclass
class PairIndex:
    tile0: int  # the index's first tile (8 x its first byte)
    tiles: int  # tiles it spans (8 x bytes; those past the vocabulary hold no pairs)
    pair_row: torch.Tensor  # (pairs,) int32, by (group, tile, row)
    pair_slot: torch.Tensor | None  # (pairs,) int32: the pair's row-major slot in its group
    pair_off: torch.Tensor  # (groups, tiles) int64: first pair of (group, tile)
    pair_cnt: torch.Tensor  # (groups, tiles) int32
    pack_off: torch.Tensor  # (groups * tiles + 1,) int64: first pack of (group, tile), flattened

    @property
    def search_steps(self) -> int:
        """Steps of ``locate_pack``'s binary search over the tiles."""
        return max(1, (self.tiles - 1).bit_length())


def upload(values: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """A host list on ``device`` without waiting for the GPU (pinned memory, a non-blocking copy)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ``segment_rows`` below: rows per segment, a segment's rows of one tile ranked by one tl.cumsum
# (``HostTuning.segment_rows``, a power of two).


def segments(bounds: list[tuple[int, int]], segment_rows: int) -> tuple[list[int], list[int]]:
    """(seg_start, seg_group) for consecutive groups of rows ``bounds`` [(n0, n1), ...]: each group
    cut into segments of at most ``segment_rows`` rows; seg_start has one more entry, the last row's end."""
    rows = segment_rows
    seg_start, seg_group = [], []
    for g, (n0, n1) in enumerate(bounds):
        for r in range(n0, n1, rows):
            seg_start.append(r)
            seg_group.append(g)
    seg_start.append(bounds[-1][1])
    return seg_start, seg_group


def index_bytes(pairs: int, rows: int, byte_count: int, slots: bool, segment_rows: int) -> int:
    """Device memory ``build`` takes for this many pairs, rows and bytes of bits (module doc)."""
    segs = -(-rows // segment_rows) + 1
    return pairs * (8 if slots else 4) + (8 * rows * byte_count if slots else 0) + 28 * segs * 8 * byte_count


def count(bits: torch.Tensor, live: torch.Tensor | None, seg_start: torch.Tensor, byte0: int, byte_count: int,
          popcount_of: tuple[int, int] | None = None, *, segment_rows: int):
    """(cnt (S, 8 byte_count) int32: marked live rows per (segment, tile), popcount (byte_count, rows)
    int32 of each row's marked tiles per byte for the rows ``popcount_of`` = (row0, rows), or None)."""
    S = seg_start.numel() - 1
    cnt = torch.empty(S, 8 * byte_count, dtype=torch.int32, device=bits.device)
    row0, pc = 0, None
    if popcount_of is not None:
        row0, rows = popcount_of
        pc = torch.empty(byte_count, rows, dtype=torch.int32, device=bits.device)
    count_pairs_kernel[(byte_count, S)](
        bits, live if live is not None else bits, seg_start, cnt, pc if pc is not None else cnt,
        byte0, row0, bits.stride(0), cnt.stride(0), pc.stride(0) if pc is not None else 0,
        HAS_LIVE=live is not None, POPCOUNT=pc is not None, ROWS=segment_rows)
    return cnt, pc


def build(bits: torch.Tensor, live: torch.Tensor | None, seg_start: list[int], seg_group: list[int],
          byte0: int, byte_count: int, pairs: int, pack_rows: int, cnt: torch.Tensor | None = None,
          row_slot: torch.Tensor | None = None, group_slot0: list[int] | None = None, *,
          segment_rows: int) -> PairIndex:
    """The pairs of rows [seg_start[0], seg_start[-1]) and bytes [byte0, byte0 + byte_count) of
    ``bits`` ((T8, N) uint8), ``live`` ((N,) uint8 or None: every row). ``pairs``: their number
    (the host knows it). ``cnt``: ``count``'s, when the caller has it. With ``row_slot`` ((N,) int64:
    each row's first slot) and ``group_slot0`` (host: each group's first), each pair's row-major slot
    in its group too (the dE pass's rows of Y)."""
    device = bits.device
    slots = row_slot is not None
    seg_start_t = upload(seg_start, torch.int32, device)
    pc = None
    if cnt is None or slots:
        cnt, pc = count(bits, live, seg_start_t, byte0, byte_count,
                        (seg_start[0], seg_start[-1] - seg_start[0]) if slots else None,
                        segment_rows=segment_rows)
    S, Tp = cnt.shape
    groups = seg_group[-1] + 1
    # Pairs of each tile in the segments before, within the group: an exclusive scan over segments.
    cs = torch.cumsum(cnt, 0, dtype=torch.int32)  # (S, Tp)
    if groups == 1:
        cnt_g = cs[-1:]
        within = cs - cnt
    else:
        last = [i for i in range(S) if i + 1 == S or seg_group[i + 1] != seg_group[i]]
        seg_group_t = upload(seg_group, torch.int64, device)
        cg = cs[upload(last, torch.int64, device)]  # (groups, Tp), inclusive at each group's end
        prev = torch.cat([torch.zeros_like(cg[:1]), cg[:-1]])
        cnt_g = cg - prev
        within = cs - cnt - prev[seg_group_t]
    # List positions by (group, tile, row): an exclusive scan of the (group, tile) counts.
    pair_off = torch.zeros(groups * Tp, dtype=torch.int64, device=device)
    torch.cumsum(cnt_g.reshape(-1)[:-1], 0, dtype=torch.int64, out=pair_off[1:])
    pair_off = pair_off.view(groups, Tp)
    off = within.to(torch.int64) + (pair_off if groups == 1 else pair_off[seg_group_t])
    pack_off = torch.zeros(groups * Tp + 1, dtype=torch.int64, device=device)
    torch.cumsum(((cnt_g + pack_rows - 1) // pack_rows).reshape(-1), 0, dtype=torch.int64, out=pack_off[1:])
    pair_row = torch.empty(pairs, dtype=torch.int32, device=device)
    pair_slot = rank = slot0 = None
    if slots:
        pair_slot = torch.empty(pairs, dtype=torch.int32, device=device)
        rank = torch.cumsum(pc, 0, dtype=torch.int32) - pc  # marked tiles of each row in the bytes before
        slot0 = upload([group_slot0[g] for g in seg_group], torch.int64, device)
    write_pairs_kernel[(byte_count, S)](
        bits, live if live is not None else bits, seg_start_t, off,
        rank if slots else off, row_slot if slots else off, slot0 if slots else off,
        pair_row, pair_slot if slots else pair_row,
        byte0, seg_start[0], bits.stride(0), off.stride(0), off.stride(1), rank.stride(0) if slots else 0,
        HAS_LIVE=live is not None, SLOTS=slots, ROWS=segment_rows)
    return PairIndex(8 * byte0, Tp, pair_row, pair_slot, pair_off, cnt_g.contiguous(), pack_off)


def tile_counts(bits: torch.Tensor, live: torch.Tensor | None, N: int,
                segment_rows: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """(cnt (S, 8 T8) int32, seg_start, seg_group) of every row in segments, for the dC pass; the
    marked rows per tile are cnt.sum(0)."""
    seg_start, seg_group = segments([(0, N)], segment_rows)
    cnt, _ = count(bits, live, upload(seg_start, torch.int32, bits.device), 0, bits.shape[0],
                   segment_rows=segment_rows)
    return cnt, seg_start, seg_group

