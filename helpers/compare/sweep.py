"""The memory sweep: peak memory and latency of each loss method against tokens N, with theory.

The question the seed article asked on a free T4: as the micro-batch grows, how much memory does
the loss (forward and backward, at the Qwen3-0.6B head, V = 151,936, D = 1,024) take, and where
does it stop fitting? This module answers it on whatever device is at hand, in three parts:

- **theory** (``predicted_peak_bytes``): what each method holds at its peak, from the arithmetic
  and from reading its code, checked against measurements (tests/test_sweep.py on the CPU; the
  article's T4 table and our earlier H200 measurements on GPUs);
- **the runner** (``run_sweep``): every (method, N) point measured through ``helpers.compare.measure``,
  OOM recorded and the sweep carried on, a method that ran out of memory skipped at larger N,
  each point appended to a JSONL store as soon as it is measured, so an interrupted run resumes;
- **the verdicts and the table** (``verdicts``, ``results_table``, ``write_results``).

Bytes everywhere; GB means 10^9 bytes (the article's unit).
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from helpers.compare.units import GB, dtype_bytes, dtype_name, lower_bound_bytes, torch_dtype
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import MemoryCap, measure, release_memory
from helpers.compare.methods import chunk_rows, get_method
from helpers.cce.device import device_info

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
T4_CAPABILITY = (7, 5)

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
    # split); the backward allocates dE and dC, a G chunk (n_chunk, v_chunk) in the input dtype
    # unless it fits in dE's rows (helpers.cce.g_fits_in_dE), for 16-bit inputs dE's fp32
    # accumulator (n_chunk, D) and, with several row chunks, dC rows staged in fp32 (v_chunk, D)
    # before each fold. Chunk sizes from helpers.cce.gemm_chunks, rounded to the BLOCK_V of the
    # configuration tier this capability gets (the rounding decides whether G fits in dE at the
    # Gemma-2-2B head). On the CPU the products run in fp32 ("upcast"): 16-bit operands are copied
    # to fp32 for each product, and the staged dC rows are used even for one row chunk.
    from helpers.cce.backward_gemm import g_fits_in_dE, gemm_chunks
    from helpers.cce.kernels.configs import tier_for_capability

    dtype = torch.float32 if b == 4 else torch.float16
    block_v = tier_for_capability(capability).backward_gemm_for(dtype).BLOCK_V
    n_chunk, v_chunk = gemm_chunks(N, V, D, dtype, block_v)
    low = b < 4
    several = N > n_chunk
    scratch = (0 if g_fits_in_dE(dtype, v_chunk, D) else n_chunk * v_chunk * b) + low * n_chunk * D * 4
    if low and (several or capability is None):
        scratch += v_chunk * D * 4
    if low and capability is None:  # the larger of the two products' fp32 operand copies
        scratch += n_chunk * v_chunk * 4 + max(v_chunk, n_chunk) * D * 4
    # Per row, fp32: the forward's lse, and the backward's row gradient (w, w / max w and the three
    # coefficients of G, helpers.cce.gradients.RowGradient).
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
    "ours": (_ours, "(N·D + V·D)·b + a G chunk (input dtype; inside dE when it fits) + 16-bit: "
             "dE's fp32 accumulator (helpers.cce.gemm_chunks sizes both) + 24 bytes of per-row state"),
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
# The runner
# ---------------------------------------------------------------------------------------------

DONE = ("ok", "oom", "skipped after OOM")  # statuses a re-run keeps; an "error" is retried


@dataclass(frozen=True)
class SweepConfig:
    """Everything that decides a point's result besides (method, N): a re-run skips a point only
    when all of it matches."""

    V: int
    D: int
    dtype: str
    device: str  # the device's name, e.g. "NVIDIA H200" (a result from another card is not reused)
    pretend_t4: bool
    memory_cap_bytes: int | None

    def key(self, method: str, N: int) -> tuple:
        return (method, int(N), self.V, self.D, self.dtype, self.device, self.pretend_t4, self.memory_cap_bytes)


def _record_key(record: dict) -> tuple:
    return (
        record["method"], int(record["N"]), record["V"], record["D"], record["dtype"],
        record["device"], record["pretend_t4"], record["memory_cap_bytes"],
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
    Points already in ``store`` with the same configuration are taken from it, not re-measured.
    """
    from tqdm.auto import tqdm

    device = torch.device(device)
    dtype = torch_dtype(dtype)
    info = device_info(device)
    config = SweepConfig(V, D, dtype_name(dtype), info.name, info.pretend_t4, memory_cap.usable_bytes)
    store = Path(store)
    done = {k: r for k, r in load_points(store).items() if r["status"] in DONE}
    Ns = sorted(Ns)
    out_of_memory_at: dict[str, str] = {}  # method -> where it ran out, said in words
    records = []
    bar = tqdm(total=len(methods) * len(Ns), desc="sweep", disable=not progress)
    for N in Ns:
        inputs = None
        for method in methods:
            bar.set_postfix_str(f"{method} N={N:,}")
            record = done.get(config.key(method, N))
            if record is None:
                if method in out_of_memory_at:
                    record = _record(config, method, N, capability_for(method, info), "skipped after OOM",
                                     error=out_of_memory_at[method])
                else:
                    if inputs is None:
                        inputs = make_inputs(N, V, D, dtype, device, regime="uniform", seed=seed, requires_grad=True)
                    record = _measure_point(config, method, N, inputs, capability_for(method, info), memory_cap,
                                            device, warmup, repeats)
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


def _measure_point(config, method, N, inputs, capability, memory_cap, device, warmup, repeats) -> dict:
    # measure() turns an OOM into a result; anything else a method raises at one point is recorded
    # as an error (and printed by the caller) rather than ending the sweep.
    failure = None
    try:
        m = measure(loss_step(method, *inputs), warmup=warmup, repeats=repeats, device=device,
                    budget_bytes=memory_cap.budget_bytes)
    except Exception as error:  # noqa: BLE001
        failure = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
    if failure is not None:
        release_memory(device)  # after the except block: its traceback no longer holds the tensors
        return _record(config, method, N, capability, "error", error=failure)
    stats = m.latency.as_dict() if m.latency else {}
    return _record(config, method, N, capability, m.status, peak_bytes=m.peak_bytes, error=m.error, **stats)


def _record(config: SweepConfig, method, N, capability, status, *, peak_bytes=None, error="",
            median_ms=None, p10_ms=None, p90_ms=None, repeats=None) -> dict:
    theory = predicted_peak_bytes(method, N, config.V, config.D, config.dtype, capability)
    return {
        **asdict(config),
        "method": method,
        "N": int(N),
        "status": status,
        "peak_bytes": peak_bytes,
        "theory_bytes": theory,
        "lower_bound_bytes": lower_bound_bytes(N, config.V, config.D, config.dtype),
        "input_bytes": input_bytes(N, config.V, config.D, config.dtype),
        "median_ms": median_ms,
        "p10_ms": p10_ms,
        "p90_ms": p90_ms,
        "repeats": repeats,
        "error": error,
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
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


def results_table(records: list[dict], labels: dict[str, str] | None = None) -> str:
    """A markdown table, per method and N: measured and predicted peak, their ratio, the floor,
    and the forward+backward median time."""
    labels = labels or {}
    unit = _records_unit(records)
    u = unit[0]
    lines = [
        f"| method | N | status | measured {u} | theory {u} | measured / theory | floor {u} | fwd+bwd ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(records, key=lambda r: (r["method"], r["N"])):
        ok = r["status"] == "ok"
        ratio = f"{r['peak_bytes'] / r['theory_bytes']:.3f}" if ok and r["theory_bytes"] else "—"
        ms = f"{r['median_ms']:.2f}" if ok and r["median_ms"] is not None else "—"
        status = r["status"] if ok else f"**{r['status']}**"
        lines.append(
            f"| {labels.get(r['method'], r['method'])} | {r['N']:,} | {status} | "
            f"{_in(r['peak_bytes'], unit) if ok else '—'} | {_in(r['theory_bytes'], unit)} | {ratio} | "
            f"{_in(r['lower_bound_bytes'], unit)} | {ms} |"
        )
    return "\n".join(lines)


def verdicts(records: list[dict], V: int) -> dict[str, str]:
    """One sentence per method: does its peak grow with N×V (the logits) or stay flat, and where
    did it hit the wall?

    Growth is the slope between the smallest and largest N measured, in bytes per token. Keeping
    the logits costs at least 2 bytes per logit (16-bit logits); 1.5 bytes per logit (1.5·V bytes
    per token) or more counts as growing with them. Below that the growth is dE and chunk buffers,
    which scale with N·D (about 1 byte per logit even at the CPU run's tiny V/D = 8).
    """
    unit = _records_unit(records)
    out = {}
    for method in dict.fromkeys(r["method"] for r in records):
        rows = sorted((r for r in records if r["method"] == method), key=lambda r: r["N"])
        ok = [r for r in rows if r["status"] == "ok"]
        oom = [r for r in rows if r["status"] == "oom"]
        errors = [r for r in rows if r["status"] == "error"]
        if len(ok) >= 2:
            first, last = ok[0], ok[-1]
            per_token = (last["peak_bytes"] - first["peak_bytes"]) / (last["N"] - first["N"])
            shape = (
                f"grows with the logits: {per_token / V:.1f} bytes per logit "
                f"({per_token / 1e3:,.1f} kB per token)"
                if per_token >= 1.5 * V
                else f"flat in V: {per_token / 1e3:,.2f} kB per token, "
                f"{last['peak_bytes'] / first['peak_bytes']:.2f}× from N={first['N']:,} to {last['N']:,}"
            )
            span = f"{_in(first['peak_bytes'], unit, 2)} → {_in(last['peak_bytes'], unit, 2)} {unit[0]}"
            sentence = f"{shape}; {span}"
        elif ok:
            sentence = f"one point measured: {_in(ok[0]['peak_bytes'], unit, 2)} {unit[0]} at N={ok[0]['N']:,}"
        else:
            sentence = "no point measured"
        if oom:
            skipped = any(r["status"] == "skipped after OOM" for r in rows)
            sentence += f"; hit the wall at N={oom[0]['N']:,} (out of memory)"
            sentence += ", larger N skipped" if skipped else ", the largest N of the sweep"
        elif ok:
            sentence += f"; no OOM up to N={ok[-1]['N']:,}"
        if errors:
            where = ", ".join(f"{r['N']:,}" for r in errors)
            sentence += f"; ERROR at N={where}: {errors[0]['error']}"
        out[method] = sentence + "."
    return out


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
    "SweepConfig",
    "first_oom_n",
    "input_bytes",
    "load_points",
    "loss_step",
    "memory_unit",
    "lower_bound_bytes",
    "predicted_peak_bytes",
    "results_table",
    "run_sweep",
    "sizes_that_fit",
    "verdicts",
    "write_results",
]
