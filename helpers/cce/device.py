"""The device as the kernels and the suite see it, and the pretend card.

``device_info`` gives the facts about one device that decide what can run on it: compute
capability (bf16 tensor cores from sm_80), shared memory per block (which launch configurations
fit), multiprocessors (how many programs fill it) and memory (what fits).

A pretend card: a bigger GPU answering as one of the cards in ``CARDS`` (a free Kaggle or Colab T4;
an A100, 40 or 80 GB; an L4). With ``HELPERS_PRETEND=<card>`` in the environment (set by
``python -m helpers run --pretend <card>``, inherited by every notebook it runs, or by
``pretend(card)`` in this process; ``pretend_scope(card)`` for one block of it) ``device_info``
reports that card's capability, memory, shared memory and multiprocessors, so our kernels take the
configuration tier its shared memory selects (``helpers.cce.kernels.configs``), a dtype or method
the card cannot run is refused with the reason, and the allocator is capped at the card's memory
(``pretend``, which ``import helpers`` calls when the variable is set). Every Triton kernel loaded
in the process, ours, a notebook's or a peer's, is held to the card's shared memory per block
(``enforce_shared_memory``): a kernel that asks for more raises the ``OutOfResources`` the card
would raise. What it cannot give is the card's speed, or a peer's own view of the card (Liger picks
its code paths from the real device). A GPU pretends only to a card it contains (no less memory,
shared memory or compute capability). On a CPU the variable selects the card's configuration tier
under the interpreter (and for the T4, its fp16 smoke profile ``cpu-t4``).

The pretend T4 came first, and its names stay: ``pretend_t4()``, ``pretend_t4_scope()``,
``pretending_t4()``, ``check_fits_t4``, ``enforce_t4_shared_memory`` and ``HELPERS_PRETEND_T4=1``
(read as ``HELPERS_PRETEND=t4``).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

PRETEND_ENV = "HELPERS_PRETEND"
PRETEND_T4_ENV = "HELPERS_PRETEND_T4"  # the older switch: "1" reads as HELPERS_PRETEND=t4

KiB, MiB, GiB = 1024, 1024**2, 1024**3


@dataclass(frozen=True)
class CardSpec:
    """A GPU as a cloud hands it out: the facts a pretend card reproduces.

    ``memory_bytes`` is the card's memory as ``nvidia-smi`` reports it with ECC on (a 16 GB T4:
    15,360 MiB; a 24 GB L4: 23,034 MiB); the driver keeps a few hundred MiB of it, so torch's
    ``total_memory`` on the real card is 1-2% less. ``shared_memory_per_block_bytes`` is the opt-in
    maximum a kernel may ask for (``cudaDevAttrMaxSharedMemoryPerBlockOptin``), which picks the
    configuration tier (``helpers.cce.kernels.configs.tier_for_card``). ``dense_16bit_tflops``: the datasheet's dense fp16/bf16 tensor-core
    rate (without sparsity), what a pretend card's times are not.
    """

    key: str  # the name on command lines and in HELPERS_PRETEND
    label: str  # how a person reads it
    capability: tuple[int, int]
    memory_bytes: int
    shared_memory_per_block_bytes: int
    multiprocessors: int
    bf16: bool  # bf16 tensor cores (sm_80 and later)
    l2_cache_bytes: int
    dense_16bit_tflops: float

    @property
    def a_label(self) -> str:
        """The label with its article, as it is read aloud: "a T4", "an A100-40GB", "an L4"."""
        return f"{'an' if self.label[0] in 'AEFHILMNORSX' else 'a'} {self.label}"


CARDS: dict[str, CardSpec] = {c.key: c for c in (
    CardSpec("t4", "T4", (7, 5), 15 * GiB, 64 * KiB, 40, False, 4 * MiB, 65.0),
    CardSpec("a100-40gb", "A100-40GB", (8, 0), 40 * GiB, 166_912, 108, True, 40 * MiB, 312.0),
    CardSpec("a100-80gb", "A100-80GB", (8, 0), 80 * GiB, 166_912, 108, True, 40 * MiB, 312.0),
    CardSpec("l4", "L4", (8, 9), 23_034 * MiB, 101_376, 58, True, 48 * MiB, 121.0),
)}

# A T4 as Kaggle and Colab hand it out: a 16 GB card of which 15 GiB can be allocated.
T4 = CARDS["t4"]
T4_CAPABILITY = T4.capability
T4_MEMORY_BYTES = T4.memory_bytes
T4_SHARED_MEMORY_BYTES = T4.shared_memory_per_block_bytes
T4_MULTIPROCESSORS = T4.multiprocessors
T4_L2_CACHE_BYTES = T4.l2_cache_bytes


def card_spec(key: str) -> CardSpec:
    """The card called ``key`` (``CARDS``' keys; any case), or a ValueError naming the cards."""
    found = CARDS.get(str(key).strip().lower())
    if found is None:
        raise ValueError(f"no card {key!r} to pretend to be; the cards: {', '.join(CARDS)}")
    return found


@dataclass(frozen=True)
class DeviceInfo:
    """The facts about one device that decide what can run on it."""

    kind: str  # "cuda" or "cpu"
    name: str
    capability: tuple[int, int] | None  # (major, minor) for CUDA
    total_memory_bytes: int | None
    shared_memory_per_block_bytes: int | None  # the opt-in maximum a kernel may request
    multiprocessors: int | None
    pretend: str | None = None  # the key of the card a bigger GPU answers as (its speed is still its own)
    real_capability: tuple[int, int] | None = None  # the card's own; differs from capability on a pretend card
    l2_cache_bytes: int | None = None  # None where unknown (the CPU; a torch that does not report it)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def pretend_card(self) -> CardSpec | None:
        return CARDS[self.pretend] if self.pretend else None

    @property
    def pretend_t4(self) -> bool:
        """A pretend T4 (the card whose limits change what runs most: fp16 only, 64 KB per block)."""
        return self.pretend == T4.key

    @property
    def has_bf16_matmul(self) -> bool:
        """bf16 tensor cores exist from Ampere (sm_80) on; a T4 (sm_75) has fp16 ones only."""
        return self.is_cuda and self.capability >= (8, 0)

    def describe(self) -> str:
        if not self.is_cuda:
            return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        gb = self.total_memory_bytes / GiB
        smem = self.shared_memory_per_block_bytes // KiB
        card = self.pretend_card
        pretend = f"; a pretend {card.label}: {card.a_label}'s limits, this GPU's speed" if card else ""
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
            "pretend": self.pretend,
            "real_capability": list(self.real_capability) if self.real_capability else None,
            "description": self.describe(),
        }


def pretended_card() -> CardSpec | None:
    """The card this process pretends to be (``HELPERS_PRETEND``, or the older
    ``HELPERS_PRETEND_T4=1``), or None. An unknown name raises: a run must not quietly be itself."""
    key = os.environ.get(PRETEND_ENV)
    if key:
        return card_spec(key)
    return T4 if os.environ.get(PRETEND_T4_ENV) == "1" else None


def pretending_t4() -> bool:
    """Whether this process runs as a pretend T4."""
    return pretended_card() is T4


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# device_info's answers for CUDA devices, by (index, the pretend switches, the properties' source):
# a call asks several times (plan, forward, backward), and each answer is ~10 us of Python.
_CUDA_INFO: dict = {}


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """DeviceInfo for ``device`` (default: the first CUDA GPU if there is one, else the CPU); the
    pretended card's limits under ``HELPERS_PRETEND``."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        return DeviceInfo("cpu", platform.processor() or platform.machine(), None, None, None, None)
    if device.index is None:  # the current device, which set_device may change: not kept
        return _cuda_device_info(device)
    # The function itself is in the key: a test that replaces it gets answers from its replacement.
    key = (device.index, os.environ.get(PRETEND_ENV), os.environ.get(PRETEND_T4_ENV), torch.cuda.get_device_properties)
    info = _CUDA_INFO.get(key)
    if info is None:
        info = _CUDA_INFO[key] = _cuda_device_info(device)
    return info


def _cuda_device_info(device: torch.device) -> DeviceInfo:
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", None) or 48 * KiB
    card = pretended_card()
    if card is not None:
        return DeviceInfo("cuda", f"{props.name} as {card.a_label}", card.capability,
                          min(card.memory_bytes, props.total_memory), min(card.shared_memory_per_block_bytes, smem),
                          card.multiprocessors, pretend=card.key, real_capability=(props.major, props.minor),
                          l2_cache_bytes=card.l2_cache_bytes)
    return DeviceInfo("cuda", props.name, (props.major, props.minor), props.total_memory, smem,
                      props.multi_processor_count, real_capability=(props.major, props.minor),
                      l2_cache_bytes=getattr(props, "L2_cache_size", None) or None)


def why_cannot_pretend(card: CardSpec, props) -> str | None:
    """Why the GPU whose properties are ``props`` cannot pretend to be ``card``, or None: it must
    contain the card, or it would promise what it cannot run or hold. Its memory may fall 3% short
    of the card's (torch's ``total_memory`` leaves out what the driver keeps, ``CardSpec``), so that
    a card can pretend to be itself."""
    smem = getattr(props, "shared_memory_per_block_optin", None) or 48 * KiB
    short = []
    if (props.major, props.minor) < card.capability:
        short.append(f"compute capability (sm_{props.major}{props.minor} < sm_{card.capability[0]}{card.capability[1]})")
    if props.total_memory < 0.97 * card.memory_bytes:
        short.append(f"memory ({props.total_memory / GiB:.1f} GiB < {card.memory_bytes / GiB:.1f} GiB)")
    if smem < card.shared_memory_per_block_bytes:
        short.append(f"shared memory per block ({smem // KiB} KB < {card.shared_memory_per_block_bytes // KiB} KB)")
    return f"this {props.name} cannot pretend to be {card.a_label}: it has less {', less '.join(short)}" if short else None


def check_fits(kernel, card: CardSpec | None = None) -> None:
    """Raise what ``card`` (default: the pretended one) raises when the compiled Triton ``kernel``
    asks for more shared memory per block than it has: ``triton.runtime.errors.OutOfResources``,
    naming the kernel and the card.

    ``kernel`` is a ``triton.compiler.CompiledKernel`` (or anything with ``.metadata.shared`` and
    ``.name``). Its bytes are those of the GPU it was compiled for, and they differ by target: the
    same tiles can need more on sm_75 than on sm_90 (Triton holds 16-bit ``tl.dot`` operands as fp32
    in a T4's shared memory). So a kernel that passes on a pretend T4 should also be compiled for
    sm_75 on a CPU (``triton.compile(..., target=GPUTarget("cuda", 75, 32))``), as the tests do.
    """
    card = card or pretended_card()
    if card is None:
        return
    shared = getattr(getattr(kernel, "metadata", None), "shared", 0) or 0
    if shared > card.shared_memory_per_block_bytes:
        from triton.runtime.errors import OutOfResources

        name = getattr(kernel, "name", None) or "a Triton kernel"
        raise OutOfResources(shared, card.shared_memory_per_block_bytes,
                             f"shared memory of {name} on a (pretend) {card.label}")


def check_fits_t4(kernel) -> None:
    """``check_fits`` against a T4's 64 KB."""
    check_fits(kernel, T4)


def enforce_shared_memory() -> bool:
    """From now on, while this process pretends to be a card, every Triton kernel is checked by
    ``check_fits`` against that card before it is loaded onto the GPU. Returns whether the check is
    in place.

    Triton checks a kernel's shared memory against the real card where it loads it
    (``CompiledKernel._init_handles``, in Triton 3.x, run before a kernel's first launch): the check
    is put in front of that, so it covers every launch through Triton's runtime (``@triton.jit``,
    the autotuner, which drops configurations that raise it just as on the card). Installed once;
    outside a pretend card (``pretended_card()`` is read at every load) it does nothing. Kernels
    loaded before the pretence began are not re-checked, and launchers that load Triton's binaries
    themselves (torch.compile's static launcher) are outside it: they pick their tiles from the real
    card, which the pretended card would see differently anyway.
    """
    try:
        from triton.compiler.compiler import CompiledKernel
    except ImportError:  # no Triton: no kernels to check
        return False
    load = getattr(CompiledKernel, "_init_handles", None)
    if load is None:
        return False
    if getattr(load, "_checks_pretend_shared_memory", False):
        return True

    def _init_handles(self):
        check_fits(self)  # nothing outside a pretend card
        return load(self)

    _init_handles._checks_pretend_shared_memory = True
    _init_handles.__wrapped__ = load
    CompiledKernel._init_handles = _init_handles
    return True


enforce_t4_shared_memory = enforce_shared_memory  # its first name, from the pretend T4


def pretend(card: str | CardSpec) -> CardSpec:
    """From now on this process, and every process it starts, sees ``card`` (a key of ``CARDS``;
    see the module doc). Returns the card.

    On a GPU it caps the caching allocator at the card's memory, so that an allocation past it raises
    ``torch.OutOfMemoryError`` as on the card, and holds every Triton kernel to the card's shared
    memory (``enforce_shared_memory``). A GPU smaller than the card in memory, shared memory or
    compute capability is refused (ValueError). Call it before the work it should govern; launch
    configurations are chosen per call, so everything after it runs as on the card.
    """
    card = card if isinstance(card, CardSpec) else card_spec(card)
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        why = why_cannot_pretend(card, props)
        if why:
            raise ValueError(why)
        os.environ[PRETEND_ENV] = card.key
        enforce_shared_memory()
        torch.cuda.set_per_process_memory_fraction(min(1.0, card.memory_bytes / props.total_memory), index)
    else:
        os.environ[PRETEND_ENV] = card.key
        enforce_shared_memory()
    return card


def pretend_t4() -> None:
    """``pretend("t4")``: this process, and every process it starts, sees a free Kaggle/Colab T4."""
    pretend(T4)


@contextmanager
def pretend_scope(card: str | CardSpec) -> Iterator[CardSpec]:
    """Within the block this process is a pretend ``card``, as after ``pretend(card)``; after it,
    what it was before: the variable and the allocator's memory fraction are put back.

    For a card-sized pass after a full one in the same process (notebook 02's second sweep, as a T4,
    on a big GPU). Entering frees the caching allocator's cache: blocks reserved by the work before
    would count against the card's cap. Processes started inside the block inherit the variable.
    """
    before = os.environ.get(PRETEND_ENV)
    restore = None
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch 2.8 and later
        restore = (get_fraction(index) if get_fraction else 1.0, index)
        torch.cuda.empty_cache()
    try:
        yield pretend(card)
    finally:
        if before is None:
            os.environ.pop(PRETEND_ENV, None)
        else:
            os.environ[PRETEND_ENV] = before
        if restore is not None:
            torch.cuda.set_per_process_memory_fraction(*restore)


def pretend_t4_scope():
    """``pretend_scope("t4")``: a pretend T4 for one block."""
    return pretend_scope(T4)


__all__ = [
    "CARDS",
    "PRETEND_ENV",
    "PRETEND_T4_ENV",
    "T4",
    "T4_CAPABILITY",
    "T4_MEMORY_BYTES",
    "T4_SHARED_MEMORY_BYTES",
    "CardSpec",
    "DeviceInfo",
    "card_spec",
    "check_fits",
    "check_fits_t4",
    "default_device",
    "device_info",
    "enforce_shared_memory",
    "enforce_t4_shared_memory",
    "pretend",
    "pretend_scope",
    "pretend_t4",
    "pretend_t4_scope",
    "pretended_card",
    "pretending_t4",
    "why_cannot_pretend",
]
