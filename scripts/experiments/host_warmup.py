"""How long a host-bound call takes to reach its steady time in a fresh process, and what each kind of
launch costs the host.

    python scripts/experiments/host_warmup.py [--seconds 20] [--out $OUT/host_warmup.jsonl] [--tiny]

Why: the bench's first row at 1,024 tokens on a freshly started machine (ours, uniform) took 3.30 ms a
call where the next rows took 2.01-2.05 (``docs/measurements/h200-2026-12-04g``), and last stop's first
A/B pair after a start ran slow in both trees. A host-bound call is timed by how fast the host issues it,
so whatever keeps a fresh process's host slow (a core's clock, cold caches, lazily made state) lands in
its figure. Part 1 times ours and torch.compile's loss (``loss_step``, the bench's own step) at the Qwen3
head with 1,024 tokens as the bench does (``latency``: median of 10 calls after 2), again and again for
``--seconds``, alternating the two, and records when each window ran and the pinned core's clock
(``/proc/cpuinfo``'s MHz of the core this process runs on) and its busy and steal ticks over the
window (``/proc/stat``: steal is time the hypervisor gave a ready core to someone else). Part 2: the host's microseconds per call of
each kind of launch the loss makes (200 back-to-back calls, 100 for the kernels, on small tensors, so
the GPU never holds the host back): an empty tensor, a zeroed one, a slice, a copy to the host's pinned
memory, cuBLAS products into fp32 (each ``product_mode``), one Triton launch (the row-weights kernel)
and the Gluon forward.
``--tiny``: a small head on the CPU (timings meaningless there; checks the script).
"""

from __future__ import annotations

import os
import time

import torch
from _common import Checker, finish, script_setup

from helpers.compare.heads import QWEN3
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import latency, loss_step


def core_mhz() -> float | None:
    """The clock of the core this process runs on (the first it may run on), from /proc/cpuinfo."""
    try:
        core = min(os.sched_getaffinity(0))
        with open("/proc/cpuinfo") as f:
            blocks = f.read().split("\n\n")
        for block in blocks:
            fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in block.splitlines() if ":" in line)}
            if fields.get("processor") == str(core) and "cpu MHz" in fields:
                return float(fields["cpu MHz"])
    except (OSError, ValueError, KeyError):
        return None
    return None


def core_ticks() -> tuple[int, int] | None:
    """(this process's core's busy ticks, its steal ticks) from /proc/stat, in USER_HZ (1/100 s): steal is
    the time a virtual machine's core was ready to run but the hypervisor ran something else."""
    try:
        core = f"cpu{min(os.sched_getaffinity(0))}"
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if name == core:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, values[:8])
                    return user + nice + system + irq + softirq, steal
    except (OSError, ValueError):
        return None
    return None


def host_us(fn, device, calls: int = 200) -> float:
    """The host's microseconds per call of ``fn``, back to back after 20 untimed calls."""
    for _ in range(20):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / calls * 1e6


def launch_costs(device, dtype) -> dict:
    """Part 2: host microseconds per call of each kind of launch."""
    from helpers.cce.backward.gemm import PRODUCT_MODES, fp32_product
    from helpers.cce.backward.rows import RowGradient
    from helpers.cce.options import CCEOptions
    from helpers.cce.shared import read_later

    n = 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=torch.float32)
    big = torch.empty(4 * n, device=device)
    scalar = torch.ones((), device=device)
    costs = {
        "torch.empty": host_us(lambda: torch.empty(n, n, device=device), device),
        "torch.zeros": host_us(lambda: torch.zeros(n, n, device=device), device),
        "slice": host_us(lambda: big[3:n], device),
        "read_later (copy queued, read)": host_us(lambda: read_later(scalar)(), device),
        "mm in the dtype": host_us(lambda: torch.mm(a, b), device),
    }
    for mode in PRODUCT_MODES:
        try:
            fp32_product(out, a, b, alpha=0.5, accumulate=True, mode=mode)
        except (RuntimeError, TypeError) as error:
            costs[f"fp32_product {mode}"] = f"unavailable: {type(error).__name__}"
            continue
        costs[f"fp32_product {mode}"] = host_us(
            lambda mode=mode: fp32_product(out, a, b, alpha=0.5, accumulate=True, mode=mode), device)
    labels = torch.randint(0, n, (n,), device=device)
    lse = torch.randn(n, device=device)
    r = torch.rand(2 * n, device=device)  # cce_forward's r: 1 - S_x and the lse's rounding
    costs["Triton launch (row weights)"] = host_us(
        lambda: RowGradient.of(None, None, labels, -100, lse, r, CCEOptions()), device, calls=100)
    if device.type == "cuda":
        from helpers.cce.kernels import lse_forward_pingpong as pingpong

        if pingpong.GLUON_ERROR is None and torch.cuda.get_device_capability(device) == (9, 0):
            E = torch.randn(128, 256, device=device, dtype=torch.bfloat16)
            C = torch.randn(1024, 256, device=device, dtype=torch.bfloat16)
            x = torch.randint(0, 1024, (128,), device=device)
            z = torch.zeros(128, device=device)
            costs["Gluon launch (lse forward, 2 descriptors)"] = host_us(
                lambda: pingpong.lse_forward_pingpong(E, C, x, z, -100), device, calls=100)
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in costs.items()}


def main():
    args, cuda, device, _ = script_setup(__doc__, "host_warmup.jsonl", budget_s=120, add_arguments=lambda p: p.add_argument(
        "--seconds", type=float, default=20.0, help="how long part 1 times the two losses"))
    t0 = time.perf_counter()  # the process's start, near enough: imports done
    device = torch.device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    c = Checker(args.budget_s, "cuda" if cuda else "cpu", args.out)
    N, V, D = (1024, QWEN3.V, QWEN3.D) if not args.tiny else (8, 300, 32)
    E, C, x = make_inputs(N, V, D, dtype, device, regime="uniform", seed=N)
    E.requires_grad_(True)
    C.requires_grad_(True)
    methods = ["ours", "torch_compile"] if cuda else ["ours"]
    steps = {m: loss_step(m, E, C, x) for m in methods}
    for step in steps.values():  # compilation and autotuning outside every window
        step()
    seconds = args.seconds if not args.tiny else 0.0
    window = 0
    while True:
        for method, step in steps.items():
            started = time.perf_counter() - t0
            before = core_ticks()
            stats = latency(step, warmup=2, repeats=10, device=device)
            after = core_ticks()
            busy, steal = ((after[0] - before[0], after[1] - before[1]) if before and after else (None, None))
            record = dict(part="warmup", window=window, method=method, t_s=round(started, 3),
                          median_ms=stats.median_ms, p10_ms=stats.p10_ms, p90_ms=stats.p90_ms, core_mhz=core_mhz(),
                          core_busy_ticks=busy, core_steal_ticks=steal, N=N, V=V, D=D, status="ok")
            c._record(record)
            print(f"t {started:6.2f} s  {method:14s} median {stats.median_ms:7.3f} ms  p10 {stats.p10_ms:7.3f}  "
                  f"p90 {stats.p90_ms:7.3f}  core {record['core_mhz']} MHz  busy/steal ticks {busy}/{steal}")
        window += 1
        if time.perf_counter() - t0 > seconds:
            break
    costs = launch_costs(device, dtype)
    record = dict(part="launch_costs", host_us=costs, status="ok")
    c._record(record)
    for name, us in costs.items():
        print(f"host per call  {name:44s} {us} us")
    finish(c, args.out, cuda)


if __name__ == "__main__":
    main()
