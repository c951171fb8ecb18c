"""Where a small call's host time goes: our loss's forward+backward at the Qwen3 head, few tokens.

    python scripts/experiments/host_path.py [--out $OUT/host_path.jsonl] [--tiny]

Why: at N = 1,024 the GPU finishes our forward+backward long before the host has issued it (the
bench: ~5.8 ms a call against ~2 ms of kernels), so launches, Python and synchronisations bound
it, not arithmetic. Per case (N = 1,024 and 4,096 at the Qwen3 head; notebook 03's head, N 4,096,
V 32,768, D 256, with the host-bound G buffer and without; bf16, the "uniform" regime; and notebook 03's
head as its pretend-T4 run takes it: the Turing tier's configurations, fp16, the "uniform" regime (its
fine-tuning's flat softmax) and the "realistic" one (its pretraining's peaked softmax, where "auto" may
run the sparse backward; on an H200 it ran "gemm", ``docs/measurements/h200-2026-12-03e``), that one with
"gemm" too; and the Qwen3 head at 1,024 tokens and notebook 03's head as a T4 with the loss's CUDA graphs
on, ``helpers.cce.graphs``, whose counts each record keeps):

1. host ms and GPU busy ms per call (``helpers.compare.measure.host_and_device_time``);
2. the launches per call and the host's time in each CUDA runtime/driver call (torch.profiler:
   ``cudaLaunchKernel``, ``cuLaunchKernelEx``, ``cudaStreamSynchronize``, ``cudaMemcpyAsync``, ...),
   and the aten operators by their host time;
3. the Python functions by their own time over 20 calls (``cProfile``), the hot path's shape, and
   ours (``helpers``) by cumulative time: which of our steps the host's time is in;
4. the host's time split without a profiler (``host_split``): each call timed alone after a
   synchronisation, with the time inside Triton's launch path (its argument binding and cache
   lookup, then the launcher), inside cuBLAS's host calls (``torch.mm``/``addmm``) and waiting for
   the device (``Event.synchronize``) summed by wrappers; the rest is our Python and torch's other
   operators. cProfile inflates many small Python calls, so only this split gives shares. Python's
   garbage collector is counted too: collections per call by generation, its ms per call.

``--cases NAME ...``: only those cases. ``--tiny``: a small head on the CPU under the Triton interpreter,
to check the script (timings meaningless there). It prints which ``helpers`` it ran (an A/B puts the other
tree first on PYTHONPATH).
"""

from __future__ import annotations

import cProfile
import os
import pstats

import torch
from _common import Checker, finish, script_setup

import helpers
from helpers.cce import linear_cross_entropy
from helpers.cce.graphs import GRAPHS
from helpers.cce.kernels.configs import select_configs, tier
from helpers.compare.heads import QWEN3
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import host_and_device_time


def step_fn(E, C, x, configs=None, backward_impl="auto"):
    def step():
        loss = linear_cross_entropy(E, C, x, configs=configs, backward_impl=backward_impl)
        torch.autograd.grad(loss, (E, C))
    return step


def profile_ops(step, cuda: bool, calls: int = 5, top: int = 25) -> dict:
    """Host time per call by operator and runtime call, and launches per call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    launches = 0
    for event in prof.key_averages():
        if str(getattr(event, "device_type", "")).endswith(("CUDA", "PrivateUse1")):
            continue
        name = event.key
        if "LaunchKernel" in name:
            launches += event.count
        rows.append((name[:70], round(event.self_cpu_time_total / 1e3 / calls, 4), round(event.count / calls, 1)))
    rows.sort(key=lambda r: -r[1])
    return {"launches_per_call": launches / calls, "host_ms_by_op": rows[:top]}


def python_profile(step, calls: int = 20, top: int = 30) -> tuple[list, list]:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = list(_rows(stats, calls))
    rows.sort(key=lambda r: -r[1])
    # Our own functions by cumulative time: where in the hot path the host's time is spent.
    ours = sorted((r for (path, _, _), r in zip(stats.stats, _rows(stats, calls)) if "/helpers/" in path),
                  key=lambda r: -r[2])
    return rows[:top], ours[:top]


def _rows(stats, calls: int):
    """(function, own ms, cumulative ms, calls), per call, for each of ``stats``'s functions in its order."""
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        yield (f"{path.rsplit('/', 2)[-1]}:{line}:{name}"[:90], round(tottime * 1e3 / calls, 4),
               round(cumtime * 1e3 / calls, 4), round(ncalls / calls, 1))


def host_split(step, cuda: bool, calls: int = 30, warmup: int = 3) -> dict:
    """Median host ms per call and its parts (module doc, 4): each call timed from a synchronised
    start to its return, so a part that waits for the device waits for this call's work only."""
    import statistics
    import time

    from triton.runtime import jit

    parts = {"triton_ms": 0.0, "launcher_ms": 0.0, "blas_ms": 0.0, "wait_ms": 0.0}
    patched = []

    def timed(owner, name, part):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                parts[part] += time.perf_counter() - t
        patched.append((owner, name, original))
        setattr(owner, name, wrapper)

    # Python's garbage collector, by generation: how often it runs during calls and how long (notebook
    # 03's pretraining steps were bimodal, 10 against 25 ms, in ours and its filter-off arm alike).
    import gc

    collections = [0, 0, 0]
    gc_started = []

    def on_gc(phase, info):
        if phase == "start":
            gc_started.append(time.perf_counter())
        elif gc_started:
            parts["gc_ms"] += time.perf_counter() - gc_started.pop()
            collections[info["generation"]] += 1

    parts["gc_ms"] = 0.0
    gc.callbacks.append(on_gc)
    timed(jit.JITFunction, "run", "triton_ms")
    timed(torch, "mm", "blas_ms")
    timed(torch, "addmm", "blas_ms")
    if cuda:
        from triton.backends.nvidia import driver as nvidia_driver

        timed(nvidia_driver.CudaLauncher, "__call__", "launcher_ms")
        timed(torch.cuda.Event, "synchronize", "wait_ms")
    host, split = [], []
    try:
        for i in range(calls + warmup):
            if cuda:
                torch.cuda.synchronize()
            for k in parts:
                parts[k] = 0.0
            t = time.perf_counter()
            step()
            elapsed = time.perf_counter() - t
            if i >= warmup:
                host.append(elapsed * 1e3)
                split.append({k: v * 1e3 for k, v in parts.items()})
    finally:
        gc.callbacks.remove(on_gc)
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
    median = statistics.median(host)
    record = {"host_ms_median": round(median, 4), "host_ms_min": round(min(host), 4)}
    for k in parts:
        record[k] = round(statistics.median(s[k] for s in split), 4)
    # The launcher's time is inside Triton's; the rest: our Python and torch's other operators (and
    # the garbage collector, which may run inside any of them).
    record["other_ms"] = round(median - record["triton_ms"] - record["blas_ms"] - record["wait_ms"], 4)
    record["gc_collections_per_call"] = [round(n / (calls + warmup), 3) for n in collections]
    record["gc_ms_max"] = round(max(s["gc_ms"] for s in split), 4)
    return record


def main():
    args, cuda, device, _ = script_setup(
        __doc__, "host_path.jsonl", budget_s=300,
        add_arguments=lambda p: p.add_argument("--cases", nargs="*", help="run only the cases of these names"))
    dtype = torch.bfloat16 if cuda else torch.float32
    shipped = select_configs(torch.device(device))
    t4 = tier("turing-64k")
    # (name, N, V, D, configs, dtype, regime, backward_impl): the Qwen3 head with few tokens; notebook
    # 03's head (D 256, where dC's rows hold little of G), with the host-bound G buffer
    # (``HostTuning.g_chunk_host_us``) and without; notebook 03's head as a pretend T4 runs it.
    cases = ([("qwen3-1024", 1_024, QWEN3.V, QWEN3.D, None, dtype, "uniform", "auto"),
              ("qwen3-4096", 4_096, QWEN3.V, QWEN3.D, None, dtype, "uniform", "auto"),
              ("nb03-4096", 4_096, 32_768, 256, None, dtype, "uniform", "auto"),
              ("nb03-4096/no-host-bound-buffer", 4_096, 32_768, 256, shipped.tuned(g_chunk_host_us=0.0), dtype,
               "uniform", "auto"),
              ("nb03-4096/t4-tier", 4_096, 32_768, 256, t4, torch.float16, "uniform", "auto"),
              ("nb03-4096/t4-tier/realistic", 4_096, 32_768, 256, t4, torch.float16, "realistic", "auto"),
              ("nb03-4096/t4-tier/realistic/gemm", 4_096, 32_768, 256, t4, torch.float16, "realistic", "gemm"),
              # The loss's CUDA graphs on (``helpers.cce.graphs``; every tier keeps them off until measured).
              ("qwen3-1024/graphs", 1_024, QWEN3.V, QWEN3.D, shipped.tuned(graphs_below_us=float("inf")), dtype,
               "uniform", "auto"),
              ("qwen3-4096/graphs", 4_096, QWEN3.V, QWEN3.D, shipped.tuned(graphs_below_us=float("inf")), dtype,
               "uniform", "auto"),
              ("nb03-4096/graphs", 4_096, 32_768, 256, shipped.tuned(graphs_below_us=float("inf")), dtype,
               "uniform", "auto"),
              ("nb03-4096/t4-tier/graphs", 4_096, 32_768, 256, t4.tuned(graphs_below_us=float("inf")),
               torch.float16, "uniform", "auto")]
             if not args.tiny else [("tiny-64", 64, 1031, 40, None, dtype, "uniform", "auto"),
                                    ("tiny-64/realistic", 64, 1031, 40, None, dtype, "realistic", "auto")])
    print(f"helpers from {os.path.dirname(os.path.dirname(helpers.__file__))}")  # which tree an A/B timed
    check = Checker(args.budget_s, device)
    for name, N, V, D, configs, dt, regime, backward_impl in cases:
        if args.cases and name not in args.cases:
            continue
        E, C, x = make_inputs(N, V, D, dt, device, regime=regime, seed=N, requires_grad=True)

        def case(N=N, V=V, D=D, E=E, C=C, x=x, configs=configs, backward_impl=backward_impl, name=name):
            step = step_fn(E, C, x, configs, backward_impl)
            timing = host_and_device_time(step, calls=10 if cuda else 1, warmup=3 if cuda else 1, device=device)
            stats = {}  # which backward "auto" ran (one more call, outside every timing)
            loss = linear_cross_entropy(E, C, x, configs=configs, backward_impl=backward_impl, stats=stats)
            torch.autograd.grad(loss, (E, C))
            record = {"N": N, "V": V, "D": D, "dtype": str(dt), "regime": regime, "backward_impl": backward_impl,
                      "backward_ran": stats.get("backward"), **timing.as_dict()}
            record.update(profile_ops(step, cuda, calls=5 if cuda else 1))
            record["python"], record["python_ours"] = python_profile(step, calls=20 if cuda else 1)
            record["split"] = host_split(step, cuda, calls=30 if cuda else 1, warmup=3 if cuda else 0)
            record["graphs"] = GRAPHS.summary()  # what the graphs did over the case's calls (all zero: off)
            GRAPHS.clear()
            print(f"  {name}: split {record['split']}")
            print(f"  {name}: host {timing.host_ms:.2f} ms, GPU {timing.device_ms:.2f} ms, "
                  f"{record['launches_per_call']:.0f} launches")
            for row in record["host_ms_by_op"][:12]:
                print(f"      {row[1]:8.3f} ms x{row[2]:<6} {row[0]}")
            for row in record["python"][:15]:
                print(f"      py {row[1]:8.3f} ms (cum {row[2]:8.3f}) x{row[3]:<6} {row[0]}")
            for row in record["python_ours"][:25]:
                print(f"      ours cum {row[2]:8.3f} ms (own {row[1]:8.3f}) x{row[3]:<6} {row[0]}")
            return record

        check.run(name, case)
    finish(check, args.out, cuda)


if __name__ == "__main__":
    main()
