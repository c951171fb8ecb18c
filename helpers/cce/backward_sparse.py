"""The "sparse" backward (opt-in, ``backward_impl="sparse"``): only the marked (row, tile) pairs.

Why. On a trained model's softmax most of a row's vocabulary carries no gradient worth its
arithmetic, but the rows do not agree on which: in our ``realistic`` regime at the Gemma-2-2B
vocabulary, sorted, ~1-10% of (row, 128-column tile) pairs matter while ~25-60% of (128-row block,
tile) pairs hold at least one that does (docs/speed_v3_notes.md). So skipping is decided per row,
and before any logit is rebuilt: from the forward's activity bits (``helpers.cce.activity``).

The filter's rule, as everywhere: a row's gradient in a tile is dropped when its |G| mass there is
below eps. A row has T = ceil(V / BLOCK_V) tiles, so at most T * eps of its |G| mass (out of
sum |G| <= 2, more with z-loss or a gradient into the lse) is dropped. For this backward "auto" picks eps = B / T with B one
machine epsilon of the dtype (``SPARSE_ROW_BUDGET``: 2^-7 bf16, 2^-10 fp16): at most B of each row's
gradient mass is dropped, and a flat softmax (every tile ~1/T) keeps every tile. The "gemm"
backward's eps = 2^-12 per tile, applied per row, dropped up to 2% of a row's mass at V = 256,000
and put dE 5-9x the naive bf16 path's error (notes); a number passed as ``filter_eps`` is used as
given, per tile. ``stats`` reports the softmax mass each row lost.

The work (kernels: ``helpers/cce/kernels/backward_sparse.py``):

1. Each row's G = a S - b [v = x] and weight w come from ``RowGradient`` (per-row upstream
   gradients, z-loss, a gradient into the returned lse), the same G as "gemm"'s. Fix-up of the bits
   (in place, the same on every call): every kept row's target tile marked (G there holds -b; the
   forward's bits see only S). Rows with w = 0 are skipped (their bits left as they are), and every
   row's |a| is checked against the bound the forward's bits were made for (``helpers.cce.activity``).
2. dE, row block by row block: the block's marked pairs gathered per tile into packs of BLOCK_N
   rows; each pack's G (filter applied per row) times C_tile goes to Y, one fp32 row of D per
   marked pair; then each row sums its Y rows in tile order and is written once: dE_i = w_i sum Y.
   Y lives in dC's memory (dC is not written yet): V * D * itemsize / (4 D) pairs, V / 2 for
   16-bit inputs, so no scratch; a row block is as many rows as their pairs fill it. (When C needs
   no gradient there is no dC: Y gets its own max(LB / 20, 4 MiB), or all the pairs if fewer.)
3. dC, tile range by tile range: every row's packs of those tiles, G again (times w_rel) into Gc,
   then each tile's dC rows = w_scale sum_packs Gc^T E[pack rows], written once. With a bias on
   the head, its gradient comes from the same Gc: db_tile = w_scale sum_packs Gc^T 1 (the bias also
   enters the logits the forward's bits and G are made from).

Only the gradients asked for (``need``): no dE pass when E needs none; no dC pass when neither C nor
the bias does, and for db alone the pass forms Gc and sums it, with no product with E.

Deterministic: no atomics; every sum runs in an order fixed by the data (tile, then row), so two
runs give the same bits. The "gemm" backward runs instead, and ``stats["fallback"]`` says why, when
the bits mark more than ``DENSE_FALLBACK`` of the pairs (a dense softmax: early training, the
``uniform`` regime), an option needs every pair (label smoothing, FullC/FullE, no filter), the
forward made no bits (or made them for other tiles or another eps), or a row's |a| exceeds the
bound its bits were made for (a z-loss factor 1 + 2 zl lse > 2, or a gradient into an lse the
forward was not told would be returned).

Memory beyond dE and dC (LB): the bits (N * T / 8 bytes) and the order (V int64), Gc (max(LB / 20,
4 MiB, the largest tile's packs): 61 MB at the Gemma-2-2B head; at the Qwen3 head with N = 131,072
its first tiles hold every row, 33.6 MB each), the unpacked bits and pair lists of one block or
range (<= 3 LB / 128 and LB / 64) and O(N): <= 1.09-1.10 LB at the Gemma head and the Qwen3 head up
to N = 16,384, ~1.11 LB at N = 131,072 (docs/speed_v3_notes.md, section 5).
"""

from __future__ import annotations

from bisect import bisect_right

import torch
import triton

from helpers.cce.activity import Activity, count_tiles, marked_pairs, popcount_rows, set_bits
from helpers.cce.backward_gemm import backward_gemm
from helpers.cce.gradients import MiB, RowGradient, vocabulary_order
from helpers.cce.kernels.backward_sparse import (
    sparse_dC_kernel,
    sparse_dE_pack_kernel,
    sparse_dE_reduce_kernel,
    sparse_g_kernel,
)
from helpers.cce.kernels.configs import CCEConfigs
from helpers.cce.options import CCEOptions, dot_precision

# "auto" filter for this backward: at most this much of a row's |G| mass is dropped (eps = B / T).
SPARSE_ROW_BUDGET = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: None}
# Marked share of the (row, tile) pairs (of the rows with a gradient) above which the "gemm"
# backward is faster (a guess from the kernels' arithmetic: 4 products on the marked pairs at ~60% of cuBLAS's rate against 3
# on all of them; the GPU run will tell).
DENSE_FALLBACK = 0.25
# Tests shrink these to force several row blocks and tile ranges.
Y_LANES = None  # rows of Y (marked pairs) in dC's memory; None: all that fit
GC_BYTES = None  # Gc's bytes; None: max(LB / 20, 4 MiB, the largest tile's packs)


def sparse_auto_eps(dtype: torch.dtype, V: int, block_v: int, label_smoothing: float = 0.0) -> float | None:
    """The "auto" filter threshold of the sparse backward: B / T, T = ceil(V / block_v) tiles per row;
    None (off) for fp32 and with label smoothing, as "auto" is for the other backwards."""
    budget = SPARSE_ROW_BUDGET[dtype]
    if budget is None or label_smoothing:
        return None
    return budget / triton.cdiv(V, block_v)


def options_need_every_pair(o: CCEOptions) -> str | None:
    """Why these options leave nothing for the sparse backward to skip (None: they do not)."""
    if o.filter_eps is None:
        return "the filter is off (fp32 'auto', filter_eps=None or label smoothing)"
    if o.full_c or o.full_e:
        return "FullC / FullE keep one gradient exact: every pair"
    if o.label_smoothing:
        return "label smoothing puts -ls/V in every entry"
    return None


def why_dense(activity: Activity | None, o: CCEOptions, block_v: int) -> str | None:
    """Why the sparse backward cannot run from this forward's state (None when it can)."""
    reason = options_need_every_pair(o)
    if reason is None and activity is None:
        reason = "the forward emitted no activity bits"
    if reason is None and (activity.block_v != block_v or activity.eps != o.filter_eps):
        reason = "the forward's bits were made for other tiles or another eps"
    return reason


def backward_sparse(E, C, x, lse, up: RowGradient, activity: Activity | None, o: CCEOptions,
                    configs: CCEConfigs, n_chunk: int | None, v_chunk: int | None, stats: dict | None,
                    bias=None, need: tuple[bool, bool, bool] = (True, True, False)):
    """(dE, dC, db) from the marked pairs, or from ``backward_gemm`` when the bits mark too much
    (``DENSE_FALLBACK``), the options need every pair, or a row's softmax coefficient exceeds what
    the forward's bits were made for (``Activity.coef_max``); arguments as ``cce_backward``'s
    (``n_chunk`` and ``v_chunk`` reach only the fallback). A gradient ``need`` (dE, dC, db) does
    not ask for is not computed: no dE pass without dE, dC's pass without its products for db
    alone, none for neither."""
    if not any(need):
        return None, None, None
    dtype = E.dtype
    cfg = configs.sparse_for(dtype)
    reason = why_dense(activity, o, cfg.BLOCK_V)
    plan = None
    if reason is None:
        plan = _plan(E, C, x, lse, up, activity, o, cfg)
        reason = plan.get("dense")
    if reason is not None:
        order = activity.order if activity is not None else None
        if order is None and o.sort_vocab:
            order = vocabulary_order(E, C)
        grads = backward_gemm(E, C, x, lse, up, order, o, configs.backward_gemm_for(dtype),
                              n_chunk, v_chunk, stats, bias, need)
        if stats is not None:
            stats.update(fallback=reason, density=plan["density"] if plan else None)
        return grads
    return _sparse(E, C, x, lse, up, activity, o, cfg, plan, stats, bias, need)


def _plan(E, C, x, lse, up, activity, o, cfg) -> dict:
    """Fix the bits up (step 1 of the module doc) and decide: {"dense": reason} or the counts."""
    bits = activity.bits
    T, BV = activity.tiles, activity.block_v
    # Rows with no gradient at all (w = 0: ignored, or an upstream gradient of 0, and none through
    # the lse) are skipped, not cleared: a later backward through the same graph (retain_graph) may
    # give them one.
    live = up.w > 0
    # G = a S - b [v = x]: outside the target's tile a row's |G| mass is |a| times its softmax mass,
    # and the bits were made for |a| <= coef_max (``helpers.cce.activity``); past it, every pair.
    a_max = float(torch.where(live, up.coef[0].abs(), 0.0).max()) if live.numel() else 0.0
    if a_max > activity.coef_max:
        return {"dense": f"a row's softmax coefficient |a| = {a_max:.3g} (z-loss's 1 + 2 zl lse, plus a "
                         f"gradient into the lse) exceeds the {activity.coef_max:g} the forward's bits "
                         "were made for", "density": None}
    # Each kept row's target tile holds -b there, which the forward's bits (made from S) do not see.
    # Only what x decides: the fix-up is the same on every call.
    kept = x != o.ignore_index
    rows = kept.nonzero()[:, 0]
    target = x[rows].long()
    if activity.order is not None:
        position = torch.empty_like(activity.order)
        position[activity.order] = torch.arange(activity.order.numel(), device=E.device)
        target = position[target]
    set_bits(bits, target // BV, rows)
    all_live = bool(live.all())
    live = None if all_live else live
    per_row = popcount_rows(bits, live)
    n_live = E.shape[0] if all_live else int(live.sum())
    marked = int(per_row.sum())
    density = marked / max(1, n_live * T)
    plan = {"per_row": per_row, "live": live, "live_rows": n_live, "marked": marked, "density": density}
    if density > DENSE_FALLBACK:
        plan["dense"] = f"the bits mark {density:.0%} of the pairs (> {DENSE_FALLBACK:.0%})"
        return plan
    # Y must hold one row's pairs at the least.
    plan["row_lanes"] = max(1, int(per_row.max()))
    return plan


def _y_in(dC: torch.Tensor, lanes: int, D: int) -> torch.Tensor:
    """(lanes, D) fp32 laid over dC's memory (dC is written only after the last use of Y)."""
    flat = dC.view(-1)
    if flat.dtype != torch.float32:
        flat = flat[: flat.numel() // 2 * 2].view(torch.float32)
    return flat[: lanes * D].view(lanes, D)


def _counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """bincount without its host sync (the size is known): (size,) int64."""
    return torch.zeros(size, dtype=torch.int64, device=index.device).scatter_add_(
        0, index, torch.ones_like(index))


def _packs(tiles: torch.Tensor, rows: torch.Tensor, t0: int, n_tiles: int, P: int, n_packs: int | None = None):
    """Gather each tile's rows (pairs ordered by tile, then row) into packs of P:
    (pack_rows (packs, P) int32 with -1 in empty lanes, pack_tile (packs,) int32,
    tile_packs (n_tiles + 1,) int64, pack_slots (packs, P) int32: each lane's pair, -1 when empty).
    ``n_packs``: their number when the caller knows it (no host sync then)."""
    device = rows.device
    local = tiles - t0
    counts = _counts(local, n_tiles)
    per_tile = (counts + P - 1) // P
    tile_packs = torch.zeros(n_tiles + 1, dtype=torch.int64, device=device)
    torch.cumsum(per_tile, 0, out=tile_packs[1:])
    first_pair = torch.cumsum(counts, 0) - counts
    position = torch.arange(rows.numel(), device=device) - first_pair[local]
    pack = tile_packs[local] + position // P
    if n_packs is None:
        n_packs = int(tile_packs[-1])  # the grid's size: one host sync
    lane = position % P
    pack_rows = torch.full((n_packs, P), -1, dtype=torch.int32, device=device)
    pack_rows[pack, lane] = rows.to(torch.int32)
    pack_slots = torch.full((n_packs, P), -1, dtype=torch.int32, device=device)
    pack_slots[pack, lane] = torch.arange(rows.numel(), dtype=torch.int32, device=device)
    pack_tile = torch.repeat_interleave(torch.arange(t0, t0 + n_tiles, dtype=torch.int32, device=device),
                                        per_tile, output_size=n_packs)
    return pack_rows, pack_tile, tile_packs, pack_slots


def _sparse(E, C, x, lse, up, activity: Activity, o: CCEOptions, cfg, plan: dict, stats: dict | None, bias,
            need: tuple[bool, bool, bool]):
    N, D = E.shape
    V = C.shape[0]
    dtype, device = E.dtype, E.device
    bits, order = activity.bits, activity.order
    T, P, BV = activity.tiles, cfg.BLOCK_N, activity.block_v
    lb = (N + V) * D * E.element_size()
    need_dE, need_dC, need_db = need[0], need[1], need[2] and bias is not None
    dE = torch.empty(N, D, dtype=dtype, device=device) if need_dE else None
    dC = torch.empty(V, D, dtype=dtype, device=device) if need_dC else None
    db = torch.empty(V, dtype=bias.dtype, device=device) if need_db else None
    counting = stats is not None
    common = dict(
        BLOCK_N=P, BLOCK_V=BV, BLOCK_D=cfg.BLOCK_D, HAS_SOFTCAP=o.softcap is not None,
        HAS_BIAS=bias is not None, SORTED=order is not None, DOT_PRECISION=dot_precision(dtype), **cfg.launch)
    # lse stands in for the pointers of a bias or an order there is not.
    gather = (E, C, x, lse, up.coef, bias if bias is not None else lse, order if order is not None else lse)
    strides = (E.stride(0), E.stride(1), C.stride(0), C.stride(1), x.stride(0), up.coef.stride(0))
    options = (o.softcap if o.softcap is not None else 1.0, o.filter_eps)
    # The bits of one block, one byte per (row, tile) while unpacked, ~3 such temporaries alive;
    # and its pair lists, ~70 bytes per marked pair (int64 tiles, rows, positions; packs).
    unpack_bytes = max(MiB, lb // 128)
    index_pairs = max(2**14, lb // 64 // 70)
    counters = dict(launches=0, row_blocks=0, tile_ranges=0, pack_lanes=0, pack_lanes_dC=0)
    kept_pairs = torch.zeros((), dtype=torch.int64, device=device)
    accounted = torch.zeros(N, dtype=torch.float32, device=device) if counting else None
    Y = Gc = None

    # 2. dE, row block by row block; Y over dC's memory (its own buffer only when dC is not wanted or
    # cannot hold one row's pairs: tiny vocabularies; then at most what dC's pass gets for Gc).
    if need_dE:
        lanes = V * D * E.element_size() // (4 * D)
        if need_dC and lanes >= plan["row_lanes"]:
            Y = _y_in(dC, lanes, D)
        else:
            lanes = max(4 * plan["row_lanes"], min(plan["marked"], max(lb // 20, 4 * MiB) // (4 * D)))
            Y = torch.empty(lanes, D, dtype=torch.float32, device=device)
        if Y_LANES:  # tests: as few lanes as one row needs
            lanes = min(lanes, max(Y_LANES, plan["row_lanes"]))
        ends = torch.cumsum(plan["per_row"], 0).tolist()  # marked pairs up to each row (one sync)
        block_r = 256 if device.type == "cuda" else 16
        n0 = 0
        while n0 < N:
            # As many rows as their marked pairs fill Y (one row of Y per pair) and their unpacked
            # bits fit unpack_bytes (a row's pairs always fit: Y holds the largest row's at least).
            before = ends[n0 - 1] if n0 else 0
            n1 = min(bisect_right(ends, before + min(lanes, index_pairs), lo=n0), n0 + max(1, unpack_bytes // T))
            n1 = max(n1, n0 + 1)
            pairs = ends[n1 - 1] - before
            if pairs > lanes:  # cannot happen: Y holds the largest row's pairs
                raise RuntimeError(f"sparse backward: {pairs} Y rows needed, {lanes} available")
            tiles, rows = marked_pairs(bits, 0, T, n0, n1, count=pairs, live=plan["live"])
            pack_rows, pack_tile, _, pack_slots = _packs(tiles, rows, 0, T, P)
            n_packs = pack_rows.shape[0]
            if n_packs:
                stat_kept = torch.empty(rows.numel(), dtype=torch.int8, device=device) if counting else Y
                stat_mass = torch.empty(rows.numel(), dtype=torch.float32, device=device) if counting else Y
                sparse_dE_pack_kernel[(n_packs,)](
                    *gather, pack_rows, pack_tile, pack_slots, Y, stat_kept, stat_mass,
                    V, D, *strides, Y.stride(0), *options, STATS=counting, **common)
                counters["launches"] += 1
                counters["pack_lanes"] += n_packs * P
                if counting:
                    kept_pairs += stat_kept.sum()
                    accounted.index_add_(0, rows, stat_mass)
            # Each row's pairs (= its rows of Y) in tile order: pairs are ordered by tile, then row,
            # so a stable sort by row keeps each row's in tile order.
            row_slots = torch.sort(rows, stable=True).indices
            row_start = torch.zeros(n1 - n0 + 1, dtype=torch.int64, device=device)
            torch.cumsum(_counts(rows - n0, n1 - n0), 0, out=row_start[1:])
            sparse_dE_reduce_kernel[(n1 - n0, triton.cdiv(D, block_r))](
                Y, row_start, row_slots, up.w, dE, n0, D, Y.stride(0), dE.stride(0), dE.stride(1),
                BLOCK_R=block_r)
            counters["launches"] += 1
            counters["row_blocks"] += 1
            n0 = n1

    # 3. dC and db, tile range by tile range: Gc for the range's packs, then each tile's rows, once.
    # The filter's counts come from here when there was no dE pass.
    if need_dC or need_db:
        count_here = counting and not need_dE
        per_tile = count_tiles(bits, T, plan["live"])
        pack_bytes = ((per_tile + P - 1) // P) * (P * BV * E.element_size())
        gc_bytes = GC_BYTES or max(lb // 20, 4 * MiB)
        gc_bytes = max(gc_bytes, int(pack_bytes.max()))  # a tile's packs go in one launch
        Gc = torch.empty(max(1, gc_bytes // E.element_size()), dtype=dtype, device=device)
        tile_ends = torch.cumsum(pack_bytes, 0).tolist()
        pair_ends = torch.cumsum(per_tile, 0).tolist()
        packs_per_tile = ((per_tile + P - 1) // P).tolist()
        d_blocks = triton.cdiv(D, cfg.BLOCK_D) if need_dC else 1
        dC_arg = dC if need_dC else Gc  # a pointer never written without NEED_DC
        t0 = 0
        while t0 < T:
            # As many tiles as their packs fill Gc, their pair lists fit index_pairs and their
            # unpacked bits fit unpack_bytes.
            t1 = min(bisect_right(tile_ends, (tile_ends[t0 - 1] if t0 else 0) + gc_bytes, lo=t0),
                     bisect_right(pair_ends, (pair_ends[t0 - 1] if t0 else 0) + index_pairs, lo=t0),
                     t0 + max(1, unpack_bytes // N))
            t1 = max(t1, t0 + 1)
            # Pair and pack counts are known here: no host sync, the host runs ahead of the GPU.
            pairs = pair_ends[t1 - 1] - (pair_ends[t0 - 1] if t0 else 0)
            n_packs = sum(packs_per_tile[t0:t1])
            tiles, rows = marked_pairs(bits, t0, t1, 0, N, count=pairs, live=plan["live"])
            pack_rows, pack_tile, tile_packs, pack_slots = _packs(tiles, rows, t0, t1 - t0, P, n_packs=n_packs)
            if n_packs:
                stat_kept = torch.empty(pairs, dtype=torch.int8, device=device) if count_here else Gc
                stat_mass = torch.empty(pairs, dtype=torch.float32, device=device) if count_here else Gc
                sparse_g_kernel[(n_packs,)](
                    *gather, pack_rows, pack_tile, pack_slots, up.w_rel, Gc, stat_kept, stat_mass,
                    V, D, *strides, *options, STATS=count_here, **common)
                counters["launches"] += 1
                counters["pack_lanes_dC"] += n_packs * P
                if count_here:
                    kept_pairs += stat_kept.sum()
                    accounted.index_add_(0, rows, stat_mass)
            sparse_dC_kernel[(t1 - t0, d_blocks)](
                E, Gc, pack_rows, tile_packs, order if order is not None else tile_packs, up.w_scale, dC_arg,
                db if need_db else Gc, t0, V, D, E.stride(0), E.stride(1), dC_arg.stride(0),
                dC_arg.stride(-1), BLOCK_N=P, BLOCK_V=BV, BLOCK_D=cfg.BLOCK_D, SORTED=order is not None,
                NEED_DC=need_dC, NEED_DB=need_db, DOT_PRECISION=dot_precision(dtype), **cfg.launch)
            counters["launches"] += 1
            counters["tile_ranges"] += 1
            t0 = t1

    if counting:
        pairs = plan["live_rows"] * T
        kept = int(kept_pairs)
        # |G| mass each row lost, the rule's quantity (``pack_gradient``): |a| - what its pairs accounted for.
        lost = (up.coef[0].abs() - accounted).clamp_(min=0.0)
        lost = lost if plan["live"] is None else lost[plan["live"]]
        y_in_dC = Y is not None and dC is not None and Y.data_ptr() == dC.data_ptr()
        # Tile products made: per pack lane the logits and G C (dE's pass), the logits and G^T E
        # (dC's; db needs no product), against "gemm"'s logits and a product per wanted gradient.
        products = 2 * counters["pack_lanes"] + (1 + need_dC) * counters["pack_lanes_dC"]
        stats.update(
            counters, fallback=None, density=plan["density"], pairs=pairs, marked=plan["marked"],
            kept_pairs=kept, tiles=pairs, skipped=pairs - kept,
            work_fraction=products / ((1 + need_dE + need_dC) * N * T),
            skipped_mass_max=float(lost.max()) if lost.numel() else 0.0,
            skipped_mass_mean=float(lost.mean()) if lost.numel() else 0.0,
            eps=o.filter_eps, block_v=BV, pack_rows=P, y_in_dC=y_in_dC,
            extra_bytes=activity.nbytes() + (Gc.numel() * Gc.element_size() if Gc is not None else 0)
            + (Y.numel() * 4 if Y is not None and not y_in_dC else 0),
        )
    return dE, dC, db
