"""What the forward and the backward both use, at the bottom of the package so that neither imports
the other: the vocabulary order of the sort (paper section 4.3), a deferred read of a device scalar,
whether a call may read the device on the host at all, and ``MiB``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

MiB = 1024 * 1024


def vocabulary_order(E: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """(V,) int64, C's rows by average logit, largest first (paper section 4.3): the average of
    E_i . C_v over i is C_v . mean_i E_i, one (V, D) @ (D,) product, no logits. The sort ignores
    the soft cap, which is monotone."""
    E_mean = E.mean(dim=0, dtype=torch.float32).to(E.dtype)
    return torch.argsort(torch.mv(C, E_mean).float(), descending=True)


def shift_targets(x: torch.Tensor, shift: bool, ignore_index: int) -> torch.Tensor:
    """x as the loss scores it: with ``shift`` (a causal LM's labels), position t takes x[..., t + 1] and
    the last position ``ignore_index``; else x. Shifting needs a sequence dimension (a ``ValueError``
    for a 0-d x)."""
    if not shift:
        return x
    if x.dim() == 0:
        raise ValueError("shift=True needs targets with a sequence dimension (x of shape (..., T)), got one 0-d target")
    shifted = torch.full_like(x, ignore_index)
    shifted[..., :-1] = x[..., 1:]
    return shifted


def read_later(t: torch.Tensor) -> Callable[[], float | bool]:
    """A function that returns the one-element ``t`` as a Python number. On a GPU the copy to the
    host is queued now and waited for only when called (up to ``t``'s own work, not the work queued
    after it), so a host that launches more work first never leaves the GPU idle; on the CPU, at once."""
    if t.device.type != "cuda":
        return lambda: t.item()
    host = t.to("cpu", non_blocking=True)  # into pinned memory, queued on the current stream
    copied = torch.cuda.Event()
    copied.record()

    def value() -> float | bool:
        copied.synchronize()
        return host.item()

    return value


def no_host_sync(E: torch.Tensor) -> bool:
    """Whether this call must not read the device on the host: ``torch.compile`` is tracing it, a
    CUDA graph is capturing the current stream, or ``host_reads_off`` holds (this thread runs work
    that a graph captures, or its warm-up, which must take the captured path)."""
    return (getattr(_HOST_READS_OFF, "on", False) or torch.compiler.is_compiling()
            or (E.device.type == "cuda" and torch.cuda.is_current_stream_capturing()))


_HOST_READS_OFF = threading.local()  # per thread: autograd runs a GPU backward on a thread of its own


@contextmanager
def host_reads_off() -> Iterator[None]:
    """Calls in this block take the path that reads nothing on the host (``no_host_sync``)."""
    before = getattr(_HOST_READS_OFF, "on", False)
    _HOST_READS_OFF.on = True
    try:
        yield
    finally:
        _HOST_READS_OFF.on = before
