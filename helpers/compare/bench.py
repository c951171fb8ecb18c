"""Side-by-side speed and memory of registered methods: ``python -m helpers bench``.

For each named shape, input regime (``helpers.compare.inputs``), dtype and method, in one process:

- peak memory of forward+backward above the inputs (``helpers.compare.measure.peak_memory``), against the
  lower bound LB = bytes of dE + dC that any method must return;
- forward time and forward+backward time (median, p10, p90 over ``repeats`` calls after warm-up);
- achieved TFLOP/s, counting the 3 N×V×D products an exact forward+backward needs at the least
  (6·N·V·D FLOP), against the device's matmul rate measured in the same process.

A point whose forward+backward takes less than ``RETIME_BELOW_MS`` on a GPU (few tokens: the host's
launches bound it, so its time is the host's speed at that moment) is timed again after every point
has run, newest first, for every method alike; the faster of its two rounds stands and the record keeps
both (``fwd_bwd_rounds_ms``). On an H200 the first point a fresh process timed at 1,024 tokens took 3.30
ms a call where the same call took 2.01-2.05 ms seconds later (``docs/measurements/h200-2026-12-04g``):
the host on these machines changes speed from moment to moment, and one short round cannot tell.

The correctness gate runs first, on small shapes and one case of realistic targets, for the same
methods and dtypes; a method that fails it is not timed (``time_failed=True`` times it anyway and
marks it, so a peer's speed can be reported beside its accuracy problem). Results go to a results
file (``helpers.compare.results_file``: JSON Lines, one ``BenchRecord`` a line, appended as they
come so that a run that dies keeps what it measured); its meta record holds the device (a pretend
card's name too), the versions, the command, what was asked, the gate, the matmul rate measured per
dtype (``matmul_tflops``: TFLOP/s, null on a CPU) and, for the "trained" regime, the facts of each
model trained for it (``helpers.compare.trained``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from helpers.compare.inputs import REGIMES, make_inputs
from helpers.compare.gate import gate_cases, run_gate
from helpers.compare.measure import is_out_of_memory, latency, peak_memory, release_memory
from helpers.compare.methods import get_method
from helpers.cce import forget_backward_choices
from helpers.cce.device import default_device
from helpers.cce.graphs import GRAPHS, KINDS as GRAPHS_KINDS
from helpers.compare.results_file import ResultsWriter, run_meta
from helpers.compare.heads import GEMMA2, QWEN3
from helpers.compare.measure import loss_step
from helpers.compare.units import dtype_name, lower_bound_bytes, torch_dtype

# name -> (V, D, default N list): the heads of helpers.compare.heads, and a tiny one for CPU checks
SHAPES = {
    GEMMA2.name: (GEMMA2.V, GEMMA2.D, [8_192]),
    QWEN3.name: (QWEN3.V, QWEN3.D, [1_024, 4_096, 16_384, 65_536, 131_072]),
    "tiny": (1_031, 40, [64, 256]),  # CPU checks of the machinery
}
GATE_SHAPES_GPU = [(257, 5003, 136), (1031, 32011, 520)]
GATE_SHAPES_CPU = [(37, 257, 24)]
# And notebook 01's case with realistic targets (``helpers.compare.gate.gate_cases``): the Qwen3 head at
# 4,096 tokens on a GPU, a tiny head on the CPU.
GATE_REALISTIC_GPU = [(4_096, QWEN3.V, QWEN3.D)]
GATE_REALISTIC_CPU = [(64, 521, 16)]
# A GPU point faster than this is timed in a second round (module doc): host-bound sizes.
RETIME_BELOW_MS = 20.0


@dataclass
class BenchRecord:
    shape: str
    regime: str
    dtype: str
    method: str
    N: int
    V: int
    D: int
    status: str  # "ok", "oom", "error", "failed gate", "unavailable"
    gate: str = ""  # "pass", "fail (timed anyway)", ...
    peak_mb: float | None = None
    lower_bound_mb: float | None = None
    peak_over_lb: float | None = None
    forward_ms: float | None = None
    fwd_bwd_ms: float | None = None
    fwd_bwd_p10_ms: float | None = None
    fwd_bwd_p90_ms: float | None = None
    fwd_bwd_rounds_ms: list[float] | None = None  # each round's median where timed twice (module doc)
    tflops: float | None = None
    fraction_of_matmul_peak: float | None = None
    note: str = ""


def matmul_tflops(dtype: torch.dtype, device, size: int = 8192) -> float | None:
    """The device's dense matmul rate in this dtype, measured (random inputs, median of 10)."""
    if torch.device(device).type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    stats = latency(lambda: a @ b, warmup=3, repeats=10, device=device)
    a = b = None  # the lambda holds them: free before the next measurement
    release_memory(device)
    return 2 * size**3 / (stats.median_ms * 1e-3) / 1e12


def bench_point(method, shape, regime, dtype, N, V, D, device, warmup, repeats, rate, gate_status):
    d = dtype_name(dtype)
    rec = BenchRecord(shape, regime, d, method, N, V, D, "ok", gate_status)
    lb = lower_bound_bytes(N, V, D, dtype)
    rec.lower_bound_mb = lb / 1e6
    # Ours' "auto" remembers, per problem, whether the sparse backward paid (``helpers.cce.auto``): a
    # point starts from nothing remembered, as a new training run would, not from the decision the
    # previous regime's softmax left for the same shape.
    forget_backward_choices()
    try:
        E, C, x = point_inputs(regime, dtype, N, V, D, device)
        forward_backward = loss_step(method, E, C, x)  # returns dE, dC: they count in the peak

        def forward():  # the targets checked by loss_step (a check in a timed call is a sync)
            return get_method(method)(E, C, x, check_targets=False)

        for _ in range(warmup):
            forward_backward()
        _, peak = peak_memory(forward_backward, device=device)
        rec.peak_mb, rec.peak_over_lb = peak / 1e6, peak / lb
        before = graphs_summary()
        _set_time(rec, latency(forward_backward, warmup=0, repeats=repeats, device=device), rate)
        graphs = graphs_note(before, graphs_summary())
        rec.forward_ms = latency(forward, warmup=1, repeats=repeats, device=device).median_ms
        rec.note = "; ".join(filter(None, (backward_note(method, E, C, x), graphs)))
    except Exception as error:  # noqa: BLE001
        rec.status = "oom" if is_out_of_memory(error) else "error"
        rec.note = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"
    E = C = x = forward = forward_backward = None
    release_memory(device)
    return rec


def point_inputs(regime, dtype, N, V, D, device):
    """A point's E, C (both requiring their gradients) and x: the same for its every round (seed N)."""
    E, C, x = make_inputs(N, V, D, dtype, device, regime=regime, seed=N)
    return E.requires_grad_(True), C.requires_grad_(True), x


def _set_time(rec: BenchRecord, full, rate) -> None:
    """``rec``'s forward+backward time from ``full`` (a ``LatencyStats``) and the rates it gives."""
    rec.fwd_bwd_ms, rec.fwd_bwd_p10_ms, rec.fwd_bwd_p90_ms = full.median_ms, full.p10_ms, full.p90_ms
    rec.tflops = 6 * rec.N * rec.V * rec.D / (full.median_ms * 1e-3) / 1e12
    rec.fraction_of_matmul_peak = rec.tflops / rate if rate else None


def retime_point(rec: BenchRecord, device, warmup, repeats, rate) -> None:
    """The second round of a host-bound point (module doc): ``rec``'s forward+backward timed again on the
    same inputs (``point_inputs``), after the same warm-up; the faster round's median, p10 and
    p90 stand, and ``fwd_bwd_rounds_ms`` keeps both medians. An error leaves the first round's figures,
    and the note says so."""
    first = rec.fwd_bwd_ms
    forget_backward_choices()  # "auto" starts from nothing, as in the first round
    try:
        E, C, x = point_inputs(rec.regime, torch_dtype(rec.dtype), rec.N, rec.V, rec.D, device)
        forward_backward = loss_step(rec.method, E, C, x)
        before = graphs_summary()
        second = latency(forward_backward, warmup=warmup + 1, repeats=repeats, device=device)  # + the peak's call
        graphs = graphs_note(before, graphs_summary(), "calls of the second round, its warm-up's too")
    except Exception as error:  # noqa: BLE001  (the first round's figures stand)
        note = f"second round failed ({type(error).__name__}), the first round's time stands"
    else:
        rec.fwd_bwd_rounds_ms = [first, second.median_ms]
        if second.median_ms < first:
            _set_time(rec, second, rate)
        note = "; ".join(filter(None, (f"timed in two rounds, {first:.2f} and {second.median_ms:.2f} ms: the faster "
                                       "stands", graphs)))
    rec.note = "; ".join(filter(None, (rec.note, note)))
    E = C = x = forward_backward = None
    release_memory(device)


def graphs_summary() -> dict:
    """``GRAPHS.summary`` of each kind of call (``helpers.cce.graphs``), for ``graphs_note``."""
    return {kind: GRAPHS.summary(kind) for kind in GRAPHS_KINDS}


def graphs_note(before: dict, after: dict, calls_of: str = "timed calls") -> str:
    """What our loss's CUDA graphs did between two ``graphs_summary()``: per kind of call that could take
    a graph, how many replayed one ("" where none could)."""
    parts = []
    for kind in GRAPHS_KINDS:
        calls = after[kind]["calls"] - before[kind]["calls"]
        if calls:
            parts.append(f"{kind} {after[kind]['replayed'] - before[kind]['replayed']} of {calls}")
    return f"replayed from CUDA graphs: {', '.join(parts)} {calls_of}" if parts else ""


def backward_note(method: str, E, C, x) -> str:
    """What a backward that can take another path did (a benchmark of a path that silently fell
    back would mislead): for ours, the backward that ran, why ("auto"'s reason, or the sparse
    backward's hand-over), the pairs it marked and its work. One more call after the timed ones:
    for "auto", what its record says by then."""
    if not get_method(method).counts_skips:
        return ""
    stats = {}
    loss = get_method(method)(E, C, x, stats=stats)
    torch.autograd.grad(loss, (E, C))
    notes = []
    if stats.get("budget_bytes") is not None:  # under a memory budget: the schedule it chose, predicted
        chunks = (f", {stats['chunks']} chunk(s) of {stats['rows']:,} rows, {stats['logits_dtype']} logits"
                  if stats["schedule"] == "forward_grads" else "")
        notes.append(f"schedule {stats['schedule']}{chunks}; predicted peak {stats['predicted_peak_bytes'] / 1e6:,.1f} "
                     f"MB, {stats['predicted_ms']:.1f} ms ({stats['why']})")
    auto = f"auto, {stats['auto']}" if "auto" in stats else ""
    if stats.get("backward") == "sparse":
        notes.append((f"{auto}; " if auto else "") + f"sparse: marked {stats['density']:.1%} of the pairs, "
                     f"{stats['work_fraction']:.1%} of gemm's tile products, at most {stats['skipped_mass_max']:.1e} "
                     "of a row's |G| mass dropped")
    elif stats.get("backward") == "gemm":
        why = "; ".join(filter(None, (auto, stats.get("fallback"))))
        if why:
            notes.append(f"ran the gemm backward: {why}")
    if stats.get("forward") == "gluon":  # the Hopper tier's lse kernel (elsewhere the Triton one)
        notes.append("forward: the Gluon lse kernel")
    return "; ".join(notes)


def run_bench(
    methods: list[str],
    shapes: list[str],
    regimes: list[str] = ("uniform",),
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
    Ns: list[int] | None = None,
    output: str | Path | None = None,
    warmup: int = 2,
    repeats: int = 7,
    time_failed: bool = False,
    device=None,
    progress: bool = True,
    retime_below_ms: float | None = None,
) -> list[BenchRecord]:
    """Gate, then measure every (shape, regime, dtype, N, method); see the module doc.
    ``retime_below_ms``: points faster than this get a second round (default ``RETIME_BELOW_MS`` on a
    GPU, none on the CPU, whose interpreted kernels are not host-bound in this sense)."""
    from tqdm.auto import tqdm

    device = torch.device(device) if device is not None else default_device()
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {s!r}")
    for r in regimes:
        if r not in REGIMES:
            raise ValueError(f"regime must be one of {REGIMES}, got {r!r}")
    cuda = device.type == "cuda"
    cases = gate_cases(GATE_SHAPES_GPU if cuda else GATE_SHAPES_CPU, GATE_REALISTIC_GPU if cuda else GATE_REALISTIC_CPU)
    report = run_gate(methods, tuple(dtypes), cases, device=device, raise_on_failure=False)
    asked = dict(methods=list(methods), shapes=list(shapes), regimes=list(regimes),
                 dtypes=[dtype_name(dt) for dt in dtypes], Ns=Ns, warmup=warmup, repeats=repeats,
                 time_failed=time_failed)
    store = ResultsWriter(output, run_meta(device, bench=asked, gate=report.summary())) if output else None
    trained_models = {}
    work = [
        (s, r, dt, N)
        for s in shapes
        for r in regimes
        for dt in dtypes
        for N in (Ns or SHAPES[s][2])
    ]
    records = []
    rates = {dt: matmul_tflops(dt, device) for dt in dtypes}
    if store:  # the rate each point's fraction is of, and the floor a scale report draws (helpers.lab.scale)
        store.update_meta(matmul_tflops={dtype_name(dt): rate for dt, rate in rates.items()})
    bar = tqdm(total=len(work) * len(methods), desc="bench", disable=not progress)
    for shape, regime, dtype, N in work:
        V, D, _ = SHAPES[shape]
        for method in methods:
            reason = get_method(method).why_unavailable(device, dtype)
            passed = report.passed(method, dtype)
            d = dtype_name(dtype)
            if reason:
                rec = BenchRecord(shape, regime, d, method, N, V, D, "unavailable", note=reason)
            elif not passed and not time_failed:
                rec = BenchRecord(shape, regime, d, method, N, V, D, "failed gate", "fail",
                                  note=f"{report.why_failed(method, dtype)} (--time-failed times it anyway)")
            else:
                gate = "pass" if passed else "fail (timed anyway)"
                rec = bench_point(method, shape, regime, dtype, N, V, D, device, warmup, repeats, rates[dtype], gate)
            records.append(rec)
            if store:
                store.append(asdict(rec))
            bar.update(1)
        if regime == "trained" and shape not in trained_models:
            from helpers.compare.trained import describe

            try:
                trained_models[shape] = describe(V, D, device)
            except Exception as error:  # noqa: BLE001  (its points already say why they failed)
                trained_models[shape] = f"{type(error).__name__}: {error}"[:300]
            if store:
                store.update_meta(trained_models=trained_models)
    bar.close()
    if retime_below_ms is None:
        retime_below_ms = RETIME_BELOW_MS if cuda else 0.0
    again = [i for i, r in enumerate(records)
             if r.status == "ok" and r.fwd_bwd_ms is not None and r.fwd_bwd_ms < retime_below_ms]
    for i in tqdm(again[::-1], desc="bench, second round of few-token points", disable=not progress or not again):
        rec = records[i]
        retime_point(rec, device, warmup, repeats, rates[torch_dtype(rec.dtype)])
        if store:
            store.replace(i, asdict(rec))
    return records


def bench_table(records: list[BenchRecord]) -> str:
    head = "| shape | regime | dtype | N | method | peak MB | LB MB | peak/LB | fwd ms | fwd+bwd ms (p10-p90) | TFLOP/s | status |"
    lines = [head, "|---|---|---|---:|---|---:|---:|---:|---:|---|---:|---|"]

    def f(v, fmt):
        return format(v, fmt) if v is not None else ""

    for r in records:
        spread = f"{r.fwd_bwd_ms:.1f} ({r.fwd_bwd_p10_ms:.1f}-{r.fwd_bwd_p90_ms:.1f})" if r.fwd_bwd_ms else ""
        if r.fwd_bwd_rounds_ms:  # a host-bound point timed twice (module doc): both rounds' medians
            spread += f", rounds {' / '.join(f'{ms:.2f}' for ms in r.fwd_bwd_rounds_ms)}"
        status = r.status if r.status != "ok" else ("ok" if r.gate == "pass" else f"ok, gate {r.gate}")
        if r.note:
            status += f": {r.note[:80]}"
        lines.append(
            f"| {r.shape} | {r.regime} | {r.dtype} | {r.N} | {r.method} | {f(r.peak_mb, ',.0f')} | "
            f"{f(r.lower_bound_mb, ',.0f')} | {f(r.peak_over_lb, '.2f')} | {f(r.forward_ms, '.1f')} | {spread} | "
            f"{f(r.tflops, '.0f')} | {status} |"
        )
    return "\n".join(lines)
