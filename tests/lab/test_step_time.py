"""helpers.lab.step_time: notebook 03's fair step timer. Warm-up outside the timed steps, no skip
counting while timing, and the host-bound reading of its numbers. Tiny shapes, exact loss on the CPU."""

import math
import time

import pytest
import torch

from helpers.compare.methods.baselines import exact_loss
from helpers.compare.methods import Method
from helpers.lab import step_time, training

TIMING = dict(compute_dtype=torch.float32, device="cpu", lr=1e-2)


def small_task():
    return training.FineTuneTask(V=97, D=12, d_features=10, rows=256, batch=24)


def test_the_warm_up_steps_are_not_among_the_timed_ones(temporary_method):
    calls = []

    def compiles_first(E, C, x, **kw):  # its first two calls stand for compilation and autotuning
        calls.append(1)
        if len(calls) <= 2:
            time.sleep(0.25)
        return exact_loss(E, C, x, **kw)

    temporary_method(Method("compiles_first", "compiles first", "exact, slow on its first two calls",
                            compiles_first, lambda device, dtype, softcap: None))
    timed = step_time.time_training_steps(small_task(), "compiles_first", warmup=2, repeats=3, loss_calls=1, **TIMING)
    assert len(timed["step_s"]) == 3 and max(timed["step_s"]) < 0.2 and timed["median_s"] < 0.2
    # The same arm without warm-up: the slow calls land in the timed steps (the check above can fail).
    calls.clear()
    cold = step_time.time_training_steps(small_task(), "compiles_first", warmup=0, repeats=3, loss_calls=1, **TIMING)
    assert cold["step_s"][0] >= 0.25 and cold["step_s"][1] >= 0.25


def test_no_arm_counts_skipped_tiles_while_it_is_timed(temporary_method):
    received = []

    def counting(E, C, x, stats=None, **kw):
        received.append(stats)
        return exact_loss(E, C, x, **kw)

    temporary_method(Method("counting", "counting", "exact, records the stats it is handed",
                            counting, lambda device, dtype, softcap: None, counts_skips=True))
    training.train(small_task(), "counting", seed=0, steps=2, lr=1e-2)
    assert received and all(isinstance(s, dict) for s in received)  # training counts: the recorder sees it
    received.clear()
    step_time.time_training_steps(small_task(), "counting", warmup=1, repeats=2, loss_calls=1, **TIMING)
    assert len(received) == 1 + 2 + 1 + 1 and all(s is None for s in received)  # steps, then loss calls


def test_the_result_names_what_was_timed():
    timed = step_time.time_training_steps(small_task(), "exact", warmup=1, repeats=4, loss_calls=2, **TIMING)
    assert set(timed) == {"variant", "median_s", "step_s", "warmup", "repeats", "host_ms", "device_ms", "loss_calls",
                          "host_bound", "device", "tokens", "V", "D", "dtype"}
    assert (timed["tokens"], timed["V"], timed["D"], timed["dtype"]) == (24, 97, 12, "float32")
    assert len(timed["step_s"]) == 4 and timed["median_s"] == pytest.approx(sum(sorted(timed["step_s"])[1:3]) / 2)
    assert timed["host_ms"] > 0 and math.isnan(timed["device_ms"]) and timed["device"] == "cpu"
    assert timed["host_bound"] is None  # the CPU is host and device at once: no device time, no verdict


def _timed(median_s, host_ms, device_ms, host_bound, device="cpu"):
    return {"median_s": median_s, "step_s": [median_s], "warmup": 3, "repeats": 10, "host_ms": host_ms,
            "device_ms": device_ms, "loss_calls": 5, "host_bound": host_bound, "device": device, "tokens": 4096,
            "V": 32768, "D": 256, "dtype": "float16"}


def test_each_slower_arm_is_read_as_host_bound_or_device_bound():
    times = step_time.against_baseline({
        "exact": _timed(0.010, 0.4, 2.0, False),
        "ours": _timed(0.028, 3.0, 1.0, True),
        "liger": _timed(0.020, 0.5, 4.0, False),
        "chunked": _timed(0.009, 5.0, 1.0, True),  # faster than exact: no reading needed
        "cpu_arm": _timed(0.030, 2.0, 2.0, None),
    })
    assert times["ours"]["vs_baseline"] == pytest.approx(2.8) and times["exact"]["vs_baseline"] == 1.0
    lines = step_time.describe_step_times("fine-tuning", times, {"ours": "Ours", "liger": "Liger"})
    assert "N = 4,096 tokens a step, V = 32,768, D = 256, float16" in lines[0] and "median of 10 steps" in lines[0]
    interpreter, ours, liger, cpu, undecided = lines[1:]  # on a CPU: what its ratios measure, first
    assert interpreter.startswith("On a CPU the Triton kernels (ours, Liger's) run under the Triton interpreter")
    assert ours.startswith("Ours takes 2.80x the step time of exact")
    assert "host 3 ms and the GPU 1 ms: host-bound" in ours
    assert liger.startswith("Liger takes 2.00x") and "device-bound" in liger and "host-bound" not in liger
    assert cpu.startswith("cpu_arm takes 3.00x") and "bound" not in cpu
    assert undecided.startswith("Whether cpu_arm is host-bound cannot be told here: on a CPU host and device are one")
    assert not any("chunked" in line for line in lines)
    on_gpu = step_time.against_baseline({"exact": _timed(0.010, 0.4, 2.0, False, "cuda"),
                                         "ours": _timed(0.030, 2.0, math.nan, None, "cuda")})
    assert not any(line.startswith("On a CPU") for line in step_time.describe_step_times("fine-tuning", on_gpu, {}))
    assert step_time.describe_step_times("fine-tuning", on_gpu, {})[-1].endswith(
        "cannot be told here: the profiler recorded no GPU activity for the loss.")


def test_without_a_baseline_there_is_no_ratio():
    times = step_time.against_baseline({"ours": _timed(0.02, 1.0, 2.0, False)})
    assert math.isnan(times["ours"]["vs_baseline"])
    assert step_time.describe_step_times("pretraining", {}, {}) == ["pretraining: no arm was timed."]


def test_a_spread_of_steps_and_a_pretend_card_are_read_out():
    """A median of steps at two speeds is no typical step (notebook 03's pretraining as a pretend T4:
    five steps near 10 ms, five near 25); on a pretend card a host-bound ratio is this machine's host."""
    exact = {**_timed(0.0087, 5.0, 5.6, False), "step_s": [0.0090, 0.0187, 0.0086, 0.0084, 0.0084, 0.0085]}
    ours = {**_timed(0.0184, 7.4, 1.1, True), "step_s": [0.0284, 0.0251, 0.0097, 0.0103, 0.0238, 0.0104]}
    steady = {**_timed(0.0200, 1.0, 9.0, False), "step_s": [0.020, 0.021, 0.019, 0.020]}
    times = step_time.against_baseline({"exact": exact, "ours": ours, "steady": steady})
    lines = step_time.describe_step_times("pretraining", times, {"ours": "Ours"}, pretend="T4")
    spread = [line for line in lines if "steps spread" in line]
    assert spread == ["exact's steps spread from 8.4 to 18.7 ms: its median is not a typical step.",
                      "Ours's steps spread from 9.7 to 28.4 ms: its median is not a typical step; its fastest step is "
                      "1.15x exact's fastest."]
    assert "exact and Ours each spread, steady did not: slow steps shared by more than one loss come from " \
        "outside any one of them" in lines[-2]
    assert lines[-1].startswith("As a pretend T4 the kernels take the card's configurations at this GPU's speed")
    alone = step_time.against_baseline({"exact": {**exact, "step_s": [0.0084] * 6}, "ours": ours, "steady": steady})
    assert not any("each spread" in line for line in step_time.describe_step_times("p", alone, {}))
    plain = step_time.describe_step_times("pretraining", times, {"ours": "Ours"})
    assert not any("pretend" in line for line in plain)
    device_bound = step_time.against_baseline({"exact": exact, "steady": steady})
    assert not any("pretend" in line for line in step_time.describe_step_times("p", device_bound, {}, pretend="T4"))


def test_no_timed_call_reads_the_targets_on_the_device(monkeypatch):
    """The timed steps and loss calls do not check the targets through the method (a device read: the
    host would wait for the previous step, timing a host-heavy arm as host plus GPU): the batches'
    targets are checked on the host, before they move, and a bad one is still refused, naming x."""
    import helpers.compare.methods.entry as entry

    checks = []
    real = entry.validate_inputs
    monkeypatch.setattr(entry, "validate_inputs", lambda *a, **k: checks.append(k["check_targets"]) or real(*a, **k))
    step_time.time_training_steps(small_task(), "exact", warmup=1, repeats=2, loss_calls=2, **TIMING)
    assert checks and not any(checks), checks
    arm = training.start_arm(small_task(), "exact", seed=0, lr=1e-3, compute_dtype=torch.float32, device="cpu")
    inputs, targets = small_task().sample(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="x holds target 97"):
        arm.loss(inputs, torch.full_like(targets, 97))
