"""Where our CCE's time goes on a GPU, and what would shorten it: a sweep of launch configurations.

    python scripts/experiments/tune.py [--out $OUT/tune.json] [--budget-s 240] [--tiny]

Written for an H200 (torch 2.11, triton 3.6), bf16, at the Gemma-2-2B head (N=8,192,
V=256,000, D=2,304) and the Qwen3 head at N=16,384 (V=151,936, D=1,024). In order:

1. forward launch configurations: ``cce_forward`` (indexed dot + online-LSE kernel) per candidate
   tile / warps / stages, median ms and TFLOP/s of its one N x V x D product (2 N V D / t);
2. the "gemm" backward's G kernel per candidate: the kernel's own GPU time over one backward
   (torch.profiler, summed over its launches) and the whole backward's median;
3. the "gemm" backward's vocabulary chunks: its median, host time, peak memory, launches and GPU
   time per cap on a G chunk kept in dE's or dC's unwritten rows (``HostTuning.g_in_place_bytes``, 0 to 1 GiB;
   0: chunks at the scratch budget's width, as before G moved there), also at the Qwen3 head with
   N = 1,024, 4,096 and 131,072;
4. the cuBLAS alternative to our Triton logit products: per vocabulary chunk an fp32-output
   ``torch.mm`` of E and the chunk of C, alone (the product's rate), then followed by an
   elementwise Triton kernel that turns the fp32 logits into G (backward), or by a logsumexp
   (forward): what the logit product costs when cuBLAS does it;
5. the realistic regime (``helpers.compare.inputs``): tiles and whole chunks the filter skips, without and
   with the vocabulary sort, and the backward's time (what skipping the GEMMs of dead chunks is
   worth).

``--sections`` picks among these (default: all), by name: ``forward``, ``g_kernel``, ``chunks``,
``cublas``, ``realistic`` (items 1-5) and
- ``host``: the "gemm" backward's host time (until it returns) against its wall and total GPU
  kernel time, per G-kernel variant (pointer loads, descriptor loads, descriptor loads and store);
- ``order``: the LSE grid's vocabulary splits (``helpers.cce.forward.lse_splits``'s choice against
  1, 2, 4 and 8), for the plain forward and the sorted one with activity bits, also at the Qwen3
  head with N = 131,072;
- ``sparse_forward``: the sorted forward with activity bits per candidate (realistic regime);
- ``e2e_hopper``: forward+backward, "gemm" and "sparse", with the Hopper tier as shipped against its
  configuration before tensor descriptors, loss and gradients compared;
- ``dense``: forward+backward on a flat softmax with the dense filter on and off, at the G kernel's
  shipped tiles and at 128 x 128, with the G kernel's time, and the shipped step kernel by kernel;
- ``timeline`` (GPU only): one shipped step under the profiler, the GPU's idle gaps between kernels
  and the Chrome trace beside the results;
- ``bench_loop`` (GPU only): the bench's own timing loop (``call_times_ms``: calls back to back, a
  pair of events around each) for ours and torch.compile, then the same loop under the profiler:
  per call the events' ms against the kernels' busy and idle ms, the largest gaps and each kernel's
  ms, and the SM clock and power ``nvidia-smi`` samples during 20 more calls (at the Gemma-2-2B head
  every kernel of ours ran 9-29% slower in the loop than in one step);
- ``small_n``: forward+backward through autograd at the Qwen3 head with N = 1,024 and 4,096 (the
  host bounds them): as shipped, G chunks at the budget's width, G-kernel descriptors off and on.

Every case runs in try/except and records its error; cases that would start after ``--budget-s``
are skipped. Prints one table per section; writes JSON. ``--tiny``: small shapes on a CPU under the
Triton interpreter, to check the script (timings meaningless there).
"""

from __future__ import annotations

# _common first: on a CPU it sets TRITON_INTERPRET before triton is imported (triton's own
# helpers, tl.sum among them, are made interpreted or not when triton is imported).
from _common import Checker, finish, script_setup
import dataclasses

import torch
import triton
import triton.language as tl

from helpers.cce import cce_backward, cce_forward, gemm_chunks, linear_cross_entropy, resolve_options
from helpers.cce.kernels.configs import LaunchConfig, select_configs, tier
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import latency, peak_memory, release_memory
from helpers.compare.heads import GEMMA2, QWEN3

L = LaunchConfig
T = dict(tma=True)  # E and C (and G) through tensor descriptors: the copy engine (Hopper and later)
# (BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages[, GROUP_N]); the first is the shipped one.
# (A forward whose vocabulary loop was fused with its D loop, ``tl.range(flatten=True)``, measured
# slower on an H200: 13.3 -> 15.1 ms at the Gemma-2-2B head, 8.0 -> 8.5 at Qwen3 16k; the sorted
# walk 15.1 -> 16.9: docs/PERFORMANCE.md, fifth pass.)
# 64-row tiles read C twice as often from L2: what the on-chip dE design (docs/PERFORMANCE.md, "what
# limits it", item 3), whose row blocks are 64 rows, would pay in its forward.
FORWARD_CANDIDATES = [L(128, 256, 64, 8, 3, **T), L(128, 256, 64, 8, 3), L(256, 128, 64, 8, 4, **T),
                      L(128, 256, 64, 8, 4, **T), L(64, 256, 64, 4, 3, **T), L(128, 256, 64, 8, 3, **T)]
# The Turing tier's (64 KB of shared memory per block; the CPU test compiles the shipped one for
# sm_75): (BLOCK_N + BLOCK_V) * BLOCK_D * 2 bytes * stages stays at or under 48 KB.
TURING_CANDIDATES = [L(64, 128, 32, 4, 2), L(128, 128, 32, 8, 2), L(128, 128, 32, 4, 2),
                     L(128, 64, 32, 4, 3), L(64, 256, 32, 8, 2), L(128, 128, 32, 8, 3),
                     L(64, 128, 64, 4, 2), L(128, 64, 64, 4, 2)]
# Persistent (``LaunchConfig.persistent``): programs per multiprocessor walking their tiles, the
# next tile's loads under this one's epilogue. Compiled for sm_90 on a CPU first (Triton 3.6, bf16,
# filter on; shared memory per program): 128 x 256 x 64, 8 warps, 3 stages 209 KB (4 stages with G
# whole, 257 KB, does not fit 227 KB; with G in two column blocks 225 KB); two programs per SM
# (each <= 113 KB and <= 255 registers at 4 warps): 64 x 256 x 64 at 2 stages 112 KB (96 KB with
# G/2, 223-227 registers), 128 x 128 x 64 at 2 stages 97 KB, at 3 stages with G/2 113 KB. 64-row
# tiles keep the filter's 256 columns; 128-column ones change what it skips (third pass). The
# shipped one last as well: a drift of the GPU's clocks over the sweep shows as two times.
P = dict(tma=True, persistent=1)
P2 = dict(tma=True, persistent=2)
G_CANDIDATES = [L(128, 256, 64, 8, 3, GROUP_N=16, **P), L(64, 256, 64, 4, 2, GROUP_N=16, **P2),
                L(64, 256, 64, 4, 2, GROUP_N=16, g_subtile=2, **P2), L(128, 128, 64, 4, 2, **P2),
                L(128, 128, 64, 4, 3, g_subtile=2, **P2), L(128, 256, 64, 8, 4, **T),
                L(128, 256, 64, 8, 3, GROUP_N=16, **P)]
# The forward of the "sparse" backward (activity bits, the sorted vocabulary gathered: E alone
# through a descriptor), realistic regime.
SPARSE_FORWARD_CANDIDATES = [L(256, 128, 64, 8, 3, **T), L(128, 256, 64, 8, 3), L(256, 128, 64, 8, 4, **T),
                             L(256, 128, 128, 8, 2, **T), L(256, 128, 64, 8, 3, GROUP_N=4, **T)]
SECTIONS = ("forward", "g_kernel", "host", "order", "sparse_forward", "e2e_hopper", "chunks", "small_n", "dense",
            "timeline", "cublas", "realistic", "bench_loop")


def label(cfg: LaunchConfig) -> str:
    return (f"{cfg.BLOCK_N}x{cfg.BLOCK_V}x{cfg.BLOCK_D} w{cfg.num_warps} s{cfg.num_stages} g{cfg.GROUP_N}"
            + (" tma" if cfg.tma else "") + (f" persistent x{cfg.persistent}" if cfg.persistent else "")
            + (f" G/{cfg.g_subtile}" if cfg.g_subtile > 1 else ""))


def product_tflops(N, V, D, ms):
    return round(2 * N * V * D / (ms * 1e-3) / 1e12, 1)


def with_config(base, kernel: str, cfg: LaunchConfig):
    """``base`` with ``kernel``'s ("forward" or "backward_gemm") 2-byte configuration replaced."""
    return dataclasses.replace(base, **{kernel: {**getattr(base, kernel), 2: cfg}})


def kernel_ms(fn, name: str) -> float:
    """GPU time of the kernels whose name starts with ``name`` during one call of ``fn`` ("": every
    kernel)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = 0.0
    for event in prof.key_averages():
        on_gpu = str(getattr(event, "device_type", "")).endswith(("CUDA", "PrivateUse1"))
        if event.key.startswith(name) and (name or on_gpu):
            total += getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0))
    return round(total / 1e3, 2)


class Case:
    """Inputs at one shape and the forward's lse, shared by the sections."""

    def __init__(self, name, N, V, D, dtype, device, regime="uniform"):
        self.name, self.N, self.V, self.D, self.dtype, self.device = name, N, V, D, dtype, device
        self.E, self.C, self.x = make_inputs(N, V, D, dtype, device, regime=regime, seed=N)
        self.options = resolve_options(dtype, vocabulary=V)
        _, self.lse, self.r = cce_forward(self.E, self.C, self.x, self.options)
        self.grad_rows = torch.full((), 1.0 / N, device=device).expand(N)  # a mean's

    def backward(self, **kw):
        return cce_backward(self.E, self.C, self.x, self.lse, self.r, self.grad_rows,
                            kw.pop("options", self.options), backward_impl="gemm", **kw)


def forward_sweep(case, base, candidates, repeats):
    """The Triton forward per candidate (the tier's Gluon forward turned off, or every candidate would time
    it: ``helpers.cce.forward.lse_pingpong_reason``), then the tier's own forward where it is the Gluon one."""
    from helpers.cce.forward import forward_kernel

    records, first = [], None
    triton_only = dataclasses.replace(base, host=dataclasses.replace(base.host, lse_pingpong_max_d=0))
    runs = [(label(cfg), with_config(triton_only, "forward", cfg)) for cfg in candidates]
    if forward_kernel(case.E, case.C, None, case.options, base.host, bits=False) == "gluon":
        runs.append(("gluon (the tier's)", base))
    for name, configs in runs:
        rec = dict(case=f"forward/{case.name}/{name}", status="ok",
                   kernel=forward_kernel(case.E, case.C, None, case.options, configs.host, bits=False))
        try:
            run = lambda: cce_forward(case.E, case.C, case.x, case.options, configs)  # noqa: E731
            _, lse, _ = run()
            ms = latency(run, warmup=1, repeats=repeats, device=case.device).median_ms
            rec.update(ms=round(ms, 2), tflops=product_tflops(case.N, case.V, case.D, ms))
            if first is None:
                first = lse
            else:  # against the first candidate's (other tiles sum in another order)
                rec["lse_max_diff"] = float((lse - first).abs().max())
        except Exception as error:  # noqa: BLE001 (a config may not fit or compile: record it)
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:200]}")
        records.append(rec)
    return records


def g_kernel_sweep(case, base, candidates, repeats, cuda):
    records = []
    for cfg in candidates:
        rec = dict(case=f"g_kernel/{case.name}/{label(cfg)}", status="ok")
        try:
            configs = with_config(base, "backward_gemm", cfg)
            run = lambda: case.backward(configs=configs)  # noqa: E731
            run()
            rec["bwd_ms"] = round(latency(run, warmup=1, repeats=repeats, device=case.device).median_ms, 2)
            if cuda:
                g_ms = kernel_ms(run, "gradient_chunk_kernel")
                rec.update(g_kernel_ms=g_ms, g_tflops=product_tflops(case.N, case.V, case.D, g_ms))
        except Exception as error:  # noqa: BLE001
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:200]}")
        records.append(rec)
    return records


def host_ms(run, repeats, cuda) -> float:
    """Median time until ``run`` returns (the GPU may still be working): the host's share."""
    import time

    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            torch.cuda.synchronize()
    return round(sorted(times)[len(times) // 2], 2)


# The in-place G chunk's cap (``HostTuning.g_in_place_bytes``) swept, MiB; 0: every
# chunk at the scratch budget's width (the layout before G moved into dC's rows).
IN_PLACE_MIB = (0, 64, 128, 256, 512, 1024)


def chunk_width_sweep(case, base, repeats, cuda):
    """The "gemm" backward per in-place cap: median ms, host ms, peak / LB, launches, GPU time."""
    lb = (case.N + case.V) * case.D * case.dtype.itemsize
    shipped = select_configs(torch.device(case.device))  # the device's tier, as the backward picks it
    records = []
    for mib in IN_PLACE_MIB if cuda else (0, 1):
        rec = dict(case=f"chunks/{case.name}/in_place={mib}MiB", status="ok")
        try:
            configs = shipped.tuned(g_in_place_bytes=mib * 2**20 if cuda else mib * 4096)
            stats = {}
            case.backward(stats=stats, configs=configs)
            run = lambda: case.backward(configs=configs)  # noqa: E731
            _, peak = peak_memory(run, device=case.device)  # dE, dC and the scratch, inputs excluded
            rec.update(bwd_ms=round(latency(run, warmup=1, repeats=repeats, device=case.device).median_ms, 2),
                       host_ms=host_ms(run, repeats, cuda), bwd_peak_over_lb=round(peak / lb, 3),
                       launches=stats["launches"], places=stats["g_places"])
            if cuda:
                rec.update(g_kernel_ms=kernel_ms(run, "gradient_chunk_kernel"), gpu_ms=kernel_ms(run, ""))
        except Exception as error:  # noqa: BLE001
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:200]}")
        records.append(rec)
    return records


def small_n_sweep(N, V, D, dtype, device, repeats, cuda):
    """Forward+backward through autograd, as the bench times it, at a small N where the host's
    launches bound the time: as shipped, with every G chunk at the scratch budget's width
    (in place 0), without G-kernel descriptors, and with them for every chunk."""
    E, C, x = make_inputs(N, V, D, dtype, device, regime="uniform", seed=N)
    E.requires_grad_(True)
    C.requires_grad_(True)
    shipped = select_configs(torch.device(device))

    def step(configs):
        E.grad = C.grad = None
        linear_cross_entropy(E, C, x, configs=configs).backward()

    variants = [("shipped", {}), ("in_place=0", dict(g_in_place_bytes=0)),
                ("no G descriptors", dict(tma_min_chunk_flop=float("inf"))),
                ("descriptors every chunk", dict(tma_min_chunk_flop=0.0))]
    records = []
    for name, knobs in variants:
        rec = dict(case=f"small_n/qwen3-{N}/{name}", status="ok")
        configs = shipped.tuned(**knobs)
        try:
            step(configs)
            run = lambda: step(configs)  # noqa: E731
            rec.update(ms=round(latency(run, warmup=2, repeats=2 * repeats, device=device).median_ms, 2),
                       host_ms=host_ms(run, repeats, cuda))
        except Exception as error:  # noqa: BLE001
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:200]}")
        records.append(rec)
    return records


@triton.jit
def g_from_logits_kernel(Z_ptr, lse_ptr, x_ptr, G_ptr, N, v_count, v_begin, ignore_index,
                         stride_z, stride_g, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """G = exp(z - lse) - [v = x], 0 at ignored rows, from fp32 logits; the prototype's epilogue."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = (rows < N)[:, None] & (cols < v_count)[None, :]
    z = tl.load(Z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=rows < N, other=0.0)
    x = tl.load(x_ptr + rows, mask=rows < N, other=ignore_index)
    G = tl.exp(z - lse[:, None]) - tl.where((v_begin + cols)[None, :] == x[:, None], 1.0, 0.0)
    G = tl.where((x != ignore_index)[:, None], G, 0.0)
    tl.store(G_ptr + rows[:, None] * stride_g + cols[None, :], G.to(G_ptr.dtype.element_ty), mask=mask)


def cublas_logits(case, repeats):
    """The logit product by cuBLAS per vocabulary chunk (fp32 output), alone and with an epilogue."""
    cfg = select_configs(torch.device(case.device)).backward_gemm_for(case.dtype)
    _, v_chunk = gemm_chunks(case.N, case.V, case.D, case.dtype, cfg.BLOCK_V)
    E, C, N, V = case.E, case.C, case.N, case.V
    records = []
    for width in (v_chunk, 2 * v_chunk):
        Z = torch.empty(N, width, dtype=torch.float32, device=case.device)
        G = torch.empty(N, width, dtype=case.dtype, device=case.device)

        def products(epilogue=None, Z=Z, width=width):
            for v0 in range(0, V, width):
                cols = min(V, v0 + width) - v0
                z = Z[:, :cols]
                torch.mm(E, C[v0:v0 + cols].T, out_dtype=torch.float32, out=z)
                if epilogue:
                    epilogue(z, v0, cols)

        def to_g(z, v0, cols, G=G):
            g = G[:, :cols]
            g_from_logits_kernel[(triton.cdiv(N, 64), triton.cdiv(cols, 128))](
                z, case.lse, case.x, g, N, cols, v0, -100, z.stride(0), g.stride(0),
                BLOCK_N=64, BLOCK_V=128, num_warps=4)

        lse_parts = []

        def to_lse(z, v0, cols):
            lse_parts.append(torch.logsumexp(z, dim=1))
            if len(lse_parts) > 8:
                lse_parts[:] = [torch.logsumexp(torch.stack(lse_parts), dim=0)]

        rec = dict(case=f"cublas/{case.name}/v_chunk={width}", status="ok", v_chunk=width,
                   extra_mb=round((Z.numel() * 4 + G.numel() * G.element_size()) / 1e6, 1))
        for key, epi in (("mm", None), ("mm_then_g", to_g), ("mm_then_lse", to_lse)):
            ms = latency(lambda: products(epi), warmup=1, repeats=repeats, device=case.device).median_ms
            rec[f"{key}_ms"] = round(ms, 2)
        rec["mm_tflops"] = product_tflops(N, V, case.D, rec["mm_ms"])
        records.append(rec)
        del Z, G
        release_memory(case.device)
    return records


def end_to_end(case, tiers, repeats):
    """Forward+backward of ``linear_cross_entropy`` (defaults) with each tier's shipped configs,
    and each tier's loss and gradients against the first tier's (relative; tiles change the order
    of the fp32 sums only, so they agree to rounding)."""
    records, first = [], None
    for configs in tiers:
        E = case.E.detach().clone().requires_grad_(True)
        C = case.C.detach().clone().requires_grad_(True)

        def step():
            E.grad = C.grad = None
            linear_cross_entropy(E, C, case.x, configs=configs).backward()

        ms = latency(step, warmup=1, repeats=repeats, device=case.device).median_ms
        rec = dict(case=f"e2e/{case.name}/{configs.name}", status="ok", ms=round(ms, 2))
        E.grad = C.grad = None
        loss = linear_cross_entropy(E, C, case.x, configs=configs)
        loss.backward()
        got = (loss.detach(), E.grad, C.grad)
        if first is None:
            first = got
        else:
            for key, a, b in zip(("loss", "dE", "dC"), got, first):
                rec[f"{key}_vs_first"] = float((a.double() - b.double()).norm() / b.double().norm())
        records.append(rec)
    return records


def sparse_forward_sweep(case, base, candidates, repeats):
    """The forward of the "sparse" backward (activity bits, sorted vocabulary) per candidate, and
    its bits and lse against the first candidate's (the same tiles give the same bits)."""
    from helpers.cce.options import sparse_auto_eps

    eps = sparse_auto_eps(case.dtype, case.V, base.sparse_for(case.dtype).BLOCK_V)
    options = resolve_options(case.dtype, filter_eps=eps, sort_vocab=True)
    records, first = [], None
    for cfg in candidates:
        rec = dict(case=f"sparse_forward/{case.name}/{label(cfg)}", status="ok")
        try:
            configs = with_config(base, "forward_sorted", cfg)
            run = lambda: cce_forward(case.E, case.C, case.x, options, configs, emit_activity=True)  # noqa: E731
            _, lse, _, activity = run()
            ms = latency(run, warmup=1, repeats=repeats, device=case.device).median_ms
            ones = sum(((activity.bits >> k) & 1).sum() for k in range(8))
            rec.update(ms=round(ms, 2), tflops=product_tflops(case.N, case.V, case.D, ms),
                       marked=round(float(ones) / (activity.tiles * case.N), 4))
            if first is None:
                first = (lse, activity.bits, cfg)
            else:
                rec["lse_max_diff"] = float((lse - first[0]).abs().max())
                if cfg.BLOCK_V == first[2].BLOCK_V:
                    rec["bits_differ"] = int((activity.bits != first[1]).sum())
        except Exception as error:  # noqa: BLE001
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:200]}")
        records.append(rec)
    return records


def e2e_hopper(case, base, forward_cfg, g_cfg, repeats):
    """Forward+backward of ``linear_cross_entropy`` ("gemm" and "sparse") with the tier as shipped
    and with the configuration before tensor descriptors (``forward_cfg`` for both forwards,
    ``g_cfg`` for the G kernel); loss and gradients of the second against the first (relative L2)."""
    before = dataclasses.replace(with_config(with_config(base, "forward", forward_cfg), "backward_gemm", g_cfg),
                                 forward_sorted={}, name=base.name + " before")
    records = []
    for impl, extra in (("gemm", {}), ("sparse", dict(sort_vocab=True))):
        first = None
        for configs in (base, before):
            E = case.E.detach().clone().requires_grad_(True)
            C = case.C.detach().clone().requires_grad_(True)

            def step():
                E.grad = C.grad = None
                linear_cross_entropy(E, C, case.x, configs=configs, backward_impl=impl, **extra).backward()

            step()
            ms = latency(step, warmup=1, repeats=repeats, device=case.device).median_ms
            fwd = latency(lambda: linear_cross_entropy(E, C, case.x, configs=configs, backward_impl=impl, **extra),
                          warmup=1, repeats=repeats, device=case.device).median_ms
            rec = dict(case=f"e2e/{case.name}/{impl}/{configs.name}", status="ok", ms=round(ms, 2),
                       fwd_ms=round(fwd, 2))
            E.grad = C.grad = None
            loss = linear_cross_entropy(E, C, case.x, configs=configs, backward_impl=impl, **extra)
            loss.backward()
            got = (loss.detach().float(), E.grad.float(), C.grad.float())
            if first is None:
                first = got
            else:
                for key, a, b in zip(("loss", "dE", "dC"), got, first):
                    rec[f"{key}_vs_shipped"] = float((a - b).norm() / b.norm().clamp(min=1e-30))
            records.append(rec)
    return records


def kernel_table(fn, top: int = 12) -> list:
    """[(kernel name, GPU ms, launches)] of one call of ``fn``, largest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        if str(getattr(event, "device_type", "")).endswith(("CUDA", "PrivateUse1")):
            ms = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0)) / 1e3
            rows.append((event.key[:60], round(ms, 3), event.count))
    return sorted(rows, key=lambda r: -r[1])[:top]


def dense_sweep(case, base, repeats, cuda):
    """Forward+backward (the default "gemm") on a flat softmax: the dense filter on (as shipped) and
    off, at the G kernel's shipped 256-column tiles and at 128 x 128 (two programs per SM); the G
    kernel's own time; and, as shipped, every kernel of the step (where the time goes)."""
    # On a CPU (the script's check) the shipped tiles only: the narrow ones run the same code.
    tiles = (base.backward_gemm_for(case.dtype),) + ((L(128, 128, 64, 4, 3, **T),) if cuda else ())
    variants = [(f"filter={'on' if eps else 'off'} G {label(cfg)}", eps, cfg) for cfg in tiles
                for eps in ("auto", None)]
    E = case.E.detach().clone().requires_grad_(True)
    C = case.C.detach().clone().requires_grad_(True)
    records = []
    for name, eps, cfg in variants:
        rec = dict(case=f"dense/{case.name}/{name}", status="ok")
        configs = with_config(base, "backward_gemm", cfg)

        def step():
            E.grad = C.grad = None
            linear_cross_entropy(E, C, case.x, configs=configs, filter_eps=eps).backward()

        try:
            step()
            rec.update(ms=round(latency(step, warmup=1, repeats=repeats, device=case.device).median_ms, 2),
                       host_ms=host_ms(step, repeats, cuda))
            if cuda:
                rec.update(g_kernel_ms=kernel_ms(step, "gradient_chunk_kernel"), gpu_ms=kernel_ms(step, ""))
                if not records:  # the shipped step, kernel by kernel
                    rec["kernels"] = kernel_table(step)
        except Exception as error:  # noqa: BLE001
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:200]}")
        records.append(rec)
    for r in records:
        for name, ms, count in r.get("kernels", []):
            print(f"    {ms:9.3f} ms  x{count:<5d} {name}")
    return records


def timeline(case, out_dir):
    """One shipped forward+backward under the profiler: the GPU's idle gaps between kernels (the
    largest, with the kernels on either side), their sum against the step's span; the Chrome trace
    is written beside the results."""
    import json
    import os

    from torch.profiler import ProfilerActivity, profile

    E = case.E.detach().clone().requires_grad_(True)
    C = case.C.detach().clone().requires_grad_(True)

    def step():
        E.grad = C.grad = None
        linear_cross_entropy(E, C, case.x).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"trace_{case.name}.json")
    prof.export_chrome_trace(path)
    return [dict(case=f"timeline/{case.name}", status="ok", **kernel_summary(json.load(open(path))["traceEvents"]))]


def kernel_summary(events: list, calls: int = 1) -> dict:
    """The GPU's side of a Chrome trace's ``events`` (kernels, memsets, copies), per call of ``calls``:
    the span from the first kernel's start to the last's end, the busy and idle ms, the kernels, the
    largest idle gaps with the kernels on either side, and each kernel name's launches and ms."""
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                     key=lambda e: e["ts"])
    gaps = []
    for a, b in zip(kernels, kernels[1:]):
        gap = b["ts"] - (a["ts"] + a.get("dur", 0))
        if gap > 0:
            gaps.append((round(gap / 1e3, 3), a["name"][:40], b["name"][:40]))
    by_kernel: dict[str, list] = {}
    for k in kernels:
        entry = by_kernel.setdefault(k["name"][:60], [0, 0.0])
        entry[0] += 1
        entry[1] += k.get("dur", 0) / 1e3
    span = (kernels[-1]["ts"] + kernels[-1].get("dur", 0) - kernels[0]["ts"]) / 1e3
    return dict(span_ms=round(span / calls, 2), busy_ms=round(sum(ms for _, ms in by_kernel.values()) / calls, 2),
                idle_ms=round(sum(g[0] for g in gaps) / calls, 2), kernels=len(kernels) / calls,
                largest_gaps=sorted(gaps, reverse=True)[:12],
                by_kernel=sorted(([name, round(n / calls, 1), round(ms / calls, 3)] for name, (n, ms) in by_kernel.items()),
                                 key=lambda r: -r[2])[:15])


def gpu_clock_during(fn) -> dict:
    """The SM clock (MHz), power (W) and temperature (C) that ``nvidia-smi`` samples every 20 ms while
    ``fn`` runs: median and lowest clock, median and highest power, highest temperature ("clock_note"
    says why not, where it cannot run)."""
    import statistics
    import subprocess

    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
             "-i", str(torch.cuda.current_device()), "-lms", "20"]
    try:
        sampler = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError as error:
        fn()
        return {"clock_note": f"nvidia-smi did not run: {error}"}
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        sampler.terminate()
        out, _ = sampler.communicate(timeout=10)
    rows = []
    for line in out.splitlines():
        try:
            rows.append([float(v) for v in line.split(",")])
        except ValueError:
            continue
    if not rows:
        return {"clock_note": "nvidia-smi returned no samples"}
    clock, power, temperature = zip(*rows)
    return {"sm_clock_mhz_median": statistics.median(clock), "sm_clock_mhz_min": min(clock),
            "power_w_median": statistics.median(power), "power_w_max": max(power),
            "temperature_c_max": max(temperature), "clock_samples": len(rows)}


def bench_loop(case, methods=("ours", "torch_compile", "ours_budget_4g"), calls=5, pause_s=0.25):
    """The bench's timing loop, as ``helpers.compare.bench`` runs it, for each method: the events' ms
    per call (``call_times_ms``, back to back), then ``calls`` calls back to back under the profiler,
    per call (``kernel_summary``), the clock and power during 20 more (``gpu_clock_during``), and
    ``paced_ms``: 5 calls each after ``pause_s`` of idle GPU (a cool, unthrottled start: if the loop's
    calls are slower than these, the GPU slowed under sustained load, not the schedule).
    ``ours_budget_4g`` holds the logits in chunks (three products, not four)."""
    import json
    import os
    import tempfile
    import time

    from torch.profiler import ProfilerActivity, profile

    from helpers.compare.measure import call_times_ms, loss_step

    records = []
    for method in methods:
        E = case.E.detach().clone().requires_grad_(True)
        C = case.C.detach().clone().requires_grad_(True)
        step = loss_step(method, E, C, case.x)
        events_ms = sorted(call_times_ms(step, warmup=3, repeats=7, device=case.device))
        clocks = gpu_clock_during(lambda step=step: call_times_ms(step, warmup=0, repeats=20, device=case.device))
        paced = []
        for _ in range(5):
            torch.cuda.synchronize()
            time.sleep(pause_s)
            paced += call_times_ms(step, warmup=0, repeats=1, device=case.device)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            prof.export_chrome_trace(path)
            summary = kernel_summary(json.load(open(path))["traceEvents"], calls)
        records.append(dict(case=f"bench_loop/{case.name}/{method}", status="ok", events_median_ms=events_ms[3],
                            events_ms=[round(t, 2) for t in events_ms], paced_ms=[round(t, 2) for t in paced],
                            **summary, **clocks))
        del E, C, step
    return records


def host_sweep(case, base, repeats, cuda):
    """The "gemm" backward's wall time against its host time (until ``cce_backward`` returns, the
    GPU still working) per G-kernel variant: pointer loads, descriptor loads with a pointer G
    store, descriptor loads and store, at the shipped tiles and the tiles before. Where the host
    time reaches the wall time, the launches bound the backward."""
    variants = [("pointers 128x256 s4", L(128, 256, 64, 8, 4), True),
                ("pointers 128x128 w4 s3", L(128, 128, 64, 4, 3), True),
                ("tma loads 128x256 s4", L(128, 256, 64, 8, 4, **T), False),
                ("tma 128x256 s4", L(128, 256, 64, 8, 4, **T), True),
                ("tma loads 128x128 w4 s3", L(128, 128, 64, 4, 3, **T), False),
                ("tma 128x128 w4 s3", L(128, 128, 64, 4, 3, **T), True)]
    if not cuda:  # the interpreter: one of each kind of variant
        variants = [variants[0], variants[2], variants[5]]
    records = []
    for name, cfg, g_store in variants:
        rec = dict(case=f"host/{case.name}/{name}", status="ok")
        try:
            configs = with_config(base, "backward_gemm", cfg).tuned(g_store_tma=g_store)
            run = lambda: case.backward(configs=configs)  # noqa: E731
            run()
            rec["bwd_ms"] = round(latency(run, warmup=1, repeats=repeats, device=case.device).median_ms, 2)
            rec["host_ms"] = host_ms(run, repeats, cuda)
            if cuda:
                rec["g_kernel_ms"] = kernel_ms(run, "gradient_chunk_kernel")
                rec["gpu_ms"] = kernel_ms(run, "")  # every kernel of the backward
        except Exception as error:  # noqa: BLE001
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:200]}")
        records.append(rec)
    return records


def forward_order_sweep(case, base, repeats):
    """The LSE grid's vocabulary splits (None: ``helpers.cce.forward.lse_splits``'s choice; the grid
    split-major), for the plain forward and the sorted one with activity bits; the lse against
    the rule's."""
    from helpers.cce.options import sparse_auto_eps

    eps = sparse_auto_eps(case.dtype, case.V, base.sparse_for(case.dtype).BLOCK_V)
    sorted_options = resolve_options(case.dtype, filter_eps=eps, sort_vocab=True)
    counts = (None, 1, 2, 4, 8) if case.device == "cuda" else (None, 2)  # the interpreter: the code paths
    variants = [(kind, s) for kind in ("plain", "sorted") for s in counts]
    records, first = [], {}
    for kind, splits in variants:
        rec = dict(case=f"order/{case.name}/{kind}/splits={splits}", status="ok")
        try:
            if kind == "plain":
                run = lambda: cce_forward(case.E, case.C, case.x, case.options, base, v_splits=splits)  # noqa: E731
            else:
                run = lambda: cce_forward(case.E, case.C, case.x, sorted_options, base,  # noqa: E731
                                          v_splits=splits, emit_activity=True)
            out = run()
            ms = latency(run, warmup=1, repeats=repeats, device=case.device).median_ms
            rec.update(ms=round(ms, 2), tflops=product_tflops(case.N, case.V, case.D, ms))
            if kind in first:
                rec["lse_max_diff"] = float((out[1] - first[kind]).abs().max())
            else:
                first[kind] = out[1]
        except Exception as error:  # noqa: BLE001
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:200]}")
        records.append(rec)
    return records


def realistic_filter(name, N, V, D, dtype, device, repeats):
    case = Case(name, N, V, D, dtype, device, regime="realistic")
    records = []
    for sort in (False, True):
        options = resolve_options(dtype, vocabulary=V, sort_vocab=sort)
        stats = {}
        case.backward(options=options, stats=stats)
        ms = latency(lambda: case.backward(options=options), warmup=1, repeats=repeats,
                     device=device).median_ms
        records.append(dict(case=f"realistic/{name}/sort={sort}", status="ok", bwd_ms=round(ms, 2),
                            tiles_skipped=round(stats["skipped"] / max(1, stats["tiles"]), 3),
                            chunks_dead=f"{stats['dead_chunks']}/{stats['launches']}"))
    return records


def main():
    def tier_arguments(parser):
        parser.add_argument("--tier", help="sweep this configuration tier's candidates (e.g. "
                            "turing-64k) instead of the device's; only the forward and G-kernel "
                            "sections and the end-to-end comparison run")
        parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
        parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                            help="the sections to run, in this file's order (default: all)")

    args, cuda, device, scale = script_setup(__doc__, "tune.json", 240.0, tier_arguments)
    dtype = getattr(torch, args.dtype) if cuda else torch.float16
    base = tier(args.tier) if args.tier else select_configs(torch.device(device))
    forward_candidates, g_candidates = FORWARD_CANDIDATES, G_CANDIDATES
    if args.tier:
        forward_candidates = g_candidates = (
            TURING_CANDIDATES if args.tier == "turing-64k" else [base.forward[2]])
    if not cuda:  # the interpreter runs any tile size; keep them small
        forward_candidates = [L(16, 32, 16, 1, 1), L(32, 16, 16, 1, 1, GROUP_N=2)]
        g_candidates = forward_candidates + [L(16, 32, 16, 1, 1, persistent=1)]  # the forward has no walk
        base = tier("interpreter")
    # --tiny: ten vocabulary tiles of the interpreter's 32 columns are enough to run every section's code
    # (scale's V // 256 gave 1,000 and 593: 164 s of CI on two cores, ~60 s this way).
    vocab = (lambda v, lo: 320) if args.tiny else scale
    gemma = ("gemma2", scale(8192, 40), vocab(GEMMA2.V, 500), scale(GEMMA2.D, 36))
    qwen = ("qwen3-16k", scale(16_384, 64), vocab(QWEN3.V, 301), scale(QWEN3.D, 24))
    repeats = 1 if args.tiny else 7  # --tiny checks code paths: one timed call (and its warm-up) is enough
    c = Checker(args.budget_s, device)
    print(f"swept tier: {base.name}", flush=True)

    sparse_candidates = SPARSE_FORWARD_CANDIDATES
    hopper_pair = (L(128, 256, 64, 8, 3), L(128, 256, 64, 8, 4))  # the Hopper tier before descriptors
    if not cuda:
        sparse_candidates = [L(16, 32, 16, 1, 1), L(16, 32, 16, 1, 1, **T)]
        hopper_pair = (L(16, 32, 16, 1, 1), L(16, 32, 16, 1, 1, GROUP_N=2))
    sections = set(args.sections)

    cases = {}
    for shape in (gemma, qwen):
        cases[shape[0]] = Case(*shape, dtype, device)
    # --tiny checks each section's code on one shape (each case is minutes under the interpreter).
    first_only = (lambda names: list(names)[:1]) if args.tiny else list
    for name in first_only(cases) if "forward" in sections else ():
        c.run(f"forward/{name}", forward_sweep, cases[name], base, forward_candidates, repeats,
              required=name == "gemma2")
    for name in first_only(cases) if "g_kernel" in sections else ():
        c.run(f"g_kernel/{name}", g_kernel_sweep, cases[name], base, g_candidates, repeats, cuda,
              required=name == "gemma2")
    for name in first_only(cases) if "host" in sections and not args.tier else ():
        c.run(f"host/{name}", host_sweep, cases[name], base, repeats, cuda)
    if args.tier:
        for name in cases:
            c.run(f"e2e/{name}", end_to_end, cases[name], [select_configs(torch.device(device)), base],
                  repeats)
    if not args.tier and "e2e_hopper" in sections and not args.tiny:
        for name in cases:
            c.run(f"e2e_hopper/{name}/uniform", e2e_hopper, cases[name], base, *hopper_pair, repeats)
    if not args.tier and "chunks" in sections:
        for name in first_only(cases):
            c.run(f"chunks/{name}", chunk_width_sweep, cases[name], base, repeats, cuda)
        for N in (1024, 4096, 131_072) if cuda else ():  # one row chunk with a small N; eight
            case = Case(f"qwen3-{N // 1024}k", N, QWEN3.V, QWEN3.D, dtype, device)
            c.run(f"chunks/{case.name}", chunk_width_sweep, case, base, repeats, cuda)
            del case
            release_memory(device)
    if not args.tier and "dense" in sections:
        for name in first_only(cases):
            c.run(f"dense/{name}", dense_sweep, cases[name], base, repeats, cuda)
    if cuda and not args.tier and "timeline" in sections:
        import os

        for name in cases:
            c.run(f"timeline/{name}", timeline, cases[name], os.path.dirname(os.path.abspath(args.out)))
    if cuda and not args.tier and "bench_loop" in sections:
        for name in cases:
            c.run(f"bench_loop/{name}", bench_loop, cases[name])
    if not args.tier and "small_n" in sections:
        for N in (1024, 4096) if cuda else (scale(1024, 24),):
            c.run(f"small_n/{N}", small_n_sweep, N, vocab(QWEN3.V, 301), scale(QWEN3.D, 24), dtype, device, repeats,
                  cuda)
    if cuda and not args.tier and "cublas" in sections:
        for name in cases:
            c.run(f"cublas/{name}", cublas_logits, cases[name], repeats)
    del cases
    release_memory(device)
    if not args.tier and ("sparse_forward" in sections or "e2e_hopper" in sections):
        for shape in first_only((gemma, qwen)):
            case = Case(*shape, dtype, device, regime="realistic")
            if "sparse_forward" in sections:
                c.run(f"sparse_forward/{shape[0]}", sparse_forward_sweep, case, base, sparse_candidates, repeats)
            if "e2e_hopper" in sections:
                c.run(f"e2e_hopper/{shape[0]}/realistic", e2e_hopper, case, base, *hopper_pair, repeats)
            del case
            release_memory(device)
    if not args.tier and "order" in sections:
        for shape in first_only((gemma, qwen, ("qwen3-131k", scale(131_072, 256), vocab(QWEN3.V, 301),
                                               scale(QWEN3.D, 24)))):
            case = Case(*shape, dtype, device, regime="realistic")
            c.run(f"order/{shape[0]}", forward_order_sweep, case, base, repeats)
            del case
            release_memory(device)
    if not args.tier and "realistic" in sections:
        c.run("realistic/gemma2", realistic_filter, *gemma, dtype, device, repeats)

    print("\n" + "=" * 100)
    keys = ("ms", "fwd_ms", "host_ms", "gpu_ms", "tflops", "marked", "lse_max_diff", "bits_differ",
            "loss_vs_shipped", "dE_vs_shipped", "dC_vs_shipped", "bwd_ms", "g_kernel_ms", "g_tflops", "v_chunk",
            "bwd_peak_over_lb", "launches",
            "mm_ms", "mm_tflops", "mm_then_g_ms", "mm_then_lse_ms", "extra_mb", "tiles_skipped",
            "chunks_dead", "span_ms", "busy_ms", "idle_ms", "largest_gaps", "loss_vs_first", "dE_vs_first",
            "dC_vs_first", "error")
    for r in c.records:
        print(f"{r['case'][:52]:52s} {r.get('status', '?')[:6]:6s} "
              + " ".join(f"{k}={r[k]}" for k in keys if k in r))
    finish(c, args.out, cuda)


if __name__ == "__main__":
    main()
