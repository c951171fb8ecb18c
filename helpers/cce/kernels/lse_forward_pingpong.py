"""Algorithm 2 (the lse of every row) on Hopper, warp-specialized: the G kernel's ping-pong for the forward.

The Hopper tier's forward where D <= ``HostTuning.lse_pingpong_max_d`` (``helpers.cce.forward.lse_pingpong_reason``
says where it applies). What it computes is ``lse_forward_kernel``'s plain case (no bias, soft cap,
temperature, label smoothing, bits or row statistics): per row block and vocabulary split,
lse = log sum_v exp(z_v) over the split's columns, as a running (max m, sum s).

Why. The Triton forward runs each tile's epilogue (exp, a row max and a row sum over 256 columns)
after its products in the same warps: at the Qwen3 head (D = 1,024, 16 steps of D a tile) 599
TFLOP/s with 16k tokens on an H200. The Hopper G kernel
(``gradient_chunk_pingpong.py``) hid a heavier epilogue (G formed and stored) behind the other
consumer's products and reached 729 TFLOP/s at that head. This kernel is the same schedule with the
same ring and barrier protocol (``gradient_chunk_pingpong.ring_protocol_check`` holds for it: the
producer walks a program's tiles in order, the consumers take them in turn), only the epilogue differs:

    z' = z log2(e),  m' = max(m, max_v z'),  s' = s 2^(m - m') + sum_v 2^(z' - m'),  lse = (m + log2 s) / log2(e)

and, given the targets x, the non-target mass u (``lse_forward_kernel``'s NONTARGET in its plain walk: the
running sum leaves the target's column out, one compare and select per logit; the consumer that holds
the target's tile adds 2^(z_x' - m) from Algorithm 1's z_x at the end), written as (m + log2 u) / log2(e)
into a second output of the same shape.

Each program owns one (row block of 64 rows, vocabulary split) pair; its two consumers take its tiles
in turn, so each ends with the (m, s) of half the split's tiles and writes its own partial lse:
(2 x SPLITS, N) partials, merged by a logsumexp as the Triton forward's splits are. A consumer given no
tile (a split of one tile) writes -inf, which the merge ignores. Columns past V (the copy engine reads
zeros there) are set to -inf before the row max.

Measured on an H200 (``scripts/experiments/gluon_forward.py``, ``docs/measurements/h200-2026-12-03g``,
bf16, the lse alone against the Triton forward's splits): Qwen3 head 0.636 -> 0.469 ms with 1k tokens,
8.51 -> 7.53 ms (599 -> 677 TFLOP/s) with 16k, 33.4 -> 31.1 ms with 65k; the Gemma-2-2B head
(D = 2,304) 13.95 -> 14.12 ms, where 36 steps of D a tile already hide the Triton kernel's epilogue
(hence the tier's limit on D). Its lse is within the Triton kernel's error against float64 (4.7e-6 to
1.0e-5 at lse ~ 12), not the same bits: the sums run in another order and base 2.

Memory: a ring of STAGES x (64 + 256) x 64 x 2 B (5 stages: 200 KB; no G buffers; 4 stages measured
1-5% slower at D = 1,024), 168 registers a thread, the consumers given 232 by ``setmaxnreg``. Like the
G kernel it does not run under the interpreter: the CPU tests compile it for sm_90.
"""

from __future__ import annotations

import torch
import triton

from helpers.cce.device import device_info
from helpers.cce.kernels.gradient_chunk_pingpong import GLUON_ERROR, MAXNREG, compile_gluon_sm90, pingpong_descriptor

BLOCK_N, BLOCK_V, BLOCK_D = 64, 256, 64  # one consumer's tile; the ring's blocks (the G kernel's)
STAGES = 5  # 5 x (64 + 256) x 64 x 2 B = 200 KB of shared memory

if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from helpers.cce.kernels.gradient_chunk_pingpong import ring_products

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # Triton 3.6's name
    CONSUMER_REGS, PRODUCER_REGS = gl.constexpr(232), gl.constexpr(24)
    LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _program_tiles(N, V, tiles_per_split, n_blocks, BN: gl.constexpr, BV: gl.constexpr,
                       SPLIT_FASTEST: gl.constexpr):
        """(first row, first column, tiles) of this program's (row block, split); SPLIT_FASTEST: the
        programs launched together are one row block's splits (they share its rows of E in L2), else
        one split's row blocks (they share its rows of C)."""
        pid = gl.program_id(0)
        splits = gl.num_programs(0) // n_blocks
        if SPLIT_FASTEST:
            block, split = pid // splits, pid % splits
        else:
            block, split = pid % n_blocks, pid // n_blocks
        v_tiles = gl.cdiv(V, BV)
        first_tile = split * tiles_per_split
        tiles = gl.maximum(gl.minimum(tiles_per_split, v_tiles - first_tile), 0)
        return block * BN, first_tile * BV, tiles

    @gluon.jit
    def _producer(E_desc, C_desc, out_ptr, x_ptr, nontarget_ptr, target_logit_ptr, ignore_index, tile_flags_ptr,
                  bufs, bars, N, V, D, tiles_per_split, n_blocks, SPLIT_FASTEST: gl.constexpr,
                  TILE_FLAGS: gl.constexpr):
        """One warp: the copy engine's loads of every tile's E and C blocks, in tile then D order."""
        e_bufs, c_bufs = bufs
        ready, empty, turn = bars
        S: gl.constexpr = e_bufs.type.shape[0]
        BN: gl.constexpr = E_desc.block_type.shape[0]
        BD: gl.constexpr = E_desc.block_type.shape[1]
        BV: gl.constexpr = C_desc.block_type.shape[0]
        row0, col0, tiles = _program_tiles(N, V, tiles_per_split, n_blocks, BN, BV, SPLIT_FASTEST)
        k_steps = gl.cdiv(D, BD)
        it = 0
        for t in range(tiles):
            for k in range(k_steps):
                s = it % S
                mbarrier.wait(empty.index(s), ((it // S) & 1) ^ 1)  # a fresh barrier passes phase 1
                mbarrier.expect(ready.index(s), E_desc.block_type.nbytes + C_desc.block_type.nbytes)
                tma_load(E_desc, [row0, k * BD], ready.index(s), e_bufs.index(s))
                tma_load(C_desc, [col0 + t * BV, k * BD], ready.index(s), c_bufs.index(s))
                it += 1

    @gluon.jit
    def _consumer(E_desc, C_desc, out_ptr, x_ptr, nontarget_ptr, target_logit_ptr, ignore_index, tile_flags_ptr,
                  bufs, bars, N, V, D, tiles_per_split, n_blocks, SPLIT_FASTEST: gl.constexpr,
                  TILE_FLAGS: gl.constexpr, WHICH: gl.constexpr):
        """One warpgroup: the products of this program's tiles WHICH, WHICH + 2, ..., folded into its
        running (m, s, u); then its partial lse and non-target lse."""
        e_bufs, c_bufs = bufs
        ready, empty, turn = bars
        BN: gl.constexpr = E_desc.block_type.shape[0]
        BD: gl.constexpr = E_desc.block_type.shape[1]
        BV: gl.constexpr = C_desc.block_type.shape[0]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BV, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma)
        row0, col0, tiles = _program_tiles(N, V, tiles_per_split, n_blocks, BN, BV, SPLIT_FASTEST)
        k_steps = gl.cdiv(D, BD)
        m = gl.full((BN,), float("-inf"), gl.float32, layout=row_layout)
        u_sum = gl.zeros((BN,), gl.float32, layout=row_layout)
        rows = row0 + gl.arange(0, BN, layout=row_layout)
        # The targets in int32 (a valid one is below V < 2^31; anything else matches no column).
        x = gl.load(x_ptr + rows, mask=rows < N, other=-1)
        x = gl.where((x >= 0) & (x < V) & (x != ignore_index), x, -1).to(gl.int32)
        for j in range(WHICH, tiles, 2):
            # 0. The tile's products, this consumer's turn at the ring (the G kernel's protocol).
            acc = ring_products(e_bufs, c_bufs, ready, empty, turn, j, k_steps,
                                gl.zeros((BN, BV), dtype=gl.float32, layout=mma), WHICH)
            # 1. The online log-sum-exp in base 2, columns past V out of it.
            cols = col0 + j * BV + gl.arange(0, BV, layout=col_layout)
            z = gl.where(gl.expand_dims(cols < V, 0), acc * LOG2E, float("-inf"))
            m_new = gl.maximum(m, gl.max(z, axis=1))
            p = gl.exp2(z - gl.expand_dims(m_new, 1))
            alpha = gl.exp2(m - m_new)
            # The target's column out (only in the tiles Algorithm 1's launch flagged, with TILE_FLAGS).
            if TILE_FLAGS:
                if gl.load(tile_flags_ptr + (row0 // BN) * gl.cdiv(V, BV) + col0 // BV + j) != 0:
                    p = gl.where(gl.expand_dims(cols, 0) != gl.expand_dims(x, 1), p, 0.0)
            else:
                p = gl.where(gl.expand_dims(cols, 0) != gl.expand_dims(x, 1), p, 0.0)
            u_sum = u_sum * alpha + gl.sum(p, axis=1)
            m = m_new
        # 2. This consumer's partial lse and non-target lse (-inf where it had no tile: m = -inf, u = 0);
        # the target's term where the target's tile was one of this consumer's.
        local = (x - col0) // BV
        holds = (x >= col0) & (local < tiles) & (local % 2 == WHICH)
        z_x = gl.load(target_logit_ptr + rows, mask=(rows < N) & holds, other=0.0) * LOG2E
        s_sum = u_sum + gl.where(holds, gl.exp2(z_x - m), 0.0)
        split = (gl.program_id(0) % (gl.num_programs(0) // n_blocks) if SPLIT_FASTEST
                 else gl.program_id(0) // n_blocks)
        lse = (m + gl.log2(s_sum)) / LOG2E
        gl.store(out_ptr + (2 * split + WHICH) * N + rows, lse, mask=rows < N)
        gl.store(nontarget_ptr + (2 * split + WHICH) * N + rows, (m + gl.log2(u_sum)) / LOG2E, mask=rows < N)

    @gluon.jit
    def _consumer_even(E_desc, C_desc, out_ptr, x_ptr, nontarget_ptr, target_logit_ptr, ignore_index,
                       tile_flags_ptr, bufs, bars, N, V, D, tiles_per_split, n_blocks,
                       SPLIT_FASTEST: gl.constexpr, TILE_FLAGS: gl.constexpr):
        _consumer(E_desc, C_desc, out_ptr, x_ptr, nontarget_ptr, target_logit_ptr, ignore_index, tile_flags_ptr,
                  bufs, bars, N, V, D, tiles_per_split, n_blocks, SPLIT_FASTEST, TILE_FLAGS, 0)

    @gluon.jit
    def _consumer_odd(E_desc, C_desc, out_ptr, x_ptr, nontarget_ptr, target_logit_ptr, ignore_index,
                      tile_flags_ptr, bufs, bars, N, V, D, tiles_per_split, n_blocks,
                      SPLIT_FASTEST: gl.constexpr, TILE_FLAGS: gl.constexpr):
        _consumer(E_desc, C_desc, out_ptr, x_ptr, nontarget_ptr, target_logit_ptr, ignore_index, tile_flags_ptr,
                  bufs, bars, N, V, D, tiles_per_split, n_blocks, SPLIT_FASTEST, TILE_FLAGS, 1)

    @gluon.jit
    def lse_forward_pingpong_kernel(
        E_desc, C_desc,  # E (N, D) in (BLOCK_N, BLOCK_D) blocks, C (V, D) in (BLOCK_V, BLOCK_D)
        out_ptr,  # (2 x SPLITS, N) fp32: each consumer's partial lse over its tiles of a split
        x_ptr,  # (N,) int64 targets
        nontarget_ptr,  # (2 x SPLITS, N) fp32: out's partials without the target's column
        target_logit_ptr,  # (N,) fp32: Algorithm 1's z_x
        ignore_index,  # a target equal to it matches no column
        tile_flags_ptr,  # (row blocks x tiles,) int8: the (row block, tile) pairs holding a target (TILE_FLAGS)
        N, V, D, tiles_per_split, n_blocks,  # the grid is n_blocks x SPLITS programs
        STAGES_: gl.constexpr, SPLIT_FASTEST: gl.constexpr, num_warps: gl.constexpr,
        TILE_FLAGS: gl.constexpr = False,
    ):
        e_bufs = gl.allocate_shared_memory(E_desc.dtype, [STAGES_] + E_desc.block_type.shape, E_desc.layout)
        c_bufs = gl.allocate_shared_memory(C_desc.dtype, [STAGES_] + C_desc.block_type.shape, C_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES_):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        args = (E_desc, C_desc, out_ptr, x_ptr, nontarget_ptr, target_logit_ptr, ignore_index, tile_flags_ptr,
                (e_bufs, c_bufs), (ready, empty, turn), N, V, D, tiles_per_split, n_blocks, SPLIT_FASTEST, TILE_FLAGS)
        gl.warp_specialize([
            (_consumer_even, args),
            (_consumer_odd, args),
            (_producer, args),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def pingpong_splits(n_blocks: int, v_tiles: int, multiprocessors: int) -> int:
    """The fewest vocabulary splits whose n_blocks x splits programs (one a multiprocessor: the ring
    takes most of its shared memory) fill their waves to at least 95% (at most ``v_tiles``)."""
    for s in range(1, v_tiles + 1):
        programs = n_blocks * s
        if programs >= multiprocessors and programs >= 0.95 * triton.cdiv(programs, multiprocessors) * multiprocessors:
            return s
    return v_tiles


def lse_forward_pingpong(E: torch.Tensor, C: torch.Tensor, x: torch.Tensor, target_logit: torch.Tensor,
                         ignore_index: int, splits: int | None = None, *, stages: int = STAGES,
                         split_fastest: bool = False, tile_flags: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse partials, non-target partials), each (2 x splits, N) fp32: each consumer's partial lse, and
    the same without the target x's column; ``torch.logsumexp(out, 0)`` is each row's lse (its
    non-target lse). E (N, D) and C (V, D) 16-bit on an sm_90 GPU, rows 16-byte aligned (the copy
    engine's); x (N,) targets (one outside [0, V) or equal to ``ignore_index`` matches no column);
    target_logit (N,) fp32, Algorithm 1's z_x (``helpers.cce.forward``); tile_flags: Algorithm 1's flags of
    this kernel's (BLOCK_N, BLOCK_V) tiling (``helpers.cce.forward.TileFlags``), or None to mask every tile."""
    N, D = E.shape
    V = C.shape[0]
    n_blocks, v_tiles = triton.cdiv(N, BLOCK_N), triton.cdiv(V, BLOCK_V)
    if splits is None:
        splits = pingpong_splits(n_blocks, v_tiles, device_info(E.device).multiprocessors)
    tiles_per_split = triton.cdiv(v_tiles, splits)
    splits = triton.cdiv(v_tiles, tiles_per_split)
    out, nontarget = torch.empty(2, 2 * splits, N, dtype=torch.float32, device=E.device).unbind(0)
    lse_forward_pingpong_kernel[(n_blocks * splits,)](
        pingpong_descriptor(E, BLOCK_N, BLOCK_D), pingpong_descriptor(C, BLOCK_V, BLOCK_D), out,
        x.to(torch.int64).contiguous(), nontarget, target_logit, ignore_index,
        tile_flags if tile_flags is not None else out,
        N, V, D, tiles_per_split, n_blocks, stages, split_fastest, num_warps=4, maxnreg=MAXNREG,
        TILE_FLAGS=tile_flags is not None)
    return out, nontarget


def compile_for_sm90(split_fastest: bool = False) -> dict:
    """Compile the kernel for sm_90 with this machine's Triton (no GPU needed): ``compile_gluon_sm90``'s report."""
    from triton.runtime.jit import mangle_type

    if GLUON_ERROR:
        return {"status": "error", "triton": triton.__version__, "error": GLUON_ERROR}
    small = torch.empty(BLOCK_V, BLOCK_V, dtype=torch.bfloat16)
    sig = {"E_desc": mangle_type(pingpong_descriptor(small, BLOCK_N, BLOCK_D)),
           "C_desc": mangle_type(pingpong_descriptor(small, BLOCK_V, BLOCK_D)),
           "out_ptr": "*fp32", "x_ptr": "*i64", "nontarget_ptr": "*fp32", "target_logit_ptr": "*fp32",
           "ignore_index": "i32", "tile_flags_ptr": "*i8", "N": "i32", "V": "i32", "D": "i32",
           "tiles_per_split": "i32", "n_blocks": "i32", "STAGES_": "constexpr", "SPLIT_FASTEST": "constexpr",
           "num_warps": "constexpr", "TILE_FLAGS": "constexpr"}
    return compile_gluon_sm90(lse_forward_pingpong_kernel, sig,
                              {"STAGES_": STAGES, "SPLIT_FASTEST": split_fastest, "num_warps": 4, "TILE_FLAGS": True})
