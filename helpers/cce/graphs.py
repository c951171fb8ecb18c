"""The loss's forward and "gemm" backward replayed from CUDA graphs, where the host's launches would
bound a call.

Why. With few tokens the GPU finishes our loss before the host has issued it: at the Qwen3 head
(V 151,936, D 1,024) with 1,024 tokens a call's ~25 launches (the forward's indexed dot, lse and
row loss; the backward's row weights, five G chunks, their ten cuBLAS products, dE's scaling) cost an
H200's host 1.8-3.6 ms against ~1.9 ms of GPU work, the backward ~2/3 of it, and a training step with
small micro-batches pays that every call (docs/PERFORMANCE.md, "1,024 tokens"). A CUDA graph replays
the same launches for ~10 us of host time.

What a graph holds. Capture records every kernel with its arguments, addresses included, and replay
reads and writes those addresses again. So a graph may only be replayed for a call whose tensors sit
where the captured call's sat. Per call:

- the small per-call inputs (E and the targets x; for the backward also the forward's lse and
  non-target mass r, the kept rows' count, the upstream gradients) are copied into the graph's own
  buffers before replay, N (D + ~4) elements at most, so that a new batch anywhere in memory replays;
- what is too large to copy (the classifier C, the bias, the class weights) and the backward's
  gradients (dE and dC, allocated from the caller's allocator just before the lookup, so that
  autograd may keep them: a graph's own output would be overwritten by the next replay) are part of
  the key by address. A training loop frees last step's gradients before the next backward
  (``zero_grad``), and the caching allocator hands the same blocks back: one backward graph per
  loop, two with gradient accumulation (dC's block alternates). The forward's outputs (the loss,
  lse, r, the kept count: O(N)) are the graph's own, copied out after each replay;
- the key also holds which call it is, the options, the tier, the gradients wanted, and every
  tensor's shape, strides and dtype: anything else the captured launches depend on is a function of
  these.

The targets' range check (a device read) stays outside the graph: launched before the forward's replay
and read after it is queued, so the host waits for the check, not the forward (as in eager).

A key is captured the second time it is seen (the first call runs eagerly): a loop whose shapes or
addresses never repeat pays no capture, and the eager call has compiled every kernel by then. The
capture runs the call once more eagerly first (that call's answer), with the host reads off
(``helpers.cce.shared.host_reads_off``: dC's scale enters through its operand, as under
``torch.compile``), so that what is captured is what was just run. At most
``HostTuning.graphs_kept`` graphs live per process (those whose C is gone are dropped to make room);
past that, new keys run eagerly. A capture that fails (an operation the graph cannot hold) runs
eagerly, is not tried again for that key, and warns once.

Memory. A graphed backward runs without the G buffer that few tokens get (``graphed_plan``: it saves
launches, which a graph makes free). The captured calls' temporaries (dE's fp32 accumulator, the row
weights, the forward's splits, a cuBLAS workspace of 32 MiB on Hopper) and the forward's outputs live in a
private pool that stays reserved while the
graphs live, shared by the graphs of one device and stream (replayed one after another, each
forward's outputs copied out before anything else runs), and each graph's input copies stay
allocated: neither shows in ``torch.cuda.memory_allocated`` during a replay. ``peak_bytes`` gives what
a replay held there, and ``helpers.compare.measure.peak_memory`` adds it to a measured peak, so a
graphed call is not reported below what it uses.

Where it runs (``applies``): CUDA, ``HostTuning.graphs_below_us`` > 0 and the backward's products
predicted below it (``backward_us``), "gemm" (what "auto" runs on a flat softmax), no ``stats``
(its counts are read on the host), and not already under capture or ``torch.compile``. What stays
eager: the per-token outputs (``helpers.cce.outputs``), "sparse" and "atomic".
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from helpers.cce.options import CCEPlan
from helpers.cce.shared import host_reads_off, no_host_sync

SEEN_KEPT = 64  # keys seen once, least recently used first: a second sight captures


def backward_us(N: int, V: int, D: int, dtype: torch.dtype, plan: CCEPlan) -> float:
    """The "gemm" backward's products, microseconds: G's logits at ``CCEConfigs.logit_tflops`` and dE's and
    dC's at the tier's matmul rate, where wanted."""
    configs = plan.configs
    product = 2.0 * N * V * D
    seconds = (product / configs.logit_tflops(dtype)
               + product * (plan.need[0] + plan.need[1]) / configs.matmul_tflops(dtype)) * 1e-12
    return seconds * 1e6


def graphed_plan(plan: CCEPlan) -> CCEPlan:
    """The plan a graphed backward runs: without the G buffer that few tokens get (``HostTuning.g_buffer_lb_share``,
    up to 8% of LB), which exists to save launches, and launches are free under a graph. Measured on an H200
    (Qwen3 head, 1,024 tokens, docs/measurements/h200-2026-12-05): 1.04 LB against 1.27 with it (its buffer,
    held in the graph's pool per backward graph), at 2.20 ms a call against 2.10. The tier is tuned once per
    tier (``CCEConfigs.tuned`` returns one object), so the graphs' key, which holds it by identity, is stable."""
    return replace(plan, configs=plan.configs.tuned(g_buffer_lb_share=0.0))


class CudaBackend:
    """CUDA's graphs, streams and allocator, as ``CallGraphs`` uses them (tests pass another)."""

    def available(self, E: torch.Tensor) -> bool:
        return E.device.type == "cuda"

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A call's gradient, from the caching allocator (which hands a freed block back)."""
        return torch.empty(shape, dtype=dtype, device=device)

    def stream_id(self, device: torch.device) -> int:
        return torch.cuda.current_stream(device).stream_id

    def pool(self, device: torch.device):
        return torch.cuda.graph_pool_handle()

    def reserved(self, device: torch.device) -> int:
        return torch.cuda.memory_reserved(device)

    def __init__(self):
        self._capture_streams: dict[torch.device, torch.cuda.Stream] = {}

    @contextmanager
    def _capture_stream(self, device: torch.device):
        """The device's capture stream (a graph cannot be captured on the default stream), after the
        current stream's work, which waits for it after. One per device, so that cuBLAS's workspace for
        it is made once."""
        current = torch.cuda.current_stream(device)
        if device not in self._capture_streams:
            self._capture_streams[device] = torch.cuda.Stream(device)
        side = self._capture_streams[device]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            yield
        current.wait_stream(side)

    def capture(self, fn: Callable[[], tuple], device: torch.device, pool) -> tuple[Callable[[], None], tuple]:
        """(replay, fn's outputs under capture): ``fn``, run eagerly just before (its kernels loaded),
        captured into a graph allocating from ``pool``. "thread_local": autograd runs a GPU backward on
        a thread of its own, while other threads may call CUDA."""
        graph = torch.cuda.CUDAGraph()
        with self._capture_stream(device):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs = fn()
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass  # the capture was invalidated by the error being raised
                raise
            graph.capture_end()
        return graph.replay, outputs


def _static(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what a graph reads, the buffer a call's tensor is copied into) for an input like ``t``: its
    shape, strides and dtype; a dimension of stride 0 (an expanded gradient) stays expanded, with
    one element stored (``_stored``)."""
    if 0 in t.stride() and t.numel() > 1:
        buffer = torch.empty([1 if stride == 0 else size for size, stride in zip(t.shape, t.stride())],
                             dtype=t.dtype, device=t.device)
        return buffer.expand(t.shape), buffer
    buffer = torch.empty_like(t, memory_format=torch.preserve_format)  # t's strides where it is dense
    return buffer, buffer


def _stored(t: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The view of ``t`` that its ``_static`` buffer takes (the key holds t's strides: they match)."""
    return t.as_strided(buffer.shape, t.stride()) if buffer.shape != t.shape else t


def _device_key(device: torch.device | str) -> str:
    """"cuda:0" for "cuda" on device 0: a peak is asked for by the device a caller names."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _layout(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype)


def _where(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


@dataclass
class _Graph:
    replay: Callable[[], None]
    copies: list  # (buffer, name) of every copied input
    # The held tensors and ``out`` of the call replaying it, while it runs, else None: a CUDA graph reads
    # its baked addresses (the key says they are these), a simulated one (tests/conftest.py) these tensors.
    call: dict
    results: tuple  # per output of the call: None, ("out", i): the call's out[i], ("own", t): a copy of t
    configs: object  # the plan's tier, held so that its id in the key is not reused
    held: list  # weak references to the tensors its key holds by address (C, the bias)
    held_bytes: int  # the input copies (the pool's bytes are counted per pool: its graphs share them)
    pool_key: tuple


@dataclass
class _Counts:
    """Each call ``run`` takes is counted once, by what it did."""

    replayed: int = 0
    captured: int = 0  # its answer from the eager run before the capture
    failed: int = 0  # its capture failed: its answer from the eager run before it
    eager_first_sight: int = 0
    eager_full: int = 0  # no room for another graph
    eager_failed: int = 0  # a key whose capture failed before

    @property
    def calls(self) -> int:
        return (self.replayed + self.captured + self.failed + self.eager_first_sight + self.eager_full
                + self.eager_failed)


KINDS = ("forward", "backward")


class CallGraphs:
    """The process's graphs of our loss's calls (module doc); ``GRAPHS`` is the one the loss uses."""

    def __init__(self, backend=None):
        self.backend = backend if backend is not None else CudaBackend()
        self._lock = threading.Lock()
        self.clear()

    def applies(self, E: torch.Tensor, C: torch.Tensor, plan: CCEPlan, stats=None, activity=None) -> bool:
        """Whether this call runs through a graph (module doc, "Where it runs")."""
        limit = plan.configs.host.graphs_below_us
        return (limit > 0 and plan.backward_impl == "gemm" and stats is None and activity is None
                and self.backend.available(E) and not no_host_sync(E)
                and backward_us(E.shape[0], C.shape[0], E.shape[1], E.dtype, plan) < limit)

    def run(self, kind: str, fn: Callable[..., tuple], *, copied: dict, held: dict, plan: CCEPlan,
            outputs: tuple = ()) -> tuple:
        """``fn(**copied, **held, out=out)``'s outputs, replayed from a graph where one fits; ``kind``: one of
        ``KINDS``, the call it is.

        copied: the per-call inputs by name (a graph reads its copies of them; None where absent);
        held: the other tensors ``fn`` reads, by name (the key holds their addresses, and the plan's class
        weights'); outputs: (shape, dtype, device) or None per tensor of ``out``, allocated here for each
        call (``fn`` writes them and may return them); the other tensors ``fn`` returns are copied out of
        the graph. Nothing here keeps a reference to ``held`` or ``out`` once the call returns."""
        out = tuple(None if spec is None else self.backend.empty(*spec) for spec in outputs)
        device = next(t.device for t in copied.values() if t is not None)
        stream = self.backend.stream_id(device)
        key = (kind, str(device), stream, plan.options, id(plan.configs), plan.backward_impl, plan.need,
               plan.return_lse, tuple((name, _layout(t)) for name, t in copied.items()),
               tuple((name, _where(t)) for name, t in held.items()), _where(plan.class_weight),
               tuple(_where(t) for t in out))
        counts = self._counts[kind]
        with self._lock:
            graph = self._graphs.get(key)
            capture = graph is None and self._capture_now(key, plan, counts)
        if graph is None and not capture:
            return fn(**copied, **held, out=out)
        if graph is None:
            return self._capture(key, fn, copied, held, out, plan, device, stream, counts)
        for buffer, name in graph.copies:
            buffer.copy_(_stored(copied[name], buffer))
        graph.call.update(held=held, out=out)
        try:
            graph.replay()
        finally:
            graph.call.update(held=None, out=None)  # no reference to a caller's tensors outlives its call
        counts.replayed += 1
        held_bytes = self._pool_bytes.get(graph.pool_key, 0) + graph.held_bytes
        self._peak[_device_key(device)] = max(self._peak.get(_device_key(device), 0), held_bytes)
        return tuple(None if r is None else out[r[1]] if r[0] == "out" else r[1].clone() for r in graph.results)

    def _capture_now(self, key: tuple, plan: CCEPlan, counts: _Counts) -> bool:
        """Whether to capture ``key`` now: seen once before, never failed, room for a graph."""
        if key in self._failed:
            counts.eager_failed += 1
            return False
        if len(self._graphs) >= plan.configs.host.graphs_kept:
            self._drop_orphans()
        if len(self._graphs) >= plan.configs.host.graphs_kept:
            counts.eager_full += 1
            return False
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > SEEN_KEPT:
                self._seen.popitem(last=False)
            counts.eager_first_sight += 1
            return False
        del self._seen[key]
        return True

    def _drop_orphans(self) -> None:
        """Drops the graphs whose C (or bias) is gone: a graph per gate case or benchmark point, each with
        C of its own, would otherwise fill the room a training loop's graphs need."""
        for key in [key for key, graph in self._graphs.items() if any(ref() is None for ref in graph.held)]:
            del self._graphs[key]
        self._forget_unused_pools()

    def _forget_unused_pools(self) -> None:
        """Forgets the pools that no graph uses any more. CUDA releases a pool with its last graph and refuses a
        capture into it after that (torch 2.11: "use_count > 0 INTERNAL ASSERT FAILED", raised by
        ``capture_begin`` after it has put the RNG in capture mode, so that the process's next ``torch.randn``
        on the GPU fails too): the next capture takes a new pool."""
        used = {graph.pool_key for graph in self._graphs.values()}
        for pool_key in [pool_key for pool_key in self._pools if pool_key not in used]:
            del self._pools[pool_key]
            self._pool_bytes.pop(pool_key, None)

    def _capture(self, key, fn, copied: dict, held: dict, out: tuple, plan: CCEPlan, device, stream,
                 counts: _Counts) -> tuple:
        """This call's outputs from an eager run of the captured path, then its graph (module doc)."""
        statics, copies, copy_bytes = {}, [], 0
        for name, t in copied.items():
            if t is None:
                statics[name] = None
                continue
            statics[name], buffer = _static(t)
            buffer.copy_(_stored(t, buffer))
            copies.append((buffer, name))
            copy_bytes += buffer.numel() * buffer.element_size()
        call = {"held": held, "out": out}  # this call's; a replay's while it runs (``_Graph.call``)

        def captured():
            return fn(**statics, **call["held"], out=call["out"])

        with host_reads_off():
            # This call's answer, on the current stream (its outputs stay with it), which also compiles and
            # loads every kernel the capture launches, with the alignments of the buffers it reads.
            answer = captured()
            pool_key = (str(device), stream)
            pool = self._pools.setdefault(pool_key, self.backend.pool(device))
            before = self.backend.reserved(device)
            try:
                replay, graph_outputs = self.backend.capture(captured, device, pool)
            except Exception as error:  # an operation the graph cannot hold: this key stays eager
                with self._lock:
                    self._failed.add(key)
                    self._forget_unused_pools()
                    counts.failed += 1
                    self.failures.append(f"{key[0]}: {type(error).__name__}: {error}"[:300])
                warnings.warn(f"helpers.cce: the {key[0]}'s CUDA graph could not be captured, it runs eagerly "
                              f"for this shape: {type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)
                return answer
        added = max(0, self.backend.reserved(device) - before)
        results = tuple(None if t is None else
                        next((("out", i) for i, o in enumerate(out) if o is t), ("own", t)) for t in graph_outputs)
        call.update(held=None, out=None)
        graph = _Graph(replay=replay, copies=copies, call=call, results=results, configs=plan.configs,
                       held=[weakref.ref(t) for t in held.values() if t is not None], held_bytes=copy_bytes,
                       pool_key=pool_key)
        with self._lock:
            self._graphs[key] = graph
            self._pool_bytes[pool_key] = self._pool_bytes.get(pool_key, 0) + added
            counts.captured += 1
        return answer

    def summary(self, kind: str | None = None) -> dict:
        """The calls of ``kind`` (None: both) by what they did, the graphs, and the bytes the graphs hold."""
        kinds = KINDS if kind is None else (kind,)
        counts = {name: sum(getattr(self._counts[k], name) for k in kinds)
                  for name in ("calls", "replayed", "captured", "failed", "eager_first_sight", "eager_full",
                               "eager_failed")}
        return {"graphs": sum(1 for key in self._graphs if key[0] in kinds), **counts,
                "failures": [f for f in self.failures if f.split(":")[0] in kinds],
                "held_bytes": sum(self._pool_bytes.values()) + sum(g.held_bytes for g in self._graphs.values())}

    def reset_peak(self, device: torch.device | str) -> None:
        self._peak.pop(_device_key(device), None)

    def peak_bytes(self, device: torch.device | str) -> int:
        """The most a replay on ``device`` held outside the allocator's count since ``reset_peak``: the
        pool its graph allocates from and its input copies."""
        return self._peak.get(_device_key(device), 0)

    def clear(self) -> None:
        """Drops every graph and count (the pools are released once nothing else holds them)."""
        with self._lock:
            self._graphs: dict[tuple, _Graph] = {}
            self._seen: OrderedDict[tuple, None] = OrderedDict()
            self._failed: set[tuple] = set()
            self._pools: dict[tuple, object] = {}
            self._pool_bytes: dict[tuple, int] = {}
            self._peak: dict[str, int] = {}
            self._counts = {kind: _Counts() for kind in KINDS}
            self.failures: list[str] = []


GRAPHS = CallGraphs()
