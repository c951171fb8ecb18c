"""The memory sweep: peak memory and latency of each loss method against tokens N, with theory.

The question the seed article asked on a free T4: as the micro-batch grows, how much memory does
the loss (forward and backward, at the Qwen3-0.6B head, V = 151,936, D = 1,024) take, and where
does it stop fitting? This module answers it on whatever device is at hand, in three parts:

- **theory** (``predicted_peak_bytes``): what each method holds at its peak, from the arithmetic
  and from reading its code, checked against measurements (tests/test_sweep.py on the CPU; the
  article's T4 table and our earlier H200 measurements on GPUs);
- **how many tokens fit** (``largest_n_that_fits``, ``fits_table``): the same theory asked the other
  way round, for this card, a T4 or any card (notebook 02's widget);
- **the runner** (``quick_gate``, ``plan_methods``, ``run_sweep``, ``run_pretend_t4_sweep``): every
  method that can run here (one that fails the accuracy gate too: memory does not depend on
  rounding), every (method, N) point measured through ``helpers.compare.measure``, OOM recorded and
  the sweep carried on, a method that ran out of memory skipped at larger N, each point appended to
  a JSONL store as soon as it is measured, so an interrupted run resumes (with the same library
  versions only);
- **reading the results** (``results_pivot``, ``describe_methods``, ``headline``, ``report_facts``,
  ``write_results``).

Bytes everywhere; GB means 10^9 bytes (the article's unit).
"""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib.metadata
import json
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from helpers.compare.gate import GateCase, GateReport, run_gate
from helpers.compare.units import GB, dtype_bytes, dtype_name, format_bytes, lower_bound_bytes, torch_dtype
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import MemoryCap, apply_memory_cap, measure, release_memory
from helpers.compare.methods import METHODS, chunk_rows, get_method
from helpers.cce.device import T4_CAPABILITY, T4_MEMORY_BYTES, DeviceInfo, device_info, pretend_t4_scope, pretending_t4

# The seed article's setting: the Qwen3-0.6B head, its token counts, its real micro-batch.
QWEN3_HEAD = {"V": 151_936, "D": 1_024}
ARTICLE_N = [1_024, 2_048, 4_096, 8_192, 16_384, 32_768]
ARTICLE_MICRO_BATCH_N = 16_384
# Its measured peaks on a Kaggle T4, fp16, in GB (the seed article's table); None where it ran out of memory.
ARTICLE_T4_PEAK_GB = {
    "naive": [3.77, 5.64, 9.38, None, None, None],
    "torch_compile": [2.53, 2.84, 3.48, 4.74, 7.26, 12.30],
    "liger": [3.15, 3.16, 3.17, 3.20, 3.25, 3.36],
}

# ---------------------------------------------------------------------------------------------
# Theory: what each method holds at its peak (bytes above the inputs E, C, x)
# ---------------------------------------------------------------------------------------------


def input_bytes(N: int, V: int, D: int, dtype: torch.dtype | str) -> int:
    """E (N, D), C (V, D) and the int64 targets x (N,): resident before the loss runs."""
    return (N * D + V * D) * dtype_bytes(dtype) + N * 8


def _naive(N, V, D, b, capability):
    # Forward: z = E @ C.T in the input dtype (N V b) is upcast to fp32 (N V 4) and dies right
    # after the cast; log_softmax saves its fp32 output (N V 4) for backward. Backward, inside
    # log_softmax's backward, three fp32 N×V tensors are alive at once: the saved log-softmax, the
    # gradient nll_loss hands it (dense, N V 4) and the gradient it returns (N V 4). That is the
    # peak: 12 bytes per logit in every input dtype. After it: the fp32 gradient, its cast to the
    # input dtype (16-bit inputs only), then dE and dC.
    after = (4 + (b if b < 4 else 0)) * N * V + (N * D + V * D) * b
    return max(12 * N * V, after)


def _torch_compile(N, V, D, b, capability):
    # Inductor fuses upcast, softmax and the loss into one kernel that keeps only the input-dtype
    # logits (N V b) for backward; backward writes the logits' gradient over them (same size,
    # same dtype), then the two matmuls add dE and dC. Peak: one N×V tensor in the input dtype.
    return N * V * b + (N * D + V * D) * b


def _chunked(N, V, D, b, capability):
    # methods.ChunkedLinearCrossEntropy. Backward holds dE (N D b), the fp32 accumulator dC32
    # (V D 4), for 16-bit inputs an fp32 copy of C (V D 4) and of the chunk's rows of E, and fp32
    # (rows, V) blocks at the peak: raw logits, (z - lse) and G = exp(z - lse); each chunk's G is
    # freed before the next chunk starts. The last step casts dC32 to the input dtype (V D b) while
    # dC32 and the copy of C are still alive.
    rows = min(N, chunk_rows(V))
    blocks = 3
    upcast = b < 4
    per_chunk = N * D * b + V * D * 4 + upcast * (V * D * 4 + rows * D * 4) + blocks * rows * V * 4
    last_step = N * D * b + V * D * 4 + upcast * (V * D * 4 + V * D * b)
    return max(per_chunk, last_step)


def _liger(N, V, D, b, capability):
    # liger_kernel.ops.fused_linear_cross_entropy: dE and dC (input dtype) computed during the
    # forward pass, over row chunks whose (rows, V) logits are about the size of E:
    # rows = next_pow2(ceil(N / ceil(V / D))). The kernel writes the logits' gradient over the
    # logits. dC accumulates in place (addmm) only on CUDA sm_80+ in fp16/bf16. Elsewhere each
    # chunk adds `mm(G^T, E_chunk).float()` to dC: a (V, D) matmul result and its fp32 copy (one
    # tensor in fp32). On the CPU, adding that fp32 tensor into a 16-bit dC in place allocates two
    # more fp32 (V, D) temporaries (CUDA casts inside the kernel instead).
    rows = min(N, _next_power_of_2(math.ceil(N / math.ceil(V / D))))
    if capability is not None and capability >= (8, 0) and b == 2:
        temporaries = 0
    elif b == 4:
        temporaries = V * D * 4
    elif capability is not None:
        temporaries = V * D * (b + 4)
    else:
        temporaries = V * D * (4 + 2 * 4)
    return (N * D + V * D) * b + rows * V * b + temporaries + N * 4


def _ours(N, V, D, b, capability):
    # helpers.cce with its defaults (backward "gemm"): the forward keeps O(N) (lse per row and vocabulary
    # split); the backward allocates dE and dC, for 16-bit inputs dE's fp32 accumulator (n_chunk, D)
    # and, with several row chunks, dC rows staged in fp32 (v_chunk, D) before each fold. Each G chunk
    # lives in dE's or dC's rows not yet written, or in a buffer where neither has room (fp32):
    # helpers.cce.gemm_plan says which, with chunk sizes rounded to the BLOCK_V of the configuration
    # tier this capability gets. On the CPU the products run in fp32 ("upcast"): 16-bit operands
    # are copied to fp32 for each product, and the staged dC rows are used even for one row chunk.
    from helpers.cce.backward.gemm import gemm_plan
    from helpers.cce.kernels.configs import tier_for_capability

    dtype = torch.float32 if b == 4 else torch.float16
    block_v = tier_for_capability(capability).backward_gemm_for(dtype).BLOCK_V
    plan = gemm_plan(N, V, D, dtype, block_v)
    n_chunk, widest = plan.n_chunk, plan.widest
    staged = min(plan.v_chunk, widest)  # dC's rows staged in fp32, a piece of a chunk at a time
    low = b < 4
    several = N > n_chunk
    scratch = plan.buffer_elements * b + low * n_chunk * D * 4
    if low and (several or capability is None):
        scratch += staged * D * 4
    if low and capability is None:  # the larger of the two products' fp32 operand copies
        scratch += max(n_chunk * widest + widest * D, n_chunk * staged + n_chunk * D) * 4
    # Per row, fp32: the forward's lse, and the backward's row gradient (w, w / max w and the three
    # coefficients of G, helpers.cce.backward.rows.RowGradient).
    per_row = 24 * N
    return (N * D + V * D) * b + scratch + per_row


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _floor(N, V, D, b, capability):
    # No formula beyond the floor: the gradients plus O(N) per-row state, which is what these
    # methods are designed to reach (Apple CCE measured within 0.5% of it on an H200).
    return (N * D + V * D) * b


THEORY: dict[str, tuple[Callable[..., int], str]] = {
    "naive": (_naive, "12·N·V: three fp32 N×V tensors inside log_softmax's backward"),
    "torch_compile": (_torch_compile, "N·V·b + (N·D + V·D)·b: the input-dtype logits, then dE, dC"),
    "chunked": (_chunked, "dE + 2 fp32 (V, D) + 4 fp32 (chunk, V) blocks (3 if one chunk); chunk = 256 MiB / 4V rows"),
    "liger": (_liger, "(N·D + V·D)·b + a (chunk, V) logit block of about N·D elements, + (V, D) "
              "temporaries for dC except on sm_80+ in 16-bit"),
    "apple_cce": (_floor, "(N·D + V·D)·b: the floor (its O(N) LSE not counted)"),
    "ours": (_ours, "(N·D + V·D)·b + 16-bit: dE's fp32 accumulator + fp32: a G chunk (16-bit G lives "
             "in dE's and dC's rows not yet written; helpers.cce.gemm_plan) + 24 bytes of per-row state"),
}


def predicted_peak_bytes(
    method: str,
    N: int,
    V: int,
    D: int,
    dtype: torch.dtype | str,
    capability: tuple[int, int] | None = None,
) -> int | None:
    """Peak bytes above the inputs that ``method`` should need for one forward+backward, or None
    for a method with no formula here. ``capability``: the CUDA compute capability (None: CPU);
    it decides which code path Liger takes."""
    if method not in THEORY:
        return None
    formula, _ = THEORY[method]
    return int(formula(N, V, D, dtype_bytes(dtype), tuple(capability) if capability else None))


def capability_for(method: str, info) -> tuple[int, int] | None:
    """The compute capability whose code path ``method`` takes on the device ``info`` describes:
    on a pretend T4 our kernels take the T4's (they choose through ``helpers.cce.device``), every other
    method the real card's (a peer picks its paths from the card itself)."""
    return info.capability if method == "ours" or not info.pretend_t4 else info.real_capability


def first_oom_n(
    method: str, Ns: Iterable[int], V: int, D: int, dtype, cap: MemoryCap, capability=None
) -> int | None:
    """The smallest N whose predicted peak does not fit under ``cap`` (None: every N fits)."""
    for N in sorted(Ns):
        need = predicted_peak_bytes(method, N, V, D, dtype, capability)
        room = cap.room_for(input_bytes(N, V, D, dtype))
        if need is not None and room is not None and need > room:
            return N
    return None


def sizes_that_fit(Ns: Iterable[int], V: int, D: int, dtype, cap: MemoryCap) -> list[int]:
    """The N at which the floor (dE + dC) fits under ``cap`` once the inputs are resident: where
    a method could run at all. Larger N are left out (no method can fit them on this card)."""
    fits = []
    for N in sorted(Ns):
        room = cap.room_for(input_bytes(N, V, D, dtype))
        if room is None or lower_bound_bytes(N, V, D, dtype) <= room:
            fits.append(N)
    return fits


# ---------------------------------------------------------------------------------------------
# How many tokens fit: the theory asked the other way round
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    """A card to ask "how many tokens fit?" about: what the process may use on it (``cap``), the
    dtype the loss runs in, and the compute capability whose code paths the methods take
    (``capabilities``: per method, where one differs, as ours does on a pretend T4)."""

    label: str
    cap: MemoryCap
    dtype: str
    capability: tuple[int, int] | None
    capabilities: dict[str, tuple[int, int] | None] = field(default_factory=dict)

    def capability_of(self, method: str) -> tuple[int, int] | None:
        return self.capabilities.get(method, self.capability)

    def describe(self) -> str:
        usable = "no cap" if self.cap.usable_bytes is None else f"{format_bytes(self.cap.usable_bytes)} usable"
        return f"{self.label} ({usable}, {self.dtype})"


def card(label: str, memory_bytes: float, dtype: torch.dtype | str, capability: tuple[int, int] | None,
         memory_fraction: float = 0.9) -> Card:
    """A CUDA card of ``memory_bytes`` of which the process may use ``memory_fraction`` (the
    guardrail's share, as ``helpers.compare.measure.apply_memory_cap`` takes it). Bad values are
    refused with what was wrong."""
    if not (isinstance(memory_bytes, (int, float)) and math.isfinite(memory_bytes) and memory_bytes > 0):
        raise ValueError(f"the card's memory must be a positive number of bytes, got {memory_bytes!r}")
    if not (isinstance(memory_fraction, (int, float)) and 0 < memory_fraction <= 1):
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    if capability is not None and not (len(capability) == 2 and all(isinstance(c, int) for c in capability)):
        raise ValueError(f"capability must be (major, minor) or None, got {capability!r}")
    dtype = torch_dtype(dtype)
    if dtype == torch.bfloat16 and capability is not None and tuple(capability) < (8, 0):
        raise ValueError(f"bfloat16 needs bf16 tensor cores (sm_80 or newer); sm_{capability[0]}{capability[1]} "
                         "has none: train in float16 there")
    usable = int(memory_bytes * memory_fraction)
    cap = MemoryCap("cuda", usable, int(memory_bytes), memory_fraction)
    return Card(label, cap, dtype_name(dtype), tuple(capability) if capability else None)


def t4_card(memory_fraction: float = 0.9) -> Card:
    """A free Kaggle or Colab T4 in fp16 (it has no bf16 tensor cores), under the same guardrail."""
    return card("T4", T4_MEMORY_BYTES, "float16", T4_CAPABILITY, memory_fraction)


def this_card(info: DeviceInfo, cap: MemoryCap, dtype: torch.dtype | str, methods: Iterable[str]) -> Card:
    """The device the sweep ran on, under the sweep's own cap (on the CPU the simulated budget)."""
    label = f"this {info.name}" if info.is_cuda else "this CPU (simulated cap)"
    return Card(label, cap, dtype_name(dtype), info.capability, {m: capability_for(m, info) for m in methods})


def largest_n_that_fits(method: str, V: int, D: int, dtype: torch.dtype | str, cap: MemoryCap,
                        capability: tuple[int, int] | None = None) -> int | None:
    """The largest N whose loss step (forward and backward) fits under ``cap`` by the theory, with
    the inputs resident (``MemoryCap.room_for``); 0 when not even one token fits; None for a method
    with no formula. Only the loss step: weights, optimizer state and activations are not counted.

    Doubling, then bisection to one token: the theory grows with N, and where a chunk size steps
    (ours) the N returned fits and N + 1 does not."""
    for name, value in (("V", V), ("D", D)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    torch_dtype(dtype)  # refuses an unknown dtype by name
    if cap.usable_bytes is None:
        raise ValueError("no memory cap: every N fits; give the card's memory")
    if method not in THEORY:
        return None

    def fits(N: int) -> bool:
        room = cap.room_for(input_bytes(N, V, D, dtype))
        return room >= 0 and predicted_peak_bytes(method, N, V, D, dtype, capability) <= room

    if not fits(1):
        return 0
    good, bad = 1, 2
    while fits(bad):
        good, bad = bad, bad * 2
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def _tokens(N: int) -> str:
    """A token count to read: exact below 10,000, else rounded down to three significant digits
    (rounded down, so that what is printed still fits)."""
    if N < 10_000:
        return f"{N:,}"
    scale = 10 ** (len(str(N)) - 3)
    return f"{N // scale * scale:,}"


def fits_table(methods: Iterable[str], V: int, D: int, cards: list[Card], labels: dict[str, str] | None = None,
               cannot_run: dict[str, dict[str, str]] | None = None) -> str:
    """Markdown: per method (rows) and card (columns), the largest N whose loss step fits, by the
    theory. ``cannot_run``: {card label: {method: why}} for methods a card cannot run at all."""
    labels, cannot_run = labels or {}, cannot_run or {}
    lines = ["| method | " + " | ".join(c.describe() for c in cards) + " |", "|---|" + "---:|" * len(cards)]
    notes = []
    for method in methods:
        cells = []
        for c in cards:
            why = cannot_run.get(c.label, {}).get(method)
            if why:
                notes.append(f"{labels.get(method, method)} on {c.label}: {why}")
                cells.append(f"cannot run [{len(notes)}]")
                continue
            n = largest_n_that_fits(method, V, D, c.dtype, c.cap, c.capability_of(method))
            cells.append("no formula" if n is None else "not one token" if n == 0 else _tokens(n))
        lines.append(f"| {labels.get(method, method)} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- [{i}] {note}" for i, note in enumerate(notes, 1)] if notes else []
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------

DONE = ("ok", "oom", "skipped after OOM")  # statuses a re-run keeps; an "error" is retried

# The packages whose code runs in a sweep point: a point measured under other versions is measured again.
VERSIONED_PACKAGES = ("torch", "triton", "liger-kernel", "cut-cross-entropy", "helpers")

# Library warnings a reader can do nothing about, kept out of the notebook (regular expressions,
# matched case-insensitively at the start of the message): Inductor (torch 2.7 to 2.12) warns
# "Online softmax is disabled on the fly since Inductor decides to split the reduction" when it
# compiles torch.compile's loss at a large vocabulary.
QUIET_WARNINGS = (r".*online softmax is disabled",)


@contextmanager
def quiet_library_warnings() -> Iterator[None]:
    """Within the block, the ``QUIET_WARNINGS`` are not shown (every other warning is)."""
    with warnings.catch_warnings():
        for message in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        yield


PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # helpers/, whose code library_versions digests


@functools.lru_cache(maxsize=1)
def library_versions() -> str:
    """The versions a point's numbers depend on, in one string: each of ``VERSIONED_PACKAGES`` as
    installed, and for ``helpers`` a digest of the code that computes and measures the losses
    (``helpers/cce``, the registry, the meter, the inputs, the spec), so that an edited kernel is
    measured again at the same package version."""
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    root = PACKAGE_ROOT
    sources = sorted((root / "cce").rglob("*.py")) + [
        root / "compare" / f"{name}.py" for name in ("methods", "measure", "inputs")] + [root / "spec.py"]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:10]
    versions = {package: version(package) for package in VERSIONED_PACKAGES}
    versions["torch"] = torch.__version__  # the build running, whatever the metadata says
    versions["helpers"] += f"+code.{digest}"
    return " ".join(f"{package}={v}" for package, v in versions.items())


@dataclass(frozen=True)
class SweepConfig:
    """Everything that decides a point's result besides (method, N): a re-run skips a point only
    when all of it matches."""

    V: int
    D: int
    dtype: str
    device: str  # the device's name, e.g. "NVIDIA H200" (a result from another card is not reused)
    pretend_t4: bool  # a T4's limits and configurations (on the CPU: the configurations)
    memory_cap_bytes: int | None
    versions: str  # library_versions(): a point from other library versions is measured again

    def key(self, method: str, N: int) -> tuple:
        return (method, int(N), self.V, self.D, self.dtype, self.device, self.pretend_t4, self.memory_cap_bytes,
                self.versions)


def _record_key(record: dict) -> tuple:
    return (
        record["method"], int(record["N"]), record["V"], record["D"], record["dtype"],
        record["device"], record["pretend_t4"], record["memory_cap_bytes"], record.get("versions"),
    )


def load_points(store: str | Path) -> dict[tuple, dict]:
    """The points already in ``store`` (JSONL), by key; the last line for a key wins. A torn last
    line (a run killed while writing) is ignored."""
    points = {}
    path = Path(store)
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            points[_record_key(record)] = record
    return points


def _append_point(store: Path, record: dict) -> None:
    store.parent.mkdir(parents=True, exist_ok=True)
    record = {k: v for k, v in record.items() if k != "reused"}  # a property of a run, not of the point
    with store.open("a") as f:
        f.write(json.dumps(record) + "\n")


def loss_step(method: str, E: torch.Tensor, C: torch.Tensor, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One training step's worth of loss work: forward, then dE and dC (mean over tokens).

    ``torch.autograd.grad`` hands the gradients back instead of storing them in ``.grad``: each call
    then starts from the same memory, and what it measures ends with the gradients it returns.
    """
    loss_fn = get_method(method)

    def step() -> torch.Tensor:
        loss = loss_fn(E, C, x)
        torch.autograd.grad(loss, (E, C))
        return loss.detach()

    return step


def quick_gate(methods: list[str], dtype: torch.dtype | str, shapes: list[tuple[int, int, int]],
               device: torch.device | str, seed: int = 0) -> GateReport:
    """The sweep's quick accuracy gate (the full one is notebook 01's): ``methods`` in ``dtype`` on
    the configuration the sweep calls (mean over tokens, some ignored, no soft cap) at each (N, V, D)
    of ``shapes``. A failure is recorded, not raised."""
    cases = [GateCase(n, v, d, "mean", "some") for n, v, d in shapes]
    with quiet_library_warnings():
        return run_gate(methods, (torch_dtype(dtype),), cases, device=device, seed=seed, raise_on_failure=False)


@dataclass(frozen=True)
class MethodPlan:
    """Which methods a sweep measures. ``swept``: every one that can run here, in the order given;
    ``failed_gate``: those of them that failed the accuracy gate, with the first failing line (still
    swept: memory does not depend on rounding); ``unavailable``: not swept, with the reason."""

    swept: list[str]
    failed_gate: dict[str, str]
    unavailable: dict[str, str]


def plan_methods(methods: list[str], gate: GateReport, device: torch.device | str,
                 dtype: torch.dtype | str) -> MethodPlan:
    """The ``MethodPlan`` for ``methods`` on ``device`` in ``dtype``, given the gate's report."""
    dtype = torch_dtype(dtype)
    swept, failed_gate, unavailable = [], {}, {}
    failures = gate.failure_message().splitlines()
    for name in methods:
        reason = get_method(name).why_unavailable(device, dtype)
        if reason:
            unavailable[name] = reason
            continue
        swept.append(name)
        if not gate.passed(name, dtype):
            first = next((line for line in failures if line.startswith(f"{name} ")), None)
            failed_gate[name] = first or "no gate case ran (see notebook 01)"
    return MethodPlan(swept, failed_gate, unavailable)


def run_sweep(
    methods: list[str],
    Ns: Iterable[int],
    *,
    V: int,
    D: int,
    dtype: torch.dtype | str,
    store: str | Path,
    memory_cap: MemoryCap,
    device: torch.device | str,
    warmup: int = 2,
    repeats: int = 7,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Measure every (method, N) point; return one record per point, in (N, method) order.

    Each point: fresh random inputs E (N, D), C (V, D), x (N,) in ``dtype`` (the gate's recipe),
    then ``helpers.compare.measure.measure`` on one forward+backward. Statuses: "ok"; "oom" (ran out of
    memory: the cap on CUDA, the budget on the CPU); "skipped after OOM" (a larger N of a method
    that already ran out); "error" (anything else: printed, recorded, retried on a re-run).

    Points already in ``store`` with the same configuration and library versions are taken from it,
    not measured again (their theory recomputed), and marked ``"reused": True``; how many, and how
    many stored points were left for having other versions, is printed.
    """
    from tqdm.auto import tqdm

    device = torch.device(device)
    dtype = torch_dtype(dtype)
    info = device_info(device)
    config = SweepConfig(V, D, dtype_name(dtype), info.name, pretending_t4(), memory_cap.usable_bytes,
                         library_versions())
    store = Path(store)
    stored = load_points(store)
    done = {k: r for k, r in stored.items() if r["status"] in DONE}
    Ns = sorted(Ns)
    _announce_reuse(store, config, done, stored, methods, Ns)
    out_of_memory_at: dict[str, str] = {}  # method -> where it ran out, said in words
    records = []
    bar = tqdm(total=len(methods) * len(Ns), desc="sweep", disable=not progress)
    for N in Ns:
        inputs = None
        for method in methods:
            bar.set_postfix_str(f"{method} N={N:,}")
            capability = capability_for(method, info)
            record = done.get(config.key(method, N))
            if record is not None:
                record = {**record, **_theory(config, method, N, capability), "reused": True}
            elif method in out_of_memory_at:
                record = _record(config, method, N, capability, "skipped after OOM", error=out_of_memory_at[method])
                _append_point(store, record)
            else:
                if inputs is None:
                    inputs = make_inputs(N, V, D, dtype, device, regime="uniform", seed=seed, requires_grad=True)
                record = _measure_point(config, method, N, inputs, capability, memory_cap, device, warmup, repeats)
                if record["status"] == "error":
                    bar.write(f"{method} at N={N:,}: {record['error']}")
                _append_point(store, record)
            if record["status"] == "oom":
                out_of_memory_at.setdefault(method, f"ran out of memory at N={N:,}")
            elif record["status"] == "skipped after OOM":
                out_of_memory_at.setdefault(method, record["error"])
            records.append(record)
            bar.update(1)
        del inputs
        release_memory(device)
    bar.close()
    return records


def _announce_reuse(store: Path, config: SweepConfig, done: dict, stored: dict, methods, Ns) -> None:
    """Say how many points of this sweep ``store`` already holds, and how many it holds only from
    other library versions (measured again)."""
    wanted = [(m, N) for N in Ns for m in methods]
    reused = sum(config.key(m, N) in done for m, N in wanted)
    settings = {config.key(m, N)[:-1] for m, N in wanted if config.key(m, N) not in done}
    old = [r for k, r in stored.items() if k[:-1] in settings and r["status"] in DONE]
    if reused:
        print(f"{reused} of {len(wanted)} points reused from {store} (measured before with the same settings "
              f"and versions: {config.versions}); delete the file to measure them again")
    if old:
        others = sorted({r.get("versions") or "versions not recorded" for r in old})
        print(f"{len(old)} points in {store} were measured with other versions ({'; '.join(others)}): measured again")


def run_pretend_t4_sweep(
    methods: list[str],
    settings: dict,
    *,
    V: int,
    D: int,
    device: torch.device | str,
    memory_fraction: float,
    store: str | Path,
    progress: bool = True,
) -> SweepPass:
    """The sweep a T4 would run, in this process (``helpers.cce.device.pretend_t4_scope``): the
    allocator capped at ``memory_fraction`` of a T4's memory, our kernels in their T4
    configurations, a method a T4 cannot run refused with the reason, the quick gate run again in
    the T4's dtype. ``settings``: the profile's ``"t4_sweep"`` (dtype, N, gate_shapes, warmup,
    repeats, seed; on the CPU, where only the configurations change, cpu_budget_bytes).
    Afterwards the process is as before: its own limits, its own cap."""
    device = torch.device(device)
    with pretend_t4_scope():
        info = device_info(device)
        dtype = torch_dtype(settings["dtype"])
        cap = apply_memory_cap(memory_fraction, cpu_budget_bytes=settings.get("cpu_budget_bytes"), device=device)
        Ns = sizes_that_fit(settings["N"], V, D, dtype, cap)
        plan = plan_methods(methods, quick_gate(methods, dtype, settings["gate_shapes"], device), device, dtype)
        records = run_sweep(plan.swept, Ns, V=V, D=D, dtype=dtype, store=store, memory_cap=cap, device=device,
                            warmup=settings["warmup"], repeats=settings["repeats"], seed=settings["seed"],
                            progress=progress)
    return SweepPass(info, dtype_name(dtype), V, D, Ns, cap, plan, records)


@dataclass
class SweepPass:
    """One sweep with what decided it: the device as it answered, the dtype, the head, the token
    counts, the cap, the methods, and the points measured."""

    info: DeviceInfo
    dtype: str
    V: int
    D: int
    Ns: list[int]
    cap: MemoryCap
    plan: MethodPlan
    records: list[dict]


def _measure_point(config, method, N, inputs, capability, memory_cap, device, warmup, repeats) -> dict:
    # measure() turns an OOM into a result; anything else a method raises at one point is recorded
    # as an error (and printed by the caller) rather than ending the sweep.
    failure = None
    try:
        with quiet_library_warnings():
            m = measure(loss_step(method, *inputs), warmup=warmup, repeats=repeats, device=device,
                        budget_bytes=memory_cap.budget_bytes)
    except Exception as error:  # noqa: BLE001
        failure = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
    if failure is not None:
        release_memory(device)  # after the except block: its traceback no longer holds the tensors
        return _record(config, method, N, capability, "error", error=failure)
    stats = m.latency.as_dict() if m.latency else {}
    return _record(config, method, N, capability, m.status, peak_bytes=m.peak_bytes, error=m.error, **stats)


def _theory(config: SweepConfig, method: str, N: int, capability) -> dict:
    """The arithmetic beside a point, from today's formulas (a reused point gets them fresh)."""
    return {
        "theory_bytes": predicted_peak_bytes(method, N, config.V, config.D, config.dtype, capability),
        "lower_bound_bytes": lower_bound_bytes(N, config.V, config.D, config.dtype),
        "input_bytes": input_bytes(N, config.V, config.D, config.dtype),
    }


def _record(config: SweepConfig, method, N, capability, status, *, peak_bytes=None, error="",
            median_ms=None, p10_ms=None, p90_ms=None, repeats=None) -> dict:
    return {
        **asdict(config),
        "method": method,
        "N": int(N),
        "status": status,
        "peak_bytes": peak_bytes,
        **_theory(config, method, N, capability),
        "median_ms": median_ms,
        "p10_ms": p10_ms,
        "p90_ms": p90_ms,
        "repeats": repeats,
        "error": error,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "reused": False,
    }


# ---------------------------------------------------------------------------------------------
# Reading the results: table, verdicts, files
# ---------------------------------------------------------------------------------------------


def memory_unit(largest_bytes: int | float | None) -> tuple[str, float]:
    """("GB", 1e9), or ("MB", 1e6) when the largest number to show is under 0.1 GB (the CPU)."""
    return ("GB", GB) if (largest_bytes or 0) >= 0.1 * GB else ("MB", 1e6)


def _records_unit(records: list[dict]) -> tuple[str, float]:
    keys = ("peak_bytes", "theory_bytes", "lower_bound_bytes")
    return memory_unit(max((r[k] or 0 for r in records for k in keys), default=0))


def _in(value: int | float | None, unit: tuple[str, float], digits: int = 3) -> str:
    return "—" if value is None else f"{value / unit[1]:.{digits}f}"


def _ms(ms: float) -> str:
    """Milliseconds to read: about three significant digits, never an exponent."""
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _first_oom_n(rows: list[dict]) -> int | None:
    return min((r["N"] for r in rows if r["status"] == "oom"), default=None)


def memory_order(records: list[dict]) -> list[str]:
    """The methods of ``records`` from the least memory to the most: those that never ran out of
    memory first, by their measured peak at the largest N every method measured (the smallest N
    when there is none); those that did after them, the earliest wall last."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    ok = {(r["method"], r["N"]): r["peak_bytes"] for r in records if r["status"] == "ok"}
    Ns = sorted({r["N"] for r in records})
    common = [N for N in Ns if all((m, N) in ok for m in methods)]
    at = common[-1] if common else Ns[0] if Ns else None

    def key(method: str) -> tuple:
        wall = _first_oom_n([r for r in records if r["method"] == method])
        return (-(wall if wall is not None else math.inf), ok.get((method, at), math.inf))

    return sorted(methods, key=key)


def results_pivot(records: list[dict], labels: dict[str, str] | None = None, *, cell: str = "memory_time",
                  failed_gate: dict[str, str] | None = None) -> str:
    """A markdown table like the article's: methods as rows (least memory first, ``memory_order``),
    tokens N as columns. ``cell``: "memory_time" (measured peak above the inputs / forward+backward
    median ms) or "theory_ratio" (measured / theory; for a method with no formula, measured / floor).
    A method in ``failed_gate`` is marked † and a note under the table says what that means."""
    if cell not in ("memory_time", "theory_ratio"):
        raise ValueError(f"cell must be 'memory_time' or 'theory_ratio', got {cell!r}")
    labels, failed_gate = labels or {}, failed_gate or {}
    unit = _records_unit(records)
    digits = 2 if unit[0] == "GB" else 3
    Ns = sorted({r["N"] for r in records})
    points = {(r["method"], r["N"]): r for r in records}
    caption = (f"Peak {unit[0]} above the inputs / forward+backward ms (median)" if cell == "memory_time"
               else "Measured peak / theory (no formula: measured / floor dE + dC)")
    lines = [f"{caption}, least memory first:", "", "| method | " + " | ".join(f"N={n:,}" for n in Ns) + " |",
             "|---|" + "---:|" * len(Ns)]
    for method in memory_order(records):
        cells = []
        for N in Ns:
            r = points.get((method, N))
            if r is None:
                cells.append("")
            elif r["status"] == "oom":
                cells.append("**OOM**")
            elif r["status"] != "ok":
                cells.append("error" if r["status"] == "error" else "—")
            elif cell == "memory_time":
                ms = "—" if r["median_ms"] is None else _ms(r["median_ms"])
                cells.append(f"{_in(r['peak_bytes'], unit, digits)} / {ms}")
            elif r["theory_bytes"]:
                cells.append(f"{r['peak_bytes'] / r['theory_bytes']:.3f}")
            else:
                cells.append(f"{r['peak_bytes'] / r['lower_bound_bytes']:.2f}× floor")
        mark = " †" if method in failed_gate else ""
        lines.append(f"| {labels.get(method, method)}{mark} | " + " | ".join(cells) + " |")
    if failed_gate and records:
        lines += ["", f"† fails the quick accuracy gate in {records[0]['dtype']}; swept all the same, since memory "
                  "and time do not depend on rounding."]
    return "\n".join(lines)


def describe_methods(records: list[dict], V: int, *, smoke: bool = False, baseline: str = "torch_compile") -> dict[str, str]:
    """One sentence per method: does its peak grow with N×V (the logits) or only with N·D (the
    gradients), where did it hit the wall, and how fast is it next to ``baseline``?

    Growth is the slope between the smallest and largest N measured, in bytes per token. Keeping
    the logits costs at least 2 bytes per logit (16-bit logits); 1.5 bytes per logit (1.5·V bytes
    per token) or more counts as growing with them. Below that the growth is dE and chunk buffers,
    which scale with N·D. Time: at the largest N both measured, per token and as a multiple of the
    baseline's.

    ``smoke``: a smoke run's shapes support no such verdict (at a tiny V one chunk holds every row,
    so a flat method is the N×V computation there); each sentence then says only what ran.
    """
    unit = _records_unit(records)
    base = {r["N"]: r for r in records if r["method"] == baseline and r["status"] == "ok"}
    base_label = METHODS[baseline].label if baseline in METHODS else baseline
    out = {}
    for method in dict.fromkeys(r["method"] for r in records):
        rows = sorted((r for r in records if r["method"] == method), key=lambda r: r["N"])
        ok = [r for r in rows if r["status"] == "ok"]
        oom = [r for r in rows if r["status"] == "oom"]
        errors = [r for r in rows if r["status"] == "error"]
        if smoke:
            sentence = (f"{len(ok)} points measured (N={ok[0]['N']:,} to {ok[-1]['N']:,})" if len(ok) > 1
                        else f"one point measured (N={ok[0]['N']:,})" if ok else "no point measured")
        elif len(ok) >= 2:
            first, last = ok[0], ok[-1]
            per_token = (last["peak_bytes"] - first["peak_bytes"]) / (last["N"] - first["N"])
            shape = (
                f"grows with the logits N·V: {per_token / V:.1f} bytes per logit ({per_token / 1e3:,.1f} kB per token)"
                if per_token >= 1.5 * V
                else f"grows with N·D (the gradients), not N·V (the logits): {per_token / 1e3:,.2f} kB per token"
            )
            span = f"{_in(first['peak_bytes'], unit, 2)} → {_in(last['peak_bytes'], unit, 2)} {unit[0]}"
            sentence = f"{shape}; {span} from N={first['N']:,} to {last['N']:,}"
        elif ok:
            sentence = f"one point measured: {_in(ok[0]['peak_bytes'], unit, 2)} {unit[0]} at N={ok[0]['N']:,}"
        else:
            sentence = "no point measured"
        if oom:
            skipped = any(r["status"] == "skipped after OOM" for r in rows)
            sentence += (f"; out of memory at N={oom[0]['N']:,} (the simulated cap)" if smoke
                         else f"; hit the wall at N={oom[0]['N']:,} (out of memory)")
            sentence += ", larger N skipped" if skipped else ""
        elif ok and not smoke:
            sentence += f"; no OOM up to N={ok[-1]['N']:,}"
        timed = [r for r in ok if r["N"] in base and r["median_ms"] is not None]
        if timed and not smoke:
            r = timed[-1]
            sentence += (f"; {_ms(r['median_ms'])} ms at N={r['N']:,} "
                         f"({r['median_ms'] * 1e3 / r['N']:.3g} µs per token")
            ratio = r["median_ms"] / base[r["N"]]["median_ms"]
            sentence += ")" if method == baseline else f", {ratio:.2f}× {base_label})"
        if errors:
            where = ", ".join(f"{r['N']:,}" for r in errors)
            sentence += f"; ERROR at N={where}: {errors[0]['error']}"
        out[method] = sentence + "."
    return out


def _point(records: list[dict] | None, method: str, N: int) -> dict | None:
    return next((r for r in records or [] if r["method"] == method and r["N"] == N), None)


def headline(records: list[dict], *, labels: dict[str, str] | None = None, N: int = ARTICLE_MICRO_BATCH_N,
             t4_records: list[dict] | None = None, smoke: bool = False) -> str:
    """The sweep in one line, for the report's table of notebooks: the lowest and highest peak at
    ``N`` (the largest N measured when the sweep has no ``N``), who ran out of memory, and where each
    method hits a T4's wall (``t4_records``: the pretend-T4 sweep, or this sweep on a T4). A smoke
    run's line says only what ran."""
    labels = labels or {}
    name = lambda m: labels.get(m, m)  # noqa: E731
    walls = {}
    for m in dict.fromkeys(r["method"] for r in records):
        wall = _first_oom_n([r for r in records if r["method"] == m])
        if wall is not None:
            walls[m] = wall
    ok = [r for r in records if r["status"] == "ok"]
    if smoke:
        line = (f"the pipeline ran: {len(ok)} points of {len({r['method'] for r in records})} methods measured, "
                f"{len(walls)} out of memory at the simulated cap")
        line += f" ({', '.join(f'{name(m)} at N={n:,}' for m, n in walls.items())})" if walls else ""
        return line + (f"; the T4 pass measured {sum(r['status'] == 'ok' for r in t4_records)} points"
                       if t4_records else "")
    if not ok:
        return "no point was measured"
    at = N if any(r["N"] == N for r in ok) else max(r["N"] for r in ok)
    here = sorted((r for r in ok if r["N"] == at), key=lambda r: r["peak_bytes"])
    low, high = here[0], here[-1]
    line = (f"At N={at:,} on {low['device']} ({low['dtype']}) the loss step's peak ranges from "
            f"{format_bytes(low['peak_bytes'])} ({name(low['method'])}) to {format_bytes(high['peak_bytes'])} "
            f"({name(high['method'])})")
    out = [m for m, n in walls.items() if n <= at]
    if out:
        line += f"; {', '.join(name(m) for m in out)} ran out of memory by then"
    if t4_records:
        t4_walls = {m: _first_oom_n([r for r in t4_records if r["method"] == m])
                    for m in dict.fromkeys(r["method"] for r in t4_records)}
        t4_walls = {m: n for m, n in sorted(t4_walls.items(), key=lambda item: item[1] or 0) if n is not None}
        as_t4 = f"; as a T4 ({t4_records[0]['dtype']}) "
        if t4_walls:
            line += as_t4 + " and ".join(f"{name(m)} runs out of memory from N={n:,}" for m, n in t4_walls.items())
        else:
            line += as_t4 + f"every method fits up to N={max(r['N'] for r in t4_records):,}"
    return line + "."


def report_facts(records: list[dict], *, N: int = ARTICLE_MICRO_BATCH_N, t4_records: list[dict] | None = None,
                 t4_plan: MethodPlan | None = None) -> dict[str, dict]:
    """Per method, what the report's opening table reads (``helpers.suite.report.FACT_KEYS``):
    ``sweep``, every point measured on this card (peak, time, status per N); from the T4's
    sweep (``t4_records``, ``t4_plan``: the pretend-T4 sweep, or this sweep on a T4)
    ``t4_peak_bytes_16k`` and ``runs_on_t4``: True when it ran at ``N`` and passed the gate there,
    else why not. A key with nothing measured behind it is left out. Not for a smoke run: its N
    and shapes say nothing about these."""
    facts: dict[str, dict] = {}
    for method in dict.fromkeys(r["method"] for r in records):
        points = {}
        for r in (r for r in records if r["method"] == method):
            ok = r["status"] == "ok"
            points[str(r["N"])] = {"status": r["status"], "peak_bytes": int(r["peak_bytes"]) if ok else None,
                                   "seconds": round(r["median_ms"] / 1e3, 6) if ok and r.get("median_ms") else None}
        if points:
            dtype = next(r["dtype"] for r in records if r["method"] == method)
            facts.setdefault(method, {})["sweep"] = {"dtype": dtype, "points": points}
    if t4_plan is None:
        return facts
    for method, why in t4_plan.unavailable.items():
        facts.setdefault(method, {})["runs_on_t4"] = f"cannot run on a T4: {why}"
    for method in t4_plan.swept:
        r = _point(t4_records, method, N)
        if r is None:
            continue
        fact = facts.setdefault(method, {})
        if r["status"] == "ok":
            fact["t4_peak_bytes_16k"] = int(r["peak_bytes"])
            failed = t4_plan.failed_gate.get(method)
            fact["runs_on_t4"] = True if failed is None else f"runs, but fails the {r['dtype']} accuracy gate: {failed}"
        elif r["status"] in ("oom", "skipped after OOM"):
            wall = _first_oom_n([p for p in t4_records if p["method"] == method])
            fact["runs_on_t4"] = f"out of memory on a T4 from N={wall:,}" if wall else "out of memory on a T4"
        else:
            fact["runs_on_t4"] = f"error on a T4's path at N={N:,}: {r['error']}"
    return facts


def write_results(records: list[dict], output_dir: str | Path, stem: str, meta: dict) -> tuple[Path, Path]:
    """``<stem>.csv`` (one row per point) and ``<stem>.json`` (``meta`` and the points)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = output_dir / f"{stem}.csv", output_dir / f"{stem}.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]) if records else ["method"])
        writer.writeheader()
        writer.writerows(records)
    json_path.write_text(json.dumps({"meta": meta, "points": records}, indent=1, default=str))
    return csv_path, json_path


__all__ = [
    "ARTICLE_MICRO_BATCH_N",
    "ARTICLE_N",
    "ARTICLE_T4_PEAK_GB",
    "QWEN3_HEAD",
    "T4_CAPABILITY",
    "THEORY",
    "Card",
    "MethodPlan",
    "SweepConfig",
    "SweepPass",
    "capability_for",
    "card",
    "first_oom_n",
    "fits_table",
    "headline",
    "input_bytes",
    "largest_n_that_fits",
    "library_versions",
    "load_points",
    "loss_step",
    "lower_bound_bytes",
    "memory_order",
    "memory_unit",
    "plan_methods",
    "predicted_peak_bytes",
    "quick_gate",
    "quiet_library_warnings",
    "report_facts",
    "results_pivot",
    "run_pretend_t4_sweep",
    "run_sweep",
    "sizes_that_fit",
    "t4_card",
    "this_card",
    "describe_methods",
    "write_results",
]
