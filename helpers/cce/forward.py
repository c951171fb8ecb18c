"""The forward pass: Algorithm 1 (the indexed dot) and Algorithm 2 (the online log-sum-exp).

``indexed_dot_kernel`` on a grid of N / BLOCK_N programs gives z_{i, x_i}; ``lse_forward_kernel``
on a (SPLITS, N / BLOCK_N) grid gives each row's log-sum-exp over one split of the vocabulary, the
splits merged with a logsumexp here (SPLITS fills the GPU when N alone would not, ``lse_splits``;
a row block's splits run side by side, sharing its strip of E in L2; the buffer is
SPLITS * N * 4 bytes). What the backward needs from the forward is the lse: N * 4 bytes. On the Hopper
tier the plain lse (``lse_pingpong_reason``) runs ``lse_forward_pingpong``'s warp-specialized kernel
instead, two partial lse per split (one per consumer warpgroup), merged the same way.

For the "sparse" backward (``emit_activity``) the LSE kernel also writes activity bits
(``helpers.cce.activity``): per row and vocabulary tile, whether the tile's softmax mass may reach
eps, judged against a lower bound of the row's final sum. Two things keep that bound close to the
final sum, so that the bits mark little more than the exact rule would (docs/speed_v3_notes.md):
the target logit seeds every split (exp(z_x) is one term of the sum; Algorithm 1 runs first), and,
with the vocabulary sorted, a pilot launch walks the first ``HostTuning.pilot_columns`` sorted positions (the
frequent tokens, most of the mass) in one split whose lse then seeds every other split. Without
the pilot each split's running sum starts from nothing and its first tiles are always marked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
import triton

from helpers.cce.activity import Activity, coef_bound
from helpers.cce.backward.gemm import fp32_product, product_mode, uses_cublas_logits
from helpers.cce.class_weights import smoothed_rows
from helpers.cce.cublas_logits import chunk_columns
from helpers.cce.descriptors import operand_descriptors, tma_ready
from helpers.cce.device import device_info
from helpers.cce.shared import vocabulary_order
from helpers.cce.kernels.configs import CCEConfigs, HostTuning
from helpers.cce.kernels.indexed_dot import indexed_dot_kernel
from helpers.cce.kernels.lse_forward import lse_forward_kernel
from helpers.cce.kernels.row_loss import ONE_PROGRAM_ROWS as ROW_LOSS_ONE_PROGRAM, row_loss_kernel
from helpers.cce.options import CCEOptions, dot_precision, fp_fusion, resolve_configs



def cce_forward(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    options: CCEOptions = CCEOptions(),
    configs: CCEConfigs | str | None = None,
    v_splits: int | None = None,
    bias: torch.Tensor | None = None,
    emit_activity: bool = False,
    return_lse: bool = False,
    counted: Callable[[torch.Tensor], None] | None = None,
    class_weight: torch.Tensor | None = None,
    reduced: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, Activity]:
    """(loss per row (N,) fp32, 0 at ignored rows; lse (N,) fp32; r (2N,) fp32, two rows the backward
    takes, flat (``r.view(2, -1)``): the first each row's 1 - p(target), from the non-target softmax
    mass to fp32's relative precision where it is below 1/2 (``lse_forward_kernel``'s NONTARGET: the
    backward's target column and a confident token's loss are formed from it), from the target's own logit above
    (``helpers.cce.kernels.logits.target_complement``), the second the lse's rounding lo (lse + lo is the
    row's lse to ~1e-14 for fp32 inputs: ``row_loss_kernel``)), from Algorithms 1 and 2; with
    ``emit_activity``, a fourth element: the ``Activity`` the "sparse" backward needs (the options
    must have a filter: ``options.filter_eps``; ``options.sort_vocab`` walks the sorted vocabulary).
    ``return_lse``: the lse is returned to the caller, so a gradient may flow into it and the bits are
    made for a larger softmax coefficient (``helpers.cce.activity.coef_bound``).

    ``configs``: a ``CCEConfigs`` (``linear_cross_entropy`` passes its plan's), a tier's name, or None
    for the device's tier. ``v_splits``: vocabulary splits of the LSE grid; None picks enough to fill the device.
    ``bias``: the head's bias (V,), added to every row's logits; None for none.
    ``counted``: None, or a function called with ``counts`` once the first launch (``indexed_dot_kernel``)
    is queued: an int64 (2,) tensor that gets the kept rows' count and the count of targets outside
    [0, V) that are not ignore_index (a mean's divisor and the target check), so a caller may queue
    their copy to the host there and wait for that launch alone (``helpers.cce.ops.loss_forward``).
    ``class_weight``: (V,) fp32 class weights with label smoothing (``helpers.cce.class_weights``): the
    rows come weighted (``smoothed_rows``), the smoothing term summed with the weights; no z-loss.
    ``reduced``: None, or an fp32 scalar that gets the loss reduced as ``options.reduction`` says ("sum"
    or "mean": over the kept rows, with ``counted``), by the last launch; up to ``ROW_LOSS_ONE_PROGRAM``
    rows and without class weights (``reduces_in_kernel``).
    """
    # E (N, D), C (V, D), x (N,)
    V = C.shape[0]
    o = options
    configs = resolve_configs(configs, E.device)
    fwd, _, dot_cfg = configs.for_dtype(E.dtype)
    softcap = o.softcap if o.softcap is not None else 1.0

    # Algorithm 1: z_{i, x_i}, (N,); the counts, which the caller may queue for the host right after; the
    # plain forward's tiles that hold a target (``TileFlags``). Its zeroed outputs in one allocation.
    gluon = not emit_activity and _runs_gluon(E, C, bias, o, configs.host, v_splits)
    tiling = None if emit_activity else _plain_tiling(fwd, gluon)
    tile_flags, counts = _zeroed(x.shape[0], V, tiling, E.device, counts=counted is not None)
    target_logit = indexed_dot(E, C, x, bias, o, dot_cfg, counts, tile_flags)
    if counted is not None:
        counted(counts)

    # Algorithm 2: lse over vocabulary splits, (SPLITS, N), then merged.
    smoothing = o.label_smoothing > 0
    weighted = class_weight is not None
    if weighted and (emit_activity or not smoothing or o.z_loss):
        raise ValueError("class_weight is for label smoothing without a z-loss or activity bits "
                         "(helpers.cce.class_weights)")
    if not emit_activity:
        lse_split, nontarget_split, logit_sum_split, _, lse_lo_split = _lse_splits(
            E, C, bias, x, target_logit, o, fwd, v_splits, softcap, gluon=gluon, class_weight=class_weight,
            tile_flags=tile_flags, host=configs.host)
        activity = None
    else:
        lse_split, nontarget_split, logit_sum_split, activity, lse_lo_split = _lse_with_activity(
            E, C, bias, x, target_logit, o, configs, v_splits, softcap, return_lse)
    # The splits merged and each row's loss, in one launch (``row_loss_kernel``).
    N = x.shape[0]
    # r: the backward's rows, r and the lse's rounding lo (``row_loss_kernel``). No views: a custom op's outputs
    # may not alias each other.
    lse, loss = (torch.empty(N, dtype=torch.float32, device=E.device) for _ in range(2))
    r = torch.empty(2 * N, dtype=torch.float32, device=E.device)
    # Class weights: the kernel's rows are lse - z_x, weighted with the smoothing term after it.
    reduce = 0
    if reduced is not None:
        if not reduces_in_kernel(N, o.reduction, weighted) or (o.reduction == "mean" and counts is None):
            raise ValueError(f"reduced: the kernel reduces a 'sum' or a 'mean' (with counted) of at most "
                             f"{ROW_LOSS_ONE_PROGRAM} rows without class weights; got {o.reduction!r}, N = {N}")
        reduce = 1 if o.reduction == "sum" else 2
    row_loss_kernel[(1 if reduce else triton.cdiv(N, ROW_BLOCK),)](
        lse_split, nontarget_split, logit_sum_split, target_logit, x, lse, r, loss,
        reduced if reduce else lse, counts if reduce == 2 else x,
        N, lse_split.shape[0], lse_split.stride(0), x.stride(0), o.ignore_index,
        1.0 if weighted else 1.0 - o.label_smoothing, o.label_smoothing / V, float(o.z_loss),
        SMOOTHING=smoothing and not weighted, Z_LOSS=bool(o.z_loss), BLOCK=ROW_BLOCK, REDUCE=reduce,
        lse_lo_split_ptr=lse_lo_split, HAS_LO=lse_lo_split is not None)
    if weighted:
        loss = smoothed_rows(loss, lse, logit_sum_split.sum(0), x, class_weight, o.label_smoothing, o.ignore_index)
    return (loss, lse, r) if activity is None else (loss, lse, r, activity)


def reduces_in_kernel(N: int, reduction: str, weighted: bool = False) -> bool:
    """Whether ``cce_forward`` can give the loss reduced from its last launch (``reduced``): a "sum" or a
    "mean" of at most ``ROW_LOSS_ONE_PROGRAM`` rows (one program walks them: few tokens, where each torch
    launch is host time) without class weights (weighted after the kernels)."""
    return reduction in ("sum", "mean") and N <= ROW_LOSS_ONE_PROGRAM and not weighted


def _lse_splits(E, C, bias, x, target_logit, o: CCEOptions, fwd, v_splits, softcap, row_stats=False, gluon=False,
                class_weight=None, tile_flags: TileFlags | None = None, host: HostTuning | None = None):
    """Algorithm 2 without bits: (lse_split, nontarget_split, logit_sum_split, row_stats, lse_lo_split), each
    split's rows (SPLITS, N); lse_lo_split: the rounding of each split's lse for fp32 inputs (``lse_forward_kernel``'s
    LSE_LO; None otherwise); nontarget_split: the lse of each split without the target x's column (NONTARGET;
    ``target_logit``: Algorithm 1's z_x, the target's term of the plain walk's sums);
    with ``row_stats``, row_stats = (entropy_split, max_split, target_split) (``lse_forward_kernel``'s
    ROW_STATS), else None. ``gluon``: the plain lse runs the Gluon kernel (``_runs_gluon``'s answer).
    ``class_weight``: the logit sums are weighted by it (``cce_forward``). ``tile_flags``: Algorithm 1's
    flags for the kernel that runs (``_tile_flags``); without, the plain walk masks every tile. ``host``: the
    tier's knobs, where its logits may come from cuBLAS (``helpers.cce.cublas_logits``: the splits are then
    its vocabulary chunks, ``v_splits`` not read); None: our Triton products."""
    N, D = E.shape
    V = C.shape[0]
    x = x.contiguous()
    # cuBLAS's logits for the plain walk (the per-token outputs' row statistics keep the Triton products).
    cublas = host is not None and not gluon and not row_stats and uses_cublas_logits(E, host)
    if gluon and not row_stats:
        from helpers.cce.kernels import lse_forward_pingpong as pingpong

        flags = tile_flags.for_tiling(pingpong.BLOCK_N, pingpong.BLOCK_V) if tile_flags else None
        lse_split, nontarget_split = pingpong.lse_forward_pingpong(E, C, x, target_logit, o.ignore_index,
                                                                   tile_flags=flags)
        return lse_split, nontarget_split, lse_split, None, None
    n_blocks, v_splits = split_grid(N, fwd, E.device, v_splits, D, E.element_size())
    v_blocks = triton.cdiv(V, fwd.BLOCK_V)
    blocks_per_split = triton.cdiv(v_blocks, max(1, min(v_splits, v_blocks)))
    if cublas:  # chunks of cuBLAS's logits, each a whole number of tiles, merged as they come: one split
        blocks_per_split = chunk_columns(N, V, D, E.dtype, fwd.BLOCK_V, host) // fwd.BLOCK_V  # fp32 logits
    v_splits = 1 if cublas else triton.cdiv(v_blocks, blocks_per_split)
    lse_split, nontarget_split = torch.empty(2, v_splits, N, dtype=torch.float32, device=E.device).unbind(0)
    lse_lo_split = torch.empty_like(lse_split) if E.dtype == torch.float32 else None
    logit_sum_split = torch.empty_like(lse_split) if o.label_smoothing > 0 else lse_split
    stats = tuple(torch.empty_like(lse_split) for _ in range(3)) if row_stats else None
    flags = tile_flags.for_tiling(fwd.BLOCK_N, fwd.BLOCK_V) if tile_flags and not row_stats else None
    if cublas:
        _lse_from_cublas(E, C, bias, x, target_logit, o, fwd, softcap, class_weight, flags, host, blocks_per_split,
                         lse_split, nontarget_split, logit_sum_split)
        return lse_split, nontarget_split, logit_sum_split, stats, lse_lo_split
    E_arg, C_arg, e_desc = operand_descriptors(E, C, fwd, gathered=False)
    launch = _launch_flags(fwd, o, bias, E.dtype, n_blocks, e_desc)
    lse_forward_kernel[grid_order(n_blocks, v_splits)](
        E_arg, C_arg, bias if bias is not None else lse_split, lse_split, logit_sum_split,
        lse_split, lse_split, lse_split, lse_split,  # no bits, seeds or order
        x, *(stats or (lse_split,) * 3), nontarget_split, target_logit, flags if flags is not None else lse_split,
        N, V, D, 0, o.ignore_index, blocks_per_split,
        E.stride(0), E.stride(1), C.stride(0), C.stride(1),
        softcap, 0.0, 1.0 / o.temperature,
        ROW_STATS=row_stats, NONTARGET=True, TILE_FLAGS=flags is not None,
        class_weight_ptr=class_weight, CLASS_WEIGHTS=class_weight is not None,
        lse_lo_split_ptr=lse_lo_split, LSE_LO=lse_lo_split is not None,
        **launch,
    )
    return lse_split, nontarget_split, logit_sum_split, stats, lse_lo_split


def _lse_from_cublas(E, C, bias, x, target_logit, o: CCEOptions, fwd, softcap, class_weight, flags, host: HostTuning,
                     blocks_per_split, lse, nontarget, logit_sum):
    """``_lse_splits``' plain walk a vocabulary chunk at a time, each chunk's logits E C[v0:v1]^T made by
    cuBLAS into one buffer and read by the kernel as a split of its own (``helpers.cce.cublas_logits``), merged
    into the one split given ((1, N) each; ``logit_sum`` may be ``lse`` itself: no smoothing) as they come, so
    that the splits' rows stay O(N) however many chunks a large N needs."""
    N, D = E.shape
    V = C.shape[0]
    cols = blocks_per_split * fwd.BLOCK_V
    Z_buf = torch.empty(N * min(cols, V), dtype=torch.float32, device=E.device)
    mode = host.product_mode or product_mode(E.device, E.dtype)
    n_blocks = triton.cdiv(N, fwd.BLOCK_N)
    launch = {**_launch_flags(fwd, o, bias, E.dtype, n_blocks, False), "SPLIT_MAJOR": False}
    smoothing = logit_sum.data_ptr() != lse.data_ptr()
    chunk = torch.empty(3 if smoothing else 2, 1, N, dtype=torch.float32, device=E.device)  # a later chunk's rows
    for v0 in range(0, V, cols):
        width = min(V, v0 + cols) - v0
        Z = Z_buf[: N * width].view(N, width)
        fp32_product(Z, E, C[v0:v0 + width].T, alpha=1.0, accumulate=False, mode=mode)  # the bias: the kernel's
        first = v0 == 0
        lse_c, nt_c = (lse, nontarget) if first else (chunk[0], chunk[1])
        sum_c = (logit_sum if first else chunk[2]) if smoothing else lse_c
        lse_forward_kernel[(n_blocks, 1)](
            E, C, bias if bias is not None else lse_c, lse_c, sum_c,
            lse_c, lse_c, lse_c, lse_c,  # no bits, seeds or order
            x, lse_c, lse_c, lse_c, nt_c, target_logit, flags if flags is not None else lse_c,
            N, V, D, v0, o.ignore_index, blocks_per_split,
            E.stride(0), E.stride(1), C.stride(0), C.stride(1),
            softcap, 0.0, 1.0 / o.temperature,
            NONTARGET=True, TILE_FLAGS=flags is not None,
            class_weight_ptr=class_weight, CLASS_WEIGHTS=class_weight is not None,
            z_ptr=Z, stride_zn=Z.stride(0), Z_GIVEN=True,
            **launch,
        )
        if not first:
            torch.logaddexp(lse, lse_c, out=lse)
            torch.logaddexp(nontarget, nt_c, out=nontarget)
            if smoothing:
                logit_sum += sum_c


def _runs_gluon(E, C, bias, o: CCEOptions, host, v_splits) -> bool:
    """Whether the loss's plain lse runs the Gluon forward: the splits left to the launcher and
    ``lse_pingpong_reason`` none (``cce_forward`` decides once, for ``_lse_splits`` and ``_plain_tiling``)."""
    return v_splits is None and lse_pingpong_reason(E, C, bias, o, host) is None


def lse_pingpong_reason(E, C, bias, o: CCEOptions, host) -> str | None:
    """Why the forward's lse does not run the Gluon kernel (``lse_forward_pingpong.py``) here (None: it
    does): the tier asks for it up to ``host.lse_pingpong_max_d``, and it computes only the plain lse
    (no temperature or label smoothing; the G kernel's conditions otherwise: sm_90, 16-bit inputs, no
    soft cap or bias, both operands readable by the copy engine)."""
    D = E.shape[1]
    if D > host.lse_pingpong_max_d:
        return f"the tier runs it up to D = {host.lse_pingpong_max_d}, not {D}"
    if o.temperature != 1.0 or o.label_smoothing > 0:
        return "it computes the plain lse: no temperature or label smoothing"
    from helpers.cce.kernels.gradient_chunk_pingpong import pingpong_reason

    capability = device_info(E.device).capability if E.device.type == "cuda" else None
    why = pingpong_reason(E.device, E.dtype, capability, sorted_vocab=False, split=False,
                          softcap=o.softcap is not None, bias=bias is not None)
    if why is None and not (tma_ready(E) and tma_ready(C)):
        why = "the copy engine cannot read E or C (alignment or strides)"
    return why


def forward_kernel(E, C, bias, o: CCEOptions, host, *, bits: bool) -> str:
    """Which kernel made the loss's lse (``cce_forward``'s choice, the splits left to it): "gluon" (the
    Hopper tier's ``lse_forward_pingpong``), "triton" (``lse_forward_kernel``), or "triton with bits"
    (the "sparse" backward's bits, or "auto"'s probe for them)."""
    if bits:
        return "triton with bits"
    return "gluon" if lse_pingpong_reason(E, C, bias, o, host) is None else "triton"


def cce_forward_outputs(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    options: CCEOptions = CCEOptions(),
    configs: CCEConfigs | str | None = None,
    v_splits: int | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob, entropy, lse, correct, r), each (N,), of one pass over the logits
    z = cap(E C^T + b) / temperature (``options``' soft cap and temperature; the loss options are not
    read): logprob = z_x - lse (log1p(-r) where r < 1/2: a confident token's, to fp32's relative
    precision), entropy H = lse - sum_v softmax(z)_v z_v, correct = the target is among the row's
    largest logits, r = 1 - softmax(z)_x (``cce_forward``'s). Ignored rows: 0, 0, their lse, False, 1.
    ``helpers.cce.outputs`` gives them gradients."""
    o = options
    configs = resolve_configs(configs, E.device)
    fwd, _, dot_cfg = configs.for_dtype(E.dtype)
    softcap = o.softcap if o.softcap is not None else 1.0
    # Algorithm 1: z_{i, x_i} as the loss's forward makes it; the accuracy uses the LSE tiles' own copy.
    target_logit = indexed_dot(E, C, x, bias, o, dot_cfg)
    lse_split, nontarget_split, _, (entropy_split, max_split, target_split), _ = _lse_splits(
        E, C, bias, x, target_logit, replace(o, label_smoothing=0.0), fwd, v_splits, softcap, row_stats=True,
        host=configs.host)
    lse, entropy, row_max = merge_row_stats(lse_split, entropy_split, max_split)
    r = nontarget_mass(nontarget_split, lse, target_logit)
    kept = x != o.ignore_index
    logprob = torch.where(kept, log_target_prob(target_logit, lse, r), 0.0)
    # Ties: correct when the target's logit equals the row's largest (the target is among the maxima).
    correct = kept & (target_split.sum(dim=0) >= row_max)
    return logprob, torch.where(kept, entropy, 0.0), lse, correct, r


class RowStatistics(NamedTuple):
    """Each row's statistics of its logits over C's rows, each (N,) fp32 (``cce_forward_rows``)."""

    lse: torch.Tensor  # log sum_v exp(z_v)
    lse_nontarget: torch.Tensor  # log sum_{v != x} exp(z_v) (-inf where only the target's column is here)
    target_logit: torch.Tensor  # z_{i, x_i} (Algorithm 1); 0 where x_i is ignore_index
    logit_sum: torch.Tensor | None  # sum_v z_v, with label smoothing only
    entropy: torch.Tensor | None = None  # lse - sum_v softmax(z)_v z_v (``outputs`` only)
    row_max: torch.Tensor | None = None  # max_v z_v (``outputs`` only)
    target_in_tile: torch.Tensor | None = None  # z_{i, x_i} as the max's tile made it, 0 off [0, V) (``outputs``)


def cce_forward_rows(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    options: CCEOptions = CCEOptions(),
    configs: CCEConfigs | str | None = None,
    v_splits: int | None = None,
    bias: torch.Tensor | None = None,
    outputs: bool = False,
) -> RowStatistics:
    """The per-row statistics that ``cce_forward`` (and, with ``outputs``, ``cce_forward_outputs``)
    combine into a loss, before combining them: what a vocabulary-parallel loss exchanges between
    the ranks that each hold a slice of C (``helpers.cce.parallel``). A target outside [0, V) that is
    not ``options.ignore_index`` must not be given (Algorithm 1 would read C's row 0 for it): map it
    to ``ignore_index`` (its row's lse and sums are made all the same). ``outputs``: also the
    entropy, the largest logit and the target's logit from the same tiles (no logit sum then)."""
    o = options
    configs = resolve_configs(configs, E.device)
    fwd, _, dot_cfg = configs.for_dtype(E.dtype)
    softcap = o.softcap if o.softcap is not None else 1.0
    # The Triton forward (no host tier given to ``_lse_splits``); the tiles holding a target flagged unless
    # the row statistics walk every column anyway.
    tile_flags = None if outputs else _tile_flags(x.shape[0], C.shape[0], fwd.BLOCK_N, fwd.BLOCK_V, E.device)
    target_logit = indexed_dot(E, C, x, bias, o, dot_cfg, tile_flags=tile_flags)
    if outputs:
        o = replace(o, label_smoothing=0.0)
    lse_split, nontarget_split, logit_sum_split, row_stats, _ = _lse_splits(E, C, bias, x, target_logit, o, fwd,
                                                                            v_splits, softcap, row_stats=outputs,
                                                                            tile_flags=tile_flags)
    logit_sum = logit_sum_split.sum(dim=0) if o.label_smoothing > 0 else None
    lse_nontarget = torch.logsumexp(nontarget_split, dim=0)
    if not outputs:
        lse = torch.logsumexp(lse_split, dim=0) if lse_split.shape[0] > 1 else lse_split[0]
        return RowStatistics(lse, lse_nontarget, target_logit, logit_sum)
    entropy_split, max_split, target_split = row_stats
    lse, entropy, row_max = merge_row_stats(lse_split, entropy_split, max_split)
    return RowStatistics(lse, lse_nontarget, target_logit, None, entropy, row_max, target_split.sum(dim=0))


class TileFlags(NamedTuple):
    """Which (row block, vocabulary tile) pairs of the plain forward's tiling hold a kept row's target:
    a byte each, (row blocks x tiles,) int8, written by Algorithm 1's launch (``indexed_dot_kernel``'s
    TILE_FLAGS) and read by the LSE kernel, which masks the target's column in those tiles only."""

    flags: torch.Tensor
    block_n: int
    block_v: int

    def for_tiling(self, block_n: int, block_v: int) -> torch.Tensor | None:
        """The flags where they were made for a (block_n, block_v) tiling, else None (every tile masked)."""
        return self.flags if (self.block_n, self.block_v) == (block_n, block_v) else None


def _tile_flags(N: int, V: int, block_n: int, block_v: int, device) -> TileFlags:
    """Zeroed flags for a forward tiled (block_n, block_v)."""
    return _zeroed(N, V, (block_n, block_v), device, counts=False)[0]


def _zeroed(N: int, V: int, tiling: tuple[int, int] | None, device, *, counts: bool
            ) -> tuple[TileFlags | None, torch.Tensor | None]:
    """(the tile flags of a forward tiled ``tiling`` = (block_n, block_v), or None without a tiling;
    int64 (2,) counts, or None) zeroed by one launch: with few tokens each launch is host time."""
    n_flags = triton.cdiv(N, tiling[0]) * triton.cdiv(V, tiling[1]) if tiling else 0
    head = 16 if counts else 0  # the counts' two int64, then the flags' bytes
    if head + n_flags == 0:
        return None, None
    zeros = torch.zeros(head + n_flags, dtype=torch.int8, device=device)
    return (TileFlags(zeros[head:], *tiling) if tiling else None), (zeros[:head].view(torch.int64) if counts else None)


def _plain_tiling(fwd, gluon: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_V) of the kernel ``_lse_splits`` runs for the loss: the Gluon forward's where it
    runs (``gluon``, ``_runs_gluon``), else the tier's ``fwd``."""
    if gluon:
        from helpers.cce.kernels import lse_forward_pingpong as pingpong

        return pingpong.BLOCK_N, pingpong.BLOCK_V
    return fwd.BLOCK_N, fwd.BLOCK_V


def indexed_dot(E, C, x, bias, o: CCEOptions, dot_cfg, counts: torch.Tensor | None = None,
                 tile_flags: TileFlags | None = None) -> torch.Tensor:
    """Algorithm 1: z_{i, x_i} (N,) fp32, 0 at ignored rows; ``counts`` as ``cce_forward``'s; ``tile_flags``
    (``TileFlags``) are set for the LSE kernel that runs next."""
    N, D = E.shape
    V = C.shape[0]
    target_logit = torch.empty(N, dtype=torch.float32, device=E.device)
    flags = tile_flags or TileFlags(target_logit, 1, 1)
    indexed_dot_kernel[(triton.cdiv(N, dot_cfg.BLOCK_N),)](
        E, C, x, target_logit, bias if bias is not None else target_logit,
        counts if counts is not None else target_logit, flags.flags,
        N, V, D,
        E.stride(0), E.stride(1), C.stride(0), C.stride(1), x.stride(0),
        o.ignore_index, o.softcap if o.softcap is not None else 1.0, 1.0 / o.temperature,
        flags.block_n, flags.block_v, triton.cdiv(V, flags.block_v),
        HAS_SOFTCAP=o.softcap is not None,
        HAS_BIAS=bias is not None,
        COUNTS=counts is not None,
        TILE_FLAGS=tile_flags is not None,
        **dot_cfg.tiles("BLOCK_N", "BLOCK_D"), **dot_cfg.launch, enable_fp_fusion=fp_fusion(E.dtype),
    )
    return target_logit


def nontarget_mass(nontarget_split: torch.Tensor, lse: torch.Tensor, target_logit: torch.Tensor) -> torch.Tensor:
    """r = 1 - p(target) of each row, (N,) fp32, as the backward takes it: from its splits' non-target lse
    (SPLITS, N) and its lse, exp(lse_u - lse), to fp32's relative precision (``lse_forward_kernel``'s
    NONTARGET), where that is below 1/2; else 1 - exp(z_x - lse), whose absolute error is the naive
    path's (``helpers.cce.kernels.logits.target_complement``, the same rule in the kernels, says why)."""
    r = torch.exp(torch.logsumexp(nontarget_split, dim=0) - lse)
    from_target = 1.0 - torch.exp(target_logit - lse)
    return torch.where((r < 0.5) | from_target.isnan(), r, from_target)


def log_target_prob(target_logit: torch.Tensor, lse: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """log p(target) of each row: log1p(-r) where r < 1/2 (a confident token: z_x - lse, two rounded
    numbers of |z|'s size, would be off by ~ulp(|z|) where the answer is ~ -r), else z_x - lse."""
    return torch.where(r < 0.5, torch.log1p(-r.clamp(max=0.5)), target_logit - lse)


def merge_row_stats(lse_split: torch.Tensor, entropy_split: torch.Tensor, max_split: torch.Tensor):
    """(lse, entropy, max) of whole rows from their vocabulary splits' (SPLITS, N) each. The softmax
    of a row is a mixture of its splits' softmaxes with weights w_k = exp(lse_k - lse), over disjoint
    columns, so H = sum_k w_k (H_k - log w_k) = sum_k w_k (H_k + lse - lse_k)."""
    if lse_split.shape[0] == 1:
        return lse_split[0], entropy_split[0], max_split[0]
    lse = torch.logsumexp(lse_split, dim=0)
    w = torch.exp(lse_split - lse)
    entropy = torch.where(w > 0, w * (entropy_split + (lse - lse_split)), 0.0).sum(dim=0)
    return lse, entropy, max_split.amax(dim=0)


ROW_BLOCK = 1024  # rows per program of ``row_loss_kernel``

# The most row blocks the grid's second dimension takes (CUDA's limit on gridDim.y).
MAX_GRID_Y = 65535


def split_major(n_blocks: int) -> bool:
    """Whether the LSE grid is (SPLITS, row blocks), a row block's splits next to each other
    (``SPLIT_MAJOR``), rather than (row blocks, SPLITS): always, unless the row blocks pass
    CUDA's limit on a grid's second dimension."""
    return n_blocks <= MAX_GRID_Y


def grid_order(n_blocks: int, splits: int) -> tuple[int, int]:
    return (splits, n_blocks) if split_major(n_blocks) else (n_blocks, splits)


def split_grid(N: int, cfg, device, v_splits: int | None, D: int, itemsize: int) -> tuple[int, int]:
    """(row blocks, vocabulary splits wanted) of the LSE grid: ``v_splits``, or for None the
    fewest splits that fill the GPU (``lse_splits``)."""
    n_blocks = triton.cdiv(N, cfg.BLOCK_N)
    if v_splits is None:
        if device.type == "cuda":
            info = device_info(device)
            strip = cfg.BLOCK_N * D * itemsize  # one row block's E
            v_splits = lse_splits(n_blocks, info.multiprocessors, info.l2_cache_bytes, strip)
        else:  # the interpreter runs programs one by one: a couple of splits just exercise the merge
            v_splits = triton.cdiv(4, n_blocks)
    return n_blocks, v_splits


def lse_splits(n_blocks: int, multiprocessors: int, l2_bytes: int | None, strip_bytes: int) -> int:
    """The fewest vocabulary splits s such that (1) the n_blocks * s programs fill the GPU, at
    least 0.9 of one wave and at least 0.85 of their last wave's slots on average; and (2) the E
    strips (``strip_bytes``: BLOCK_N rows x D) of the row blocks running at once, min(n_blocks,
    multiprocessors / s) of them in the split-major grid, fit in 0.8 of L2. Each split re-reads
    its row block's strip per tile and every split adds a row of the lse merge, so fewer is
    better once both hold. On an H200 this rule picked the fastest of 1, 2, 4 and 8 splits, or one
    within 1%, at the Gemma-2-2B head (plain and sorted) and the Qwen3 head at N = 131,072, where one
    split's strips overflowed L2 (scripts/experiments/tune.py "order"; docs/performance-history.md)."""
    sms = max(1, multiprocessors)
    for s in range(1, 1025):
        programs = n_blocks * s
        waves = triton.cdiv(programs, sms)
        fills = programs >= 0.9 * sms and programs >= 0.85 * waves * sms
        resident = min(n_blocks, triton.cdiv(sms, s)) * strip_bytes
        if fills and (l2_bytes is None or resident <= 0.8 * l2_bytes):
            return s
    return 1024


def _launch_flags(cfg, o: CCEOptions, bias, dtype, n_blocks: int, e_desc: bool) -> dict:
    """The LSE kernel's meta-parameters and launch options for configuration ``cfg``, ``n_blocks``
    row blocks and E (and C) read through descriptors or not (``e_desc``)."""
    return dict(
        HAS_SOFTCAP=o.softcap is not None, HAS_BIAS=bias is not None, SUM_LOGITS=o.label_smoothing > 0,
        DOT_PRECISION=dot_precision(dtype, cfg), enable_fp_fusion=fp_fusion(dtype), E_DESC=e_desc, SPLIT_MAJOR=split_major(n_blocks),
        **cfg.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D"), **cfg.launch,
    )


def _lse_with_activity(E, C, bias, x, target_logit, o: CCEOptions, configs, v_splits, softcap, return_lse):
    """Algorithm 2 with activity bits: (lse_split, nontarget_split, logit_sum_split, Activity, lse_lo_split: as
    ``_lse_splits``'s); the module doc says
    how the bits' lower bound is kept tight (target seed; pilot launch when sorted)."""
    if o.filter_eps is None:
        raise ValueError("activity bits need a gradient filter (options.filter_eps)")
    N, V = E.shape[0], C.shape[0]
    device = E.device
    # The sorted walk gathers C's rows: its own tiles (``CCEConfigs.forward_sorted``).
    fwd = configs.forward_sorted_for(E.dtype) if o.sort_vocab else configs.for_dtype(E.dtype)[0]
    n_blocks, v_splits = split_grid(N, fwd, device, v_splits, E.shape[1], E.element_size())
    bits_v = configs.sparse_for(E.dtype).BLOCK_V
    sub = fwd.BLOCK_V // bits_v
    if fwd.BLOCK_V % bits_v or sub not in (1, 2, 4, 8):
        raise ValueError(f"the sparse tiles ({bits_v}) must divide the forward's ({fwd.BLOCK_V}) 1-8 times")
    byte_blocks = 8 // sub  # forward tiles per byte of bits: splits start on whole bytes
    T = triton.cdiv(V, bits_v)
    bits = torch.empty(triton.cdiv(T, 8), N, dtype=torch.uint8, device=device)
    order = vocabulary_order(E, C) if o.sort_vocab else None
    # The bits' threshold: eps, a hair lower for the rounding of the seeds, over the largest
    # coefficient of S in G the backward may meet (z-loss's 1 + 2 zl lse, a gradient into the lse),
    # which the forward cannot know (the backward checks every row's against coef_max).
    coef_max = coef_bound(o.z_loss, return_lse)
    eps = o.filter_eps / coef_max * (1 - 1e-3)
    kept = x != o.ignore_index
    # The target logit is one term of the row's sum (minus a margin for the two kernels' rounding).
    seed_max = torch.where(kept, target_logit - 1e-3 * (1 + target_logit.abs()), float("-inf"))
    seed_add = torch.full_like(seed_max, float("-inf"))
    pilot = 0
    if order is not None:
        align = fwd.BLOCK_V * byte_blocks
        pilot = min(V, triton.cdiv(configs.host.pilot_columns, align) * align)
    v_blocks = triton.cdiv(V - pilot, fwd.BLOCK_V)
    blocks_per_split = triton.cdiv(v_blocks, max(1, min(v_splits, v_blocks))) if v_blocks else byte_blocks
    blocks_per_split = triton.cdiv(blocks_per_split, byte_blocks) * byte_blocks
    splits = triton.cdiv(v_blocks, blocks_per_split) if v_blocks else 0
    lse_split, nontarget_split = torch.empty(2, (1 if pilot else 0) + splits, N, dtype=torch.float32,
                                             device=device).unbind(0)
    lse_lo_split = torch.empty_like(lse_split) if E.dtype == torch.float32 else None
    # The targets as the kernel walks the columns: their sorted positions in the sorted walk (-1 where
    # ignored or out of range: no column), so that a tile holds a target where its positions do.
    if order is not None:
        position = torch.empty_like(order)
        position[order] = torch.arange(V, device=device, dtype=order.dtype)
        x_walk = torch.where((x >= 0) & (x < V) & (x != o.ignore_index), position[x.clamp(0, V - 1)], -1)
        ignore_walk = -1  # already applied: a position equal to ignore_index is a kept target's
    else:
        x_walk, ignore_walk = x.contiguous(), o.ignore_index
    logit_sum_split = torch.empty_like(lse_split) if o.label_smoothing > 0 else lse_split
    common = (N, V, E.shape[1])
    strides = (E.stride(0), E.stride(1), C.stride(0), C.stride(1))
    E_arg, C_arg, e_desc = operand_descriptors(E, C, fwd, gathered=order is not None)
    flags = dict(_launch_flags(fwd, o, bias, E.dtype, n_blocks, e_desc),
                 EMIT_BITS=True, SORTED=order is not None, SUB=sub, NONTARGET=True, LSE_LO=lse_lo_split is not None)
    order_arg = order if order is not None else seed_max
    bias_arg = bias if bias is not None else seed_max
    if pilot:
        # The pilot: the first sorted positions in one split, seeded by the target only.
        lse_forward_kernel[grid_order(n_blocks, 1)](
            E_arg, C_arg, bias_arg, lse_split[0], logit_sum_split[0], bits, seed_add, seed_max, order_arg,
            x_walk, *(seed_max,) * 3, nontarget_split[0], target_logit, seed_max, *common, 0, ignore_walk,
            triton.cdiv(pilot, fwd.BLOCK_V), *strides, softcap, eps,
            1.0 / o.temperature, lse_lo_split_ptr=lse_lo_split[0] if lse_lo_split is not None else None, **flags)
        seed_add = lse_split[0]
    if splits:
        lse_forward_kernel[grid_order(n_blocks, splits)](
            E_arg, C_arg, bias_arg, lse_split[1 if pilot else 0:], logit_sum_split[1 if pilot else 0:], bits,
            seed_add, seed_max, order_arg, x_walk, *(seed_max,) * 3, nontarget_split[1 if pilot else 0:],
            target_logit, seed_max, *common, pilot, ignore_walk, blocks_per_split, *strides, softcap, eps, 1.0 / o.temperature,
            lse_lo_split_ptr=lse_lo_split[1 if pilot else 0:] if lse_lo_split is not None else None, **flags)
    return (lse_split, nontarget_split, logit_sum_split,
            Activity(bits, bits_v, V, order, o.filter_eps, pilot, coef_max), lse_lo_split)
