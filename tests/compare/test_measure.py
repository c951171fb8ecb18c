"""helpers.compare.measure on the CPU: the peak-memory meter against known allocations and against autograd,
the byte budget that stands in for a small card, latency statistics, host against device time, the
OOM-safe runner, and the chunked method's bounded memory."""

import math
import time

import pytest
import torch

from helpers.compare.measure import (
    HostDeviceTime,
    MemoryBudgetExceeded,
    apply_memory_cap,
    call_times_ms,
    host_and_device_time,
    is_host_bound,
    is_out_of_memory,
    latency,
    measure,
    peak_memory,
)
from helpers.compare.methods.baselines import chunked_loss, naive_loss
from helpers.compare.inputs import make_inputs

MB = 1024**2


def test_peak_memory_measures_a_known_allocation():
    result, peak = peak_memory(lambda: torch.empty(10 * MB, dtype=torch.uint8), device="cpu")
    assert result.numel() == 10 * MB
    assert abs(peak - 10 * MB) <= 0.02 * 10 * MB


def test_peak_memory_sees_a_temporary_freed_before_the_end():
    def fn():
        a = torch.empty(4 * MB, dtype=torch.uint8)
        b = torch.empty(8 * MB, dtype=torch.uint8)  # peak here: a and b, 12 MB
        del a
        c = torch.empty(2 * MB, dtype=torch.uint8)  # 10 MB: below the peak
        return b, c

    _, peak = peak_memory(fn, device="cpu")
    assert abs(peak - 12 * MB) <= 0.02 * 12 * MB


def test_peak_memory_does_not_count_what_existed_before():
    held = torch.empty(32 * MB, dtype=torch.uint8)
    _, peak = peak_memory(lambda: held.add_(1), device="cpu")  # in place: allocates nothing
    assert peak < MB


def test_peak_memory_ignores_frees_of_blocks_from_an_earlier_profile():
    # A library that keeps a buffer from one call and frees it in the next (Liger under the
    # interpreter does): the profiler knows that block's size from the earlier profile, and the
    # free must not pull the running sum below what this call allocates.
    kept = [peak_memory(lambda: torch.empty(4 * MB, dtype=torch.uint8), device="cpu")[0]]

    def fn():
        kept.clear()
        return torch.empty(MB, dtype=torch.uint8)

    _, peak = peak_memory(fn, device="cpu")
    assert abs(peak - MB) <= 0.02 * MB


def test_peak_memory_follows_autograd_through_backward():
    # The naive loss peaks inside log_softmax's backward with three fp32 N×V tensors alive: the
    # meter must see allocations made by the autograd engine, not only by the forward. fp32 inputs:
    # a CPU's fp16 matmul allocates a conversion workspace whose size depends on the processor's
    # instruction set (on some, 1.7% over 12·N·V here), which is the BLAS's, not the loss's.
    N, V, D = 96, 1031, 32
    E, C, x = make_inputs(N, V, D, torch.float32, "cpu", requires_grad=True)

    def step():
        return torch.autograd.grad(naive_loss(E, C, x), (E, C))

    step()
    _, peak = peak_memory(step, device="cpu")
    assert abs(peak / (12 * N * V) - 1) < 0.01


def test_budget_turns_an_oversized_peak_into_an_oom():
    with pytest.raises(MemoryBudgetExceeded) as raised:
        peak_memory(lambda: torch.empty(4 * MB, dtype=torch.uint8), device="cpu", budget_bytes=MB)
    assert isinstance(raised.value, MemoryError) and is_out_of_memory(raised.value)
    _, peak = peak_memory(lambda: torch.empty(MB // 2, dtype=torch.uint8), device="cpu", budget_bytes=MB)
    assert peak <= MB


def test_is_out_of_memory_reads_the_exception_chain():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.96 GiB")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("backend compiler failed") from inner
    except RuntimeError as wrapped:
        assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(ValueError("shape mismatch"))


def test_latency_returns_sane_statistics():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    stats = latency(fn, warmup=2, repeats=5, device="cpu")
    assert len(calls) == 7
    assert stats.repeats == 5
    assert 2.0 <= stats.p10_ms <= stats.median_ms <= stats.p90_ms < 200
    assert latency(fn, warmup=0, repeats=1, device="cpu").median_ms >= 2.0
    with pytest.raises(ValueError):
        latency(fn, repeats=0, device="cpu")


def test_measure_records_an_oom_and_lets_other_errors_through():
    def too_big():
        return torch.empty(4 * MB, dtype=torch.uint8)

    result = measure(too_big, warmup=1, repeats=2, device="cpu", budget_bytes=MB)
    assert result.status == "oom" and "MemoryBudgetExceeded" in result.error and result.peak_bytes is None

    def real_oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    assert measure(real_oom, device="cpu").status == "oom"

    def broken():
        raise ValueError("not a memory problem")

    with pytest.raises(ValueError):
        measure(broken, device="cpu")

    fine = measure(lambda: torch.ones(MB // 4), warmup=1, repeats=3, device="cpu")
    assert fine.status == "ok" and abs(fine.peak_bytes - MB) <= 0.02 * MB and fine.latency.repeats == 3


def test_memory_cap_on_the_cpu_is_a_budget():
    cap = apply_memory_cap(0.9, cpu_budget_bytes=5_000_000, device="cpu")
    assert cap.budget_bytes == cap.usable_bytes == 5_000_000
    assert cap.room_for(input_bytes=1_000_000) == 5_000_000  # the budget is above the inputs already
    assert apply_memory_cap(0.9, device="cpu").budget_bytes is None


def test_chunked_peak_grows_with_dE_only_while_naive_grows_with_the_logits():
    # fp32, so the blocks are easy to count: dE (N, D), dC (V, D), and at most four fp32 (rows, V)
    # blocks (raw logits, z - lse, G, and the previous chunk's G, which lives until the new one is
    # bound). Going from N1 to N2 tokens naive must add 12 bytes per extra logit; chunked only the
    # extra rows of dE (and O(N) per-row vectors).
    V, D, rows = 1031, 32, 16
    N1, N2 = 128, 512

    def peaks(loss):
        out = []
        for N in (N1, N2):
            E, C, x = make_inputs(N, V, D, torch.float32, "cpu", requires_grad=True)

            def step():
                return torch.autograd.grad(loss(E, C, x), (E, C))

            step()
            out.append(peak_memory(step, device="cpu")[1])
        return out

    naive = peaks(naive_loss)
    chunked = peaks(lambda E, C, x: chunked_loss(E, C, x, rows=rows))
    assert abs((naive[1] - naive[0]) / (12 * (N2 - N1) * V) - 1) < 0.01

    chunk_budget = 4 * rows * V * 4
    per_row_vectors = 64  # bytes per token of fp32/int64/bool (N,) vectors: lse, weights, targets, mask
    for N, peak in zip((N1, N2), chunked):
        gradients = (N * D + V * D) * 4
        assert gradients <= peak <= gradients + chunk_budget + per_row_vectors * N
    assert chunked[1] - chunked[0] <= (N2 - N1) * (D * 4 + per_row_vectors)
    assert chunked[1] < naive[1] / 10
    assert math.isclose(chunked[1] - chunked[0], (N2 - N1) * D * 4, rel_tol=0.5)


def test_the_profilers_native_warning_is_dropped_and_other_native_output_kept(capfd):
    import os

    from helpers.compare.measure import _without_native_line

    with _without_native_line("Memory block of unknown size"):
        os.write(2, b"[W CPUAllocator.cpp:245] Memory block of unknown size was allocated before\n")
        os.write(2, b"a real problem\n")
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "unknown size" not in err and "a real problem\n" in err and "after\n" in err


def test_call_times_come_in_call_order_after_the_warm_up():
    delays = iter([0.05, 0.0, 0.02, 0.0])  # the first call is the warm-up (a compilation, say)

    times = call_times_ms(lambda: time.sleep(next(delays)), warmup=1, repeats=3, device="cpu")
    assert len(times) == 3 and times[1] >= 20.0 and max(times[0], times[2]) < 20.0


def test_host_and_device_time_on_the_cpu_is_one_wall_time_per_call():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    timed = host_and_device_time(fn, calls=4, warmup=1, device="cpu")
    assert len(calls) == 5 and timed.calls == 4
    assert 2.0 <= timed.host_ms < 200 and timed.device_ms == timed.host_ms  # the CPU is the device
    assert set(timed.as_dict()) == {"host_ms", "device_ms", "calls", "host_bound"}


def test_host_bound_means_the_host_takes_at_least_the_devices_time():
    assert is_host_bound(2.0, 1.0) and is_host_bound(1.0, 1.0) and not is_host_bound(1.0, 2.0)
    assert HostDeviceTime(0.5, 3.0, 5).as_dict()["host_bound"] is False
    assert HostDeviceTime(0.5, math.nan, 5).host_bound is None  # no GPU activity recorded: no verdict


def test_device_busy_time_counts_overlapping_intervals_once_and_gaps_never():
    from helpers.compare.measure import _union_ns

    assert _union_ns([]) == 0
    # two kernels overlapping by 5, one inside another, a gap of 10, one more
    assert _union_ns([(30, 40), (0, 10), (5, 15), (6, 8)]) == 15 + 10


def test_peak_memory_collects_earlier_cycles_before_its_baseline():
    """Python cycles left by earlier work (a compiled method's graphs hold tensors) are collected before
    the baseline is read: collected inside ``fn`` on a GPU, their bytes came off its peak (an H200 bench
    once gave ours 25 MB, 0.08 LB, for a step that returns 313 MB of gradients). The CPU's meter ignores
    frees of older blocks anyway, so the test looks at the cycle itself: gone before ``fn`` starts."""
    import gc
    import weakref

    class Cycle:
        pass

    def leave_cycle():
        a, b = Cycle(), Cycle()
        a.other, b.other, a.held = b, a, torch.ones(MB, dtype=torch.uint8)
        return weakref.ref(a)

    seen = []
    gc.disable()
    try:
        ref = leave_cycle()
        peak_memory(lambda: seen.append(ref() is None), device="cpu")
    finally:
        gc.enable()
    assert seen == [True]


def test_a_loss_step_checks_its_targets_once_not_in_every_timed_call(monkeypatch):
    """``loss_step`` refuses targets out of range when it is made, and its calls do not check again: a
    check reads the device (a sync), which would time a host-heavy method as host plus GPU."""
    import helpers.compare.methods.entry as entry
    from helpers.compare.measure import loss_step

    E, C, x = make_inputs(16, 50, 8, torch.float32, "cpu", seed=0, requires_grad=True)
    with pytest.raises(ValueError, match="outside"):
        loss_step("naive", E, C, torch.full_like(x, 50))
    step = loss_step("naive", E, C, x)
    checks = []
    real = entry.validate_inputs
    monkeypatch.setattr(entry, "validate_inputs", lambda *a, **k: checks.append(k["check_targets"]) or real(*a, **k))
    step()
    assert checks == [False]
