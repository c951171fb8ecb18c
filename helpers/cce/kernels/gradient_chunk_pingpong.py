"""The "gemm" backward's G kernel on Hopper, warp-specialized: one producer warp, two consumers taking turns.

What it computes is ``gradient_chunk.py``'s ``gradient_chunk_kernel`` for one vocabulary chunk, with the
same arithmetic (``gradient_tile``'s formula) and the same bits with the filter off; it replaces that
kernel for 16-bit chunks on sm_90 without a soft cap or a bias (``pingpong_reason`` says when it does
not apply; the persistent Triton kernel runs the rest). A soft cap or a bias keeps a second (64, 256)
fp32 tile alive through the epilogue (tanh of the logits, or the bias's columns), which spills the
consumers' registers (204 and 516 bytes with Triton 3.9's sm_90 compile): those run the Triton kernel.

Why. The Triton G kernel, persistent, runs each tile's epilogue (exp, the filter's row sums, a 32-64 KB
store of G) after its products in the same warps, and Triton 3.6 does not generate a warp-specialized
schedule for this loop on sm_90; two programs per SM were slower. On an H200 it made one chunk's
products at 540 TFLOP/s at the Qwen3 head (D = 1,024), where the epilogue is the larger share, and
687 at the Gemma-2-2B head (D = 2,304). This kernel is the "ping-pong" schedule (CUTLASS's name)
written in Gluon (``triton.experimental.gluon``, Triton >= 3.5): per SM, one producer warp issues the
copy engine's loads of E's and C's blocks into a ring of STAGES buffers, and two consumer warpgroups
take the program's tiles in turn (0, 2, 4, ... and 1, 3, 5, ...), so that one's epilogue runs while
the other multiplies. Measured on one chunk on an H200 (torch 2.11, Triton 3.6; raw file
``docs/measurements/h200-2026-12-02-gluon/``): 0.849 against 0.901 ms at the Gemma-2-2B head (16,384
columns), 0.423 against 0.509 ms at the Qwen3 head (N = 16,384, 8,192 columns), the same bits.

The two consumers take the ring in turn as well (a pair of "turn" barriers): a consumer waits for its
blocks only once the other has waited for all of its tile's, so the ring is read in the order it is
filled. Without that, the second consumer's first wait (ring step k_steps) would match the phase
parity of an earlier step's load and read the other's blocks (``ring_protocol_check`` plays the
protocol out in Python and finds exactly that without the turns). Each consumer makes a (64, 256)
tile: 128 fp32 accumulator registers a thread. The filter keeps its 256 columns: a 64-row tile is
skipped where every one of its rows holds less than eps of |G| mass, the same per-row bound as the
Triton kernel's 128-row tiles (finer tiles skip a little more of the same kind of tile).

Memory: a ring of 4 x (64 + 256) x 64 x 2 B = 160 KB and two 32 KB G buffers, 224 KB of the 227 KB
an H200 block may have; 168 registers a thread (``MAXNREG``), the consumers given 232 and the
producer 24 by ``setmaxnreg``. Gluon kernels do not run under the Triton interpreter: the CPU tests
compile this one for sm_90 (``compile_for_sm90``) and check its barrier protocol; the GPU tests
compare its G with the Triton kernel's bit for bit (``scripts/gpu/cce_check.py``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

try:  # Gluon: Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_ERROR = None
except ImportError as error:  # an older Triton: the Triton kernel runs everywhere
    GLUON_ERROR = f"this Triton ({triton.__version__}) has no Gluon ({error})"

BLOCK_N, BLOCK_V, BLOCK_D = 64, 256, 64  # one consumer's tile; the ring's blocks
STAGES = 4  # ring depth: 4 x (64 + 256) x 64 x 2 B = 160 KB, plus two 32 KB G buffers
MAXNREG = 168  # 168 x 12 warps x 32 <= 64 K registers: what the partitions' budgets share

if GLUON_ERROR is None:
    # The copy engine's load and store: Triton 3.6 names them async_copy_*; later releases renamed
    # them async_load / async_store and made the old names errors.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    GROUP_N = gl.constexpr(16)  # row blocks taking turns over a C strip (L2 reuse): 1,024 rows, as the Triton kernel's
    CONSUMER_REGS, PRODUCER_REGS = gl.constexpr(232), gl.constexpr(24)  # per thread, set by setmaxnreg

    @gluon.jit
    def _tile_coords(tile, N, v_count, BN: gl.constexpr, BV: gl.constexpr, GN: gl.constexpr):
        """(first row, first column of the chunk) of ``tile`` in grouped order (Triton tutorial 03):
        ``helpers.cce.kernels.gradient_tile.grouped_tile``'s, repeated because Gluon cannot call
        Triton's jit functions."""
        num_n = gl.cdiv(N, BN)
        num_v = gl.cdiv(v_count, BV)
        in_group = GN * num_v
        first_n = (tile // in_group) * GN
        size = gl.minimum(num_n - first_n, GN)
        pid_n = first_n + (tile % in_group) % size
        pid_v = (tile % in_group) // size
        return pid_n * BN, pid_v * BV

    @gluon.jit
    def ring_products(e_bufs, c_bufs, ready, empty, turn, j, k_steps, acc, WHICH: gl.constexpr):
        """Consumer WHICH's products of its j-th tile of the program (j = WHICH, WHICH + 2, ...): its
        turn at the ring, acc += E_rows C_cols^T over the tile's k_steps ring steps, each step's
        buffers given back to the producer, then the turn handed over; returns acc complete. The one
        place the ring's consumer protocol lives (``ring_protocol_check`` models it); the forward's
        kernel (``lse_forward_pingpong.py``) calls it too."""
        S: gl.constexpr = e_bufs.type.shape[0]
        # This consumer's turn: consumer 0 goes first (a fresh barrier passes phase parity 1), then
        # each waits for the other's (j // 2)-th hand-over.
        mbarrier.wait(turn.index(WHICH), ((j // 2) & 1) ^ (1 - WHICH))
        # The ring's blocks of this tile, products in flight one behind.
        it = j * k_steps
        for k in range(k_steps):
            s = (it + k) % S
            mbarrier.wait(ready.index(s), ((it + k) // S) & 1)
            acc = warpgroup_mma(e_bufs.index(s), c_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if k > 0:  # the product of step k - 1 is done: its buffers go back to the producer
                mbarrier.arrive(empty.index((it + k - 1) % S), count=1)
        # Every block of this tile waited for: the other consumer's turn (its products queue
        # behind this one's last; this one's epilogue runs under them).
        mbarrier.arrive(turn.index(1 - WHICH), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((it + k_steps - 1) % S), count=1)
        return acc

    @gluon.jit
    def _producer(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr, sums_ptr,
                  N, V, D, v_begin, v_count, stride_x, stride_coef, eps, row_sums):
        """One warp: the copy engine's loads of every tile's E and C blocks, in tile then D order."""
        e_bufs, c_bufs, g_bufs = bufs
        ready, empty, turn = bars
        S: gl.constexpr = e_bufs.type.shape[0]
        BN: gl.constexpr = E_desc.block_type.shape[0]
        BD: gl.constexpr = E_desc.block_type.shape[1]
        BV: gl.constexpr = C_desc.block_type.shape[0]
        tiles = gl.cdiv(N, BN) * gl.cdiv(v_count, BV)
        k_steps = gl.cdiv(D, BD)
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        it = 0
        for tile in range(pid, tiles, programs):
            row0, col0 = _tile_coords(tile, N, v_count, BN, BV, GROUP_N)
            for k in range(k_steps):
                s = it % S
                mbarrier.wait(empty.index(s), ((it // S) & 1) ^ 1)  # a fresh barrier passes phase 1
                mbarrier.expect(ready.index(s), E_desc.block_type.nbytes + C_desc.block_type.nbytes)
                tma_load(E_desc, [row0, k * BD], ready.index(s), e_bufs.index(s))
                tma_load(C_desc, [v_begin + col0, k * BD], ready.index(s), c_bufs.index(s))
                it += 1

    @gluon.jit
    def _consumer(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr, sums_ptr,
                  N, V, D, v_begin, v_count, stride_x, stride_coef, eps, row_sums, WHICH: gl.constexpr):
        """One warpgroup: the products of this program's tiles WHICH, WHICH + 2, ..., then their G."""
        e_bufs, c_bufs, g_bufs = bufs
        ready, empty, turn = bars
        BN: gl.constexpr = E_desc.block_type.shape[0]
        BD: gl.constexpr = E_desc.block_type.shape[1]
        BV: gl.constexpr = C_desc.block_type.shape[0]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BV, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma)
        g_buf = g_bufs.index(WHICH)
        tiles = gl.cdiv(N, BN) * gl.cdiv(v_count, BV)
        k_steps = gl.cdiv(D, BD)
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        j = WHICH  # this program's tile count: the tile's steps in the ring are j k_steps, ...
        for tile in range(pid + WHICH * programs, tiles, 2 * programs):
            row0, col0 = _tile_coords(tile, N, v_count, BN, BV, GROUP_N)
            # 0-1. z = E_rows C_cols^T, this consumer's turn at the ring.
            acc = ring_products(e_bufs, c_bufs, ready, empty, turn, j, k_steps,
                                gl.zeros((BN, BV), dtype=gl.float32, layout=mma), WHICH)

            # 2. G = a S - c / V off the target, t - c / V on it (t from the host: ``gradient_tile``'s
            # module doc), S = exp(z - lse), 0 in padding: ``gradient_tile``'s formula, operation for operation.
            rows = row0 + gl.arange(0, BN, layout=row_layout)
            row_mask = rows < N
            local_v = col0 + gl.arange(0, BV, layout=col_layout)
            col_mask = local_v < v_count
            lse = gl.load(lse_ptr + rows, mask=row_mask, other=0.0)
            a = gl.load(coef_ptr + rows, mask=row_mask, other=0.0)
            t_x = gl.load(coef_ptr + stride_coef + rows, mask=row_mask, other=0.0)
            c = gl.load(coef_ptr + 2 * stride_coef + rows, mask=row_mask, other=0.0)
            x = gl.load(x_ptr + rows * stride_x, mask=row_mask, other=-1)
            x = gl.where((x >= 0) & (x < V), x, -1).to(gl.int32)
            S_tile = gl.exp(acc - gl.expand_dims(lse, 1))
            is_target = gl.expand_dims(x, 1) == gl.expand_dims(v_begin + local_v, 0)
            G = gl.where(is_target, gl.expand_dims(t_x, 1), gl.expand_dims(a, 1) * S_tile) - gl.expand_dims(c / V, 1)
            G = gl.where(gl.expand_dims(col_mask, 0), G, 0.0)

            # 3. The filter: a tile whose rows each hold less than eps of |G| mass is written as
            # zeros (eps = 0: every tile kept).
            row_mass = gl.sum(gl.abs(G), axis=1)
            kept = gl.max(row_mass, axis=0) >= eps
            gl.store(kept_ptr + (row0 // BN) * gl.cdiv(v_count, BV) + col0 // BV, kept.to(gl.int8))
            if row_sums != 0:  # each row's |G| mass in the tile, (tiles across, N) (``gradient_chunk_kernel``'s ROW_SUMS)
                gl.store(sums_ptr + (col0 // BV) * N + rows, row_mass, mask=row_mask)
            G = gl.where(kept, G, 0.0)

            # 4. G through this consumer's buffer and the copy engine (clipped to the chunk's
            # bounds); the previous store must have left the buffer first.
            tma.store_wait(pendings=0)
            g_buf.store(G.to(G_desc.dtype))
            fence_async_shared()
            tma_store(G_desc, [row0, col0], g_buf)
            j += 2
        tma.store_wait(pendings=0)

    @gluon.jit
    def _consumer_even(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr, sums_ptr,
                       N, V, D, v_begin, v_count, stride_x, stride_coef, eps, row_sums):
        _consumer(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr, sums_ptr,
                  N, V, D, v_begin, v_count, stride_x, stride_coef, eps, row_sums, 0)

    @gluon.jit
    def _consumer_odd(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr, sums_ptr,
                      N, V, D, v_begin, v_count, stride_x, stride_coef, eps, row_sums):
        _consumer(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr, sums_ptr,
                  N, V, D, v_begin, v_count, stride_x, stride_coef, eps, row_sums, 1)

    @gluon.jit
    def gradient_chunk_pingpong_kernel(
        # descriptors: E (N, D) in (BLOCK_N, BLOCK_D) blocks, C (V, D) in (BLOCK_V, BLOCK_D), G (N, v_count)
        # in (BLOCK_N, BLOCK_V)
        E_desc, C_desc, G_desc,
        # pointers: x (N,) targets, lse (N,) fp32, coef (3, stride_coef) fp32 rows a, t, c,
        # kept (N / BLOCK_N, v_count / BLOCK_V) int8 (0: the filter skipped the tile)
        x_ptr, lse_ptr, coef_ptr, kept_ptr, sums_ptr,
        # sizes: this launch covers vocabulary positions [v_begin, v_begin + v_count)
        N, V, D, v_begin, v_count,
        stride_x, stride_coef,
        eps,
        row_sums,  # 1: each tile's row masses to sums_ptr, (v_count / BLOCK_V, N) fp32 (``gradient_chunk_kernel``'s ROW_SUMS); 0: none
        STAGES_: gl.constexpr, num_warps: gl.constexpr,
    ):
        e_bufs = gl.allocate_shared_memory(E_desc.dtype, [STAGES_] + E_desc.block_type.shape, E_desc.layout)
        c_bufs = gl.allocate_shared_memory(C_desc.dtype, [STAGES_] + C_desc.block_type.shape, C_desc.layout)
        g_bufs = gl.allocate_shared_memory(G_desc.dtype, [2] + G_desc.block_type.shape, G_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # consumer 0's, 1's
        for i in gl.static_range(STAGES_):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        args = (E_desc, C_desc, G_desc, (e_bufs, c_bufs, g_bufs), (ready, empty, turn), x_ptr, lse_ptr, coef_ptr,
                kept_ptr, sums_ptr, N, V, D, v_begin, v_count, stride_x, stride_coef, eps, row_sums)
        gl.warp_specialize([
            (_consumer_even, args),
            (_consumer_odd, args),
            (_producer, args),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


def pingpong_descriptor(t: torch.Tensor, rows: int, cols: int):
    """A Gluon tensor descriptor of ``t`` (2-D, 16-bit) in (rows, cols) blocks, in the shared-memory
    layout the kernel's products read."""
    return TensorDescriptor.from_tensor(t, [rows, cols], _shared_layout(rows, cols, t.dtype))


@functools.cache
def _shared_layout(rows: int, cols: int, dtype: torch.dtype):
    """The layout of a (rows, cols) block of ``dtype``, made once (Gluon's constructor costs ~20 us
    of Python, paid on every launch before)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], _gl_dtype(dtype))


def pingpong_reason(device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None, *,
                    sorted_vocab: bool, split: bool, softcap: bool, bias: bool) -> str | None:
    """Why this kernel cannot make a chunk's G (None: it can): it needs Gluon, an sm_90 GPU (its
    products are Hopper's warpgroup MMA; Blackwell has another instruction), 16-bit inputs, C's rows
    in order (the copy engine reads boxes, not gathered rows), one G (no FullC/FullE split), and no
    soft cap or bias. The
    operands' alignment is checked per chunk (``helpers.cce.descriptors.tma_ready``)."""
    if GLUON_ERROR:
        return GLUON_ERROR
    if device.type != "cuda" or capability != (9, 0):
        return f"it is written for sm_90 (Hopper), not {device.type} {capability}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it takes 16-bit inputs, not {dtype}"
    if sorted_vocab:
        return "the sorted vocabulary gathers C's rows, which the copy engine cannot"
    if split:
        return "FullC / FullE with the filter need the unfiltered G as well"
    if softcap or bias:
        return "a soft cap or a bias would spill its registers (this file's docstring)"
    return None


def launch_gradient_chunk_pingpong(E_desc, C_desc, G_desc, x, lse, coef, kept, rows: int, V: int, D: int,
                                   v_begin: int, v_count: int, eps: float, programs: int,
                                   row_sums: torch.Tensor | None = None) -> int:
    """One chunk's G through the kernel, ``programs`` programs at most; returns its tile count
    (the entries of ``kept`` it wrote). ``row_sums``: None, or (at least v_count / BLOCK_V x rows,) fp32
    that gets each tile's row masses (``gradient_chunk_kernel``'s ROW_SUMS)."""
    tiles = triton.cdiv(rows, BLOCK_N) * triton.cdiv(v_count, BLOCK_V)
    if kept.numel() < tiles:  # the kernel writes every tile's record: a short buffer would be overrun
        raise ValueError(f"kept holds {kept.numel()} tile records, the chunk has {tiles} tiles of {BLOCK_N} x {BLOCK_V}")
    if row_sums is not None and row_sums.numel() < triton.cdiv(v_count, BLOCK_V) * rows:
        raise ValueError(f"row_sums holds {row_sums.numel()} values, the chunk has {triton.cdiv(v_count, BLOCK_V)} "
                         f"tiles across {rows} rows")
    gradient_chunk_pingpong_kernel[(min(tiles, programs),)](
        E_desc, C_desc, G_desc, x, lse, coef, kept, row_sums if row_sums is not None else lse, rows, V, D, v_begin,
        v_count, x.stride(0), coef.stride(0), eps, int(row_sums is not None), STAGES, num_warps=4, maxnreg=MAXNREG)
    return tiles


def ring_protocol_check(tiles: int, k_steps: int, stages: int, seed: int, turns: bool = True) -> str | None:
    """The kernel's barrier protocol played out in Python, one program's walk: None when every
    product reads the blocks of its own ring step and the walk ends, else what went wrong.

    It models what the GPU leaves open: the partitions interleave in any order (``seed`` picks
    one), the copy engine's loads land in any order and any time after their issue, and a product
    reads its blocks at any time until the wait that retires it. An mbarrier (count 1) completes a
    phase per arrival (a load's landing, for ``ready``); ``wait(bar, p)`` passes once the barrier's
    current phase parity differs from p (so a fresh barrier passes p = 1). The index and parity
    formulas are the kernel's: keep the two in step. ``turns=False`` drops the turn barriers, the
    schedule this kernel first had, to show what they prevent."""
    import random

    rng = random.Random(seed)
    phases = {}  # barrier -> completed phases
    ring = [None] * stages  # the ring step whose blocks each stage holds
    landing = []  # (stage, step) of loads issued, not landed
    reading = {}  # step -> stage, products issued and not retired

    def arrive(bar):
        phases[bar] = phases.get(bar, 0) + 1

    def passes(bar, parity):
        return phases.get(bar, 0) & 1 != parity

    def producer():
        it = 0
        for _ in range(tiles):
            for _ in range(k_steps):
                s = it % stages
                yield ("empty", s), ((it // stages) & 1) ^ 1
                landing.append((s, it))
                it += 1

    def retire(step):  # a product's wait returned: it read its blocks throughout
        s = reading.pop(step)
        if ring[s] != step:
            raise AssertionError(f"the product of step {step} read stage {s} holding step {ring[s]}")
        arrive(("empty", s))

    def consumer(which):
        j = which
        for _ in range(which, tiles, 2):
            if turns:
                yield ("turn", which), ((j // 2) & 1) ^ (1 - which)
            it = j * k_steps
            for k in range(k_steps):
                s = (it + k) % stages
                yield ("ready", s), ((it + k) // stages) & 1
                if ring[s] != it + k:
                    raise AssertionError(f"consumer {which} found stage {s} holding step {ring[s]}, not {it + k}")
                reading[it + k] = s
                if k > 0:
                    retire(it + k - 1)
            if turns:
                arrive(("turn", 1 - which))
            retire(it + k_steps - 1)
            j += 2

    actors = {name: (gen, None) for name, gen in (("producer", producer()), ("consumer 0", consumer(0)),
                                                   ("consumer 1", consumer(1)))}
    try:
        for name in list(actors):  # each runs to its first wait
            actors[name] = (actors[name][0], next(actors[name][0], None))
        while any(w is not None for _, w in actors.values()) or landing:
            moves = [name for name, (_, w) in actors.items() if w is not None and passes(*w)]
            moves += ["land"] * bool(landing)
            if not moves:
                return "deadlock: " + ", ".join(f"{n} waits on {w}" for n, (_, w) in actors.items() if w)
            move = rng.choice(moves)
            if move == "land":
                s, step = landing.pop(rng.randrange(len(landing)))
                if any(stage == s for stage in reading.values()):
                    return f"the load of step {step} overwrote stage {s} under a product"
                ring[s] = step
                arrive(("ready", s))
            else:
                gen, _ = actors[move]
                actors[move] = (gen, next(gen, None))
    except AssertionError as error:
        return str(error)
    return None


def check_ring_protocol() -> dict:
    """``ring_protocol_check`` over tile counts, D steps, ring depths and interleavings, with the
    turn barriers (must all pass) and without (must fail somewhere: the check can fail)."""
    cases = [(tiles, k_steps, stages, seed) for tiles in (1, 2, 3, 5, 8) for k_steps in (1, 2, 3, 5, 16, 36)
             for stages in (2, 3, 4) for seed in range(6)]
    failures = [(c, why) for c in cases if (why := ring_protocol_check(*c))]
    without = sum(ring_protocol_check(*c, turns=False) is not None for c in cases)
    return {"status": "ok" if not failures and without else "error", "cases": len(cases),
            "failures": failures[:5], "failing_without_turns": without}


def compile_for_sm90() -> dict:
    """Compile the kernel for sm_90 with this machine's Triton (no GPU needed): shared memory,
    registers and spills from ptxas, or the error."""
    from triton.runtime.jit import mangle_type

    if GLUON_ERROR:
        return {"status": "error", "triton": triton.__version__, "error": GLUON_ERROR}
    # A descriptor's type names its dtype, block and layout, not its tensor's shape: small CPU
    # tensors stand in for E, C and G.
    small = torch.empty(BLOCK_V, BLOCK_V, dtype=torch.bfloat16)
    blocks = {"E_desc": (BLOCK_N, BLOCK_D), "C_desc": (BLOCK_V, BLOCK_D), "G_desc": (BLOCK_N, BLOCK_V)}
    sig = {name: mangle_type(pingpong_descriptor(small, *block)) for name, block in blocks.items()}
    sig.update(x_ptr="*i64", lse_ptr="*fp32", coef_ptr="*fp32", kept_ptr="*i8", sums_ptr="*fp32", N="i32",
               V="i32", D="i32", v_begin="i32", v_count="i32", stride_x="i32", stride_coef="i32",
               eps="fp32", row_sums="i32", STAGES_="constexpr",
               num_warps="constexpr")
    return compile_gluon_sm90(gradient_chunk_pingpong_kernel, sig, {"STAGES_": STAGES, "num_warps": 4})


def compile_gluon_sm90(kernel, signature: dict, constexprs: dict) -> dict:
    """Compile a Gluon ``kernel`` for sm_90 at ``MAXNREG`` registers (no GPU needed): its shared memory,
    ptxas's registers and spills, and the Hopper instructions it uses (warpgroup MMA, the copy engine,
    register reallocation), or the error."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        compiled = triton.compile(
            gluon._runtime.GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": constexprs.get("num_warps", 4), "maxnreg": MAXNREG})
    except Exception as error:  # noqa: BLE001 (reported, not raised: the caller decides)
        while error.__cause__ or error.__context__:  # the innermost error says what went wrong
            error = error.__cause__ or error.__context__
        return {"status": "error", "triton": triton.__version__, "error": f"{type(error).__name__}: {str(error)[-3000:]}"}
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", path + ".cubin"],
                             capture_output=True, text=True)
    return {"status": "ok", "triton": triton.__version__, "shared_bytes": compiled.metadata.shared,
            "ptxas": re.findall(r"Used \d+ registers|\d+ bytes spill stores", out.stderr),
            "wgmma": ptx.count("wgmma.mma_async"), "tma": ptx.count("cp.async.bulk.tensor"),
            "setmaxnreg": ptx.count("setmaxnreg")}
