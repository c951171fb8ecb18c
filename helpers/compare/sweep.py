"""The memory sweep: peak memory and latency of each loss method against tokens N.

The question the seed article asked on a free T4: as the micro-batch grows, how much memory does
the loss (forward and backward, at the Qwen3-0.6B head, ``helpers.compare.heads.QWEN3``) take, and
where does it stop fitting? This module answers it on whatever device is at hand: every method that
can run here (one that fails the accuracy gate too: memory does not depend on rounding)
(``quick_gate``, ``plan_methods``), every (method, N) point measured through
``helpers.compare.measure`` (``run_sweep``, ``run_pretend_t4_sweep``), OOM recorded and the sweep
carried on, a method that ran out of memory skipped at larger N, each point appended to a JSONL
store as soon as it is measured, so an interrupted run resumes (with the same library versions
only). Each point carries the theory's prediction (``helpers.compare.theory``); reading the points
is ``helpers.compare.sweep_results``.

Bytes everywhere; GB means 10^9 bytes (the article's unit).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from helpers.compare.gate import GateCase, GateReport, realistic_cases, run_gate
from helpers.compare.units import dtype_name, lower_bound_bytes, torch_dtype
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import MemoryCap, apply_memory_cap, loss_step, measure, release_memory
from helpers.compare.methods import get_method
from helpers.compare.theory import capability_for, input_bytes, predicted_peak_bytes, sizes_that_fit
from helpers.cce.device import DeviceInfo, device_info, pretend_t4_scope, pretended_card

# The seed article's setting (at the Qwen3-0.6B head, helpers.compare.heads.QWEN3): its token
# counts, its real micro-batch.
ARTICLE_N = [1_024, 2_048, 4_096, 8_192, 16_384, 32_768]
ARTICLE_MICRO_BATCH_N = 16_384
# Its measured peaks on a Kaggle T4, fp16, in GB (the seed article's table); None where it ran out of memory.
ARTICLE_T4_PEAK_GB = {
    "naive": [3.77, 5.64, 9.38, None, None, None],
    "torch_compile": [2.53, 2.84, 3.48, 4.74, 7.26, 12.30],
    "liger": [3.15, 3.16, 3.17, 3.20, 3.25, 3.36],
}

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
    sources = sorted((root / "cce").rglob("*.py")) + sorted((root / "compare" / "methods").rglob("*.py")) + [
        root / "compare" / f"{name}.py" for name in ("measure", "inputs")] + [root / "spec.py"]
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
    # The pretended card's key (helpers.cce.device.CARDS): its limits and configurations (on the CPU:
    # the configurations); None: the device as itself.
    pretend: str | None
    memory_cap_bytes: int | None
    versions: str  # library_versions(): a point from other library versions is measured again

    def key(self, method: str, N: int) -> tuple:
        return (method, int(N), self.V, self.D, self.dtype, self.device, self.pretend, self.memory_cap_bytes,
                self.versions)


def _record_key(record: dict) -> tuple:
    # A point stored before the pretend cards says only whether it was a pretend T4 ("pretend_t4").
    pretend = record["pretend"] if "pretend" in record else ("t4" if record.get("pretend_t4") else None)
    return (
        record["method"], int(record["N"]), record["V"], record["D"], record["dtype"],
        record["device"], pretend, record["memory_cap_bytes"], record.get("versions"),
    )


def load_points(store: str | Path) -> dict[tuple, dict]:
    """The points already in ``store`` (the one results format, ``helpers.compare.results_file``:
    JSON Lines, a meta record first; a store written before it has no meta record), by key; the
    last line for a key wins. A torn last line (a run killed while writing) is ignored."""
    points = {}
    path = Path(store)
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("record") == "meta":
                continue
            record.pop("record", None)
            points[_record_key(record)] = record
    return points


def _append_point(store: Path, record: dict) -> None:
    """Append one point, as it is measured (a run that dies keeps what it measured); a new store
    starts with the results format's meta record (device, versions, command)."""
    from helpers.compare.results_file import run_meta

    store.parent.mkdir(parents=True, exist_ok=True)
    if not store.exists() or store.stat().st_size == 0:
        store.write_text(json.dumps(run_meta(what="memory sweep points"), default=str) + "\n")
    record = {k: v for k, v in record.items() if k != "reused"}  # a property of a run, not of the point
    with store.open("a") as f:
        f.write(json.dumps({"record": "result", **record}) + "\n")


def quick_gate(methods: list[str], dtype: torch.dtype | str, shapes: list[tuple[int, int, int]],
               device: torch.device | str, seed: int = 0,
               realistic: list[tuple[int, int, int]] | tuple = ()) -> GateReport:
    """The sweep's quick accuracy gate (the full one is notebook 01's): ``methods`` in ``dtype`` on
    the configuration the sweep calls (mean over tokens, some ignored, no soft cap) at each (N, V, D)
    of ``shapes``, and with realistic targets (nothing ignored) at each of ``realistic``: notebook
    01's case that a dC summed in 16 bits over many row chunks fails (``gate_cases``). A failure is
    recorded, not raised."""
    cases = [GateCase(n, v, d, "mean", "some") for n, v, d in shapes]
    cases += realistic_cases(realistic)
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
    card = pretended_card()
    config = SweepConfig(V, D, dtype_name(dtype), info.name, card.key if card else None, memory_cap.usable_bytes,
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
    the T4's dtype. ``settings``: the profile's ``"t4_sweep"`` (dtype, N, gate_shapes, gate_realistic, warmup,
    repeats, seed; on the CPU, where only the configurations change, cpu_budget_bytes).
    Afterwards the process is as before: its own limits, its own cap."""
    device = torch.device(device)
    with pretend_t4_scope():
        info = device_info(device)
        dtype = torch_dtype(settings["dtype"])
        cap = apply_memory_cap(memory_fraction, cpu_budget_bytes=settings.get("cpu_budget_bytes"), device=device)
        Ns = sizes_that_fit(settings["N"], V, D, dtype, cap)
        gate = quick_gate(methods, dtype, settings["gate_shapes"], device, realistic=settings.get("gate_realistic", ()))
        plan = plan_methods(methods, gate, device, dtype)
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


__all__ = [
    "ARTICLE_MICRO_BATCH_N",
    "ARTICLE_N",
    "ARTICLE_T4_PEAK_GB",
    "MethodPlan",
    "SweepConfig",
    "SweepPass",
    "library_versions",
    "load_points",
    "loss_step",
    "plan_methods",
    "quick_gate",
    "quiet_library_warnings",
    "run_pretend_t4_sweep",
    "run_sweep",
]
