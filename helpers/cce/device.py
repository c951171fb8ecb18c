"""The device as the kernels and the suite see it, and the pretend T4.

``device_info`` gives the facts about one device that decide what can run on it: compute
capability (bf16 tensor cores from sm_80), shared memory per block (which launch configurations
fit), multiprocessors (how many programs fill it) and memory (what fits).

A free Kaggle or Colab GPU is a T4: sm_75, 16 GB (about 15 GiB usable), fp16 tensor cores only,
64 KB of shared memory per block. With ``HELPERS_PRETEND_T4=1`` in the environment (set by
``python -m helpers run --pretend-t4``, inherited by every notebook it runs, or by ``pretend_t4()``
in this process; ``pretend_t4_scope()`` for one block of it) a bigger GPU answers as a T4: ``device_info`` reports a T4's capability, memory,
shared memory and multiprocessors, so our kernels take their Turing-tier configurations, bf16 and
the methods whose kernels need more shared memory are refused with the reason, and the allocator
is capped at a T4's memory (``pretend_t4``, which ``import helpers`` calls when the variable is
set). Every Triton kernel loaded in the process, ours, a notebook's or a peer's, is held to a T4's
64 KB of shared memory per block (``enforce_t4_shared_memory``): a kernel that asks for more raises
the ``OutOfResources`` a T4 would raise. What it cannot give is a T4's speed, or a peer's own view of the card (Liger picks its code
paths from the real device). On a CPU the variable selects the T4's dtype and Turing-tier
configurations under the interpreter (the ``cpu-t4`` profile).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

PRETEND_T4_ENV = "HELPERS_PRETEND_T4"

# A T4 as Kaggle and Colab hand it out: a 16 GB card of which about 15 GiB can be allocated.
T4_CAPABILITY = (7, 5)
T4_MEMORY_BYTES = 15 * 1024**3
T4_SHARED_MEMORY_BYTES = 64 * 1024
T4_MULTIPROCESSORS = 40
T4_L2_CACHE_BYTES = 4 * 1024**2


@dataclass(frozen=True)
class DeviceInfo:
    """The facts about one device that decide what can run on it."""

    kind: str  # "cuda" or "cpu"
    name: str
    capability: tuple[int, int] | None  # (major, minor) for CUDA
    total_memory_bytes: int | None
    shared_memory_per_block_bytes: int | None  # the opt-in maximum a kernel may request
    multiprocessors: int | None
    pretend_t4: bool = False  # a bigger GPU answering as a T4 (its speed is still its own)
    real_capability: tuple[int, int] | None = None  # the card's own; differs from capability on a pretend T4
    l2_cache_bytes: int | None = None  # None where unknown (the CPU; a torch that does not report it)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def has_bf16_matmul(self) -> bool:
        """bf16 tensor cores exist from Ampere (sm_80) on; a T4 (sm_75) has fp16 ones only."""
        return self.is_cuda and self.capability >= (8, 0)

    def describe(self) -> str:
        if not self.is_cuda:
            return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        gb = self.total_memory_bytes / 1024**3
        smem = self.shared_memory_per_block_bytes // 1024
        pretend = "; a pretend T4: a T4's limits, this GPU's speed" if self.pretend_t4 else ""
        return (
            f"{self.name} (sm_{self.capability[0]}{self.capability[1]}, {gb:.0f} GiB, "
            f"{smem} KiB shared memory per block, {self.multiprocessors} SMs{pretend})"
        )

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "capability": list(self.capability) if self.capability else None,
            "total_memory_bytes": self.total_memory_bytes,
            "shared_memory_per_block_bytes": self.shared_memory_per_block_bytes,
            "multiprocessors": self.multiprocessors,
            "pretend_t4": self.pretend_t4,
            "description": self.describe(),
        }


def pretending_t4() -> bool:
    """Whether this process runs as a pretend T4 (``HELPERS_PRETEND_T4=1``)."""
    return os.environ.get(PRETEND_T4_ENV) == "1"


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """DeviceInfo for ``device`` (default: the first CUDA GPU if there is one, else the CPU); a
    T4's limits under ``HELPERS_PRETEND_T4=1``."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        return DeviceInfo("cpu", platform.processor() or platform.machine(), None, None, None, None)
    props = torch.cuda.get_device_properties(device)
    if pretending_t4():
        return DeviceInfo("cuda", f"{props.name} as a T4", T4_CAPABILITY, min(T4_MEMORY_BYTES, props.total_memory),
                          T4_SHARED_MEMORY_BYTES, T4_MULTIPROCESSORS, pretend_t4=True,
                          real_capability=(props.major, props.minor), l2_cache_bytes=T4_L2_CACHE_BYTES)
    smem = getattr(props, "shared_memory_per_block_optin", None) or 48 * 1024
    return DeviceInfo("cuda", props.name, (props.major, props.minor), props.total_memory, smem,
                      props.multi_processor_count, real_capability=(props.major, props.minor),
                      l2_cache_bytes=getattr(props, "L2_cache_size", None) or None)


def check_fits_t4(kernel) -> None:
    """Raise what a T4 raises when the compiled Triton ``kernel`` asks for more shared memory per
    block than a T4 has: ``triton.runtime.errors.OutOfResources``, naming the kernel.

    ``kernel`` is a ``triton.compiler.CompiledKernel`` (or anything with ``.metadata.shared`` and
    ``.name``). Its bytes are those of the GPU it was compiled for, and they differ by target: the
    same tiles can need more on sm_75 than on sm_90 (Triton holds 16-bit ``tl.dot`` operands as fp32
    in a T4's shared memory). So a kernel that passes on a pretend T4 should also be compiled for
    sm_75 on a CPU (``triton.compile(..., target=GPUTarget("cuda", 75, 32))``), as the tests do.
    """
    from triton.runtime.errors import OutOfResources

    shared = getattr(getattr(kernel, "metadata", None), "shared", 0) or 0
    if shared > T4_SHARED_MEMORY_BYTES:
        name = getattr(kernel, "name", None) or "a Triton kernel"
        raise OutOfResources(shared, T4_SHARED_MEMORY_BYTES, f"shared memory of {name} on a (pretend) T4")


def enforce_t4_shared_memory() -> bool:
    """From now on, while this process pretends to be a T4, every Triton kernel is checked by
    ``check_fits_t4`` before it is loaded onto the GPU. Returns whether the check is in place.

    Triton checks a kernel's shared memory against the real card where it loads it
    (``CompiledKernel._init_handles``, in Triton 3.x, run before a kernel's first launch): the check
    is put in front of that, so it covers every launch through Triton's runtime (``@triton.jit``,
    the autotuner, which drops configurations that raise it just as on a T4). Installed once;
    outside a pretend T4 (``pretending_t4()`` is read at every load) it does nothing. Kernels
    loaded before the pretence began are not re-checked, and launchers that load Triton's binaries
    themselves (torch.compile's static launcher) are outside it: they pick their tiles from the real
    card, which a T4 would see differently anyway.
    """
    try:
        from triton.compiler.compiler import CompiledKernel
    except ImportError:  # no Triton: no kernels to check
        return False
    load = getattr(CompiledKernel, "_init_handles", None)
    if load is None:
        return False
    if getattr(load, "_checks_t4_shared_memory", False):
        return True

    def _init_handles(self):
        if pretending_t4():
            check_fits_t4(self)
        return load(self)

    _init_handles._checks_t4_shared_memory = True
    _init_handles.__wrapped__ = load
    CompiledKernel._init_handles = _init_handles
    return True


def pretend_t4() -> None:
    """From now on this process, and every process it starts, sees a T4 (see the module doc).

    On a GPU it caps the caching allocator at a T4's memory, so that an allocation past it raises
    ``torch.OutOfMemoryError`` as on a T4, and holds every Triton kernel to a T4's shared memory
    (``enforce_t4_shared_memory``). Call it before the work it should govern; launch
    configurations are chosen per call, so everything after it runs as on a T4.
    """
    os.environ[PRETEND_T4_ENV] = "1"
    enforce_t4_shared_memory()
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, T4_MEMORY_BYTES / total), index)


@contextmanager
def pretend_t4_scope() -> Iterator[None]:
    """Within the block this process is a pretend T4, as after ``pretend_t4()``; after it, what it
    was before: the variable and the allocator's memory fraction are put back.

    For a T4-sized pass after a full one in the same process (notebook 02's second sweep on a big
    GPU). Entering frees the caching allocator's cache: blocks reserved by the work before would
    count against the T4's cap. Processes started inside the block inherit the variable.
    """
    before = os.environ.get(PRETEND_T4_ENV)
    restore = None
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch 2.8 and later
        restore = (get_fraction(index) if get_fraction else 1.0, index)
        torch.cuda.empty_cache()
    pretend_t4()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PRETEND_T4_ENV, None)
        else:
            os.environ[PRETEND_T4_ENV] = before
        if restore is not None:
            torch.cuda.set_per_process_memory_fraction(*restore)


__all__ = [
    "PRETEND_T4_ENV",
    "T4_CAPABILITY",
    "T4_MEMORY_BYTES",
    "T4_SHARED_MEMORY_BYTES",
    "DeviceInfo",
    "check_fits_t4",
    "default_device",
    "device_info",
    "enforce_t4_shared_memory",
    "pretend_t4",
    "pretend_t4_scope",
    "pretending_t4",
]
