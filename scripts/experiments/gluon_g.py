"""An experiment for the next design: the "gemm" backward's G kernel as a warp-specialized Gluon kernel.

    timeout 300 python scripts/experiments/gluon_g.py [--out $OUT/gluon_g.jsonl]   # on a Hopper GPU: check, then time
    python scripts/experiments/gluon_g.py --compile-only                  # any machine: compile for sm_90
    python scripts/experiments/gluon_g.py --check-protocol                # any machine: its barriers, in Python

Why (docs/PERFORMANCE.md, "What would close it", item 1, with the measured rates): the Triton G
kernel, persistent, stays well under cuBLAS's rate for the same products, the more so at the Qwen3
head (D = 1,024) than at the Gemma-2-2B head (D = 2,304), because each tile's epilogue (exp, the
filter's row sums, a 64 KB store of G) runs after its products in the same warps. Triton 3.6 does not generate a warp-specialized schedule for this loop on sm_90, and two
programs per SM were slower. This kernel is the "ping-pong" schedule written out in Gluon
(``triton.experimental.gluon``, Triton >= 3.5): per SM, one producer warp issues the copy engine's
loads of E's and C's blocks into a ring of STAGES buffers, and two consumer warpgroups take the
program's tiles in turn (0, 2, 4, ... and 1, 3, 5, ...), so that one's epilogue runs while the other
multiplies. The two take the ring in turn as well (a pair of "turn" barriers): a consumer waits
for its blocks only once the other has waited for all of its tile's, so the ring is read in the
order it is filled. Without that, the second consumer's first wait (step k_steps of the ring) would
match the phase parity of an earlier step's load and read the other's blocks. Each consumer makes
a (64, 256) tile: 128 fp32 accumulator registers a thread, and the filter keeps its 256 columns
(a 64-row tile skips where every one of its rows holds less than eps of |G| mass: the same per-row
bound as the shipped 128-row tiles).

Scope: bf16/fp16 inputs, no soft cap, no bias, no sorted vocabulary, E and C readable by the copy
engine; what the shipped kernel (``helpers/cce/kernels/gradient_chunk.py``) does for those inputs,
with the same arithmetic (``gradient_tile``'s formula). Not wired into the package: this script
checks it against the shipped kernel and times both, at the Gemma-2-2B head and the Qwen3 head
with N = 16,384, on one G chunk of each shape's widest in-place width. ``--compile-only`` compiles
it for sm_90 with this machine's Triton and prints its shared memory and registers;
``--check-protocol`` plays its barrier protocol out in Python (``ring_protocol_check``); the CPU
tests in ``tests/test_gpu_scripts.py`` run both, since Gluon kernels do not run under the Triton
interpreter. It has never run on a GPU: a barrier mistake the model does not cover would hang it,
hence the timeout (its work, two shapes' checks and 60 timed launches, should take well under a
minute).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
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

# The copy engine's load and store: Triton 3.6 (the H200's) names them async_copy_*; later releases
# renamed them async_load / async_store and made the old names errors.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

BLOCK_N, BLOCK_V, BLOCK_D = 64, 256, 64  # one consumer's tile; the ring's blocks
STAGES = 4  # ring depth: 4 x (64 + 256) x 64 x 2 B = 160 KB, plus two 32 KB G buffers
GROUP_N = gl.constexpr(16)  # row blocks taking turns over a C strip (L2 reuse): 1,024 rows, as shipped
CONSUMER_REGS, PRODUCER_REGS = gl.constexpr(232), gl.constexpr(24)  # per thread, set by setmaxnreg
MAXNREG = 168  # 168 x 12 warps x 32 <= 64 K registers: what the partitions' budgets share


@gluon.jit
def _tile_coords(tile, N, v_count, BN: gl.constexpr, BV: gl.constexpr, GN: gl.constexpr):
    """(first row, first column of the chunk) of ``tile`` in grouped order (Triton tutorial 03):
    ``helpers.cce.kernels.gradient_tile.grouped_tile``'s, repeated because Gluon cannot call Triton's
    jit functions."""
    num_n = gl.cdiv(N, BN)
    num_v = gl.cdiv(v_count, BV)
    in_group = GN * num_v
    first_n = (tile // in_group) * GN
    size = gl.minimum(num_n - first_n, GN)
    pid_n = first_n + (tile % in_group) % size
    pid_v = (tile % in_group) // size
    return pid_n * BN, pid_v * BV


@gluon.jit
def _producer(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr,
              N, V, D, v_begin, v_count, stride_coef, eps):
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
def _consumer(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr,
              N, V, D, v_begin, v_count, stride_coef, eps, WHICH: gl.constexpr):
    """One warpgroup: the products of this program's tiles WHICH, WHICH + 2, ..., then their G."""
    e_bufs, c_bufs, g_bufs = bufs
    ready, empty, turn = bars
    S: gl.constexpr = e_bufs.type.shape[0]
    BN: gl.constexpr = E_desc.block_type.shape[0]
    BD: gl.constexpr = E_desc.block_type.shape[1]
    BV: gl.constexpr = C_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
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
        # 0. This consumer's turn at the ring: consumer 0 goes first (a fresh barrier passes
        # phase parity 1), then each waits for the other's (j // 2)-th hand-over.
        mbarrier.wait(turn.index(WHICH), ((j // 2) & 1) ^ (1 - WHICH))
        # 1. z = E_rows C_cols^T: the ring's blocks of this tile, products in flight one behind.
        it = j * k_steps
        acc = gl.zeros((BN, BV), dtype=gl.float32, layout=mma)
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

        # 2. G = a S - b [v = x] - c / V with S = exp(z - lse), 0 in padding (``gradient_tile``).
        rows = row0 + gl.arange(0, BN, layout=row_layout)
        row_mask = rows < N
        local_v = col0 + gl.arange(0, BV, layout=col_layout)
        col_mask = local_v < v_count
        lse = gl.load(lse_ptr + rows, mask=row_mask, other=0.0)
        a = gl.load(coef_ptr + rows, mask=row_mask, other=0.0)
        b = gl.load(coef_ptr + stride_coef + rows, mask=row_mask, other=0.0)
        c = gl.load(coef_ptr + 2 * stride_coef + rows, mask=row_mask, other=0.0)
        x = gl.load(x_ptr + rows, mask=row_mask, other=-1)
        x = gl.where((x >= 0) & (x < V), x, -1).to(gl.int32)
        S_tile = gl.exp(acc - gl.expand_dims(lse, 1))
        is_target = gl.expand_dims(x, 1) == gl.expand_dims(v_begin + local_v, 0)
        G = (gl.expand_dims(a, 1) * S_tile - gl.where(is_target, gl.expand_dims(b, 1), 0.0)
             - gl.expand_dims(c / V, 1))
        G = gl.where(gl.expand_dims(col_mask, 0), G, 0.0)

        # 3. The filter: a tile whose rows each hold less than eps of |G| mass is written as zeros.
        kept = gl.max(gl.sum(gl.abs(G), axis=1), axis=0) >= eps
        gl.store(kept_ptr + (row0 // BN) * gl.cdiv(v_count, BV) + col0 // BV, kept.to(gl.int8))
        G = gl.where(kept, G, 0.0)

        # 4. G through this consumer's buffer and the copy engine; the previous store must have
        # left the buffer first.
        tma.store_wait(pendings=0)
        g_buf.store(G.to(G_desc.dtype))
        fence_async_shared()
        tma_store(G_desc, [row0, col0], g_buf)
        j += 2
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer_even(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr,
                   N, V, D, v_begin, v_count, stride_coef, eps):
    _consumer(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr,
              N, V, D, v_begin, v_count, stride_coef, eps, 0)


@gluon.jit
def _consumer_odd(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr,
                  N, V, D, v_begin, v_count, stride_coef, eps):
    _consumer(E_desc, C_desc, G_desc, bufs, bars, x_ptr, lse_ptr, coef_ptr, kept_ptr,
              N, V, D, v_begin, v_count, stride_coef, eps, 1)


@gluon.jit
def gradient_chunk_pingpong_kernel(E_desc, C_desc, G_desc, x_ptr, lse_ptr, coef_ptr, kept_ptr,
                                   N, V, D, v_begin, v_count, stride_coef, eps,
                                   STAGES_: gl.constexpr, num_warps: gl.constexpr):
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
            kept_ptr, N, V, D, v_begin, v_count, stride_coef, eps)
    gl.warp_specialize([
        (_consumer_even, args),
        (_consumer_odd, args),
        (_producer, args),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


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


def _descriptors(E, C, G):
    dtype = gl.bfloat16 if E.dtype == torch.bfloat16 else gl.float16
    e_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    c_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_V, BLOCK_D], dtype)
    g_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_V], dtype)
    return (TensorDescriptor.from_tensor(E, [BLOCK_N, BLOCK_D], e_layout),
            TensorDescriptor.from_tensor(C, [BLOCK_V, BLOCK_D], c_layout),
            TensorDescriptor.from_tensor(G, [BLOCK_N, BLOCK_V], g_layout))


def gradient_chunk_pingpong(E, C, x, lse, coef, v_begin: int, v_count: int, eps: float, G=None, stages=STAGES):
    """(G, tile_kept) of vocabulary chunk [v_begin, v_begin + v_count): ``gradient_chunk_kernel``'s
    result for bf16/fp16 E and C without soft cap, bias or sort, at (64, 256) tiles."""
    N, D = E.shape
    if E.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"E must be bf16 or fp16 for this kernel, got {E.dtype}")
    G = torch.empty(N, v_count, dtype=E.dtype, device=E.device) if G is None else G
    tiles = triton.cdiv(N, BLOCK_N) * triton.cdiv(v_count, BLOCK_V)
    kept = torch.empty(tiles, dtype=torch.int8, device=E.device)
    E_desc, C_desc, G_desc = _descriptors(E, C, G)
    programs = min(tiles, torch.cuda.get_device_properties(E.device).multi_processor_count)
    gradient_chunk_pingpong_kernel[(programs,)](
        E_desc, C_desc, G_desc, x, lse, coef, kept, N, C.shape[0], D, v_begin, v_count, coef.stride(0), eps,
        stages, num_warps=4, maxnreg=MAXNREG)
    return G, kept


def compile_for_sm90() -> dict:
    """Compile the kernel for sm_90 with this machine's Triton (no GPU needed): shared memory,
    registers and spills from ptxas, or the error."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.runtime.jit import mangle_type

    # A descriptor's type names its dtype, block and layout, not its tensor's shape: small CPU
    # tensors stand in for E, C and G.
    small = torch.empty(BLOCK_V, BLOCK_V, dtype=torch.bfloat16)
    sig = {name: mangle_type(_descriptors(small, small, small)[i])
           for i, name in enumerate(("E_desc", "C_desc", "G_desc"))}
    sig.update(x_ptr="*i64", lse_ptr="*fp32", coef_ptr="*fp32", kept_ptr="*i8", N="i32", V="i32", D="i32",
               v_begin="i32", v_count="i32", stride_coef="i32", eps="fp32", STAGES_="constexpr",
               num_warps="constexpr")
    fn = gradient_chunk_pingpong_kernel
    try:
        compiled = triton.compile(
            gluon._runtime.GluonASTSource(fn=fn, signature=sig, constexprs={"STAGES_": STAGES, "num_warps": 4}),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAXNREG})
    except Exception as error:  # noqa: BLE001 (reported, not raised: the caller decides)
        return {"status": "error", "triton": triton.__version__, "error": f"{type(error).__name__}: {str(error)[:3000]}"}
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gluon_g.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", path + ".cubin"],
                             capture_output=True, text=True)
    return {"status": "ok", "triton": triton.__version__, "shared_bytes": compiled.metadata.shared,
            "ptxas": re.findall(r"Used \d+ registers|\d+ bytes spill stores", out.stderr),
            "wgmma": ptx.count("wgmma.mma_async"), "tma": ptx.count("cp.async.bulk.tensor"),
            "setmaxnreg": ptx.count("setmaxnreg")}


def _shipped_chunk(E, C, x, lse, coef, v_begin, v_count, eps, G, kept, cfg):
    """The shipped G kernel (``gradient_chunk_kernel``) on one chunk, launched as ``backward_gemm`` launches it."""
    from helpers.cce.descriptors import block_descriptor, operand_descriptors
    from helpers.cce.kernels.gradient_chunk import gradient_chunk_kernel

    N, D = E.shape
    E_desc, C_desc, _ = operand_descriptors(E, C, cfg, gathered=False)
    G_desc = block_descriptor(G, cfg.BLOCK_N, cfg.BLOCK_V // cfg.g_subtile)
    tiles = triton.cdiv(N, cfg.BLOCK_N) * triton.cdiv(v_count, cfg.BLOCK_V)
    programs = torch.cuda.get_device_properties(E.device).multi_processor_count
    gradient_chunk_kernel[(min(tiles, cfg.persistent * programs) if cfg.persistent else tiles,)](
        E_desc, C_desc, x, lse, coef, lse, kept, G_desc, G, kept, N, C.shape[0], D, v_begin, v_count,
        E.stride(0), E.stride(1), C.stride(0), C.stride(1), x.stride(0), G.stride(0), G.stride(1), coef.stride(0),
        1.0, eps, HAS_SOFTCAP=False, HAS_BIAS=False, FILTER=eps > 0, SPLIT_G=False, SORTED=False,
        DOT_PRECISION="tf32", E_DESC=True, G_DESC=True, G_SUBTILE=cfg.g_subtile, PERSISTENT=cfg.persistent > 0,
        **cfg.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D", "GROUP_N"), **cfg.launch)


def run_on_gpu(out: str) -> int:
    """Per shape, one G chunk as wide as the shipped backward's first in-place chunk: the bits against
    the shipped kernel's with the filter off (the same tiles' products and formula), the tiles each
    kept with it on, and both kernels' median times."""
    from helpers.cce import cce_forward, resolve_options
    from helpers.cce.backward.rows import RowGradient
    from helpers.cce.kernels.configs import select_configs
    from helpers.cce.options import tile_eps
    from helpers.compare.heads import GEMMA2, QWEN3
    from helpers.compare.inputs import make_inputs
    from helpers.compare.measure import latency
    from helpers.compare.results_file import ResultsWriter, run_meta

    def median_ms(fn):
        return latency(fn, warmup=1, repeats=20, device=device).median_ms

    device = torch.device("cuda")
    cfg = select_configs(device).backward_gemm_for(torch.bfloat16)
    writer = ResultsWriter(out, run_meta(device))
    records = []
    for name, N, V, D, cols in (("gemma2", 8192, GEMMA2.V, GEMMA2.D, 16_384), ("qwen3-16k", 16_384, QWEN3.V, QWEN3.D, 8192)):
        rec = {"case": name, "N": N, "V": V, "D": D, "chunk_columns": cols, "shipped": repr(cfg)}
        try:
            E, C, x = make_inputs(N, V, D, torch.bfloat16, device, regime="uniform", seed=N)
            o = resolve_options(torch.bfloat16)
            _, lse = cce_forward(E, C, x, o)
            up = RowGradient.of(torch.full((N,), 1.0 / N, device=device), None, x != o.ignore_index, lse, o)
            coef = up.coef
            G_ref = torch.empty(N, cols, dtype=E.dtype, device=device)
            G_new = torch.empty_like(G_ref)
            kept_ref = torch.empty(triton.cdiv(N, cfg.BLOCK_N) * triton.cdiv(cols, cfg.BLOCK_V), dtype=torch.int8,
                                   device=device)
            # 1. Correctness: the filter off, both kernels, the same G to the bit (or the largest difference).
            _shipped_chunk(E, C, x, lse, coef, 0, cols, 0.0, G_ref, kept_ref, cfg)
            gradient_chunk_pingpong(E, C, x, lse, coef, 0, cols, 0.0, G=G_new)
            torch.cuda.synchronize()
            rec["bitwise_equal"] = bool(torch.equal(G_ref, G_new))
            rec["max_abs_diff"] = float((G_ref.float() - G_new.float()).abs().max())
            rec["G_abs_max"] = float(G_ref.float().abs().max())
            # 2. Time, the filter on at each kernel's tile width (as shipped).
            eps_ref, eps_new = tile_eps(o.filter_eps, cfg.BLOCK_V), tile_eps(o.filter_eps, BLOCK_V)
            t_ref = median_ms(lambda: _shipped_chunk(E, C, x, lse, coef, 0, cols, eps_ref, G_ref, kept_ref, cfg))
            flop = 2 * N * cols * D
            rec.update(shipped_ms=round(t_ref, 3), shipped_tflops=round(flop / t_ref / 1e9, 1),
                       shipped_kept=float(kept_ref.float().mean()))
            for stages in (STAGES, STAGES - 1):  # 224 KB and 184 KB of shared memory
                _, kept_new = gradient_chunk_pingpong(E, C, x, lse, coef, 0, cols, eps_new, G=G_new, stages=stages)
                t_new = median_ms(lambda: gradient_chunk_pingpong(E, C, x, lse, coef, 0, cols, eps_new, G=G_new,
                                                                   stages=stages))  # noqa: B023
                rec[f"pingpong_s{stages}_ms"] = round(t_new, 3)
                rec[f"pingpong_s{stages}_tflops"] = round(flop / t_new / 1e9, 1)
                rec[f"pingpong_s{stages}_kept"] = float(kept_new.float().mean())
            rec["status"] = "ok" if rec["bitwise_equal"] else "DIFFERS"
        except Exception as error:  # noqa: BLE001 (recorded; the next shape still runs)
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:1500]}")
        print(json.dumps(rec), flush=True)
        records.append(rec)
        writer.append(rec)
        torch.cuda.empty_cache()
    return 0 if all(r["status"] == "ok" for r in records) else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 and report; no GPU needed")
    parser.add_argument("--check-protocol", action="store_true",
                        help="play the kernel's barrier protocol out in Python over many interleavings; no GPU needed")
    parser.add_argument("--out", default="gluon_g.jsonl")
    args = parser.parse_args()
    if args.check_protocol:
        result = check_ring_protocol()
        print(json.dumps(result, indent=1))
        return 0 if result["status"] == "ok" else 1
    if args.compile_only or not torch.cuda.is_available():
        result = compile_for_sm90()
        print(json.dumps(result, indent=1))
        return 0 if result["status"] == "ok" else 1
    return run_on_gpu(args.out)


if __name__ == "__main__":
    sys.exit(main())
