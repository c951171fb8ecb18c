"""Every launch configuration of the CCE kernels, in one table keyed by shared memory.

A Triton kernel's shared memory grows with its tiles and pipeline depth: roughly
num_stages * (BLOCK_N + BLOCK_V) * BLOCK_D * bytes for the logit loop, plus the G tile the
backward pass feeds back into tl.dot. A launch asking for more than the device's
``shared_memory_per_block_optin`` fails at run time ("out of resource: shared memory"), which is
why Apple's CCE cannot run on a T4 (64 KB per block). So the configuration is chosen from the
device's shared memory, not its name, and ``tests/cce/test_configs.py`` compiles each tier for a
GPU of that tier (on a CPU) and checks the bytes the compiler asks for.

Tiers (opt-in shared memory per block):
    interpreter   CPU, TRITON_INTERPRET=1: small tiles, so the tests' tiny shapes span many tiles
                  (another tier's by name in ``HELPERS_CPU_TIER``: ``cpu_tier``)
    64 KB         Turing (T4, sm_75)
    99 KB         consumer Ampere / Ada (sm_86, sm_89; the L4)
    163 KB        A100 (sm_80)
    227 KB        Hopper (H100 / H200, sm_90)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import partial

MiB = 1024 * 1024


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes (the kernels' CAPS meta-parameters) and the compiler's launch options."""

    BLOCK_N: int
    BLOCK_V: int
    BLOCK_D: int
    num_warps: int
    num_stages: int
    GROUP_N: int = 8
    # E and C (unless gathered) read, and G written, through tensor descriptors: Hopper's copy
    # engine (TMA), ``helpers.cce.descriptors``. Off: pointer loads and stores.
    tma: bool = False
    # The "gemm" backward's G kernel only: ``persistent`` programs per multiprocessor (0: one per
    # tile), each walking its tiles in one flattened loop, so the next tile's loads run under this
    # tile's epilogue; G leaves through the copy engine in ``g_subtile`` column blocks (less shared
    # memory for it).
    persistent: int = 0
    g_subtile: int = 1
    # ptxas's register ceiling per thread (None: its own choice): where a kernel's registers, not its
    # shared memory, would decide how many of its programs share a multiprocessor.
    maxnreg: int | None = None
    # Whether Triton runs this configuration's 16-bit products on tensor cores. Triton from 3.3 compiles
    # tl.dot for compute capability below 8.0 (a T4) as fp32 FMAs on CUDA cores, the operands upcast
    # (triton-lang/triton#5066; tests/cce/test_configs.py checks it on the installed Triton): a T4's
    # products in any Triton kernel run at its fp32 rate (8 TFLOP/s) where cuBLAS's run on its fp16 tensor
    # cores (65). False: our kernels form that product themselves (``DOT_PRECISION="fma"``), the same
    # arithmetic on a real T4, and on a pretend T4 (a bigger GPU with this tier) the same cost.
    tensor_cores: bool = True

    def tiles(self, *names: str) -> dict:
        return {name: getattr(self, name) for name in names}

    @property
    def launch(self) -> dict:
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options


@dataclass(frozen=True)
class HostTuning:
    """How the host launchers cut the work: every knob that is not a kernel's tile, one field each.
    A tier carries one (``CCEConfigs.host``); tests and ``scripts/experiments/tune.py`` pass a changed copy
    (``CCEConfigs.tuned``) as ``configs``, never a patched module global."""

    # The "gemm" backward (``helpers.cce.backward.gemm``).
    # (rows per dE accumulator, columns per G chunk) in place of ``gemm_chunks``'s budgets; None: the budgets.
    gemm_chunks: tuple[int, int] | None = None
    # The widest G chunk kept in place (in dE's or dC's rows not yet written, ``vocab_chunks``): wider
    # chunks mean fewer launches (the host bounds the Qwen3 head's backward) and fewer passes over dE's
    # fp32 accumulator (a read-add-write per chunk), at no memory. Measured on an H200:
    # docs/performance-history.md, "G in place".
    g_in_place_bytes: int = 256 * MiB
    # The G buffer (``gemm_plan``), a scratch G for the chunks it makes wider than dE's and dC's free rows
    # would, at the larger of two sizes:
    # 1. with dE's fp32 accumulator, up to this share of LB (dE and dC's bytes): with few tokens the
    #    accumulator is small, and a buffer ends the tail of ever narrower in-place chunks (dC's room
    #    halves per chunk when the rows are about D) in one launch. 0: no G buffer at all (a tight
    #    memory budget's first step, ``helpers.cce.schedules``).
    g_buffer_lb_share: float = 0.08
    # dE made in the loss's forward (``helpers.cce.forward_de``): the forward writes P = exp(z - z_x) a chunk at a
    # time and sums P C into dE while dC does not exist yet, the backward makes dC alone; the peak stays under
    # 1.1 LB at every N where the recompute design's is 1.13-1.20 from 16,384 tokens at the Qwen3 head. bf16
    # losses without a soft cap, bias, z-loss, smoothing, temperature or class weights, reduced by a mean or a
    # sum. False: every tier's default. Its first build held 1.09-1.10 LB on an H100 but took 1.01-1.17x the
    # shipped step's time (docs/measurements/h100-2026-12-07), with a host read of every row's sum at the
    # forward's end that has since gone; the build without it has not run on a GPU yet.
    forward_de: bool = False
    # 2. where even the widest in-place chunk is host-bound (rows >> D: dC's row holds D elements of G's
    #    column of `rows`): chunks whose products take this long at the tier's matmul rate, the host's
    #    time per chunk (a G launch, two cuBLAS products, ~10 torch operators; ~0.33 ms on an H200's host,
    #    notebook 03's loss at N 4,096, V 32,768, D 256: 19.3 ms for 58 in-place chunks), up to
    #    ``g_buffer_max_bytes`` and to ``g_buffer_max_g_share`` of the whole G (N x V in the inputs'
    #    dtype, the logits' size: a tiny head would otherwise buffer all of it). 0: not this one. The
    #    pieces of cuBLAS's logits take the same floor (``helpers.cce.cublas_logits.chunk_columns``).
    g_chunk_host_us: float = 300.0
    g_buffer_max_bytes: int = 128 * MiB
    g_buffer_max_g_share: float = 0.5
    # The G kernel reads E and C and writes G through tensor descriptors (``LaunchConfig.tma``) only
    # for vocabulary chunks whose three products (6 rows v_chunk D FLOP) take longer than the host's
    # launches for the chunk: descriptor arguments cost the host time per launch, and only chunks
    # with enough products win it back. The Gemma-2-2B head's chunks (2.6e11 FLOP) use them; the
    # Qwen3 head's (1.0e11), whose backward the host's launches bound, do not. The measurements:
    # scripts/experiments/tune.py's "host" section, docs/performance-history.md.
    tma_min_chunk_flop: float = 2e11
    # G leaves the G kernel through a descriptor whenever E and C come through one; False: a pointer
    # store (scripts/experiments/tune.py's "host" section compares the two).
    g_store_tma: bool = True
    # The G kernel of 16-bit chunks on sm_90 without a soft cap or bias is the warp-specialized Gluon
    # kernel (``gradient_chunk_pingpong.py``, where its reasons and measurements are) when True: the
    # Hopper tier's; False: the Triton kernel everywhere (its A/B, and every other tier).
    g_pingpong: bool = False
    # The forward's lse (no bias, soft cap, temperature or label smoothing; 16-bit on sm_90) through the
    # warp-specialized Gluon kernel (``lse_forward_pingpong.py``) where D is at most this; 0: the Triton
    # kernel everywhere. Measured on an H200 against the Triton forward (``scripts/experiments/gluon_forward.py``,
    # docs/measurements/h200-2026-12-03g): 1.36x / 1.13x / 1.07x faster at the Qwen3 head (D 1,024) with
    # 1k / 16k / 65k tokens, 1.01x slower at the Gemma-2-2B head (D 2,304), whose long products already
    # hide the Triton kernel's epilogue. The Hopper tier's: 2,048.
    lse_pingpong_max_d: int = 0
    # How the fp32-output products are made (``helpers.cce.backward.gemm.PRODUCT_MODES``); None: the
    # first that works on the device (``product_mode``).
    product_mode: str | None = None
    # The loss's forward and "gemm" backward replayed from CUDA graphs (``helpers.cce.graphs``) where the
    # backward's products take the GPU less than this many microseconds at the tier's rate
    # (``graphs.backward_us``): there the host's launches, not the GPU, bound a call (at the Qwen3 head with
    # 1,024 tokens on an H200 ~25 launches cost the host 1.8-3.6 ms against ~1.9 ms of GPU work;
    # docs/PERFORMANCE.md). 0: never, every tier's default until an H200 has measured the graphs
    # (``scripts/gpu/graph_check.py``).
    graphs_below_us: float = 0.0
    # Graphs kept per process at most (``helpers.cce.graphs``; a training loop takes a forward's and one or
    # two backward's): a call whose key has no graph runs eagerly once there are this many, so a loop whose
    # shapes never repeat captures nothing.
    graphs_kept: int = 8

    # The "sparse" backward (``helpers.cce.backward.sparse``).
    # Fewer (row, tile) pairs than this run "gemm": the index costs more than it saves below it (on an
    # H200 the crossover lay between N = 1,024 and 16,384 at the Qwen3 head; docs/PERFORMANCE.md).
    sparse_min_pairs: int = 2**23
    y_lanes: int | None = None  # rows of Y (marked pairs) in dC's memory; None: all that fit
    gc_bytes: int | None = None  # Gc's bytes; None: max(LB / 20, 4 MiB) (a tile of more packs: in windows)
    index_bytes: int | None = None  # the pair index's bytes (``pair_index``); None: max(LB / 32, 4 MiB)
    # dC programs worth having in flight: a range with fewer (tiles x D blocks) splits its tiles' packs
    # (``sparse_dC_kernel``'s PARTIAL); None: 4 per SM on a GPU, no splits on the CPU. Their fp32 sums
    # take at most max(LB / 64, 4 MiB).
    dc_programs: int | None = None
    # Rows per segment of the pair index: a segment's rows of one tile are ranked by one tl.cumsum
    # (a power of two, the kernels' ROWS).
    segment_rows: int = 128
    # Rows at a time in ``helpers.cce.activity.popcount_rows``: torch sums a uint8 tensor into int64
    # by casting it whole first, 8 bytes per byte of bits (156 MB at the Qwen3 head with N = 131,072);
    # in slices of this many rows the cast is at most ~10 MB.
    count_rows: int = 8192
    # ``backward_impl="auto"`` (``helpers.cce.auto``): calls of one problem that run "gemm" on a remembered
    # "the bits marked too many" before a call makes bits again to look. A probe on a flat softmax costs
    # 5-8% of one step on an H200 (the bits' forward, then "gemm" anyway), 0.2-0.3% over 32 calls; a
    # softmax that sharpens waits at most this many calls for the sparse backward.
    auto_probe_calls: int = 32

    # The forward with activity bits (``helpers.cce.forward``): sorted vocabulary positions the pilot
    # launch walks first (rounded to whole bytes of bits).
    pilot_columns: int = 1024

    # The time model that picks a schedule under a memory budget (``helpers.cce.schedules``): a
    # schedule's time is its FLOP at the tier's matmul rate plus its extra bytes at the memory's
    # bandwidth. Rates are a GPU of the tier's, measured where we had one (the H200's bf16 790
    # TFLOP/s; docs/PERFORMANCE.md), else its datasheet's dense rate; they only rank schedules.
    matmul_tflops_16bit: float = 790.0
    matmul_tflops_fp32: float = 50.0  # fp32 without TF32 (torch's default)
    bandwidth_gbs: float = 4000.0
    # The share of cuBLAS's rate our Triton logit kernels (the LSE forward, the G kernel) reach: on an
    # H200 the "gemm" design's 36.3 ms at the Qwen3 head (N 16,384) and 59.5 ms at the Gemma-2-2B head
    # against their cuBLAS products fit 0.63 and 0.75.
    triton_share: float = 0.7
    # What ``memory_budget="default"`` (the loss's default) means on a GPU of this tier: "min" (the recompute
    # design) or a number of bytes. For a tier whose Triton has no tensor-core products
    # (``LaunchConfig.tensor_cores``), where our two Triton products are the slow ones and "forward_grads"
    # makes its three in cuBLAS (``helpers.cce.schedules``): 1 GiB on the Turing tier (its comment says why),
    # "min" on the others.
    default_budget: str | int = "min"
    # Where a numeric ``default_budget`` fits no "forward_grads" (a head whose fixed accumulators alone pass
    # it: fp16 holds dC in fp32, 4 V D bytes, 2.4 GB at the Gemma-2-2B head), the default is raised to that
    # schedule's least need plus ``default_budget``, at most this many bytes and ``AUTO_SHARE`` of what is free
    # (``helpers.cce.schedules.choose_schedule``); 0: never raised.
    default_budget_max: int = 0
    # The recompute design's logits made by cuBLAS in fp32, into one buffer of this many bytes: a vocabulary
    # chunk at a time in the forward, a piece of each G chunk at a time in the backward (``helpers.cce.cublas_logits``;
    # wider where so few columns would leave the GPU waiting on the host, ``g_chunk_host_us``): for a tier whose
    # Triton products are FMAs (``LaunchConfig.tensor_cores``), 16-bit inputs. 0: our Triton products.
    logits_in_cublas_bytes: int = 0
    # Host time per kernel launch, microseconds (a "forward_grads" chunk launches ~5).
    launch_us: float = 10.0
    # "forward_grads" with fp16 inputs holds its logits in fp32 where a logit could pass this
    # (fp16's largest is 65,504): |z| <= max ||E_i|| max ||C_v|| + max |b| (Cauchy-Schwarz).
    fp16_logit_limit: float = 60000.0
    # Rows per "forward_grads" chunk are a multiple of this (the last chunk takes the rest).
    row_multiple: int = 64
    # Rows per "forward_grads" chunk in place of the most the budget allows (still held to the budget);
    # None: the most. For tests and tuning.
    forward_grads_rows: int | None = None
    # "forward_grads" with 16-bit inputs accumulates dC over its chunks in fp32 (4 V D bytes) where
    # the budget holds that, else in dC itself, in its dtype, for at most this many chunks: each
    # chunk's product is summed with dC in fp32 and rounded once (cuBLAS's epilogue), so dC's error
    # grows as about sqrt((chunks + 1) / 2) roundings: 2.9 at 16 chunks. Measured on an H200, bf16:
    # 4 chunks 2.9e-3 relative (naive's 2.7e-3), 16 chunks 5.05e-3 (naive's 2.2e-3), within the gate's
    # floor (6e-3) but 2.3x naive's; fp16 16 chunks 6.7e-4 (docs/measurements/h200-2026-12-02d).
    # 0: fp32 only.
    dC_in_dtype_chunks: int = 16


def matmul_tflops(host: HostTuning, dtype) -> float:
    """cuBLAS's rate for inputs of ``dtype`` on a tier with these ``host`` figures, TFLOP/s."""
    return host.matmul_tflops_fp32 if dtype.itemsize >= 4 else host.matmul_tflops_16bit


def triton_tflops(host: HostTuning, dtype, tensor_cores: bool) -> float:
    """Our Triton logit products' rate for inputs of ``dtype``, TFLOP/s: ``HostTuning.triton_share`` of the
    tier's matmul rate, of its fp32 rate where its Triton has no tensor-core product (``tensor_cores`` False,
    ``LaunchConfig.tensor_cores``: a T4's 8 TFLOP/s, not 65). The time model (``helpers.cce.schedules``), the
    G chunks' host-bound width (``helpers.cce.backward.gemm.host_bound_cols``) and the graphs' threshold
    (``helpers.cce.graphs.backward_us``) all take it from here, through ``logit_tflops``."""
    return host.triton_share * (matmul_tflops(host, dtype) if tensor_cores else host.matmul_tflops_fp32)


def logit_tflops(host: HostTuning, dtype, tensor_cores: bool) -> float:
    """The rate of the recompute design's two logit products (the forward's lse, the backward's G), TFLOP/s:
    cuBLAS's where the tier has cuBLAS make its 16-bit logits (``HostTuning.logits_in_cublas_bytes``,
    ``helpers.cce.cublas_logits``), else our Triton products' (``triton_tflops``)."""
    if host.logits_in_cublas_bytes > 0 and dtype.itemsize < 4:
        return matmul_tflops(host, dtype)
    return triton_tflops(host, dtype, tensor_cores)


@dataclass(frozen=True)
class CCEConfigs:
    """The configurations of one shared-memory tier, per kernel and per input element size."""

    name: str
    shared_memory_bytes: int | None  # the tier's budget; None for the interpreter
    target_capability: tuple[int, int] | None  # a GPU of this tier, compiled for by the tests
    forward: dict[int, LaunchConfig] = field(default_factory=dict)  # element bytes -> config
    # The forward over the sorted vocabulary (the "sparse" backward's, with activity bits): C's rows
    # are gathered, which favours taller tiles (each gathered C block feeds more rows); empty: ``forward``.
    forward_sorted: dict[int, LaunchConfig] = field(default_factory=dict)
    backward: dict[int, LaunchConfig] = field(default_factory=dict)
    # The "gemm" backward's G kernel (gradient_chunk.py): one logit loop then a store of G, no second
    # product, so the forward's tiles fit it; its products run in cuBLAS, which picks its own.
    backward_gemm: dict[int, LaunchConfig] = field(default_factory=dict)
    indexed_dot: LaunchConfig = LaunchConfig(64, 1, 128, 4, 1)
    # The "sparse" backward's kernels (pair_gradients.py): BLOCK_N = rows per pack (the active rows
    # of one vocabulary tile, gathered), BLOCK_V = the tile's width, which is also the width of the
    # forward's activity bits (a divisor of the forward's BLOCK_V, 1-8 bits per forward tile).
    sparse: dict[int, LaunchConfig] = field(default_factory=dict)
    # The "sparse" backward runs "gemm" when the forward's bits mark more than this share of the
    # (row, tile) pairs (of the rows with a gradient): where its kernels stop paying at this tier's
    # tiles (``helpers.cce.backward.sparse``): narrower tiles mark more of the products for the same
    # softmax, so a tier with narrow tiles stops paying at a lower share (the measurements per tier:
    # docs/PERFORMANCE.md).
    dense_fallback: float = 0.15
    # The "forward_grads" schedule's row kernel (row_gradient.py): one program per logit row, walking it
    # in BLOCK_V columns (BLOCK_N and BLOCK_D unused); no dot, so its shared memory is a reduction's.
    row_gradient: LaunchConfig = LaunchConfig(1, 1024, 1, 4, 1)
    # The host's knobs (chunk widths, in-place caps, budgets, split counts).
    host: HostTuning = HostTuning()

    def tuned(self, **host) -> CCEConfigs:
        """This tier with some host knobs changed (``HostTuning``'s fields) and, for ``dense_fallback``,
        the density limit: what tests and tuning scripts pass as ``configs``. The same object for the same
        tier and knobs, so that a caller who writes ``tier.tuned(...)`` in every call keeps the caches
        keyed by the tier's identity (the plans', the CUDA graphs')."""
        try:
            key = (id(self), tuple(sorted(host.items())))
            hit = _TUNED.get(key)
        except TypeError:  # a knob's value that cannot be hashed: a new object
            key, hit = None, None
        if hit is not None:
            return hit[1]
        fallback = host.pop("dense_fallback", self.dense_fallback)
        result = replace(self, dense_fallback=fallback, host=replace(self.host, **host))
        if key is not None:
            _TUNED[key] = (self, result)  # holds self, so that no other tier takes its id while the entry lives
        return result

    def for_dtype(self, dtype) -> tuple[LaunchConfig, LaunchConfig, LaunchConfig]:
        """(forward, backward, indexed_dot) for inputs of ``dtype``."""
        size = 4 if dtype.itemsize >= 4 else 2
        return self.forward[size], self.backward[size], self.indexed_dot

    def forward_sorted_for(self, dtype) -> LaunchConfig:
        """The forward's configuration when it walks the sorted vocabulary (C's rows gathered)."""
        size = 4 if dtype.itemsize >= 4 else 2
        return self.forward_sorted.get(size, self.forward[size])

    def backward_gemm_for(self, dtype) -> LaunchConfig:
        """The G kernel of the "gemm" backward (``backward_impl="gemm"``) for inputs of ``dtype``."""
        return self.backward_gemm[4 if dtype.itemsize >= 4 else 2]

    def matmul_tflops(self, dtype) -> float:
        """cuBLAS's rate for inputs of ``dtype`` on this tier, TFLOP/s (``HostTuning``)."""
        return matmul_tflops(self.host, dtype)

    def logit_tflops(self, dtype) -> float:
        """The recompute design's logit products' rate for inputs of ``dtype`` (``logit_tflops``), TFLOP/s."""
        return logit_tflops(self.host, dtype, self.backward_gemm_for(dtype).tensor_cores)

    def sparse_for(self, dtype) -> LaunchConfig:
        """The "sparse" backward's kernels (``backward_impl="sparse"``) for inputs of ``dtype``."""
        return self.sparse[4 if dtype.itemsize >= 4 else 2]


_L = LaunchConfig
_T = partial(LaunchConfig, tensor_cores=False)  # a tier whose Triton has no tensor-core tl.dot
# ``CCEConfigs.tuned``'s results by (the tier's id, the knobs): a handful per process.
_TUNED: dict[tuple, tuple[CCEConfigs, CCEConfigs]] = {}

INTERPRETER = CCEConfigs(
    "interpreter", None, None,
    # fp32 reads through tensor descriptors (the Hopper tier's path), 16-bit through pointers.
    forward={2: _L(16, 32, 16, 1, 1), 4: _L(16, 32, 16, 1, 1, tma=True)},
    backward={2: _L(16, 32, 16, 1, 1, GROUP_N=2), 4: _L(16, 32, 16, 1, 1, GROUP_N=2)},
    backward_gemm={2: _L(16, 32, 16, 1, 1, GROUP_N=2), 4: _L(16, 32, 16, 1, 1, GROUP_N=2, tma=True)},
    indexed_dot=_L(16, 1, 16, 1, 1),
    # 16-column bits: two per forward tile, so the interpreter runs the sub-tile path.
    sparse={2: _L(16, 16, 16, 1, 1), 4: _L(16, 16, 16, 1, 1)},
    row_gradient=_L(1, 128, 1, 1, 1),  # several blocks a row at the tests' V (301: 3, the last ragged)
    # No GPU whose rate would make a chunk host-bound: the tests' plans keep their chunks in place.
    host=HostTuning(g_chunk_host_us=0.0),
)

TIERS: tuple[CCEConfigs, ...] = (
    CCEConfigs(
        "turing-64k", 64 * 1024, (7, 5),
        # fp16: the fastest of 8 candidates under 64 KB, timed on an H200 (scripts/experiments/tune.py
        # --tier turing-64k): a proxy, no T4 was available to time on, and timed on tensor cores, which a T4's
        # Triton does not use (``LaunchConfig.tensor_cores``): not the fastest tiles for its FMA products.
        forward={2: _T(128, 128, 32, 8, 3), 4: _T(64, 64, 32, 4, 2)},
        backward={2: _T(64, 64, 32, 4, 2), 4: _T(64, 64, 16, 4, 2)},
        backward_gemm={2: _T(128, 64, 32, 4, 3), 4: _T(64, 64, 32, 4, 2)},
        # Not swept (these tiles have run only as a pretend T4 on an H200): 64-column tiles, two bits per
        # forward tile.
        sparse={2: _T(64, 64, 32, 4, 2), 4: _T(32, 64, 32, 4, 2)},
        # Not timed: a T4's datasheet (65 TFLOP/s fp16 dense, 8 fp32, 320 GB/s).
        row_gradient=_L(1, 1024, 1, 4, 1),
        # The default budget is 1 GiB: our Triton products run as fp32 FMAs here, and the schedule with three
        # cuBLAS products is far faster. On an H100 as a T4, fp16, the Qwen3 head at 16,384 tokens: "min" 490 ms
        # forward and backward at 413 MB, 1 GiB 31.8 ms at 1.41 GB, Liger 81 ms at 384 MB; notebook 03 with it
        # ours equivalent to exact (its fp16 gradients held in fp32 until the loss scale reaches them,
        # ``helpers.cce.forward_grads``). docs/measurements/h100-2026-12-06 and h100-2026-12-06b. At the
        # Gemma-2-2B head, 8,192 tokens, fp16's dC held in fp32 alone is 2.4 GB: 1 GiB fits no three-product
        # schedule, and "min" took 915 ms (Liger 144 ms at 1.28 GB); 4 GiB 50.9 ms at 5.48 GB. Hence a ceiling.
        # "min" itself takes its logits from cuBLAS here (``logits_in_cublas_bytes``; 489 and 914 ms with FMA
        # products), in fp32, pieces of 16 MiB or as many columns as keep a T4 busy for ``g_chunk_host_us``
        # (``cublas_logits.chunk_columns``): on an H100 as a T4 its 44.6 ms of GPU work at the Qwen3 head, 16k tokens,
        # are bound by the H100's host, 107-111 ms (docs/measurements/h100-2026-12-06c).
        host=HostTuning(matmul_tflops_16bit=65.0, matmul_tflops_fp32=8.0, bandwidth_gbs=320.0, default_budget=2**30,
                        default_budget_max=2**32, logits_in_cublas_bytes=16 * MiB),
    ),
    CCEConfigs(
        "ampere-99k", 99 * 1024, (8, 6),
        forward={2: _L(128, 128, 32, 4, 3), 4: _L(64, 64, 32, 4, 3)},
        backward={2: _L(128, 128, 32, 8, 2), 4: _L(64, 64, 32, 4, 2)},
        backward_gemm={2: _L(128, 128, 32, 4, 3), 4: _L(64, 64, 32, 4, 3)},
        sparse={2: _L(64, 128, 32, 4, 2), 4: _L(64, 64, 32, 4, 2)},
        # Not timed: an L4's datasheet (121 TFLOP/s fp16 dense, 30 fp32, 300 GB/s).
        row_gradient=_L(1, 2048, 1, 8, 1),
        host=HostTuning(matmul_tflops_16bit=121.0, matmul_tflops_fp32=30.0, bandwidth_gbs=300.0),
    ),
    CCEConfigs(
        "ampere-163k", 163 * 1024, (8, 0),
        forward={2: _L(128, 256, 64, 8, 3), 4: _L(128, 64, 32, 8, 3)},
        backward={2: _L(128, 128, 64, 8, 3), 4: _L(64, 64, 32, 4, 3)},
        backward_gemm={2: _L(128, 256, 64, 8, 3), 4: _L(128, 64, 32, 8, 3)},
        sparse={2: _L(64, 128, 64, 4, 3), 4: _L(64, 64, 32, 4, 3)},
        # Not timed: an A100's datasheet (312 TFLOP/s 16-bit dense, 19.5 fp32, 1,555-2,039 GB/s).
        row_gradient=_L(1, 2048, 1, 8, 1),
        host=HostTuning(matmul_tflops_16bit=280.0, matmul_tflops_fp32=19.5, bandwidth_gbs=1600.0),
    ),
    CCEConfigs(
        "hopper-227k", 227 * 1024, (9, 0),
        # 16-bit: E and C through tensor descriptors (TMA), faster than pointer loads with the same
        # tiles; the sorted walk, whose C rows are gathered, with 256-row tiles (each gathered C block
        # feeds twice the rows). The G kernel keeps 256 columns although 128 x 128 tiles were faster:
        # the "gemm" filter's rule is per tile, and 128-column tiles drop ~4x the |G| mass on the
        # realistic regime. Persistent (one program per SM walking its tiles, the next tile's loads
        # under this one's epilogue; 3 stages, 209 KB); two programs per SM were slower. Timed with
        # scripts/experiments/tune.py; the figures: docs/performance-history.md, fifth pass.
        forward={2: _L(128, 256, 64, 8, 3, tma=True), 4: _L(128, 64, 32, 8, 3)},
        forward_sorted={2: _L(256, 128, 64, 8, 3, tma=True)},
        backward={2: _L(128, 128, 64, 8, 3), 4: _L(64, 64, 32, 4, 3)},
        # fp32's G kernel: at most 128 registers a thread, so that two programs (8 warps each) share a
        # multiprocessor. With the soft cap, the precise exps and no contraction, Triton 3.6's ptxas took 200
        # and one program fitted: the capped fp32 step 4.8% slower on an H100 (Gemma-2-2B head). At 128 it
        # spills 56 bytes a thread (sm_90 compiles: scripts/experiments/registers.py), and the step took
        # 462.4 ms against 472.7 without the ceiling and 450.7 before those changes
        # (docs/measurements/h100-2026-12-06).
        backward_gemm={2: _L(128, 256, 64, 8, 3, GROUP_N=16, tma=True, persistent=1),
                       4: _L(128, 64, 32, 8, 3, maxnreg=128)},
        # Not swept (the only tiles run, on an H200): packs of 64 rows x 128 columns, two bits per forward tile.
        sparse={2: _L(64, 128, 64, 4, 3), 4: _L(64, 64, 32, 4, 3)},
        # Where the sparse backward stopped beating "gemm" on an H200 with a trained model's softmax
        # (docs/PERFORMANCE.md).
        dense_fallback=0.25,
        # Not timed yet: the row kernel's blocks as Liger's softmax takes them (wide, many warps).
        row_gradient=_L(1, 4096, 1, 16, 1),
        host=HostTuning(g_pingpong=True, lse_pingpong_max_d=2048),
    ),
)


def configs_for_shared_memory(shared_memory_bytes: int) -> CCEConfigs:
    """The largest tier that fits ``shared_memory_bytes`` per block (the smallest tier otherwise)."""
    fitting = [t for t in TIERS if t.shared_memory_bytes <= shared_memory_bytes]
    return fitting[-1] if fitting else TIERS[0]


def tier(name: str) -> CCEConfigs:
    for t in (INTERPRETER, *TIERS):
        if t.name == name:
            return t
    raise ValueError(f"no configuration tier {name!r}; tiers: {[t.name for t in (INTERPRETER, *TIERS)]}")


# The tier the CPU runs under the interpreter where no card is pretended: the interpreter's own (its
# small tiles make the tests' tiny shapes span many tiles), or a tier named here. The interpreter walks
# a kernel's programs one by one, so larger tiles mean fewer of them: the suite's runner gives the cpu
# profile's notebooks the Turing tier's (``helpers.suite.runner``), a third less time on this
# project's 2-core CPU (notebooks 01, 02, 05, 06, 07: 265 s against 176).
CPU_TIER_ENV = "HELPERS_CPU_TIER"


def cpu_tier() -> CCEConfigs:
    """The CPU's tier: ``HELPERS_CPU_TIER``'s (a name of ``tier``; an unknown one raises), else the
    interpreter's."""
    name = os.environ.get(CPU_TIER_ENV)
    return tier(name) if name else INTERPRETER


def tier_for_capability(capability: tuple[int, int] | None) -> CCEConfigs:
    """The tier a GPU of this compute capability most likely gets (None: the CPU's, ``select_configs``'), for
    arithmetic without the device at hand (``helpers.compare.sweep``'s theory). The newest tier whose target
    capability is at most ``capability``; a device picks by its shared memory instead
    (``select_configs``), which agrees for every GPU named in this file's docstring."""
    if capability is None:
        return _cpu_configs()
    fitting = [t for t in TIERS if t.target_capability <= tuple(capability)]
    return max(fitting, key=lambda t: t.target_capability) if fitting else TIERS[0]


def tier_for_card(card) -> CCEConfigs:
    """The tier a card of ``helpers.cce.device.CARDS`` gets (by its shared memory per block): a T4
    turing-64k, an L4 ampere-99k, an A100 ampere-163k. What a pretend card runs."""
    return configs_for_shared_memory(card.shared_memory_per_block_bytes)


def select_configs(device) -> CCEConfigs:
    """The tier for ``device`` (a torch.device or its name): the CPU's on CPU (``cpu_tier``), else by shared memory
    (a pretend card's, ``helpers.cce.device``: a T4's 64 KB, an A100's 163 KB). On the CPU under
    ``HELPERS_PRETEND=<card>`` the card's tier, so the interpreter runs the configurations the card
    gets."""
    import torch

    from helpers.cce.device import device_info

    device = torch.device(device)
    if device.type != "cuda":
        return _cpu_configs()
    return configs_for_shared_memory(device_info(device).shared_memory_per_block_bytes)


def _cpu_configs() -> CCEConfigs:
    """What the CPU's kernels run: a pretend card's tier (``HELPERS_PRETEND``), else ``cpu_tier``'s. One rule
    for the kernels (``select_configs``) and the theory (``tier_for_capability(None)``), or a CPU pretending
    to be a T4 predicts the interpreter's tiles while it runs the T4's."""
    from helpers.cce.device import pretended_card

    card = pretended_card()
    return tier_for_card(card) if card else cpu_tier()
