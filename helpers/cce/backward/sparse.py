"""The "sparse" backward (``backward_impl="sparse"``, or chosen by the default "auto" where its bits
paid on the last calls, ``helpers.cce.auto``): only the marked (row, tile) pairs.

Why. On a trained model's softmax most of a row's vocabulary carries no gradient worth its
arithmetic, but the rows do not agree on which: in our ``realistic`` regime at the Gemma-2-2B
vocabulary, sorted, ~1-10% of (row, 128-column tile) pairs matter while ~25-60% of (128-row block,
tile) pairs hold at least one that does (docs/speed_v3_notes.md). So skipping is decided per row,
and before any logit is rebuilt: from the forward's activity bits (``helpers.cce.activity``).

The filter's rule, as everywhere: a row's gradient in a tile is dropped when its |G| mass there is
below eps. A row has T = ceil(V / BLOCK_V) tiles, so at most T * eps of its |G| mass (out of
sum |G| <= 2, more with z-loss or a gradient into the lse) is dropped. For this backward "auto"
picks eps = B / T with B one machine epsilon of the dtype (``helpers.cce.options.SPARSE_ROW_BUDGET``:
2^-7 bf16, 2^-10 fp16): at most B of each row's gradient mass is dropped, and a flat softmax (every
tile ~1/T) keeps every tile. A fixed eps = 2^-12 per tile, applied per row, dropped up to 2%
of a row's mass at V = 256,000 and put dE 5-9x the naive bf16 path's error (notes), so the dense
backwards' "auto" now holds a row to the same B (``helpers.cce.options.auto_filter_eps``); a
number passed as ``filter_eps`` is used as given, per tile. ``stats`` reports the softmax mass each row lost.

The work (kernels: ``helpers/cce/kernels/pair_gradients.py``; the pair lists:
``helpers.cce.backward.pair_index``, built on the GPU, so the backward's one host sync is in its plan):

1. Each row's G = a S - b [v = x] and weight w come from ``RowGradient`` (per-row upstream
   gradients, z-loss, a gradient into the returned lse), the same G as "gemm"'s. Fix-up of the bits
   (in place, the same on every call): every kept row's target tile marked (G there holds -b; the
   forward's bits see only S). Rows with w = 0 are skipped (their bits left as they are), and every
   row's |a| is checked against the bound the forward's bits were made for (``helpers.cce.activity``).
   The plan counts the marked pairs per row and per tile (the sync) and decides.
2. dE, row block by row block: the block's marked pairs listed per tile, packs of BLOCK_N of them;
   each pack's G (filter applied per row) times C_tile goes to Y, one row of D per marked pair
   (fp16 for 16-bit inputs, ``y_dtype``), a row's pairs in consecutive rows of Y in tile order;
   then each row sums its Y rows in fp32 and is written once: dE_i = w_i sum Y. Y lives in dC's
   memory (dC is not written yet): V pairs, so no scratch; a row block is as many rows as their
   pairs fill it, and the pair lists of many blocks are built at once (``HostTuning.index_bytes``).
   (When C needs no gradient there is no dC: Y gets its own max(LB / 20, 4 MiB), or all the pairs
   if fewer.)
3. dC, tile range by tile range: every row's packs of those tiles, G again (times w_rel) into Gc,
   then each tile's dC rows = w_scale sum_packs Gc^T E[pack rows], written once. A range with too
   few (tile, D block) programs to fill the GPU (the tiles every row marks) splits each tile's packs
   over programs, whose fp32 sums a second kernel adds in split order. With a bias on the head, its
   gradient comes from the same Gc: db_tile = w_scale sum_packs Gc^T 1 (the bias also enters the
   logits the forward's bits and G are made from).

Only the gradients asked for (``need``): no dE pass when E needs none; no dC pass when neither C nor
the bias does, and for db alone the pass forms Gc and sums it, with no product with E.

Deterministic: no atomics on the gradients; every sum runs in an order fixed by the data (tile,
then row; splits in order), so two runs give the same bits (checked on an H200 at the Gemma-2-2B
head and at the Qwen3 head with N = 131,072). The "gemm" backward runs instead, as
``backward_impl="gemm"`` runs it (its own "auto" eps, unsorted: ``CCEPlan.fallback``), and
``stats["fallback"]`` says why, when the problem is too small to pay for the index
(``HostTuning.sparse_min_pairs``), the bits mark more than the tier's ``dense_fallback`` of the
pairs (a dense softmax: early training, the ``uniform`` regime), an option needs every pair (label
smoothing, FullC/FullE, no filter), the forward made no bits (or made them for other tiles or
another eps), or a row's |a| exceeds the bound its bits were made for (a z-loss factor 1 + 2 zl
lse > 2, or a gradient into an lse the forward was not told would be returned).

Memory beyond dE and dC (LB): the bits (N * T / 8 bytes) and the order (V int64); Gc
(``HostTuning.gc_bytes``, max(LB / 20, 4 MiB), fewer when all the packs take less; a tile with more
packs than Gc holds, as the first tiles at the Qwen3 head with N = 131,072, where every row marks them: 33.6 MB each, comes
in windows of Gc, each split of its sum going on from where the last window left it); the pair
index of the blocks or tiles in flight (``HostTuning.index_bytes``, max(LB / 32, 4 MiB)); the split
tiles' fp32 sums (max(LB / 64, 4 MiB), when a range splits); the per-(segment, tile) counts of the dC pass
and O(N). Smaller budgets lower the peak a little and cost much more time: each tile range costs
launches, and the host's launches already bound the time there (the measured peaks and times:
docs/PERFORMANCE.md).
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from helpers.cce.backward import pair_index
from helpers.cce.activity import Activity, popcount_rows, set_bits
from helpers.cce.backward.rows import RowGradient
from helpers.cce.shared import MiB
from helpers.cce.kernels.pair_gradients import (
    sparse_dC_finish_kernel,
    sparse_dC_kernel,
    sparse_dE_pack_kernel,
    sparse_dE_reduce_kernel,
    sparse_g_kernel,
)
from helpers.cce.kernels.configs import CCEConfigs, HostTuning
from helpers.cce.options import CCEOptions, dot_precision, fp_fusion


def why_dense(activity: Activity | None, o: CCEOptions, block_v: int, reason: str | None) -> str | None:
    """Why the sparse backward cannot run from this forward's state (None when it can); ``reason``: the
    plan's (``CCEPlan.sparse_reason``: the options need every pair, or the problem is too small)."""
    if reason is None and activity is None:
        reason = "the forward emitted no activity bits"
    if reason is None and (activity.block_v != block_v or activity.eps != o.filter_eps):
        reason = "the forward's bits were made for other tiles or another eps"
    return reason


def sparse_plan(E, C, x, lse, up: RowGradient, activity: Activity | None, o: CCEOptions, configs: CCEConfigs,
                need: tuple[bool, bool, bool], reason: str | None) -> tuple[str | None, dict | None]:
    """(why "gemm" must run instead, or None; the plan ``backward_sparse`` runs, or the counts so far):
    the options need every pair, the problem is too small, the forward made no bits for these tiles
    and eps, the bits mark more than the tier's ``dense_fallback`` of the pairs, or a row's softmax
    coefficient exceeds what the forward's bits were made for (``Activity.coef_max``). The caller
    (``helpers.cce.backward``) runs "gemm" when there is a reason."""
    cfg = configs.sparse_for(E.dtype)
    reason = why_dense(activity, o, cfg.BLOCK_V, reason)
    if reason is not None:
        return reason, None
    plan = _plan(E, C, x, lse, up, activity, o, cfg, need, configs.dense_fallback, configs.host)
    return plan.get("dense"), plan


def backward_sparse(E, C, x, lse, up: RowGradient, activity: Activity, o: CCEOptions, configs: CCEConfigs,
                    plan: dict, stats: dict | None, bias=None, need: tuple[bool, bool, bool] = (True, True, False)):
    """(dE, dC, db) from the marked pairs, by ``sparse_plan``'s plan; arguments as ``cce_backward``'s.
    A gradient ``need`` (dE, dC, db) does not ask for is not computed: no dE pass without dE, dC's
    pass without its products for db alone, none for neither."""
    return _sparse(E, C, x, lse, up, activity, o, configs.sparse_for(E.dtype), configs.host, plan, stats, bias,
                   need)


def _plan(E, C, x, lse, up, activity, o, cfg, need, dense_fallback: float, host: HostTuning) -> dict:
    """Fix the bits up (step 1 of the module doc), count the marked pairs per row and per tile, and
    decide: {"dense": reason} (more than ``dense_fallback`` of the pairs marked, or a coefficient
    past the bits' bound) or the counts. The backward's one host sync is here: until it, the
    GPU has nothing else to do, so its host work is kept to one transfer, read as numpy arrays
    (a Python list of N = 131,072 counts, and a loop over it, cost ~9 ms)."""
    bits = activity.bits
    T, BV = activity.tiles, activity.block_v
    N = E.shape[0]
    device = E.device
    # Rows with no gradient at all (w = 0: ignored, or an upstream gradient of 0, and none through
    # the lse) are skipped, not cleared: a later backward through the same graph (retain_graph) may
    # give them one.
    live = up.w > 0
    live_u8 = live.to(torch.uint8)
    # Each kept row's target tile holds -b there, which the forward's bits (made from S) do not see.
    # Only what x decides: the fix-up is the same on every call. (x comes with -1 at ignored rows
    # where ignore_index is a class id: ``no_target_at_ignored``.)
    kept = (x != o.ignore_index) & (x >= 0)
    target = torch.where(kept, x, 0).long()
    if activity.order is not None:
        position = torch.empty_like(activity.order)
        position[activity.order] = torch.arange(activity.order.numel(), device=device)
        target = position[target]
    set_bits(bits, target // BV, kept)
    if T % 8:  # the last byte's bits past the last tile: clear, or the pair lists outgrow their counts
        bits[-1] &= (1 << (T % 8)) - 1
    per_row = popcount_rows(bits, live, count_rows=host.count_rows)
    # Row r's pairs are slots [row_slot[r], row_slot[r + 1]) of the dE pass, counted from row 0.
    row_slot = torch.zeros(N + 1, dtype=torch.int64, device=device)
    torch.cumsum(per_row, 0, out=row_slot[1:])
    # G = a S - b [v = x]: outside the target's tile a row's |G| mass is |a| times its softmax mass,
    # and the bits were made for |a| <= coef_max (``helpers.cce.activity``); past it, every pair.
    a_max = torch.where(live, up.coef[0].abs(), 0.0).amax() if N else torch.zeros((), device=device)
    head = [a_max.double(), live.sum().double(), per_row.max().double() if N else a_max.double() * 0]
    counts = [torch.stack(head), row_slot[1:].double()]
    tile_cnt = None
    if need[1] or need[2]:
        tile_cnt, seg_start, seg_group = pair_index.tile_counts(bits, live_u8, N, host.segment_rows)
        counts.append(tile_cnt.sum(0, dtype=torch.int64)[:T].double())
    counts = torch.cat(counts).cpu().numpy()  # the sync (float64: every count is exact)
    a_max, n_live, row_lanes = float(counts[0]), int(counts[1]), int(counts[2])
    # a carries exp(-lo), the lse's rounding (``row_weights``: |lo| ~ ulp(lse), under 1e-4 relative); the bits'
    # threshold keeps 1e-3 in hand (``_lse_with_activity``), so a tile they leave out stays below eps.
    if a_max > activity.coef_max * (1 + 1e-4):
        return {"dense": f"a row's softmax coefficient |a| = {a_max:.3g} (z-loss's 1 + 2 zl lse, plus a "
                         f"gradient into the lse) exceeds the {activity.coef_max:g} the forward's bits "
                         "were made for", "density": None}
    ends = counts[3:3 + N].astype(np.int64)
    marked = int(ends[-1]) if N else 0
    density = marked / max(1, n_live * T)
    plan = {"live": live_u8 if n_live < N else None, "row_slot": row_slot, "ends": ends, "live_rows": n_live,
            "marked": marked, "density": density}
    if density > dense_fallback:
        plan["dense"] = f"the bits mark {density:.0%} of the pairs (> {dense_fallback:.0%})"
        return plan
    if tile_cnt is not None:
        plan.update(tile_cnt=tile_cnt, per_tile=counts[3 + N:].astype(np.int64), seg_start=seg_start,
                    seg_group=seg_group)
    # Y must hold one row's pairs at the least.
    plan["row_lanes"] = max(1, row_lanes)
    return plan


def y_dtype(dtype: torch.dtype) -> torch.dtype:
    """Y's element: fp16 for 16-bit inputs, fp32 for fp32. A partial product G_row C_tile is at most
    2 max|C| (far inside fp16's range for a classifier's weights) and is rounded once to 2^-11, four
    times finer than the bf16 dE it sums into; fp16 halves Y's traffic (written once, read once, a
    large share of the sparse backward's time) and doubles the pairs dC's memory holds."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def _y_in(dC: torch.Tensor, lanes: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    """(lanes, D) of ``dtype`` laid over dC's memory (dC is written only after the last use of Y)."""
    flat = dC.view(-1)
    if flat.dtype != dtype:
        ratio = dtype.itemsize // flat.element_size()
        flat = flat[: flat.numel() // ratio * ratio].view(dtype)
    return flat[: lanes * D].view(lanes, D)


def _row_blocks(ends: np.ndarray, lanes: int) -> list[tuple[int, int]]:
    """Consecutive rows whose marked pairs fill at most ``lanes`` rows of Y (a row's pairs always
    fit: Y holds the largest row's at least); ``ends``: marked pairs up to each row, inclusive."""
    blocks, n0, N = [], 0, len(ends)
    while n0 < N:
        before = int(ends[n0 - 1]) if n0 else 0
        n1 = max(n0 + 1, int(np.searchsorted(ends, before + lanes, side="right")))
        blocks.append((n0, n1))
        n0 = n1
    return blocks


def _batches(items: list, cost, budget: int) -> list[list]:
    """Consecutive items whose costs sum to at most ``budget`` (one item at the least)."""
    batches, batch, spent = [], [], 0
    for item in items:
        c = cost(item)
        if batch and spent + c > budget:
            batches.append(batch)
            batch, spent = [], 0
        batch.append(item)
        spent += c
    if batch:
        batches.append(batch)
    return batches


def _sparse(E, C, x, lse, up, activity: Activity, o: CCEOptions, cfg, host: HostTuning, plan: dict,
            stats: dict | None, bias, need: tuple[bool, bool, bool]):
    N, D = E.shape
    V = C.shape[0]
    dtype, device = E.dtype, E.device
    bits, order = activity.bits, activity.order
    T, P, BV = activity.tiles, cfg.BLOCK_N, activity.block_v
    T8 = bits.shape[0]
    lb = (N + V) * D * E.element_size()
    need_dE, need_dC, need_db = need[0], need[1], need[2] and bias is not None
    dE = torch.empty(N, D, dtype=dtype, device=device) if need_dE else None
    dC = torch.empty(V, D, dtype=dtype, device=device) if need_dC else None
    db = torch.empty(V, dtype=bias.dtype, device=device) if need_db else None
    counting = stats is not None
    common = dict(
        BLOCK_N=P, BLOCK_V=BV, BLOCK_D=cfg.BLOCK_D, HAS_SOFTCAP=o.softcap is not None,
        HAS_BIAS=bias is not None, SORTED=order is not None, DOT_PRECISION=dot_precision(dtype, cfg),
        enable_fp_fusion=fp_fusion(dtype), **cfg.launch)
    # lse stands in for the pointers of a bias or an order there is not.
    gather = (E, C, x, lse, up.coef, bias if bias is not None else lse, order if order is not None else lse)
    strides = (E.stride(0), E.stride(1), C.stride(0), C.stride(1), x.stride(0), up.coef.stride(0))
    options = (o.softcap if o.softcap is not None else 1.0, o.filter_eps)
    # The pair index of the rows or tiles in flight (``pair_index.index_bytes``).
    index_budget = host.index_bytes or max(4 * MiB, lb // 32)
    segment_rows = host.segment_rows
    counters = dict(launches=0, row_blocks=0, tile_ranges=0, split_ranges=0, gc_windows=0, index_batches=0,
                    pack_lanes=0, pack_lanes_dC=0)
    kept_pairs = torch.zeros(1, dtype=torch.int32, device=device)
    accounted = torch.zeros(N, dtype=torch.float32, device=device) if counting else lse
    live, ends = plan["live"], plan["ends"]
    dE_packs = torch.zeros((), dtype=torch.int64, device=device)
    Y = Gc = None
    sums = {}  # the dC pass's split sums (``partial_sums``)

    # 2. dE, row block by row block; Y over dC's memory (its own buffer only when dC is not wanted or
    # cannot hold one row's pairs: tiny vocabularies; then at most what dC's pass gets for Gc).
    if need_dE:
        ydt = y_dtype(dtype)
        lanes = V * D * E.element_size() // (ydt.itemsize * D)
        if need_dC and lanes >= plan["row_lanes"]:
            Y = _y_in(dC, lanes, D, ydt)
        else:
            lanes = max(4 * plan["row_lanes"], min(plan["marked"], max(lb // 20, 4 * MiB) // (ydt.itemsize * D)))
            Y = torch.empty(lanes, D, dtype=ydt, device=device)
        if host.y_lanes:  # tests: as few lanes as one row needs
            lanes = min(lanes, max(host.y_lanes, plan["row_lanes"]))
        blocks = _row_blocks(ends, lanes)

        def block_pairs(block):
            return int(ends[block[1] - 1]) - (int(ends[block[0] - 1]) if block[0] else 0)

        block_r = 256 if device.type == "cuda" else 16
        # The pairs of many row blocks listed at once: no host work per block but two launches.
        for batch in _batches(blocks, lambda b: pair_index.index_bytes(block_pairs(b), b[1] - b[0], T8, True,
                                                                         segment_rows),
                              index_budget):
            seg_start, seg_group = pair_index.segments(batch, segment_rows)
            slot0 = [int(ends[n0 - 1]) if n0 else 0 for n0, _ in batch]
            index = pair_index.build(bits, live, seg_start, seg_group, 0, T8, sum(map(block_pairs, batch)), P,
                                     row_slot=plan["row_slot"], group_slot0=slot0, segment_rows=segment_rows)
            counters["index_batches"] += 1
            if counting:
                dE_packs += index.pack_off[-1]
            for g, (n0, n1) in enumerate(batch):
                pairs = block_pairs((n0, n1))
                if pairs:
                    # At most one partial pack per tile: a bound, the surplus programs return at once.
                    bound = triton.cdiv(pairs, P) + min(T, pairs)
                    sparse_dE_pack_kernel[(bound,)](
                        *gather, index.pack_off, index.pair_off, index.pair_cnt, index.pair_row,
                        index.pair_slot, Y, kept_pairs, accounted, g, index.tiles, index.search_steps,
                        V, D, *strides, Y.stride(0), *options, STATS=counting, **common)
                    counters["launches"] += 1
                sparse_dE_reduce_kernel[(n1 - n0, triton.cdiv(D, block_r))](
                    Y, plan["row_slot"], up.w, dE, n0, slot0[g], D, Y.stride(0), dE.stride(0), dE.stride(1),
                    BLOCK_R=block_r)
                counters["launches"] += 1
                counters["row_blocks"] += 1
            del index

    # 3. dC and db, tile range by tile range: Gc for the range's packs, then each tile's rows, once.
    # The filter's counts come from here when there was no dE pass.
    if need_dC or need_db:
        count_here = counting and not need_dE
        per_tile = plan["per_tile"]  # (T,) int64
        packs_per_tile = (per_tile + P - 1) // P
        pack_start = np.concatenate([[0], np.cumsum(packs_per_tile)])  # first pack of each tile
        pack_bytes = P * BV * E.element_size()
        # Gc holds this many packs; a tile with more comes in windows of them (below).
        gc_packs = max(1, (host.gc_bytes or max(lb // 20, 4 * MiB)) // pack_bytes)
        Gc = torch.empty(max(1, min(gc_packs, int(pack_start[-1]))) * P * BV, dtype=dtype, device=device)
        d_blocks = triton.cdiv(D, cfg.BLOCK_D) if need_dC else 1
        dC_arg = dC if need_dC else Gc  # a pointer never written without NEED_DC
        programs = host.dc_programs if host.dc_programs is not None else (
            4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0)
        split_bytes = max(lb // 64, 4 * MiB)
        tile_sums = BV * (D if need_dC else 1) * 4  # one split of one tile

        def partial_sums(splits, tiles=1):
            """The splits' fp32 sums ("dC", and "db" with a bias), allocated on first use."""
            n = max(split_bytes, splits * tiles * tile_sums) // 4
            if not sums or sums["dC"].numel() < n:
                sums["dC"] = torch.empty(n, dtype=torch.float32, device=device)
                sums["db"] = torch.empty(n, dtype=torch.float32, device=device) if need_db else sums["dC"]
            return sums["dC"], sums["db"]

        per_byte = np.pad(per_tile, (0, 8 * T8 - T)).reshape(T8, 8).sum(1)
        byte_cost = [pair_index.index_bytes(int(c), N, 1, False, segment_rows) for c in per_byte]
        vocab_args = dict(BLOCK_N=P, BLOCK_V=BV, BLOCK_D=cfg.BLOCK_D, SORTED=order is not None, NEED_DC=need_dC,
                          NEED_DB=need_db, DOT_PRECISION=dot_precision(dtype, cfg), enable_fp_fusion=fp_fusion(dtype),
                          **cfg.launch)
        for batch in _batches(list(range(T8)), lambda b: byte_cost[b], index_budget):
            b0, b1 = batch[0], batch[-1] + 1
            index = pair_index.build(bits, live, plan["seg_start"], plan["seg_group"], b0, b1 - b0,
                                     int(per_byte[b0:b1].sum()), P, cnt=plan["tile_cnt"][:, 8 * b0: 8 * b1],
                                     segment_rows=segment_rows)
            counters["index_batches"] += 1
            ts0, ts1 = 8 * b0, min(8 * b1, T)
            vocab = order if order is not None else index.pack_off
            pointers = (E, Gc, index.pack_off, index.pair_off, index.pair_cnt, index.pair_row, vocab, up.w_scale,
                        dC_arg, db if need_db else Gc)
            strides_dC = (V, D, E.stride(0), E.stride(1), dC_arg.stride(0), dC_arg.stride(-1))

            def fill_gc(pack0, n_packs):
                sparse_g_kernel[(n_packs,)](
                    *gather, index.pack_off, index.pair_off, index.pair_cnt, index.pair_row, up.w_rel, Gc,
                    kept_pairs, accounted, pack0, ts0, index.tiles, index.search_steps,
                    V, D, *strides, *options, STATS=count_here, **common)
                counters["launches"] += 1
                counters["pack_lanes_dC"] += n_packs * P

            def finish(t0, t1, splits):
                partial, partial_db = partial_sums(splits, t1 - t0)
                sparse_dC_finish_kernel[(t1 - t0, d_blocks)](
                    partial, partial_db, vocab, up.w_scale, dC_arg, db if need_db else Gc, ts0, t0 - ts0, splits,
                    V, D, dC_arg.stride(0), dC_arg.stride(-1), BLOCK_V=BV, BLOCK_D=cfg.BLOCK_D,
                    SORTED=order is not None, NEED_DC=need_dC, NEED_DB=need_db)
                counters["launches"] += 1
                counters["split_ranges"] += 1

            t0 = ts0
            while t0 < ts1:
                first = int(pack_start[t0] - pack_start[ts0])  # the range's first pack, in the index
                if packs_per_tile[t0] > gc_packs:
                    # A tile whose packs overflow Gc: window by window, each split going on from its
                    # sum so far, then the splits added in order (deterministic, as in one piece).
                    splits = max(1, min(triton.cdiv(programs, d_blocks), gc_packs,
                                        max(1, split_bytes // tile_sums), 64))
                    partial, partial_db = partial_sums(splits)
                    n_tile = int(packs_per_tile[t0])
                    for k, w0 in enumerate(range(first, first + n_tile, gc_packs)):
                        w1 = min(first + n_tile, w0 + gc_packs)
                        fill_gc(w0, w1 - w0)
                        sparse_dC_kernel[(1, d_blocks, splits)](
                            *pointers, partial, partial_db, w0, ts0, t0 - ts0, splits, w0, w1, *strides_dC,
                            PARTIAL=True, ACCUMULATE=k > 0, **vocab_args)
                        counters["launches"] += 1
                        counters["gc_windows"] += 1
                    finish(t0, t0 + 1, splits)
                    counters["tile_ranges"] += 1
                    t0 += 1
                    continue
                # As many tiles as their packs fill Gc.
                t1 = max(t0 + 1, min(int(np.searchsorted(pack_start, pack_start[t0] + gc_packs, side="right")) - 1,
                                     ts1))
                n_packs = int(pack_start[t1] - pack_start[t0])
                if n_packs:
                    fill_gc(first, n_packs)
                # Few programs (a range of tiles every row marks): split their packs, sum in a second pass.
                splits = 1
                if (t1 - t0) * d_blocks < programs:
                    splits = min(triton.cdiv(programs, (t1 - t0) * d_blocks), max(1, int(packs_per_tile[t0:t1].max())),
                                 max(1, split_bytes // ((t1 - t0) * tile_sums)), 64)
                partial, partial_db = partial_sums(splits, t1 - t0) if splits > 1 else (Gc, Gc)
                sparse_dC_kernel[(t1 - t0, d_blocks, splits)](
                    *pointers, partial, partial_db, first, ts0, t0 - ts0, splits, 0, 2**31 - 1, *strides_dC,
                    PARTIAL=splits > 1, ACCUMULATE=False, **vocab_args)
                counters["launches"] += 1
                if splits > 1:
                    finish(t0, t1, splits)
                counters["tile_ranges"] += 1
                t0 = t1
            del index

    if counting:
        pairs = plan["live_rows"] * T
        kept = int(kept_pairs)
        # |G| mass each row lost, the rule's quantity (``pack_gradient``): |a| - what its pairs accounted for.
        lost = (up.coef[0].abs() - accounted).clamp_(min=0.0)
        lost = lost if live is None else lost[live.bool()]
        y_in_dC = Y is not None and dC is not None and Y.data_ptr() == dC.data_ptr()
        counters["pack_lanes"] = int(dE_packs) * P
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
            + sum(t.numel() * 4 for name, t in sums.items() if name == "dC" or need_db)
            + (Y.numel() * Y.element_size() if Y is not None and not y_in_dC else 0),
        )
    return dE, dC, db
