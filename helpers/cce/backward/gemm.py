"""The "gemm" backward (what "auto" runs on a flat softmax): G per vocabulary chunk, its two products in cuBLAS.

Per row chunk (rows of dE's fp32 accumulator) and vocabulary chunk [v0, v1) of V_c columns:

    G_c  = dloss / dz[:, v0:v1]             (rows, V_c) in E's dtype    gradient_chunk_kernel
    dC[v0:v1] = g_scale * G_c^T (g_rel * E)  (V_c, D), written once     cuBLAS
    dE_acc   += G_c C[v0:v1]                 (rows, D) fp32             cuBLAS, fp32 output
    dE        = g * dE_acc, rounded once                                after the last chunk

g_scale = max g is the dC product's alpha, a host number: an eager call reads it once, after the
first G chunk and its dE product are queued (``read_later``), and dC's operand is E itself when
every row has the same g (a mean or a sum). Where nothing may be read on the host (``torch.compile``
traces the call, or a CUDA graph captures it: ``no_host_sync``), g enters through the operand
instead, g E rounded once to the dtype (n_chunk x D more bytes), and alpha is 1. In fp16, g E falls
into the subnormals where it is below 2^-14 (g = 1/N for a mean without a loss scale, N above
~16k): their absolute spacing, 2^-24, is then the rounding of each term. dE's rows and db's fp32
sums are scaled on the device after their products, in both.

Why it beats the "atomic" backward, the kernel that computes G, and the filter's place in it: the
docstring of ``helpers/cce/kernels/gradient_chunk.py``. Memory beyond dE and dC: for 16-bit inputs
dE's fp32 accumulator (rows sized by ``gemm_chunks``); G_c lives in the rows of dE or dC that the
backward has not yet written, so a chunk can be far wider than a scratch budget would allow
(fewer launches, fewer passes over the accumulator) at no memory, and only where neither has room
(fp32 inputs, a frozen body) in a buffer of ``gemm_chunks``'s width (``gemm_plan``). The measured
time and memory per shape are in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton

from helpers.cce.cublas_logits import chunk_columns
from helpers.cce.descriptors import block_descriptor, operand_descriptors, tma_ready
from helpers.cce.device import device_info
from helpers.cce.backward.rows import RowGradient, fold_dC
from helpers.cce.shared import MiB, no_host_sync, read_later
from helpers.cce.kernels.gradient_chunk import gradient_chunk_kernel
from helpers.cce.kernels.configs import HostTuning, LaunchConfig, logit_tflops, matmul_tflops
from helpers.cce.options import CCEOptions, dot_precision, fp_fusion, tile_eps


def gemm_chunks(N: int, V: int, D: int, dtype: torch.dtype, block_v: int) -> tuple[int, int]:
    """(n_chunk, v_chunk) of the "gemm" backward: rows per fp32 dE accumulator, vocabulary columns per G.

    Rows: n_chunk * D * 4 <= max(64 MiB, LB / 16), multiples of 256 (fp32 inputs accumulate into
    dE itself, but the same rows keep their G chunks as wide). Columns: n_chunk * v_chunk *
    itemsize <= max(32 MiB, LB / 32), a multiple of ``block_v`` (the G kernel's BLOCK_V) so only
    the last chunk ends in a partial tile. LB = (N + V) * D * itemsize. At the Gemma-2-2B head in
    bf16 (LB 1,217 MB): all 8,192 rows (75.5 MB of fp32), 2,304 columns (37.7 MB of G), 112 chunks.
    """
    lb = (N + V) * D * dtype.itemsize
    n_chunk = max(64 * MiB, lb // 16) // (D * 4)
    n_chunk = max(1, min(N, n_chunk // 256 * 256 if n_chunk >= 256 else n_chunk))
    v_chunk = max(32 * MiB, lb // 32) // (n_chunk * dtype.itemsize)
    v_chunk = max(block_v, v_chunk // block_v * block_v)
    return n_chunk, min(V, v_chunk)


# Where a G chunk lives (``vocab_chunks``).
G_PLACES = ("dE", "dC", "buffer")


def vocab_chunks(rows: int, V: int, D: int, v_chunk: int, block_v: int, max_cols: int, *,
                 dE_free: int, dC_free: bool, buffer_cols: int = 0) -> list[tuple[int, int, str]]:
    """The vocabulary chunks of one row chunk of ``rows`` rows: (v0, v1, where G_c lives), in order.

    G_c (rows x (v1 - v0) in E's dtype) is written where the backward has not yet written anything:
    "dE", the ``dE_free`` elements of dE from the row chunk's first free row on (for 16-bit inputs
    its own rows, whose dE is written after its last product, and the later row chunks' rows);
    "dC", dC's rows after the chunk's own, from v1 * D on, when ``dC_free`` (the first row chunk of
    an unsorted vocabulary: dC's rows are written in order, chunk by chunk); else "buffer", a
    scratch of rows x v_chunk. In place a chunk is as wide as its place allows (dC's room shrinks
    as the chunks advance: cols <= (V - v0) D / (rows + D)), up to ``max_cols``, and taken when at
    least min(v_chunk, the columns left, D) wide (D, rounded down to ``block_v``: what the row
    chunk's own dE rows hold), so that 16-bit inputs with dE wanted need no buffer. A buffer of
    ``buffer_cols`` columns (``gemm_plan``: memory the plan may spend under its peak's cap) is
    taken where it is wider than both places: dC's room halves chunk by chunk when rows ~ D, and
    the buffer ends that tail in one chunk. Widths are multiples of ``block_v`` but the last.
    """
    chunks, v0 = [], 0
    while v0 < V:
        left = V - v0

        def fit(room: int) -> int:  # the widest chunk a place of ``room`` columns takes
            cols = min(room, max_cols)
            return left if cols >= left else cols // block_v * block_v

        cols, place = max((fit(dE_free // rows), "dE"),
                          (fit(left * D // (rows + D)) if dC_free else 0, "dC"),  # (V - v1) D >= rows cols
                          (fit(buffer_cols), "buffer"))  # on a tie, a place in dE or dC (no memory)
        if cols == 0 or cols < min(v_chunk, left, D // block_v * block_v):
            cols, place = min(v_chunk, left), "buffer"
        chunks.append((v0, v0 + cols, place))
        v0 += cols
    return chunks


def host_bound_cols(rows: int, D: int, dtype: torch.dtype, host: HostTuning, *, need_dE: bool = True,
                    need_dC: bool = True, tensor_cores: bool = True) -> int:
    """The fewest columns of a G chunk of ``rows`` rows whose products (G's logits at ``logit_tflops``,
    ``tensor_cores`` the G kernel's; then dE's and dC's in cuBLAS) take the GPU
    ``host.g_chunk_host_us``, the host's time for one chunk: narrower chunks leave the GPU waiting on the host."""
    if host.g_chunk_host_us <= 0:
        return 0
    seconds_per_column = rows * D * (2 / logit_tflops(host, dtype, tensor_cores)
                                     + (2 * need_dE + 2 * need_dC) / matmul_tflops(host, dtype)) * 1e-12
    return math.ceil(host.g_chunk_host_us * 1e-6 / seconds_per_column)


@dataclass(frozen=True)
class GemmPlan:
    """How the "gemm" backward walks one problem: rows per dE accumulator (``n_chunk``), the budget's
    chunk width (``v_chunk``: a G buffer's, and dC's fp32 staging), and every row chunk with its
    ``vocab_chunks``, [(n0, n1, [(v0, v1, place)])]."""

    n_chunk: int
    v_chunk: int
    row_chunks: tuple  # of (n0, n1, chunks), chunks a tuple of (v0, v1, place): a plan is shared (``gemm_plan``'s cache)

    @property
    def widest(self) -> int:
        return max(v1 - v0 for _, _, chunks in self.row_chunks for v0, v1, _ in chunks)

    @property
    def buffer_elements(self) -> int:
        """Elements of the G buffer (0 when every chunk is in place)."""
        return max([(n1 - n0) * (v1 - v0) for n0, n1, chunks in self.row_chunks for v0, v1, place in chunks
                    if place == "buffer"], default=0)


@functools.lru_cache(maxsize=64)  # a call's plan is ~0.06 ms of Python; a GemmPlan is only read
def gemm_plan(N: int, V: int, D: int, dtype: torch.dtype, block_v: int, n_chunk: int | None = None,
              v_chunk: int | None = None, *, need_dE: bool = True, need_dC: bool = True,
              sorted_vocab: bool = False, split: bool = False, host: HostTuning = HostTuning(),
              tensor_cores: bool = True) -> GemmPlan:
    """The ``GemmPlan`` of a backward; ``n_chunk``, ``v_chunk`` None: ``host.gemm_chunks``, or
    ``gemm_chunks``'s budgets. In place, chunks go up to ``host.g_in_place_bytes`` wide, but never
    past v_chunk where the caller chose it or a scratch follows the width (the sort's gathered C,
    FullC/FullE's unfiltered G: ``split``). dC's rows are free for G only in the first row chunk of
    an unsorted vocabulary. Where dE's accumulator leaves room under ``host.g_buffer_lb_share`` x LB,
    a G buffer takes the rest (few tokens: 5 G chunks instead of 9 at the Qwen3 head, 1,024 tokens;
    none from ~8,192 tokens there, where the accumulator alone is past it). Where even the widest
    chunk in place would be host-bound (``host_bound_cols``: rows >> D), the buffer holds chunks
    that are not, up to ``host.g_buffer_max_bytes`` and a share of the whole G (notebook 03's head,
    N 4,096, D 256: 2 G chunks on the Hopper tier instead of 58). ``host.g_buffer_lb_share`` 0: no buffer
    of either kind. ``tensor_cores``: the G kernel's (``LaunchConfig.tensor_cores``), for ``host_bound_cols``."""
    default_n, default_v = host.gemm_chunks or gemm_chunks(N, V, D, dtype, block_v)
    n_chunk = min(N, n_chunk or default_n)
    max_cols = (v_chunk if v_chunk else
                default_v if sorted_vocab or split else
                max(default_v, host.g_in_place_bytes // (n_chunk * dtype.itemsize)))
    v_chunk = min(V, v_chunk or default_v)

    def dE_free(n0: int, n1: int) -> int:
        """The elements of dE not yet written when rows [n0, n1) make their G (fp32: their own accumulate)."""
        return (N - (n0 if dtype != torch.float32 else n1)) * D if need_dE else 0

    buffer_cols = 0
    if not (sorted_vocab or split) and host.g_buffer_lb_share > 0:
        # A G buffer (``HostTuning.g_buffer_lb_share``): share x LB less dE's fp32 accumulator (16-bit inputs),
        lb = (need_dE * N + need_dC * V) * D * dtype.itemsize
        accumulator = n_chunk * D * 4 if need_dE and dtype != torch.float32 else 0
        buffer_bytes = int(host.g_buffer_lb_share * lb) - accumulator
        # or, where the widest chunk in place would be host-bound, one for chunks that are not.
        # The first chunk's room in place, as ``vocab_chunks`` measures it: dE's free rows, dC's after it.
        room = max(dE_free(0, n_chunk) // n_chunk, V * D // (n_chunk + D) if need_dC else 0)
        wide = min(V, host_bound_cols(n_chunk, D, dtype, host, need_dE=need_dE, need_dC=need_dC,
                                      tensor_cores=tensor_cores))
        if room < wide:
            cap = min(host.g_buffer_max_bytes, int(host.g_buffer_max_g_share * N * V * dtype.itemsize))
            buffer_bytes = max(buffer_bytes, min(cap, wide * n_chunk * dtype.itemsize))
        buffer_cols = min(max_cols, max(0, buffer_bytes) // (n_chunk * dtype.itemsize))
    row_chunks = []
    for n0 in range(0, N, n_chunk):
        n1 = min(N, n0 + n_chunk)
        chunks = vocab_chunks(n1 - n0, V, D, v_chunk, block_v, max_cols, dE_free=dE_free(n0, n1),
                              dC_free=need_dC and not sorted_vocab and n0 == 0, buffer_cols=buffer_cols)
        row_chunks.append((n0, n1, tuple(chunks)))
    return GemmPlan(n_chunk, v_chunk, tuple(row_chunks))


# How this process makes an fp32-output product of fp16/bf16 operands, per (device, dtype):
PRODUCT_MODES = ("upcast", "addmm_out_dtype", "mm_out_dtype", "rounded")
_product_mode_cache: dict = {}


def product_mode(device: torch.device, dtype: torch.dtype) -> str:
    """How ``fp32_product`` makes out (fp32) [+]= alpha * a @ b for a, b in ``dtype`` on ``device``.

    "upcast": operands copied to fp32 (fp32 inputs, where it costs nothing; and the CPU, whose
    tests want exact products). On CUDA, the first that works and is right on a small probe:
    "addmm_out_dtype", cuBLAS with an fp32 output accumulated in its epilogue (torch.addmm's
    out_dtype, torch >= 2.8 on CUDA; older releases want ``self`` in the operands' dtype);
    "mm_out_dtype", an fp32 product then an add (one more N x D fp32 pass and buffer);
    "rounded", the product in the operands' dtype then added (rounds each chunk's partial sum:
    dE loses ~1.5x in accuracy).
    """
    if dtype == torch.float32 or device.type != "cuda":
        return "upcast"
    key = (device.type, device.index, dtype)
    if key not in _product_mode_cache:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(96, 80, device=device, generator=g).to(dtype)
        b = torch.randn(80, 72, device=device, generator=g).to(dtype)
        start = torch.randn(96, 72, device=device, generator=g)
        want = start + 0.5 * (a.double() @ b.double()).float()
        for mode in PRODUCT_MODES[1:]:
            try:
                got = start.clone()
                fp32_product(got, a, b, alpha=0.5, accumulate=True, mode=mode)
                if torch.allclose(got, want, rtol=1e-2, atol=1e-1):
                    break
            except (RuntimeError, TypeError):  # this torch lacks the overload, or refuses fp32 self
                continue
        _product_mode_cache[key] = mode
    return _product_mode_cache[key]


def fp32_product(out, a, b, *, alpha: float, accumulate: bool, mode: str):
    """out (fp32) = [out +] alpha * (a @ b), a and b in one dtype; ``mode``: ``product_mode``."""
    beta = 1.0 if accumulate else 0.0  # beta = 0: out's old contents (maybe NaN) are ignored
    if mode == "upcast":
        torch.addmm(out, a.float(), b.float(), beta=beta, alpha=alpha, out=out)
    elif mode == "addmm_out_dtype":
        torch.addmm(out, a, b, out_dtype=torch.float32, beta=beta, alpha=alpha, out=out)
    else:
        product = torch.mm(a, b, out_dtype=torch.float32) if mode == "mm_out_dtype" else torch.mm(a, b)
        if accumulate:
            out.add_(product, alpha=alpha)
        else:
            torch.mul(product, alpha, out=out)


def uses_cublas_logits(E: torch.Tensor, host: HostTuning) -> bool:
    """Whether this call's recompute products take their logits from cuBLAS (``helpers.cce.cublas_logits``):
    the tier says so, the inputs are 16-bit, and cuBLAS gives their product in fp32 here (``product_mode``
    other than "rounded"; its probe reads the device once, so under capture only once it is known)."""
    if host.logits_in_cublas_bytes <= 0 or E.dtype not in (torch.float16, torch.bfloat16):
        return False
    mode = host.product_mode
    if mode is None:
        known = E.device.type != "cuda" or (E.device.type, E.device.index, E.dtype) in _product_mode_cache
        if not known and no_host_sync(E):
            return False
        mode = product_mode(E.device, E.dtype)
    return mode != "rounded"


def backward_gemm(E, C, x, lse, up: RowGradient, vocab_order, o: CCEOptions, cfg: LaunchConfig,
                  n_chunk: int | None, v_chunk: int | None, stats: dict | None, bias=None,
                  need: tuple[bool, bool, bool] = (True, True, False), *, host: HostTuning, g_chunk=None,
                  class_weight=None, out=None, row_sums=None, finish=None):
    """(dE, dC, db), each None where ``need`` (dE, dC, db) says it is not wanted: per (row chunk,
    vocabulary chunk), G_c from ``gradient_chunk_kernel``, then dC[v0:v1] = w_scale G_c^T (w_rel E),
    db[v0:v1] = w_scale G_c^T w_rel and dE_acc += G_c C[v0:v1] in cuBLAS; the other arguments are
    ``helpers.cce.backward.cce_backward``'s. A product whose gradient is not wanted is not made.

    G_c lives in dE's or dC's rows not yet written (``vocab_chunks``), up to ``host.g_in_place_bytes``
    wide (an explicit ``v_chunk`` caps every chunk instead). Memory beyond LB, fp16/bf16: dE_acc
    (n_chunk * D * 4) + a G buffer only where no place is free (``GemmPlan.buffer_elements``: none for
    16-bit inputs with dE wanted; the unfiltered G once more with FullC/FullE and the filter) +
    w_rel E (n_chunk * D * itemsize, only when rows have different upstream gradients: reduction
    "none", or a gradient through the lse; always where nothing is read on the host) + C's gathered chunk (v_chunk * D * itemsize, sort only)
    + dC's fp32 fold (v_chunk * D * 4, several row chunks only) + Kahan's V * D compensation
    (several row chunks only) + db's fp32 accumulator (V * 4, bias only) + O(N). fp32: no dE_acc.

    ``g_chunk``: a caller's own G, for a loss that is not this one's (``helpers.cce.distill``'s
    divergences): ``g_chunk(G, n0, n1, v0, v1)`` writes G_c of rows [n0, n1) and columns [v0, v1) into
    G (rows, v1 - v0), unscaled by the rows' w as ours is, and returns the tiles it computed; x and
    lse are then not read, and the options must have no filter. ``class_weight``: (V,) fp32, the class
    weights G's smoothing term carries (``helpers.cce.class_weights``; the Triton G kernel only).
    ``out``: (dE, dC) to write, (N, D) and (V, D) in E's dtype, each None where not wanted (a CUDA graph
    writes where its key says, ``helpers.cce.graphs``); None: allocated here.

    ``row_sums``: None, or (N,) fp32 zeros that get each row's |G| mass summed over the vocabulary (the G
    kernels' ROW_SUMS: the filter's row sums, from the unrounded values). ``finish``: None, or a function
    ``finish(n0, n1, dE_acc_rows, dE_rows)`` that makes dE's rows [n0, n1) from their fp32 sum of products
    (16-bit inputs) in place of step 4's ``w dE_acc`` (``helpers.cce.forward_de``, with ``row_sums``).
    """
    need_dE, need_dC, need_db = need
    if (row_sums is not None or finish is not None) and g_chunk is not None:
        raise ValueError("row_sums and finish are for our G kernels, not a caller's g_chunk")
    if finish is not None and (not need_dE or E.dtype == torch.float32):
        raise ValueError("finish makes dE from its fp32 sum: dE wanted, 16-bit inputs")
    N, D = E.shape
    V = C.shape[0]
    dtype, device = E.dtype, E.device
    low_precision = dtype != torch.float32
    filtering = o.filter_eps is not None and not (o.full_c and o.full_e)
    if g_chunk is not None and (filtering or vocab_order is not None):
        raise ValueError("a caller's G (g_chunk) runs without the filter and the vocabulary sort")
    # FullC / FullE with the filter: the kernel also writes the unfiltered G, for the exact side.
    split = filtering and (o.full_c or o.full_e)
    plan = gemm_plan(N, V, D, dtype, cfg.BLOCK_V, n_chunk, v_chunk, need_dE=need_dE, need_dC=need_dC,
                     sorted_vocab=vocab_order is not None, split=split, host=host, tensor_cores=cfg.tensor_cores)
    n_chunk, v_chunk, widest = plan.n_chunk, plan.v_chunk, plan.widest
    n_chunks = len(plan.row_chunks)
    mode = host.product_mode or product_mode(device, dtype)
    # dC rows in fp32 before they land in dC (v_chunk at a time): folds (several row chunks), the
    # sort's scatter, the CPU's "upcast" products.
    staged = vocab_order is not None or (low_precision and (n_chunks > 1 or mode == "upcast"))

    G_buf = torch.empty(plan.buffer_elements, dtype=dtype, device=device) if plan.buffer_elements else None
    G_exact_buf = torch.empty(n_chunk * widest, dtype=dtype, device=device) if split else None
    # Hopper, 16-bit, no soft cap or bias: the warp-specialized G kernel, for the chunks whose
    # operands the copy engine can read (its 64-row tiles: twice the filter's tile records).
    pingpong = None
    # The Gluon kernel forms the plain G only: no temperature, entropy term or class weights (``gradient_tile``).
    if (host.g_pingpong and g_chunk is None and device.type == "cuda" and o.temperature == 1.0
            and up.coef.shape[0] == 3 and class_weight is None):
        from helpers.cce.kernels import gradient_chunk_pingpong as pingpong

        if pingpong.pingpong_reason(device, dtype, device_info(device).capability, sorted_vocab=vocab_order is not None,
                                    split=split, softcap=o.softcap is not None, bias=bias is not None):
            pingpong = None
    # A tier whose Triton products are FMAs: each chunk's logits from cuBLAS in fp32, a piece at a time into one
    # buffer, read by the G kernel (``helpers.cce.cublas_logits``; not for the sorted walk's gathered rows).
    cublas = g_chunk is None and pingpong is None and vocab_order is None and uses_cublas_logits(E, host)
    # Their fp32 pieces: whole tiles, as many as fit the tier's bytes or keep the GPU busy past the host (``chunk_columns``).
    Z_cols = chunk_columns(n_chunk, widest, D, dtype, cfg.BLOCK_V, host) if cublas else 0
    Z_buf = torch.empty(n_chunk * min(Z_cols, widest), dtype=torch.float32, device=device) if cublas else None
    # The Triton G kernel's persistent walk, but one program per tile with class weights: on an H200
    # (Triton 3.6) the flattened persistent loop with their load gave a wrong G (dE and dC 0.9-1.1
    # relative error against float64, bf16 and fp16), where one program per tile, the same tiles, gave
    # the unweighted path's error (docs/measurements/h200-2026-12-04c).
    persistent = cfg.persistent if class_weight is None else 0
    block_n = min(cfg.BLOCK_N, pingpong.BLOCK_N) if pingpong else cfg.BLOCK_N
    tiles_max = triton.cdiv(n_chunk, block_n) * triton.cdiv(widest, cfg.BLOCK_V)
    # The Triton kernel records its tiles only with the filter on; the Gluon kernel always does (a
    # one-entry buffer there was overrun: its records landed on whatever came next in memory).
    tile_kept = torch.empty(tiles_max if filtering or pingpong else 1, dtype=torch.int8, device=device)
    # Each tile's row masses (``row_sums``): (tiles across a chunk, rows), summed into row_sums per chunk.
    sums_block_v = min(cfg.BLOCK_V, pingpong.BLOCK_V) if pingpong else cfg.BLOCK_V
    sums_buf = (torch.empty(triton.cdiv(widest, sums_block_v) * n_chunk, dtype=torch.float32, device=device)
                if row_sums is not None else None)
    counting = stats is not None and filtering  # the filter's counts, only where asked (two launches fewer)
    skipped = torch.zeros((), dtype=torch.int64, device=device) if counting else None
    dead_chunks = torch.zeros((), dtype=torch.int64, device=device) if counting else None  # every tile skipped
    if out is None:
        dE = torch.empty(N, D, dtype=dtype, device=device) if need_dE else None
        dC = torch.empty(V, D, dtype=dtype, device=device) if need_dC else None
    else:
        dE, dC = out
    db_acc = torch.zeros(V, dtype=torch.float32, device=device) if need_db else None
    dE_acc = torch.empty(n_chunk, D, dtype=torch.float32, device=device) if low_precision and need_dE else None
    # dC's scale (module doc): alpha read on the host in eager, through the operand where no read may be made.
    device_scale = no_host_sync(E)
    w_scale = None if device_scale else read_later(up.w_scale)
    alpha = 1.0 if device_scale else None
    E_scaled_buf = (torch.empty(n_chunk, D, dtype=dtype, device=device)
                    if need_dC and (device_scale or not up.uniform) else None)
    C_sorted_buf = (torch.empty(v_chunk, D, dtype=dtype, device=device)
                    if vocab_order is not None and need_dE else None)
    staged_rows = min(v_chunk, widest)  # dC's rows staged a piece at a time
    dC_rows_buf = torch.empty(staged_rows, D, dtype=torch.float32, device=device) if staged and need_dC else None
    db_rows_buf = torch.empty(widest, 1, dtype=torch.float32, device=device) if need_db else None
    compensation = (
        torch.zeros(V, D, dtype=dtype, device=device)
        if need_dC and low_precision and o.accumulation == "kahan" and n_chunks > 1 else None
    )
    # The multiprocessors a persistent G kernel's programs fill (the interpreter: a few, so each walks several tiles).
    programs = device_info(device).multiprocessors if device.type == "cuda" else 3
    counters = {"tiles": 0, "launches": 0, "g_places": dict.fromkeys(G_PLACES, 0),
                "g_kernels": {"triton": 0, "pingpong": 0, "caller": 0, "cublas": 0}}

    for chunk, (n0, n1, chunks) in enumerate(plan.row_chunks):
        rows = n1 - n0
        E_rows = E[n0:n1]  # (rows, D)
        if need_dE:
            dE_rows = dE_acc[:rows] if low_precision else dE[n0:n1]  # (rows, D) fp32, set by the first product
        # dC's operand, (rows, D) in the dtype: E (every row's weight the same), w_rel E (rounded as the
        # "atomic" kernel rounds G w_rel for dC), or w E where alpha cannot be read (module doc).
        E_op = (None if not need_dC else
                torch.mul(E_rows, up.w[n0:n1, None], out=E_scaled_buf[:rows]) if device_scale else
                E_rows if up.uniform else torch.mul(E_rows, up.w_rel[n0:n1, None], out=E_scaled_buf[:rows]))
        # db's operand: w_rel as a column, in the dtype (1 at kept rows for a mean or a sum).
        w_op = up.w_rel[n0:n1, None].to(dtype) if need_db else None
        coef = up.coef[:, n0:n1]
        # Tensor descriptors only for the chunks whose products outlast the host's launches
        # (descriptor arguments add host time to every launch); E's and C's made once, the Triton
        # kernel's at its first chunk (the Gluon kernel may make every chunk).
        triton_operands = None  # (E's argument, C's argument, whether they are descriptors)
        G_descs = {}
        pp_descs = ({"E": pingpong.pingpong_descriptor(E_rows, pingpong.BLOCK_N, pingpong.BLOCK_D),
                     "C": pingpong.pingpong_descriptor(C, pingpong.BLOCK_V, pingpong.BLOCK_D)}
                    if pingpong and cfg.tma and tma_ready(E_rows) and tma_ready(C) else None)
        for k, (v0, v1, place) in enumerate(chunks):
            cols = v1 - v0
            # G_c's storage (``vocab_chunks``): dE's rows from the first not yet written, dC's
            # rows after this chunk's, or the buffer.
            store = (dE.view(-1)[(n0 if low_precision else n1) * D:] if place == "dE" else
                     dC.view(-1)[v1 * D:] if place == "dC" else G_buf)
            G = store[: rows * cols].view(rows, cols)  # (rows, V_c)
            G_exact = G_exact_buf[: rows * cols].view(rows, cols) if split else G
            counters["launches"] += 1
            counters["g_places"][place] += 1
            # 1. G_c: the logit tiles rebuilt, G formed and filtered, written in the dtype.
            key = (G.data_ptr(), cols)
            # The Gluon kernel for every chunk whose G the copy engine can write: its descriptors are
            # made once per row chunk (E, C) and per place (G), so narrow chunks pay no more host time.
            if g_chunk is not None:
                tiles = g_chunk(G, n0, n1, v0, v1)
                counters["g_kernels"]["caller"] += 1
            elif pp_descs is not None and tma_ready(G):
                if key not in G_descs:
                    G_descs[key] = pingpong.pingpong_descriptor(G, pingpong.BLOCK_N, pingpong.BLOCK_V)
                tiles = pingpong.launch_gradient_chunk_pingpong(
                    pp_descs["E"], pp_descs["C"], G_descs[key], x[n0:n1], lse[n0:n1], coef, tile_kept,
                    rows, V, D, v0, cols, tile_eps(o.filter_eps, pingpong.BLOCK_V) if filtering else 0.0, programs,
                    row_sums=sums_buf)
                counters["g_kernels"]["pingpong"] += 1
                sums_across = triton.cdiv(cols, pingpong.BLOCK_V)
            else:
                tiles = triton.cdiv(rows, cfg.BLOCK_N) * triton.cdiv(cols, cfg.BLOCK_V)
                sums_across = triton.cdiv(cols, cfg.BLOCK_V)
                counters["g_kernels"]["cublas" if cublas else "triton"] += 1
                if triton_operands is None:
                    triton_operands = operand_descriptors(E_rows, C, cfg, gathered=vocab_order is not None)
                E_desc, C_desc, descriptors = triton_operands
                tma = descriptors and 6 * rows * cols * D >= host.tma_min_chunk_flop and not cublas
                E_arg, C_arg = (E_desc, C_desc) if tma else (E_rows, C)
                if tma and host.g_store_tma and not split and key not in G_descs:
                    G_descs[key] = block_descriptor(G, cfg.BLOCK_N, cfg.BLOCK_V // cfg.g_subtile)
                G_desc = G_descs.get(key) if tma and host.g_store_tma else None
                # cuBLAS's logits: fp32, Z_cols columns at a time into their buffer, each piece's G launched on
                # its own columns (its tiles recorded after the last piece's); else the chunk in one launch.
                pieces = range(0, cols, Z_cols) if cublas else (0,)
                kept_at = 0
                for s0 in pieces:
                    w = min(cols, s0 + Z_cols) - s0 if cublas else cols
                    Z = None
                    if cublas:
                        Z = Z_buf[: rows * w].view(rows, w)
                        fp32_product(Z, E_rows, C[v0 + s0:v0 + s0 + w].T, alpha=1.0, accumulate=False, mode=mode)
                    piece_tiles = triton.cdiv(rows, cfg.BLOCK_N) * triton.cdiv(w, cfg.BLOCK_V)
                    gradient_chunk_kernel[(min(piece_tiles, persistent * programs) if persistent else piece_tiles,)](
                        E_arg, C_arg, x[n0:n1], lse[n0:n1], coef, bias if bias is not None else lse,
                        vocab_order if vocab_order is not None else tile_kept,
                        G[:, s0:] if G_desc is None else G_desc, G_exact[:, s0:],
                        tile_kept[kept_at:] if filtering or pingpong else tile_kept,
                        rows, V, D, v0 + s0, w,
                        E_rows.stride(0), E_rows.stride(1), C.stride(0), C.stride(1), x.stride(0),
                        G.stride(0), G.stride(1), coef.stride(0),
                        o.softcap if o.softcap is not None else 1.0, tile_eps(o.filter_eps, cfg.BLOCK_V),
                        HAS_SOFTCAP=o.softcap is not None,
                        HAS_BIAS=bias is not None,
                        FILTER=filtering,
                        SPLIT_G=split,
                        SORTED=vocab_order is not None,
                        DOT_PRECISION=dot_precision(dtype, cfg), enable_fp_fusion=fp_fusion(dtype),
                        E_DESC=tma, G_DESC=G_desc is not None, G_SUBTILE=cfg.g_subtile, PERSISTENT=persistent > 0,
                        inv_temperature=1.0 / o.temperature, ENTROPY=up.coef.shape[0] > 3,
                        class_weight_ptr=class_weight, CLASS_WEIGHTS=class_weight is not None,
                        z_ptr=Z, stride_zn=w, Z_GIVEN=cublas,
                        # a piece's tiles across start at its first column's (pieces are whole tiles)
                        row_sums_ptr=sums_buf[s0 // cfg.BLOCK_V * rows:] if sums_buf is not None else None,
                        ROW_SUMS=sums_buf is not None,
                        **cfg.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D", "GROUP_N"), **cfg.launch,
                    )
                    kept_at += piece_tiles
            counters["tiles"] += tiles
            if row_sums is not None:
                row_sums[n0:n1] += sums_buf[: sums_across * rows].view(sums_across, rows).sum(0)
            if counting:
                skipped += (tile_kept[:tiles] == 0).sum()
                dead_chunks += (tile_kept[:tiles] == 0).all()
            G_dE = G_exact if o.full_e else G  # FullE: dE exact; FullC: dC (and db) exact
            G_dC = G_exact if o.full_c else G
            where = vocab_order[v0:v1] if vocab_order is not None else slice(v0, v1)
            if need_dE:
                C_c = (torch.index_select(C, 0, where, out=C_sorted_buf[:cols]) if vocab_order is not None
                       else C[v0:v1])  # (V_c, D)
                # 2. dE_acc (+)= G_c C_c: (rows, V_c) @ (V_c, D), fp32 output (set by the row chunk's first).
                fp32_product(dE_rows, G_dE, C_c, alpha=1.0, accumulate=k > 0, mode=mode)
            if need_db:
                # db[v0:v1] += G_c^T w_rel: (V_c, rows) @ (rows, 1), fp32; times w_scale at the end.
                db_rows = db_rows_buf[:cols]
                fp32_product(db_rows, G_dC.T, w_op, alpha=1.0, accumulate=False, mode=mode)
                db_acc.index_add_(0, where if vocab_order is not None else torch.arange(v0, v1, device=device),
                                  db_rows[:, 0])
            if not need_dC:
                continue
            if alpha is None:
                alpha = w_scale()
            # 3. dC[v0:v1] = alpha G_c^T E_op: (V_c, rows) @ (rows, D).
            if not staged:
                # In place from cuBLAS's fp32 sum: written once in the dtype (one row chunk), or
                # accumulated in fp32 (fp32 inputs) across row chunks.
                dC_rows = dC[v0:v1]  # one view as input and output: addmm updates it in place
                torch.addmm(dC_rows, G_dC.T, E_op, beta=0.0 if chunk == 0 else 1.0, alpha=alpha, out=dC_rows)
                continue
            for s0 in range(0, cols, staged_rows):  # (V_c, D) fp32, a piece at a time, then folded
                s1 = min(cols, s0 + staged_rows)
                dC_rows = dC_rows_buf[: s1 - s0]
                fp32_product(dC_rows, G_dC[:, s0:s1].T, E_op, alpha=alpha, accumulate=False, mode=mode)
                piece = where[s0:s1] if vocab_order is not None else slice(v0 + s0, v0 + s1)
                if low_precision:
                    fold_dC(dC, dC_rows, piece, chunk == 0, compensation)
                elif chunk == 0:
                    dC.index_copy_(0, piece, dC_rows)
                else:
                    dC.index_add_(0, piece, dC_rows)
        # 4. dE = w dE_acc, rounded once (fp32: scaled in place); or the caller's end (``finish``).
        if finish is not None:
            finish(n0, n1, dE_rows, dE[n0:n1])
        elif need_dE and low_precision:
            torch.mul(dE_rows, up.w[n0:n1, None], out=dE[n0:n1])
        elif need_dE:
            dE_rows.mul_(up.w[n0:n1, None])

    if stats is not None:
        stats.update(counters, skipped=int(skipped.item()) if counting else 0,
                     dead_chunks=int(dead_chunks.item()) if counting else 0, products=mode)
    db = (db_acc * up.w_scale).to(bias.dtype) if need_db else None
    return dE, dC, db
