"""The "atomic" backward: one kernel rebuilds each logit tile, forms G, and adds G C_tile into dE
and G^T E_tile into dC with fp32 atomics (``helpers/cce/kernels/atomic_gradients.py``).

The paper's structure, kept for teaching and comparison. Scratch: fp32 accumulators per row chunk
of dE and vocabulary chunk of dC for fp16/bf16 inputs (``atomic_chunks``: max(64 MiB, LB / 10)
and max(16 MiB, LB / 40)), folded into the outputs in the input dtype; fp32 inputs accumulate
into dE and dC directly. Its (BLOCK_N + BLOCK_V) * D atomic adds per tile are what makes it slower
than the "gemm" backward (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch
import triton

from helpers.cce.backward.rows import RowGradient, fold_dC
from helpers.cce.shared import MiB
from helpers.cce.kernels.atomic_gradients import backward_atomic_kernel
from helpers.cce.kernels.configs import LaunchConfig
from helpers.cce.options import CCEOptions, dot_precision, fp_fusion, tile_eps


def atomic_chunks(N: int, V: int, D: int, dtype: torch.dtype) -> tuple[int, int]:
    """(n_chunk, v_chunk): rows of E and of C whose fp32 scratch the backward keeps at once.

    dE's scratch: max(64 MiB, LB / 10); dC's: max(16 MiB, LB / 40), LB = (N + V) * D * itemsize.
    """
    lb = (N + V) * D * dtype.itemsize
    n_chunk = max(64 * MiB, lb // 10) // (D * 4)
    v_chunk = max(16 * MiB, lb // 40) // (D * 4)
    # Multiples of 256 rows, so no launch ends in a partial tile except the last.
    n_chunk, v_chunk = (c // 256 * 256 if c >= 256 else c for c in (n_chunk, v_chunk))
    return max(1, min(N, n_chunk)), max(1, min(V, v_chunk))


def backward_atomic(E, C, x, lse, up: RowGradient, vocab_order, o: CCEOptions, cfg: LaunchConfig,
                    n_chunk: int | None, v_chunk: int | None, stats: dict | None, bias=None,
                    need: tuple[bool, bool] = (True, True), *, class_weight=None):
    """(dE, dC) in E's dtype, each None where ``need`` (dE, dC) says it is not wanted (its atomics
    are then compiled out); see ``helpers.cce.backward.cce_backward`` for the arguments. A bias
    enters the logits; its gradient is the "gemm" backward's. ``class_weight``: as ``backward_gemm``'s."""
    need_dE, need_dC = need
    N, D = E.shape
    V = C.shape[0]
    dtype, device = E.dtype, E.device
    skip_count = torch.zeros(1, dtype=torch.int32, device=device)
    counters = {"tiles": 0, "launches": 0}
    launch = dict(C=C, bias=bias, up=up, vocab_order=vocab_order, o=o, cfg=cfg, skip_count=skip_count,
                  counters=counters, count_skips=stats is not None, need=need, class_weight=class_weight)
    dE = dC = None
    unused = torch.empty(1, 1, dtype=torch.float32, device=device)  # the pointer of a gradient not wanted

    if dtype == torch.float32:
        # The outputs are fp32 already: the atomics add into them directly, one launch.
        dE = torch.zeros(N, D, dtype=dtype, device=device) if need_dE else None
        dC = torch.zeros(V, D, dtype=dtype, device=device) if need_dC else None
        _launch(E, x, lse, slice(0, N), dE if need_dE else unused, dC if need_dC else unused, 0, V,
                dc_local=False, **launch)
    else:
        dE = torch.empty(N, D, dtype=dtype, device=device) if need_dE else None
        dC = torch.empty(V, D, dtype=dtype, device=device) if need_dC else None
        default_n, default_v = atomic_chunks(N, V, D, dtype)
        n_chunk = min(N, n_chunk or default_n)
        v_chunk = min(V, v_chunk or default_v)
        n_chunks = triton.cdiv(N, n_chunk)
        dE_acc = torch.empty(n_chunk, D, dtype=torch.float32, device=device) if need_dE else unused
        dC_acc = torch.empty(v_chunk, D, dtype=torch.float32, device=device) if need_dC else unused
        # Kahan-style compensation: what rounding dC to the dtype lost at each fold, carried to
        # the next fold. Only needed when dC is folded more than once per row (several row chunks).
        compensation = (
            torch.zeros(V, D, dtype=dtype, device=device)
            if need_dC and o.accumulation == "kahan" and n_chunks > 1 else None
        )
        for chunk, n0 in enumerate(range(0, N, n_chunk)):
            n1 = min(N, n0 + n_chunk)
            dE_rows = dE_acc[: n1 - n0].zero_() if need_dE else unused
            for v0 in range(0, V, v_chunk):
                v1 = min(V, v0 + v_chunk)
                dC_rows = dC_acc[: v1 - v0].zero_() if need_dC else unused
                _launch(E, x, lse, slice(n0, n1), dE_rows, dC_rows, v0, v1 - v0, dc_local=True, **launch)
                if need_dC:
                    # Fold this launch's fp32 dC rows into dC (rows are vocabulary positions, mapped
                    # to C's rows through the sort when there is one).
                    where = vocab_order[v0:v1] if vocab_order is not None else slice(v0, v1)
                    fold_dC(dC, dC_rows, where, chunk == 0, compensation)
            if need_dE:
                dE[n0:n1] = dE_rows

    if stats is not None:
        stats.update(counters, skipped=int(skip_count.item()))
    return dE, dC


def _launch(E, x, lse, rows, dE_acc, dC_acc, v_begin, v_count, *, dc_local, C, bias, up, vocab_order, o, cfg,
            skip_count, counters, count_skips, need, class_weight):
    """One launch over E[rows] x vocabulary positions [v_begin, v_begin + v_count)."""
    E_rows, x_rows = E[rows], x[rows]
    coef = up.coef[:, rows]
    n_tiles = triton.cdiv(E_rows.shape[0], cfg.BLOCK_N) * triton.cdiv(v_count, cfg.BLOCK_V)
    counters["tiles"] += n_tiles
    counters["launches"] += 1
    backward_atomic_kernel[(n_tiles,)](
        E_rows, C, x_rows, lse[rows], coef, bias if bias is not None else lse, up.w_rel[rows], up.w_scale,
        vocab_order if vocab_order is not None else skip_count,
        dE_acc, dC_acc, skip_count,
        E_rows.shape[0], C.shape[0], C.shape[1], v_begin, v_count,
        E_rows.stride(0), E_rows.stride(1), C.stride(0), C.stride(1), x_rows.stride(0),
        dE_acc.stride(0), dE_acc.stride(1), dC_acc.stride(0), dC_acc.stride(1), coef.stride(0),
        o.softcap if o.softcap is not None else 1.0, tile_eps(o.filter_eps, cfg.BLOCK_V),
        HAS_SOFTCAP=o.softcap is not None,
        HAS_BIAS=bias is not None,
        NEED_DE=need[0],
        NEED_DC=need[1],
        FILTER=o.filter_eps is not None and not (o.full_c and o.full_e),
        FULL_E=o.full_e,
        FULL_C=o.full_c,
        SORTED=vocab_order is not None,
        DC_LOCAL=dc_local,
        COUNT_SKIPS=count_skips,
        DOT_PRECISION=dot_precision(E.dtype, cfg), enable_fp_fusion=fp_fusion(E.dtype),
        inv_temperature=1.0 / o.temperature,
        ENTROPY=up.coef.shape[0] > 3,
        class_weight_ptr=class_weight, CLASS_WEIGHTS=class_weight is not None,
        **cfg.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D", "GROUP_N"), **cfg.launch,
    )
