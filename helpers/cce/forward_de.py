"""dE made in the loss's forward: the recompute design ("gemm") under 1.1 LB at every N.

Why. The "gemm" backward holds dE's fp32 accumulator (rows x D x 4 bytes: 64 MiB at the Qwen3 head with
16,384 rows a chunk) while dE and dC both exist: 1.13-1.20 LB from 16,384 tokens (LB = dE + dC). In the
forward dC does not exist yet, so the accumulator and a wide G buffer fit in LB's room there. The forward
walks the vocabulary once, per chunk making P = exp(z - z_x) in the dtype (z_x the target's logit, known
before the walk from the indexed dot; the target's own column 0), the row sums S' = sum_{v != x} exp(z_v - z_x)
in fp32 from the unrounded exponentials, and A += P C_c in cuBLAS (fp32 output). Then per row

    lse = z_x + log1p(S'),  loss = log1p(S'),  1 - p_x = S' / (1 + S'),
    dE = w (A - S' C_x) / (1 + S')   (= w (sum_v p_v C_v - C_x)), rounded once,

w a mean's 1 / N_kept or a sum's 1. The backward scales dE by the upstream gradient in place (exact for
``loss.backward()``'s 1 or a power of two; one more rounding otherwise) and makes dC alone with the usual G.
Still four N x V x D products: the shipped forward's lse kernel (logits, nothing written) becomes a pass that
writes P as the backward's writes G.

The pieces are the shipped ones: the "gemm" backward's G kernels given lse := z_x and row coefficients
(a, t, c) = (1, 0, 0) (kept rows; 0 at ignored rows) write exactly P with the target column 0 (its value is t,
from the host, not formed), and their filter's per-tile row masses are S' (``gradient_chunk_kernel``'s ROW_SUMS).
``forward_de_rows_kernel`` makes dE's rows at each row chunk's end. The P pass has the G buffer of the
forward's room (``p_pass_configs``); the dC pass a buffer of what 1.1 LB leaves beside dE and dC, at most
16,384 rows a chunk (``dc_pass_configs``). Peak: the larger of the two passes, ~1.1 LB.

Where it runs (``forward_de_reason``): the tier's ``HostTuning.forward_de``; bf16 (fp16's P overflows past
z_x + 11, the row's maximum unknown before the walk: a flat softmax over a large vocabulary would pass it in
every row; fp16 runs on the CPU only, where the interpreter cannot run bf16, for the tests); no soft cap, bias, z-loss, label smoothing,
temperature or class weights; a mean or a sum; dE wanted; the "gemm" backward (the filter and the sparse
backward's marks need a probability, known only at a row's end: they drive dC only); eager, not replayed
from a CUDA graph or traced. P overflows fp32 where a logit passes the target's by ~88: a row whose S' is
past ``MAX_SUM`` or not finite (a NaN in the inputs too) is redone on the device by ``forward_de_redo_kernel``
(its lse by an online walk, then its dE; slow, for rows that should not occur), whose other blocks return at
once: no host read, so the host queues the backward while the GPU still runs the forward. (A first build read
S' on the host at the forward's end instead: 1.01-1.17x the shipped step's time on an H100 where its pieces
alone had taken 0.91-0.96x, docs/measurements/h100-2026-12-07.)

Measured before it was built (``scripts/experiments/forward_dE.py``): the stand-in at 0.88-1.00x the shipped
time on an H100 (docs/measurements/h100-2026-12-07); dE's error against float64 0.72-1.00x the shipped G's on
the CPU (the target's term exact in fp32 where the shipped G rounds -r to the dtype).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton

from helpers.cce.backward import no_target_at_ignored
from helpers.cce.backward.gemm import backward_gemm, gemm_chunks, gemm_plan
from helpers.cce.backward.rows import RowGradient
from helpers.cce.forward import indexed_dot
from helpers.cce.graphs import GRAPHS
from helpers.cce.kernels.configs import CCEConfigs
from helpers.cce.kernels.forward_de import forward_de_redo_kernel, forward_de_rows_kernel
from helpers.cce.options import CCEPlan, dot_precision
from helpers.cce.schedules import RECOMPUTE_ROW_BYTES, lower_bound_bytes, recompute_extra_bytes
from helpers.cce.shared import no_host_sync, read_later
from helpers.spec import raise_for_targets

CAP = 1.1  # the peak this design keeps under, over LB
DC_ROWS = 16_384  # rows a chunk of the dC pass at most (dC folded across them past it)
# S' past this: the row is redone (``forward_de_redo_kernel``). bf16: P near fp32's range, where A's sums could
# overflow. fp16: every P_v <= S' stays below fp16's largest, 65,504 (a target's probability above 3e-5).
MAX_SUM = {torch.bfloat16: 2.0**100, torch.float16: 2.0**15}
FINISH_ROWS, FINISH_D = 16, 128  # ``forward_de_rows_kernel``'s block
REDO_ROWS, REDO_V, REDO_D = 16, 64, 64  # ``forward_de_redo_kernel``'s blocks (tl.dot's least rows: 16)
# Bytes a row kept outside the plans' buffers: z_x, S', the row coefficients, lse, r, the backward's row weights
# (at 16 a row the peak at 4,096 tokens was 1.1007 LB on an H100: docs/measurements/h100-2026-12-07).
SLACK = 64


def forward_de_reason(E: torch.Tensor, C: torch.Tensor, bias: torch.Tensor | None, plan: CCEPlan) -> str | None:
    """Why this call's forward does not make dE (None: it does; module doc)."""
    o = plan.options
    if not plan.configs.host.forward_de:
        return "the tier's forward_de is off (HostTuning.forward_de)"
    if E.dtype != torch.bfloat16 and not (E.dtype == torch.float16 and E.device.type == "cpu"):
        return (f"bf16 (fp16 on the CPU only, for the interpreter's tests: a flat softmax passes fp16's range in "
                f"every row, each then redone alone), not {E.dtype}")
    if not plan.need[0]:
        return "dE is not wanted"
    if plan.backward_impl != "gemm":
        return f'the dC pass is "gemm", not {plan.backward_impl!r}'
    if bias is not None or o.softcap is not None or o.z_loss or o.label_smoothing or o.temperature != 1.0:
        return "a bias, soft cap, z-loss, label smoothing or temperature: the plain loss only"
    if plan.class_weight is not None or plan.return_lse:
        return "class weights or a returned lse: the plain loss only"
    if o.reduction not in ("mean", "sum"):
        return f"a mean or a sum (one upstream value for every row), not {o.reduction!r}"
    if no_host_sync(E):
        return "eager calls only (not traced or captured)"
    if GRAPHS.applies(E, C, plan):
        return "the call is replayed from a CUDA graph (few tokens)"
    return None


def p_pass_configs(configs: CCEConfigs, N: int, V: int, D: int, dtype: torch.dtype, *, slack: int = SLACK,
                   row_sums: bool = True) -> CCEConfigs:
    """The tier for the forward's P pass: a G buffer as wide as the backward's widest in-place chunk
    (``HostTuning.g_in_place_bytes``), held with dE and its accumulator under CAP x LB (dC not made yet).
    ``slack``: bytes a row kept outside the buffers; ``row_sums``: room for the tiles' row sums (False: the
    stand-in in scripts/experiments/forward_dE.py, whose pass stores none)."""
    host = configs.host
    block_v = configs.backward_gemm_for(dtype).BLOCK_V
    n_chunk = min(N, (host.gemm_chunks or gemm_chunks(N, V, D, dtype, block_v))[0])
    accumulator = n_chunk * D * 4
    room = int(CAP * lower_bound_bytes(N, V, D, dtype.itemsize)) - N * D * dtype.itemsize - accumulator - slack * N
    # less the tiles' row sums, 4 bytes a row per 256 columns: 1/128 of a 16-bit buffer's bytes
    buffer = max(0, min(host.g_in_place_bytes, room - room // 128 if row_sums else room))
    return configs.tuned(g_buffer_lb_share=(buffer + accumulator) / (N * D * dtype.itemsize))


def dc_pass_configs(configs: CCEConfigs, N: int, V: int, D: int, dtype: torch.dtype, *, rows: int = DC_ROWS,
                    slack: int = SLACK) -> CCEConfigs:
    """The tier for the backward's dC pass: at most ``rows`` rows a row chunk and a G buffer of what CAP x LB
    leaves beside dE and dC (less dC's fp32 staging where several row chunks fold), its chunks no narrower
    than a tile. ``slack`` as ``p_pass_configs``'."""
    block_v = configs.backward_gemm_for(dtype).BLOCK_V
    rows = min(N, rows)
    room = int((CAP - 1) * lower_bound_bytes(N, V, D, dtype.itemsize)) - slack * N
    cols = max(block_v, room // (rows * dtype.itemsize) // block_v * block_v)
    if rows < N:
        room -= cols * D * 4
        cols = max(block_v, room // (rows * dtype.itemsize) // block_v * block_v)
    buffer = rows * cols * dtype.itemsize
    return configs.tuned(gemm_chunks=(rows, cols), g_buffer_lb_share=buffer / (V * D * dtype.itemsize))


def forward_de_extra_bytes(N: int, V: int, D: int, itemsize: int, configs: CCEConfigs) -> int:
    """The predicted bytes above the inputs and LB (dE and dC) of a call whose forward makes dE: the larger of
    the P pass's (the recompute formula of a dE-only "gemm" pass with ``p_pass_configs``, plus the tiles' row
    sums, less dC, not made yet) and the dC pass's (the same formula, dC only, ``dc_pass_configs``), with
    ``SLACK`` bytes a row in place of the formula's own. The memory model's figure for such a call
    (``helpers.cce.schedules.choose_schedule``'s ``forward_de_extra``)."""
    dtype = torch.bfloat16 if itemsize == 2 else torch.float32
    p_configs = p_pass_configs(configs, N, V, D, dtype)
    g = p_configs.backward_gemm_for(dtype)
    plan = gemm_plan(N, V, D, dtype, g.BLOCK_V, host=p_configs.host, need_dE=True, need_dC=False,
                     tensor_cores=g.tensor_cores)
    sums = triton.cdiv(plan.widest, g.BLOCK_V) * plan.n_chunk * 4
    forward = (recompute_extra_bytes(N, V, D, itemsize, p_configs, need=(True, False, False)) + sums
               - V * D * itemsize)
    backward = recompute_extra_bytes(N, V, D, itemsize, dc_pass_configs(configs, N, V, D, dtype),
                                     need=(False, True, False))
    return max(forward, backward) + (SLACK - RECOMPUTE_ROW_BYTES) * N


def loss_forward_de(E: torch.Tensor, C: torch.Tensor, x: torch.Tensor, plan: CCEPlan, *, check_targets: bool = True):
    """(loss, lse, r, n_kept, dE) as ``helpers.cce.ops.loss_forward`` gives the first four (its r: 1 - p_x and a
    zero rounding), dE (N, D) in E's dtype scaled for a mean's or a sum's upstream gradient of 1. ``plan``: one
    that ``forward_de_reason`` passes. Reads nothing on the host but the targets' check (``check_targets``)."""
    o = plan.options
    N, D = E.shape
    V = C.shape[0]
    device = E.device
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    z_x = indexed_dot(E, C, x, None, o, plan.configs.for_dtype(E.dtype)[2], counts)
    bad = read_later(counts[1]) if check_targets else None
    n_kept = counts[0]
    x_g = no_target_at_ignored(x, o.ignore_index, V)
    kept = ((x_g >= 0) & (x_g < V)).float()
    # Row coefficients (a, t, c) = (1, 0, 0) at kept rows, 0 at ignored ones: G is P, its target column 0.
    coef = torch.zeros(3, N, dtype=torch.float32, device=device)
    coef[0] = kept
    ones = torch.ones(1, dtype=torch.float32, device=device)
    up = RowGradient(w=kept, w_rel=kept, w_scale=ones, uniform=True, coef=coef)
    scale = (1.0 / n_kept.clamp(min=1).float()).reshape(1) if o.reduction == "mean" else ones
    sums = torch.zeros(N, dtype=torch.float32, device=device)
    x_rows = x_g.contiguous()

    def finish(n0: int, n1: int, acc: torch.Tensor, out: torch.Tensor) -> None:
        rows = n1 - n0
        forward_de_rows_kernel[(triton.cdiv(rows, FINISH_ROWS), triton.cdiv(D, FINISH_D))](
            acc, C, x_rows[n0:n1], sums[n0:n1], scale, out, rows, V, D,
            acc.stride(0), C.stride(0), C.stride(1), x_rows.stride(0), out.stride(0),
            BLOCK_R=FINISH_ROWS, BLOCK_D=FINISH_D)

    configs = p_pass_configs(plan.configs, N, V, D, E.dtype)
    dE, _, _ = backward_gemm(E, C, x_g, z_x, up, None, replace(o, filter_eps=None), configs.backward_gemm_for(E.dtype),
                             None, None, None, None, (True, False, False), host=configs.host, row_sums=sums,
                             finish=finish)
    if check_targets:  # the kernels read C's row 0 for a target out of range
        raise_for_targets(x, V, o.ignore_index, bad())
    lse = z_x + torch.log1p(sums)
    loss_rows = torch.log1p(sums) * kept
    r = torch.zeros(2 * N, dtype=torch.float32, device=device)
    torch.div(sums, 1.0 + sums, out=r[:N])
    # Rows whose S' passed its range, redone on the device (no host read: the backward's launches queue on).
    cfg = plan.configs.backward_gemm_for(E.dtype)
    forward_de_redo_kernel[(triton.cdiv(N, REDO_ROWS),)](
        E, C, x_rows, sums, z_x, scale, dE, lse, r, loss_rows, N, V, D, MAX_SUM[E.dtype],
        E.stride(0), E.stride(1), C.stride(0), C.stride(1), x_rows.stride(0), dE.stride(0),
        BLOCK_R=REDO_ROWS, BLOCK_V=REDO_V, BLOCK_D=REDO_D, DOT_PRECISION=dot_precision(E.dtype, cfg))
    loss = loss_rows.sum() if o.reduction == "sum" else loss_rows.sum() / n_kept  # 0 / 0 = NaN, as torch
    return loss, lse, r, n_kept, dE


def dc_plan(plan: CCEPlan, E: torch.Tensor, C: torch.Tensor) -> CCEPlan:
    """``plan`` for the backward's dC (and db) pass after a forward that made dE (``dc_pass_configs``)."""
    N, D = E.shape
    V = C.shape[0]
    return replace(plan, need=(False, *plan.need[1:]), configs=dc_pass_configs(plan.configs, N, V, D, E.dtype))
