"""GPU check of the "sparse" backward against "gemm": accuracy, time, memory, work skipped.

    python scripts/experiments/speed_v3.py [--out results.jsonl] [--budget-s 240] [--tiny]

Written for an H200 (bf16; torch 2.11, triton 3.6). In order of priority (later cases are skipped
past --budget-s; the required ones run anyway):

1. accuracy, bf16, at the Gemma-2-2B head (N=8,192, V=256,000, D=2,304) in the ``realistic``
   regime: dE and dC relative L2 errors against float64 (``reference_loss_and_grads``, 4,096 rows
   at a time) and their ratio to the naive bf16 path's (logits in bf16, upcast, F.cross_entropy),
   for "gemm" (default options), "gemm" with the sort, "sparse" (sort, "auto" eps = 2^-7 / T) and
   "sparse" with the "gemm" backward's eps (2^-12 per tile: the row rule's cost at that eps);
   then the ``uniform`` regime (where "sparse" must hand over to "gemm") and the Qwen3 head
   (N=16,384, V=151,936, D=1,024), realistic;
2. time (median forward and forward+backward, CUDA events) and peak memory above the inputs
   (dE, dC included; / LB = (N + V) D 2 bytes) for "gemm" and "sparse" x uniform, realistic x the
   Gemma head (N=8,192) and the Qwen3 head (N=16,384, 1,024, 131,072), with the sparse
   backward's counts: marked share of (row, tile) pairs, tile products against "gemm"'s, the
   largest |G| mass a row lost, row blocks, and why it ran "gemm" when it did;
3. a compact table, with each time's ratio to torch.compile's as measured on an H200 on
   2026-11-30 (``docs/measurements/h200-2026-11-30/bench.jsonl``; not re-measured here).

``--sections`` (default ``accuracy time``: items 1-2) runs the sections named, in that order;
``trained``, ``checks`` and ``profile`` are these.

``--sections trained`` measures the "trained" regime (``helpers.compare.trained``: notebook 03's
language model trained on the Python standard library at the shape's V and D) as it measures the
generated ones, at the Gemma-2-2B head and the Qwen3 head (N = 16,384 and 131,072), with one more
variant: the sparse backward forced past its density fallback ("sparse, no fallback"), to see
whether the rule sends "gemm" the cases it should. The peers on this regime: ``python -m helpers
bench --regimes trained``.

``--sections checks`` runs two checks: the sparse backward gives the same bits on a second run (bf16,
realistic: the Gemma head, and the Qwen3 head with N = 131,072, where dC's split tiles run); and
fp16 at the T4's configurations (tier "turing-64k") against this GPU's own, time and accuracy, at
the Qwen3 head with N = 16,384, realistic.

``--sections profile`` splits one "sparse" backward per realistic shape into host and GPU
time: the wall time of the backward (synchronized), the host's time until ``backward()`` returns,
and the GPU time of every kernel it launched (``torch.profiler``), summed by kernel name.

Pass rules (status FAIL): "sparse" (auto eps) dE and dC <= 1.5x the naive path's error; "sparse" on
the uniform regime must have run "gemm" and agree with "gemm" (default options) within half the
naive path's error. Times and memory are
reported, not judged. ``--tiny`` shrinks every shape (and lets the sparse kernels run where the
fallback would take over) so the script can be checked on a CPU under the Triton interpreter.
"""

from __future__ import annotations

import functools
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import Checker, finish, script_setup

from helpers.cce import linear_cross_entropy, why_unavailable
from helpers.cce.options import resolve_configs
from helpers.compare.inputs import make_inputs
from helpers.compare.results_file import read_results
from helpers.spec import reference_loss_and_grads, relative_error
from helpers.compare.heads import GEMMA2, QWEN3

# torch.compile's forward+backward on an H200, bf16: the bench of 2026-11-30, not re-measured here.
TORCH_COMPILE_RUN = Path(__file__).resolve().parents[2] / "docs/measurements/h200-2026-11-30/bench.jsonl"


@functools.cache
def torch_compile_ms() -> dict:
    """{(shape, N, regime): fwd+bwd ms} of torch.compile in ``TORCH_COMPILE_RUN``."""
    _, rows = read_results(TORCH_COMPILE_RUN)
    short = {"gemma2-2b": "gemma2", "qwen3-0.6b": "qwen3"}
    return {(short[r["shape"]], r["N"], r["regime"]): r["fwd_bwd_ms"]
            for r in rows if r["method"] == "torch_compile" and r["status"] == "ok"}

VARIANTS = {
    "gemm": dict(backward_impl="gemm"),
    "gemm+sort": dict(backward_impl="gemm", sort_vocab=True),
    "sparse": dict(backward_impl="sparse", sort_vocab=True),
    "sparse eps=2^-12": dict(backward_impl="sparse", sort_vocab=True, filter_eps=2.0**-12),
    # forced past the density fallback: what the sparse kernels cost where the rule sends "gemm"
    "sparse, no fallback": dict(backward_impl="sparse", sort_vocab=True, dense_fallback=1.01),
}


def with_sparse(device, dtype, **tiles):
    """Options for the sparse backward with other tiles for its kernels (the tier's otherwise)."""
    from dataclasses import replace

    from helpers.cce.kernels.configs import select_configs

    tier = select_configs(torch.device(device))
    size = 4 if dtype.itemsize >= 4 else 2
    sparse = {**tier.sparse, size: replace(tier.sparse[size], **tiles)}
    return dict(VARIANTS["sparse"], configs=replace(tier, sparse=sparse))


def inputs(N, V, D, dtype, regime, device):
    return make_inputs(N, V, D, dtype, device, regime=regime, seed=0)


# Host knobs (``HostTuning``) this run gives every variant's tier: ``--tiny`` lets the sparse path run
# at shapes far too small to pay for it.
HOST_KNOBS: dict = {}


@contextmanager
def script_options(options: dict, device):
    """The variant's options for ``linear_cross_entropy``: its tier (``configs``: a name, a
    ``CCEConfigs`` or None for the device's) with this run's ``HOST_KNOBS`` and the variant's own
    ``dense_fallback`` (the sparse backward's density limit), passed as ``configs``."""
    options = dict(options)
    knobs = dict(HOST_KNOBS)
    if "dense_fallback" in options:
        knobs["dense_fallback"] = options.pop("dense_fallback")
    if knobs:
        options["configs"] = resolve_configs(options.get("configs"), torch.device(device)).tuned(**knobs)
    yield options


def describe_trained(shape, V, D, device):
    """The facts of the "trained" regime's model at this shape (trained on first use)."""
    from helpers.compare.trained import describe

    facts = describe(V, D, device)
    return dict(case=f"trained/{shape}/model", status="ok", steps=facts["recipe"]["steps"],
                **{k: v for k, v in facts.items() if k != "recipe"})


def naive_grads(E, C, x):
    E_ = E.detach().clone().requires_grad_(True)
    C_ = C.detach().clone().requires_grad_(True)
    F.cross_entropy((E_ @ C_.T).float(), x).backward()
    return E_.grad, C_.grad


def ours(E, C, x, stats=None, **options):
    E_ = E.detach().clone().requires_grad_(True)
    C_ = C.detach().clone().requires_grad_(True)
    with script_options(options, E.device) as options:
        loss = linear_cross_entropy(E_, C_, x, stats=stats, **options)
        loss.backward()
    return loss.detach(), E_.grad, C_.grad


def check_accuracy(shape, N, V, D, regime, dtype, device, chunk, variants):
    """Every variant against float64 and against the naive path's error, one reference per call."""
    reason = why_unavailable(device, dtype)
    if reason:
        return [dict(case=f"accuracy/{shape}/{regime}", status="skipped", reason=reason)]
    E, C, x = inputs(N, V, D, dtype, regime, device)
    rloss, rdE, rdC = reference_loss_and_grads(E, C, x, chunk_rows=chunk)
    nE, nC = naive_grads(E, C, x)
    naive = relative_error(nE, rdE), relative_error(nC, rdC)
    del nE, nC
    records, results = [], {}
    for name in variants:
        stats = {}
        loss, dE, dC = ours(E, C, x, stats=stats, **VARIANTS[name])
        rec = dict(case=f"accuracy/{shape}/N={N}/{regime}/{name}", N=N, V=V, D=D,
                   loss_err=relative_error(loss, rloss), dE_err=relative_error(dE, rdE),
                   dC_err=relative_error(dC, rdC), naive_dE_err=naive[0], naive_dC_err=naive[1])
        rec["dE_ratio"], rec["dC_ratio"] = rec["dE_err"] / naive[0], rec["dC_err"] / naive[1]
        rec.update(_sparse_counts(stats))
        problems = []
        if name == "sparse" and not (rec["dE_ratio"] <= 1.5 and rec["dC_ratio"] <= 1.5):
            problems.append("sparse (auto eps) beyond 1.5x the naive path's error")
        if name == "sparse" and regime == "uniform" and "gemm" in results:
            # It must have run "gemm" (with the sort and its own eps, so not to the bit): the two
            # agree far inside the rounding both carry.
            gap = max(relative_error(dE, results["gemm"][0]) / naive[0],
                      relative_error(dC, results["gemm"][1]) / naive[1])
            rec["gap_to_gemm_over_naive"] = gap
            if rec.get("fallback") is None or not gap <= 0.5:
                problems.append("did not hand over to gemm, or differs from it beyond rounding")
        rec["status"] = "FAIL" if problems else "ok"
        if problems:
            rec["problems"] = "; ".join(problems)
        if name == "gemm":
            results["gemm"] = (dE, dC)
        records.append(rec)
        del loss, dE, dC
    return records


def _sparse_counts(stats: dict) -> dict:
    keys = ("fallback", "density", "work_fraction", "skipped_mass_max", "skipped_mass_mean", "row_blocks",
            "tile_ranges", "index_batches", "launches", "eps", "extra_bytes")
    return {k: stats[k] for k in keys if k in stats}


def measure(shape, N, V, D, regime, variant, dtype, device, tiny):
    """Median forward and forward+backward ms, peak memory above the inputs, the sparse counts."""
    E, C, x = inputs(N, V, D, dtype, regime, device)
    E.requires_grad_(True)
    C.requires_grad_(True)
    with script_options(VARIANTS[variant], device) as options:
        return _measure(shape, N, V, D, regime, variant, dtype, E, C, x, options, device == "cuda", tiny)


def _measure(shape, N, V, D, regime, variant, dtype, E, C, x, options, cuda, tiny):

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def forward():
        return linear_cross_entropy(E, C, x, **options)

    def step():
        forward().backward()
        E.grad = C.grad = None

    stats = {}
    linear_cross_entropy(E, C, x, stats=stats, **options).backward()  # compile, warm up, count
    E.grad = C.grad = None
    peak = None
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        sync()
        peak = torch.cuda.max_memory_allocated() - before
    times = {}
    for name, fn in (("fwd", lambda: forward().detach()), ("fwd_bwd", step)):
        start = time.perf_counter()
        fn()
        sync()
        first = time.perf_counter() - start
        reps = 1 if tiny else max(3, min(15, int(1.0 / max(first, 1e-4))))
        samples = []
        for _ in range(reps):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                sync()
                samples.append(a.elapsed_time(b))
            else:
                start = time.perf_counter()
                fn()
                samples.append(1e3 * (time.perf_counter() - start))
        times[name] = statistics.median(samples)
    lb = (N + V) * D * dtype.itemsize
    rec = dict(case=f"time/{shape}/N={N}/{regime}/{variant}", shape=shape, N=N, V=V, D=D, regime=regime,
               variant=variant, fwd_ms=round(times["fwd"], 2), fwd_bwd_ms=round(times["fwd_bwd"], 2),
               peak_mb=round(peak / 1e6, 1) if peak is not None else None, lb_mb=round(lb / 1e6, 1),
               peak_over_lb=round(peak / lb, 3) if peak is not None else None, status="ok")
    ref = torch_compile_ms().get((shape, N, regime)) if cuda else None
    if ref:
        rec["vs_torch_compile"] = round(times["fwd_bwd"] / ref, 3)
    rec.update(_sparse_counts(stats))
    return rec


def profile_backward(shape, N, V, D, regime, dtype, device, variant="sparse", tiles=None):
    """Host and GPU time of one backward (module doc, ``--sections profile``); ``tiles``: other
    tiles for the sparse kernels (``with_sparse``)."""
    from torch.profiler import ProfilerActivity, profile

    E, C, x = inputs(N, V, D, dtype, regime, device)
    E.requires_grad_(True)
    C.requires_grad_(True)
    with script_options(with_sparse(device, dtype, **tiles) if tiles else VARIANTS[variant], device) as options:
        pass
    if tiles:
        variant += " " + ",".join(f"{k}={v}" for k, v in tiles.items())
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(2):  # compile, warm up
        linear_cross_entropy(E, C, x, **options).backward()
        E.grad = C.grad = None
    sync()
    walls, hosts = [], []
    for _ in range(3):
        loss = linear_cross_entropy(E, C, x, **options)
        sync()
        start = time.perf_counter()
        loss.backward()
        hosts.append(1e3 * (time.perf_counter() - start))
        sync()
        walls.append(1e3 * (time.perf_counter() - start))
        E.grad = C.grad = None
    loss = linear_cross_entropy(E, C, x, **options)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        loss.backward()
        sync()
    kernels = []
    for event in prof.key_averages():
        ms = getattr(event, "device_time_total", 0.0) / 1e3 if cuda else 0.0
        if ms > 0 and not event.key.startswith(("aten::", "autograd", "cuda", "Memcpy", "Memset")):
            kernels.append((event.key[:60], round(ms, 3), event.count))
    kernels.sort(key=lambda k: -k[1])
    return dict(case=f"profile/{shape}/N={N}/{regime}/{variant}", bwd_wall_ms=round(statistics.median(walls), 2),
                bwd_host_ms=round(statistics.median(hosts), 2),
                gpu_kernel_ms=round(sum(k[1] for k in kernels), 2), kernel_launches=sum(k[2] for k in kernels),
                top_kernels=kernels[:12], status="ok")


def repeats_bitwise(shape, N, V, D, regime, dtype, device):
    """Two sparse forward+backward passes: the same dE and dC to the bit."""
    E, C, x = inputs(N, V, D, dtype, regime, device)
    E.requires_grad_(True)
    C.requires_grad_(True)
    grads, stats = [], {}
    with script_options(VARIANTS["sparse"], device) as sparse:
        pass
    for _ in range(2):
        linear_cross_entropy(E, C, x, stats=stats, **sparse).backward()
        grads.append((E.grad, C.grad))
        E.grad = C.grad = None
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    return dict(case=f"repeat/{shape}/N={N}/{regime}/sparse", bitwise_equal=same, fallback=stats.get("fallback"),
                split_ranges=stats.get("split_ranges"), status="ok" if same and not stats.get("fallback") else "FAIL")


def turing_configs(shape, N, V, D, regime, device, tiny):
    """fp16 at the T4 tier's configurations against this GPU's tier: time of "gemm" and "sparse"."""
    records = []
    for tier in (None, "turing-64k"):
        for variant in ("gemm", "sparse"):
            VARIANTS[f"{variant} @{tier}"] = dict(VARIANTS[variant], configs=tier)
            rec = measure(shape, N, V, D, regime, f"{variant} @{tier}", torch.float16, device, tiny)
            rec["tier"] = tier or "this GPU's"
            records.append(rec)
    by = {(r["tier"], r["variant"].split()[0]): r["fwd_bwd_ms"] for r in records}
    for r in records:
        r["over_own_tier"] = round(r["fwd_bwd_ms"] / by[("this GPU's", r["variant"].split()[0])], 3)
    return records


def main():
    args, cuda, device, scale = script_setup(
        __doc__, "speed_v3.jsonl", 240.0,
        lambda p: p.add_argument("--sections", nargs="+", default=["accuracy", "time"],
                                 choices=["accuracy", "time", "profile", "checks", "trained"]))
    dtype = torch.bfloat16 if cuda else torch.float16  # the interpreter cannot do bf16
    if args.tiny:
        HOST_KNOBS.update(dense_fallback=0.95,  # tiny shapes mark most pairs: run the kernels anyway
                          sparse_min_pairs=0)  # and are far too small to pay for them
    gemma = (scale(GEMMA2.V, 600), scale(GEMMA2.D, 36))
    qwen = (scale(QWEN3.V, 400), scale(QWEN3.D, 24))
    n = {k: scale(k, lo) for k, lo in ((1024, 24), (8192, 40), (16_384, 48), (131_072, 64))}
    if args.tiny:
        n[131_072] = 64  # the interpreter's minutes: N / 256 would be 512 rows
    chunk = 64 if args.tiny else 4096
    c = Checker(args.budget_s, device)
    # The sections in the order asked (each skips its optional cases past --budget-s).
    for section in args.sections:
        if section == "accuracy":
            # Accuracy at the Gemma head, realistic (required), then uniform and the Qwen3 head.
            c.run("accuracy/gemma2/realistic", check_accuracy, "gemma2", n[8192], *gemma, "realistic", dtype,
                  device, chunk, ["gemm", "gemm+sort", "sparse", "sparse eps=2^-12"], required=True)
            c.run("accuracy/gemma2/uniform", check_accuracy, "gemma2", n[8192], *gemma, "uniform", dtype,
                  device, chunk, ["gemm", "sparse"])
            c.run("accuracy/qwen3/realistic", check_accuracy, "qwen3", n[16_384], *qwen, "realistic", dtype,
                  device, chunk, ["gemm", "sparse"])
        elif section == "time":
            # Time and memory: the Gemma head first (required), then the Qwen3 head by N.
            for regime in ("realistic", "uniform"):
                for variant in ("gemm", "sparse"):
                    c.run("time", measure, "gemma2", n[8192], *gemma, regime, variant, dtype, device, args.tiny,
                          required=True)
            for N in (16_384, 1024, 131_072):
                for regime in ("realistic", "uniform"):
                    for variant in ("gemm", "sparse"):
                        c.run("time", measure, "qwen3", n[N], *qwen, regime, variant, dtype, device, args.tiny)
        elif section == "trained":
            # The "trained" regime at the bench's shapes: what its bits mark, whether the sparse
            # kernels would pay at that density (forced past the fallback), and their accuracy.
            shapes = [("gemma2", n[8192], gemma), ("qwen3", n[16_384], qwen), ("qwen3", n[131_072], qwen)]
            for shape, N, (V, D) in shapes[:1] if args.tiny else shapes:  # tiny: the interpreter's minutes
                first = shape == "gemma2"
                c.run("trained", describe_trained, shape, V, D, device, required=first)
                if N <= 16_384:  # the naive path's fp32 logits at N = 131,072 would be 80 GB
                    c.run(f"accuracy/{shape}/trained", check_accuracy, shape, N, V, D, "trained", dtype, device,
                          chunk, ["gemm", "sparse", "sparse, no fallback"], required=first)
                for variant in ("gemm", "sparse", "sparse, no fallback"):
                    c.run("time", measure, shape, N, V, D, "trained", variant, dtype, device, args.tiny,
                          required=first)
        elif section == "checks":
            c.run("repeat", repeats_bitwise, "gemma2", n[8192], *gemma, "realistic", dtype, device, required=True)
            c.run("repeat", repeats_bitwise, "qwen3", n[131_072], *qwen, "realistic", dtype, device)
            c.run("turing", turing_configs, "qwen3", n[16_384], *qwen, "realistic", device, args.tiny)
            c.run("accuracy/qwen3/realistic/fp16", check_accuracy, "qwen3", n[16_384], *qwen, "realistic",
                  torch.float16, device, chunk, ["gemm", "sparse"])
        elif section == "profile":
            c.run("profile", profile_backward, "gemma2", n[8192], *gemma, "realistic", dtype, device, required=True)
            for N in (16_384, 131_072, 1024):
                c.run("profile", profile_backward, "qwen3", n[N], *qwen, "realistic", dtype, device)
            small = dict(BLOCK_N=16) if args.tiny else dict(BLOCK_N=32)
            c.run("profile", profile_backward, "qwen3", n[16_384], *qwen, "realistic", dtype, device, tiles=small)
            c.run("profile", profile_backward, "gemma2", n[8192], *gemma, "realistic", dtype, device, tiles=small)
            c.run("profile", profile_backward, "gemma2", n[8192], *gemma, "uniform", dtype, device)
            for r in c.records:
                if r["case"].startswith("profile/"):
                    print(f"{r['case']}: backward {r.get('bwd_wall_ms')} ms wall, host {r.get('bwd_host_ms')} ms, "
                          f"GPU kernels {r.get('gpu_kernel_ms')} ms in {r.get('kernel_launches')} launches")
                    for name, ms, count in r.get("top_kernels", []):
                        print(f"    {ms:9.3f} ms  x{count:<5d} {name}")

    # The table.
    print("\n" + "=" * 124)
    print(f"{'case':44s} {'status':6s} {'fwd':>7s} {'fwd+bwd':>8s} {'/tc':>5s} {'/LB':>6s} {'marked':>6s}"
          f" {'work':>5s} {'lost':>7s} {'dE/nv':>6s} {'dC/nv':>6s}  fallback")
    for r in c.records:
        def f(key, fmt):
            width = int(fmt.split(".")[0])
            return format(r[key], fmt) if isinstance(r.get(key), (int, float)) else "-".rjust(width)
        fallback = (r.get("fallback") or "")[:28]
        print(f"{r['case'][:44]:44s} {r.get('status', '?')[:6]:6s} {f('fwd_ms', '7.2f')} {f('fwd_bwd_ms', '8.2f')}"
              f" {f('vs_torch_compile', '5.2f')} {f('peak_over_lb', '6.3f')} {f('density', '6.3f')}"
              f" {f('work_fraction', '5.3f')} {f('skipped_mass_max', '7.1e')} {f('dE_ratio', '6.2f')}"
              f" {f('dC_ratio', '6.2f')}  {fallback}")
        if r.get("problems") or r.get("error"):
            print(f"    -> {r.get('problems') or r.get('error')}")
    finish(c, args.out, cuda)


if __name__ == "__main__":
    main()
