"""Where a small call's host time goes: our loss's forward+backward at the Qwen3 head, few tokens.

    python scripts/experiments/host_path.py [--out $OUT/host_path.jsonl] [--tiny]

Why: at N = 1,024 the GPU finishes our forward+backward long before the host has issued it (the
bench: ~5.8 ms a call against ~2 ms of kernels), so launches, Python and synchronisations bound
it, not arithmetic. Per N (1,024 and 4,096 at the Qwen3 head, bf16, the "uniform" regime), for
the default backward and for "gemm":

1. host ms and GPU busy ms per call (``helpers.compare.measure.host_and_device_time``);
2. the launches per call and the host's time in each CUDA runtime/driver call (torch.profiler:
   ``cudaLaunchKernel``, ``cuLaunchKernelEx``, ``cudaStreamSynchronize``, ``cudaMemcpyAsync``, ...),
   and the aten operators by their host time;
3. the Python functions by their own time over 20 calls (``cProfile``), the hot path's shape.

``--tiny``: a small head on the CPU under the Triton interpreter, to check the script (timings
meaningless there).
"""

from __future__ import annotations

import cProfile
import pstats

import torch
from _common import Checker, finish, script_setup

from helpers.cce import linear_cross_entropy
from helpers.compare.heads import QWEN3
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import host_and_device_time


def step_fn(E, C, x, backward_impl):
    def step():
        loss = linear_cross_entropy(E, C, x, **({"backward_impl": backward_impl} if backward_impl else {}))
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


def python_profile(step, calls: int = 20, top: int = 30) -> list:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append((f"{path.rsplit('/', 2)[-1]}:{line}:{name}"[:90], round(tottime * 1e3 / calls, 4),
                     round(cumtime * 1e3 / calls, 4), round(ncalls / calls, 1)))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def main():
    args, cuda, device, _ = script_setup(__doc__, "host_path.jsonl", budget_s=240)
    V, D = (QWEN3.V, QWEN3.D) if not args.tiny else (1031, 40)
    token_counts = (1_024, 4_096) if not args.tiny else (64,)
    dtype = torch.bfloat16 if cuda else torch.float32
    check = Checker(args.budget_s, device)
    for N in token_counts:
        E, C, x = make_inputs(N, V, D, dtype, device, regime="uniform", seed=N, requires_grad=True)
        for backward_impl in (None, "gemm"):
            name = f"qwen3-{N}/{backward_impl or 'default'}"

            def case(N=N, backward_impl=backward_impl, E=E, C=C, x=x):
                step = step_fn(E, C, x, backward_impl)
                timing = host_and_device_time(step, calls=10 if cuda else 1, warmup=3 if cuda else 1, device=device)
                record = {"N": N, "V": V, "D": D, **timing.as_dict()}
                record.update(profile_ops(step, cuda, calls=5 if cuda else 1))
                record["python"] = python_profile(step, calls=20 if cuda else 1)
                print(f"  {name}: host {timing.host_ms:.2f} ms, GPU {timing.device_ms:.2f} ms, "
                      f"{record['launches_per_call']:.0f} launches")
                for row in record["host_ms_by_op"][:12]:
                    print(f"      {row[1]:8.3f} ms x{row[2]:<6} {row[0]}")
                for row in record["python"][:15]:
                    print(f"      py {row[1]:8.3f} ms (cum {row[2]:8.3f}) x{row[3]:<6} {row[0]}")
                return record

            check.run(name, case)
    finish(check, args.out, cuda)


if __name__ == "__main__":
    main()
