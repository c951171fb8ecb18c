"""The one place that measures: peak memory, latency, the memory cap, and an OOM-safe runner.

Every number a notebook reports about memory or time comes from here, measured the same way on
every device:

- ``peak_memory(fn)``: the most memory ``fn`` held at once, in bytes above what was allocated when
  it started (so the inputs, allocated before, are not counted; everything ``fn`` allocates is:
  logits, temporaries, and the gradients it returns). On CUDA from the caching allocator's
  statistics; on the CPU reconstructed from the PyTorch profiler's allocation events.
- ``latency(fn, warmup, repeats)``: median, p10 and p90 wall time of ``fn`` in milliseconds, after
  warm-up (CUDA events on a GPU, ``time.perf_counter`` on the CPU); ``call_times_ms`` the times
  themselves, in call order.
- ``host_and_device_time(fn, calls)``: per call, the host's time to issue ``fn`` (no wait for the
  GPU) against the GPU's busy time: whether ``fn`` is host-bound (``is_host_bound``).
- ``apply_memory_cap(...)``: the guardrail. On CUDA, ``set_per_process_memory_fraction`` turns an
  over-allocation into a catchable ``torch.OutOfMemoryError`` instead of a machine taken down; with
  a pretend card (``helpers.cce.device.pretend``) a big GPU gets that card's memory. On the CPU a
  byte budget on the measured peak plays the same part (``MemoryBudgetExceeded``), so tests and the
  CPU smoke run can hit an OOM wall.
- ``measure(fn, ...)``: warm-up, peak memory, latency, with an OOM recorded as a result (memory
  released) instead of an exception that ends a sweep.
- ``loss_step(method, E, C, x)``: the ``fn`` a loss method is measured by (forward, then dE and dC),
  for the sweep and the benchmark alike.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from helpers.cce.device import CARDS, default_device, device_info
from helpers.cce.graphs import GRAPHS
from helpers.compare.methods import get_method
from helpers.spec import validate_inputs


class MemoryBudgetExceeded(MemoryError):
    """A step's measured peak went past the byte budget: a simulated OOM, for CPU runs and tests.

    The step has run to the end (the CPU has the memory); the budget is checked on the measured
    peak afterwards, so it says "this would not have fitted", exactly where the measurement says.
    """


def _device(device) -> torch.device:
    return torch.device(device) if device is not None else default_device()


# ---------------------------------------------------------------------------------------------
# Peak memory
# ---------------------------------------------------------------------------------------------


def peak_memory(
    fn: Callable[[], Any], *, device: torch.device | str | None = None, budget_bytes: int | None = None
) -> tuple[Any, int]:
    """(fn(), peak bytes ``fn`` held above what was allocated when it started).

    CUDA: ``reset_peak_memory_stats``, then ``max_memory_allocated`` minus ``memory_allocated``
    before the call (tensor bytes the caching allocator handed out; its cache is not counted), plus
    what a replayed CUDA graph of our loss held outside that count (``helpers.cce.graphs``).

    CPU: there are no allocator statistics, so ``fn`` runs under
    ``torch.profiler.profile(activities=[CPU], profile_memory=True)``, which records every CPU
    allocation and free with its size and time (on every thread, autograd's backward included).
    The peak is the largest running sum of those events in time order, counting only blocks ``fn``
    allocated: a free of memory that existed before the call is ignored (for a block from before
    any profiling the profiler does not even know the size, and says so once on stderr). Checked in
    tests/compare/test_measure.py against known allocations, and against the naive loss, whose backward
    holds exactly three fp32 N×V tensors at its peak. Under the Triton interpreter a kernel's own
    numpy scratch is invisible here; on a GPU a Triton kernel allocates nothing, so the two agree.

    ``budget_bytes``: raise ``MemoryBudgetExceeded`` when the peak is above it (the CPU's cap).
    """
    device = _device(device)
    # Python's cycles from earlier work (a compiled method's graphs hold CUDA tensors) collected first:
    # freed inside ``fn``, their bytes would be subtracted from its peak.
    gc.collect()
    GRAPHS.reset_peak(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - start
    else:
        result, peak = _cpu_peak_memory(fn)
    # A replayed CUDA graph's pool and input copies are memory no allocation during the call shows
    # (``helpers.cce.graphs``): added, so that a graphed call is not measured below what it uses.
    peak += GRAPHS.peak_bytes(device)
    if budget_bytes is not None and peak > budget_bytes:
        raise MemoryBudgetExceeded(
            f"peak {peak / 1e6:,.3f} MB is over the budget of {budget_bytes / 1e6:,.3f} MB"
        )
    return result, peak


def memory_timeline(fn: Callable[[], Any], *, device: torch.device | str | None = None) -> tuple[Any, list[int]]:
    """(fn(), the bytes ``fn`` held above its start after each allocation and free, in order).

    CUDA: the caching allocator's own record (``torch.cuda.memory._record_memory_history``), so
    every tensor allocation and free counts; CPU: the profiler's events, as ``peak_memory`` reads
    them. Its maximum is ``peak_memory``'s number; its shape shows where in a step the peak is.
    """
    device = _device(device)
    if device.type != "cuda":
        result, events = _cpu_memory_events(fn)
        held, timeline = 0, []
        for size in events:
            held += size
            timeline.append(held)
        return result, timeline
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, device=device)
    try:
        result = fn()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    traces = snapshot["device_traces"][index]
    held, live, timeline = 0, {}, []
    for event in traces:
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            held += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            held -= live.pop(event["addr"])
        else:
            continue
        timeline.append(held)
    return result, timeline


@contextlib.contextmanager
def _without_native_line(fragment: str):
    """Drop the lines containing ``fragment`` that C++ code writes to the process's stderr (file
    descriptor 2, out of reach of ``warnings``) inside the block; pass every other line on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if fragment not in line]
            if kept:
                sys.stderr.write("".join(kept))


def _cpu_memory_events(fn: Callable[[], Any]) -> tuple[Any, list[int]]:
    """(fn(), the signed sizes of the allocations and frees ``fn`` made, in time order): frees of
    blocks allocated before the call are left out (the module doc of ``peak_memory`` says why)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _without_native_line("Memory block of unknown size"):  # that case is handled below
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
    events = [
        node
        for node in _walk(prof.profiler.kineto_results.experimental_event_tree())
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu"
    ]
    events.sort(key=lambda node: node.start_time_ns)
    live: dict[int, int] = {}
    sizes = []
    for node in events:
        size, address = node.extra_fields.alloc_size, node.extra_fields.ptr
        if size > 0:
            live[address] = size
            sizes.append(size)
        elif address in live:
            sizes.append(-live.pop(address))
    return result, sizes


def _cpu_peak_memory(fn: Callable[[], Any]) -> tuple[Any, int]:
    # The event tree holds each allocation (positive size) and free (negative size) as its own
    # node with a timestamp. The flat FunctionEvent list would not do: it folds a free into the op
    # that made it, so an op that allocates a temporary and frees it shows no peak at all.
    result, sizes = _cpu_memory_events(fn)
    held = peak = 0
    for size in sizes:
        held += size
        peak = max(peak, held)
    return result, peak


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


# ---------------------------------------------------------------------------------------------
# Latency
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyStats:
    """Wall time of one call, in milliseconds, over ``repeats`` timed calls after warm-up."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    repeats: int

    def as_dict(self) -> dict:
        return asdict(self)


def call_times_ms(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 7,
    device: torch.device | str | None = None,
) -> list[float]:
    """Wall time of each of ``repeats`` calls of ``fn`` in milliseconds, in call order, after
    ``warmup`` untimed ones (compilation and autotuning happen there, outside every timer).

    Time on random inputs, never zeros: a kernel or a CPU may take shortcuts on zeros. On CUDA each
    call sits between two CUDA events (GPU time of the call, launch queue included), read after one
    synchronisation at the end; on the CPU, ``time.perf_counter`` around each call.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = _device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        gc.collect()  # earlier work's cycles not collected inside the timed calls (host time; ~50 ms a collection)
        torch.cuda.synchronize(device)
        events = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def latency(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 7,
    device: torch.device | str | None = None,
) -> LatencyStats:
    """Median, p10 and p90 of ``repeats`` timed calls of ``fn`` after ``warmup`` untimed ones,
    timed by ``call_times_ms``."""
    times = sorted(call_times_ms(fn, warmup=warmup, repeats=repeats, device=device))
    return LatencyStats(
        median_ms=statistics.median(times),
        p10_ms=_percentile(times, 0.10),
        p90_ms=_percentile(times, 0.90),
        repeats=repeats,
    )


@dataclass(frozen=True)
class HostDeviceTime:
    """Per call of ``fn``, in milliseconds: the host's time and the device's busy time.

    host_ms: the host's wall time inside ``fn`` over back-to-back calls, with no synchronisation
    but what ``fn`` does itself: the Python, dispatch and kernel-launch work of a call. device_ms:
    the time the GPU spent running the calls' kernels and copies (its idle gaps left out); on the
    CPU, which is host and device at once, the same wall time as host_ms.
    """

    host_ms: float
    device_ms: float
    calls: int

    @property
    def host_bound(self) -> bool | None:
        """None where the device time is unknown (NaN: the profiler recorded no GPU activity)."""
        return is_host_bound(self.host_ms, self.device_ms) if math.isfinite(self.device_ms) else None

    def as_dict(self) -> dict:
        return {**asdict(self), "host_bound": self.host_bound}


def is_host_bound(host_ms: float, device_ms: float) -> bool:
    """Whether a call is host-bound: the host takes at least as long to issue it as the GPU takes
    to run it, so the GPU waits on the host (launch latency: many small kernels, small shapes) and
    a faster GPU would not make the call faster."""
    return host_ms >= device_ms


def host_and_device_time(
    fn: Callable[[], Any],
    *,
    calls: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
) -> HostDeviceTime:
    """Host time and device busy time per call of ``fn`` over ``calls`` back-to-back calls.

    Host: ``time.perf_counter`` around the calls, started after a synchronisation and read before
    the final one, so the host never waits for the GPU but where ``fn`` itself synchronises (a
    ``.item()``: then that wait is part of its host time, as it is of every call's). Device (CUDA):
    a second pass of the same calls under the PyTorch profiler, the union of the intervals in which
    the GPU ran something (kernels, copies, sets), divided by ``calls``; the profiler's own host
    cost cannot enter it, and the first pass, which gives the host time, runs without it. CPU: one
    pass; device_ms is host_ms. ``warmup`` untimed calls come first.
    """
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    device = _device(device)
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()  # as ``call_times_ms``
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_ms = (time.perf_counter() - start) * 1e3 / calls
    if not cuda:
        return HostDeviceTime(host_ms, host_ms, calls)
    torch.cuda.synchronize(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    intervals = [
        (event.start_ns(), event.end_ns())
        for event in prof.profiler.kineto_results.events()
        if event.device_type() == torch.autograd.DeviceType.CUDA and not _is_annotation(event)
    ]
    # No GPU activity at all (a profiler without CUPTI, say) is an unknown, not a GPU that idled.
    device_ms = _union_ns(intervals) / 1e6 / calls if intervals else math.nan
    return HostDeviceTime(host_ms, device_ms, calls)


def _is_annotation(event) -> bool:
    """A GPU-side copy of a ``record_function`` range: it spans kernels and the gaps between
    them, so it is not GPU work of its own."""
    is_annotation = getattr(event, "is_user_annotation", None)  # absent from older torch
    activity = getattr(event, "activity_type", None)
    return bool(is_annotation and is_annotation()) or bool(activity and "annotation" in activity())


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """Total length of the union of [start, end) intervals: time covered by at least one (two
    overlapping kernels on two streams are counted once)."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), on sorted values."""
    position = q * (len(sorted_values) - 1)
    low, high = math.floor(position), math.ceil(position)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


# ---------------------------------------------------------------------------------------------
# The memory cap (the article's guardrail) and out-of-memory handling
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryCap:
    """How much memory a run may use, and who enforces it.

    usable_bytes: on CUDA, all the process may allocate (inputs included), enforced by the caching
    allocator; on the CPU, the budget on one step's peak above its inputs, enforced by
    ``peak_memory``. None: no cap (a CPU run without a budget).
    """

    device_kind: str  # "cuda" or "cpu"
    usable_bytes: int | None
    total_bytes: int | None  # the card's memory; None on the CPU
    fraction: float | None  # what set_per_process_memory_fraction was given; None on the CPU
    pretend: str | None = None  # the key of the card (helpers.cce.device.CARDS) whose memory it stands for

    @property
    def pretend_t4(self) -> bool:
        return self.pretend == "t4"

    def room_for(self, input_bytes: int) -> int | None:
        """Bytes left for one step's peak (above its inputs) once ``input_bytes`` are resident."""
        if self.usable_bytes is None:
            return None
        return self.usable_bytes - input_bytes if self.device_kind == "cuda" else self.usable_bytes

    @property
    def budget_bytes(self) -> int | None:
        """The byte budget ``peak_memory`` must check: the CPU's cap (CUDA enforces its own)."""
        return self.usable_bytes if self.device_kind == "cpu" else None

    def describe(self) -> str:
        if self.usable_bytes is None:
            return "no memory cap"
        if self.device_kind == "cpu":
            return (
                f"simulated cap: a step whose measured peak is over {self.usable_bytes / 1e6:,.1f} MB "
                "counts as out of memory"
            )
        raises = "past it an allocation raises torch.OutOfMemoryError"
        if self.pretend:
            card = CARDS[self.pretend]
            return (
                f"pretending to be {card.a_label}: allocator capped at {self.usable_bytes / 1e9:.2f} GB "
                f"({self.usable_bytes / card.memory_bytes:.0%} of {card.a_label}'s {card.memory_bytes / 1e9:.2f} GB) "
                f"on this card's {self.total_bytes / 1e9:.2f} GB; {raises}"
            )
        return (
            f"allocator capped at {self.usable_bytes / 1e9:.2f} GB ({self.fraction:.0%} of this "
            f"card's {self.total_bytes / 1e9:.2f} GB); {raises}"
        )


def apply_memory_cap(
    memory_fraction: float | None,
    *,
    cpu_budget_bytes: int | None = None,
    card_bytes: int | None = None,
    device: torch.device | str | None = None,
) -> MemoryCap:
    """Cap the memory this process may use, and say how much that is.

    CUDA: ``torch.cuda.set_per_process_memory_fraction`` so that an allocation past the cap raises
    a catchable ``torch.OutOfMemoryError`` (the guardrail the article added after an OOM took a
    unified-memory machine down). The usable bytes are ``memory_fraction`` of the card as
    ``helpers.cce.device.device_info`` sees it: on a pretend card (``HELPERS_PRETEND=t4``, ...) of
    that card's memory, so a bigger GPU hits the wall a reader with that card running this same code
    would hit, guardrail included. ``memory_fraction=None`` leaves the card (or the pretend card)
    uncapped. ``card_bytes``: take the fraction of a card of that size instead (a 16 GB card's wall
    on a bigger one; the cap says which card of ``CARDS`` that is, where one has that memory).

    CPU: nothing to set; ``cpu_budget_bytes`` (or None) becomes the budget ``peak_memory`` checks.
    """
    device = _device(device)
    if device.type != "cuda":
        return MemoryCap("cpu", cpu_budget_bytes, None, None)
    info = device_info(device)
    total = torch.cuda.get_device_properties(device).total_memory
    card = min(total, card_bytes) if card_bytes else info.total_memory_bytes
    usable = min(total, int(card * (memory_fraction if memory_fraction is not None else 1.0)))
    fraction = usable / total
    # Set even when it is 1.0: a notebook re-run in the same process must not keep an old cap.
    # It takes an index: a bare torch.device("cuda") raises ("expected ... a specified index").
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    sized_like = next((c.key for c in CARDS.values() if c.memory_bytes == card_bytes), None) if card_bytes else None
    return MemoryCap("cuda", usable, total, fraction, info.pretend if card_bytes is None else sized_like)


def is_out_of_memory(error: BaseException) -> bool:
    """True when ``error``, or an exception it was raised from, is an out-of-memory error.

    torch raises ``torch.OutOfMemoryError``; a MemoryError covers the CPU (and our budget); the
    chain is searched because torch.compile and some extensions wrap what they catch.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(error, RuntimeError) and "out of memory" in str(error).lower():
            return True
        error = error.__cause__ or error.__context__
    return False


def release_memory(device: torch.device | str | None = None) -> None:
    """Free what a failed or finished step left: our loss's CUDA graphs (keyed by the addresses of
    tensors now gone, ``helpers.cce.graphs``), Python cycles, then the CUDA cache."""
    GRAPHS.clear()
    gc.collect()
    if _device(device).type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Measurement:
    """One step measured: ``status`` "ok" (with peak and latency) or "oom" (with the error)."""

    status: str
    peak_bytes: int | None = None
    latency: LatencyStats | None = None
    error: str = ""


def measure(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 7,
    device: torch.device | str | None = None,
    budget_bytes: int | None = None,
) -> Measurement:
    """Warm ``fn`` up, measure its peak memory (one call), then its latency (``repeats`` calls).

    Warm-up comes first so that one-time costs (compilation, cuBLAS workspaces, autotuning) are
    neither in the peak nor in the times. An out-of-memory error at any stage (a real one, or the
    CPU budget) is returned as ``status="oom"`` after the memory is released; any other error
    propagates.
    """
    device = _device(device)
    try:
        for _ in range(warmup):
            fn()
        _, peak = peak_memory(fn, device=device, budget_bytes=budget_bytes)
        stats = latency(fn, warmup=0, repeats=repeats, device=device)
        result = Measurement("ok", peak, stats)
    except Exception as error:  # noqa: BLE001  (only OOMs are caught; see the re-raise)
        if not is_out_of_memory(error):
            raise
        result = Measurement("oom", error=f"{type(error).__name__}: {_first_line(error)}")
    # Outside the except block: the exception and its traceback (whose frames hold the step's
    # tensors) are gone, so this really frees them.
    release_memory(device)
    return result


def loss_step(method: str, E: torch.Tensor, C: torch.Tensor, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One training step's worth of loss work: forward, then dE and dC (mean over tokens).

    ``torch.autograd.grad`` hands the gradients back instead of storing them in ``.grad``: each call
    then starts from the same memory, and what it measures ends with the gradients it returns. The
    inputs are checked once, here: a check of the targets' range in every call would read the device,
    a sync that makes the host wait for the previous call's work, so a method with much host work per
    call (few tokens) would be timed as host plus GPU instead of the larger of the two (on an H200 at
    1,024 tokens, ours 3.1-3.4 ms a call with the sync against 1.9-2.0 without; torch.compile 2.2-2.4).
    """
    loss_fn = get_method(method)
    validate_inputs(E, C, x)

    def step() -> torch.Tensor:
        loss = loss_fn(E, C, x, check_targets=False)
        torch.autograd.grad(loss, (E, C))
        return loss.detach()

    return step


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


__all__ = [
    "HostDeviceTime",
    "LatencyStats",
    "Measurement",
    "MemoryBudgetExceeded",
    "MemoryCap",
    "apply_memory_cap",
    "call_times_ms",
    "host_and_device_time",
    "is_host_bound",
    "is_out_of_memory",
    "latency",
    "loss_step",
    "measure",
    "peak_memory",
    "release_memory",
]
