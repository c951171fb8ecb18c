"""Fair training-step times: every arm warmed up, timed without instrumentation, a median of steps.

Notebook 03's training runs cannot time the losses. A fine-tuning arm runs once, so its Triton
kernels compile (and autotune) inside its wall time; only our arm counts skipped tiles, which
reads counts back to the host at every step; and each run's time mixes in its sampling and
bookkeeping. So the speed table times each arm apart, the same way for every arm:

- the arm is built as ``training.train`` builds it (``training.start_arm``: same model, seed,
  Adam and fp16 gradient scaler; ``Arm.loss``: the same autocast and cast of E and C);
- ``warmup`` untimed steps first (compilation and autotuning happen there), then ``repeats``
  steps timed one by one by ``helpers.compare.measure.call_times_ms``; the median is the number;
- no ``stats=``: no arm counts skipped tiles while it is timed; and no device read of the targets (the
  batches' targets are checked on the host, ``training.Arm.loss``; the loss alone's once before its calls);
- the loss alone (forward and backward on one batch), called back to back: the host's time per
  call against the device's busy time (``measure.host_and_device_time``). Where the host takes at
  least as long as the GPU, the GPU waits on kernel launches: the arm is host-bound at these sizes,
  and its step time says little about the kernels.
"""

from __future__ import annotations

import math
import statistics

import torch

from helpers.compare.measure import call_times_ms, host_and_device_time
from helpers.lab import training
from helpers.spec import validate_inputs


def time_training_steps(
    task,
    variant: str,
    *,
    compute_dtype: torch.dtype,
    device: torch.device | str,
    lr: float = 1e-3,
    warmup: int = 3,
    repeats: int = 10,
    loss_calls: int = 5,
    seed: int = 0,
) -> dict:
    """Time ``repeats`` training steps of ``task`` with loss ``variant`` after ``warmup`` untimed ones.

    Returns {"variant", "median_s", "step_s" (each timed step, in order), "warmup", "repeats",
    "host_ms" and "device_ms" (per loss call: forward and backward, ``loss_calls`` back to back; device_ms
    NaN on the CPU, where host and device are one, or where the profiler saw no GPU work), "loss_calls",
    "host_bound" (None where device_ms is NaN), "device" (the torch device type), "tokens" (N), "V", "D", "dtype"}. A step: sample a batch, the body and the loss, backward (scaled in fp16), the
    optimizer step, gradients cleared; the constant learning rate ``lr`` (a schedule costs nothing).
    """
    device = torch.device(device)
    arm = training.start_arm(task, variant, seed=seed, lr=lr, compute_dtype=compute_dtype, device=device)
    g = torch.Generator().manual_seed(seed)

    def step():
        loss = arm.loss(*task.sample(g))  # no stats=: nothing counted, nothing read back
        arm.scaler.scale(loss).backward()
        arm.scaler.step(arm.optimizer)
        arm.scaler.update()
        arm.optimizer.zero_grad(set_to_none=True)

    step_ms = call_times_ms(step, warmup=warmup, repeats=repeats, device=device)

    # The loss alone, on one batch's E and C as the step hands them over (leaves, so that the
    # body's backward is not in it).
    with torch.no_grad():
        E, C, x = arm.loss_inputs(*task.sample(g))
    E, C = E.detach().requires_grad_(True), C.detach().requires_grad_(True)
    validate_inputs(E, C, x)  # once: a check in each call reads the device, a wait inside the host's time

    def loss_call():
        E.grad = C.grad = None
        arm.loss_fn(E, C, x, check_targets=False).backward()

    loss_time = host_and_device_time(loss_call, calls=loss_calls, warmup=1, device=device)
    return {
        "variant": variant,
        "median_s": statistics.median(step_ms) / 1e3,
        "step_s": [ms / 1e3 for ms in step_ms],
        "warmup": warmup,
        "repeats": repeats,
        "host_ms": loss_time.host_ms,
        # The CPU: host and device are one, so no device time and no verdict.
        "device_ms": loss_time.device_ms if device.type == "cuda" else math.nan,
        "loss_calls": loss_calls,
        "host_bound": loss_time.host_bound if device.type == "cuda" else None,
        "device": device.type,
        "tokens": x.numel(),
        "V": C.shape[0],
        "D": C.shape[1],
        "dtype": str(compute_dtype).removeprefix("torch."),
    }


def against_baseline(times: dict[str, dict], baseline: str = "exact") -> dict[str, dict]:
    """``times`` ({arm: time_training_steps's dict}) with "vs_baseline" added to each: its median
    step over the baseline's (NaN where the baseline did not run)."""
    base = times.get(baseline, {}).get("median_s")
    return {arm: {**t, "vs_baseline": t["median_s"] / base if base else math.nan} for arm, t in times.items()}


# An arm whose slowest timed step is past this multiple of its fastest ran at more than one speed (on an
# H200 as a pretend T4, notebook 03's pretraining steps of ours: five near 10 ms, five near 25): its
# median is then no typical step, and the reading says so.
SPREAD = 1.5


def describe_step_times(
    part: str, times: dict[str, dict], labels: dict[str, str], baseline: str = "exact", pretend: str | None = None
) -> list[str]:
    """What ``against_baseline``'s table measures, and for each arm slower than the baseline
    whether the host or the device sets its speed, in sentences computed from the numbers; arms whose
    steps spread past ``SPREAD``; and, on a pretend card (``pretend``: its label), what a host-bound
    ratio there does not say about the card."""
    if not times:
        return [f"{part}: no arm was timed."]
    first = next(iter(times.values()))
    warmup = f"{first['warmup']} untimed warm-up step{'s' if first['warmup'] != 1 else ''}"
    lines = [f"{part}: training-step time at this notebook's {part} sizes (N = {first['tokens']:,} tokens a step, "
             f"V = {first['V']:,}, D = {first['D']:,}, {first['dtype']}), the median of {first['repeats']} steps after "
             f"{warmup} (compilation and autotuning there), no arm counting skipped tiles; the model, optimizer and "
             "batches are every arm's, so the loss is what differs."]
    if first.get("device") not in (None, "cuda"):
        lines.append("On a CPU the Triton kernels (ours, Liger's) run under the Triton interpreter, which executes each "
                     "kernel's programs in Python, one by one: a fused loss's ratio below measures the interpreter's "
                     "overhead, not its kernels' speed. A fused loss's step can also cost more than its timed call here: the fp16 "
                     "loss scaler's upstream gradient is not 1, and a kernel that scales dE and dC by it (Liger's) "
                     "runs once more, interpreted.")
    base = labels.get(baseline, baseline)
    undecided = []
    for arm, t in times.items():
        if arm == baseline or not t["vs_baseline"] > 1:
            continue
        name = labels.get(arm, arm)
        said = (f"{name} takes {t['vs_baseline']:.2f}x the step time of {base}; one call of its loss (forward and "
                f"backward) keeps the host {t['host_ms']:.3g} ms")
        if t["host_bound"] is None:
            undecided.append(name)
            said += "."
        elif t["host_bound"]:
            said += (f" and the GPU {t['device_ms']:.3g} ms: host-bound, the GPU waits on kernel launches at these "
                     "small shapes, so the ratio measures launch latency more than the kernels.")
        else:
            said += (f" and the GPU {t['device_ms']:.3g} ms: device-bound, its kernels themselves take longer at "
                     "these sizes.")
        lines.append(said)
    if undecided:
        why = ("the profiler recorded no GPU activity for the loss" if first.get("device") == "cuda"
               else "on a CPU host and device are one")
        lines.append(f"Whether {', '.join(undecided)} {'is' if len(undecided) == 1 else 'are'} host-bound cannot be "
                     f"told here: {why}.")
    base_fastest = min(times[baseline]["step_s"]) if baseline in times and times[baseline]["step_s"] else None
    spread, steady = [], []
    for arm, t in times.items():
        steps, name = t["step_s"], labels.get(arm, arm)
        if len(steps) < 4:
            continue
        if not max(steps) > SPREAD * min(steps):
            steady.append(name)
            continue
        spread.append(name)
        said = (f"{name}'s steps spread from {min(steps) * 1e3:.3g} to {max(steps) * 1e3:.3g} ms: its "
                "median is not a typical step")
        if arm != baseline and base_fastest:
            said += f"; its fastest step is {min(steps) / base_fastest:.2f}x {base}'s fastest"
        lines.append(said + ".")
    if len(spread) > 1 and steady:
        # Notebook 03 as a pretend T4 on an H200: ours, its filter-off arm and plain torch's chunked loss
        # each had steps near 12 and near 25 ms while exact and naive held steady.
        lines.append(f"{_listed(spread)} each spread, {_listed(steady)} did not: slow steps shared by more than one "
                     "loss come from outside any one of them (this machine's host at times), not from one loss's "
                     "path.")
    if pretend and any(t["host_bound"] for arm, t in times.items() if arm != baseline):
        lines.append(f"As a pretend {pretend} the kernels take the card's configurations at this GPU's speed: a "
                     "host-bound arm's ratio here measures this machine's host, and on the card itself, whose "
                     "arithmetic is slower, the same launches would hide behind more of its kernels' time.")
    return lines


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


__all__ = ["time_training_steps", "against_baseline", "describe_step_times"]
