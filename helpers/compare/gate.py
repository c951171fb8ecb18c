"""The correctness gate: every method against a float64 reference, on loss, dE and dC.

A method is measured only after it passes here. For each dtype and case the gate draws one set of
inputs, computes the float64 reference from exactly those (upcast) inputs, runs every method, and
compares with the relative L2 error

    err(a, r) = ||a - r|| / ||r||        (||a - r|| when r is all zeros)

A NaN must sit exactly where the reference has one (a mean over zero kept tokens) and nowhere else.

The bound for each quantity is ``max(FLOOR[dtype], SLACK * naive_error)``: the naive path (fp32
logits from a matmul in the input dtype) is the fair yardstick of what the dtype allows, and the
floor keeps the bound from collapsing where naive happens to be nearly exact. The floors are below
1% everywhere, so a gradient scaled by 1.01 or a dropped soft cap fails in every dtype; a test
proves it (tests/compare/test_gate.py).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from helpers.compare.inputs import ignore_targets, make_inputs
from helpers.compare.methods import MethodUnavailable, get_method, method_label, primary_methods
from helpers.compare.units import dtype_name
from helpers.compare.verdicts import GATE_FLOOR, gate_bound, gate_case_status, gate_verdict
from helpers.spec import reference_loss_and_grads, relative_error

QUANTITIES = ("loss", "dE", "dC")

# The bounds are the verdict engine's (helpers.compare.verdicts); FLOOR by torch dtype, for tables.
FLOOR = {getattr(torch, d): floors for d, floors in GATE_FLOOR.items()}

# The soft cap the gate uses: with logits of standard deviation ~2 (see make_inputs) a cap of 4 bends
# them hard, so a method that drops it fails. Gemma-2 uses 30 on logits an order of magnitude larger.
GATE_SOFTCAP = 4.0


@dataclass(frozen=True)
class GateCase:
    N: int
    V: int
    D: int
    reduction: str = "mean"
    ignore: str = "none"  # "none", "some" (every 7th token) or "all"
    softcap: float | None = None
    regime: str = "uniform"  # helpers.compare.inputs' regime of E, C and the targets

    @property
    def name(self) -> str:
        cap = f", softcap={self.softcap:g}" if self.softcap is not None else ""
        targets = f", {self.regime} targets" if self.regime != "uniform" else ""
        return f"N={self.N} V={self.V} D={self.D} {self.reduction}, ignore {self.ignore}{cap}{targets}"


def gate_cases(shapes: list[tuple[int, int, int]],
               realistic: list[tuple[int, int, int]] | tuple = ()) -> list[GateCase]:
    """The gate's cases for the given (N, V, D) shapes, and one case (mean, nothing ignored) for
    each shape of ``realistic``.

    Every shape gets each reduction, with and without ignored tokens, and the soft cap; the
    all-ignored corner (NaN mean, zero sum, zero gradients) is checked once, on the first shape.
    A ``realistic`` shape draws the realistic regime (``helpers.compare.inputs``): frequent tokens
    are the target of many rows, so a gradient summed over chunks of rows in 16 bits adds many
    comparable amounts into the same rows of dC, and rounds each time. Uniform targets over a large
    vocabulary hide that (each token the target of a row or two): at the Qwen3 head an H200
    measured Liger's bf16 dC within the bound on uniform targets and at 2.7x naive's error on
    realistic ones (docs/measurements/h200-2026-12-03b).
    """
    cases = []
    for N, V, D in shapes:
        cases += [
            GateCase(N, V, D, "mean", "none"),
            GateCase(N, V, D, "sum", "some"),
            GateCase(N, V, D, "none", "some"),
            GateCase(N, V, D, "mean", "some", GATE_SOFTCAP),
        ]
    N, V, D = shapes[0]
    cases += [GateCase(N, V, D, "mean", "all"), GateCase(N, V, D, "sum", "all")]
    return cases + realistic_cases(realistic)


def realistic_cases(shapes: list[tuple[int, int, int]] | tuple) -> list[GateCase]:
    """One case with realistic targets (mean, nothing ignored) for each (N, V, D) of ``shapes``:
    ``gate_cases``' last ones, and the sweep's quick gate's."""
    return [GateCase(N, V, D, "mean", "none", regime="realistic") for N, V, D in shapes]


def case_inputs(case: GateCase, dtype: torch.dtype, device, seed: int):
    """(E, C, x, grad_output) of one case: the case's regime of ``helpers.compare.inputs`` (most:
    ``uniform``, logits of std ~2, uniform targets), drawn on the CPU so every device gates the same
    numbers, with the case's ignored targets. The realistic regime's targets are drawn on ``device``
    (its N x V logits: 19-24 s a dtype on a 16-core CPU at 4,096 tokens of the Qwen3 head), from the
    same E and C with the device's generator: on a GPU other targets than the CPU's, the same regime.

    Uniform targets on random weights make the softmax dense: nothing for a filter to skip, so a
    method's every code path is exercised. grad_output, the upstream gradient the gate feeds back:
    a random vector for reduction="none", a scalar that is not 1 otherwise (a method that ignores
    its upstream gradient fails).
    """
    E, C, x = make_inputs(case.N, case.V, case.D, dtype, "cpu", regime=case.regime, seed=seed, targets_device=device)
    x = ignore_targets(x, case.ignore)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    grad_output = torch.randn(case.N, generator=g) if case.reduction == "none" else torch.tensor(0.73)
    return E.to(device), C.to(device), x.to(device), grad_output.to(device)


def run_method(name: str, E, C, x, grad_output, case: GateCase):
    """(loss, dE, dC) of method ``name`` on fresh leaf copies of E and C: of its last call, where its entry
    asks for several on the same leaves (``Method.gate_calls``), each from gradients reset to None."""
    method = get_method(name)
    E_ = E.detach().clone().requires_grad_(True)
    C_ = C.detach().clone().requires_grad_(True)
    for _ in range(method.gate_calls):
        E_.grad = C_.grad = None
        loss = method(E_, C_, x, reduction=case.reduction, softcap=case.softcap)
        loss.backward(grad_output.to(loss.dtype).expand_as(loss))
    return loss.detach(), E_.grad, C_.grad


@dataclass
class GateRow:
    method: str
    dtype: str
    case: str
    status: str  # "pass", "fail", "unavailable", or "over floor" (the yardstick only; see run_gate)
    errors: dict = field(default_factory=dict)  # quantity -> relative error
    bounds: dict = field(default_factory=dict)  # quantity -> bound
    reason: str = ""  # why unavailable, or what raised
    # The method's forward and backward, wall clock to the last kernel's end: the first call of a
    # method in a dtype and shape includes its compiling (torch.compile's graph, Triton's kernels).
    seconds: float | None = None


# The gate figure: each bar's colour is its verdict, its hatching the quantity.
VERDICT_COLOURS = {"pass": "#2ca02c", "fail": "#d62728", "yardstick over the floor": "#f0a030"}
QUANTITY_HATCHES = {"loss": "", "dE": "///", "dC": "..."}


def bar_verdict(summary_row: dict, ratio: float) -> str:
    """The verdict one bar of the gate figure shows: a method's worst error/bound on one quantity.

    At most 1: "pass". Over 1: "fail", except for naive, the yardstick, whose finite errors over
    the floor are the dtype's own limit ("over floor" rows, which pass) unless it failed otherwise.
    """
    if math.isfinite(ratio) and ratio <= 1.0:
        return "pass"
    if summary_row["method"] == "naive" and math.isfinite(ratio) and summary_row["verdict"] != "fail":
        return "yardstick over the floor"
    return "fail"


class GateFailure(AssertionError):
    """Raised by the gate with one line per failing method, dtype, case and quantity."""


@dataclass
class GateReport:
    rows: list[GateRow]
    device: str
    # Per "dtype case": seconds to make the inputs and the float64 reference (the part of the gate's
    # time that is no method's).
    setup_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def failures(self) -> list[GateRow]:
        return [r for r in self.rows if r.status == "fail"]

    def failing_methods(self) -> set[str]:
        return {r.method for r in self.failures}

    def passed(self, method: str, dtype: torch.dtype | str | None = None) -> bool:
        """True when ``method`` ran (in ``dtype``, if given) and failed no case."""
        d = dtype_name(dtype) if dtype is not None else None
        return gate_verdict([r.status for r in self.rows if r.method == method and (d is None or r.dtype == d)]) == "pass"

    def failure_message(self) -> str:
        lines = []
        for r in self.failures:
            if r.reason:
                lines.append(f"{r.method} [{r.dtype}] {r.case}: raised {r.reason}")
            for q in QUANTITIES:
                if q in r.errors and not r.errors[q] <= r.bounds[q]:
                    lines.append(
                        f"{r.method} [{r.dtype}] {r.case}: {q} error {r.errors[q]:.3g} > bound {r.bounds[q]:.3g}"
                    )
        return "\n".join(lines)

    def why_failed(self, method: str, dtype: torch.dtype | str) -> str:
        """One line on why ``method`` failed in ``dtype``: how many cases, and its worst error over its
        bound with the case ("" where it failed none)."""
        d = dtype_name(dtype)
        rows = [r for r in self.rows if r.method == method and r.dtype == d and r.status != "unavailable"]
        failed = [r for r in rows if r.status == "fail"]
        if not failed:
            return ""
        raised = [r for r in failed if r.reason]
        worst = max(((r.errors[q] / r.bounds[q] if r.bounds[q] else math.inf, q, r.case)
                     for r in failed for q in QUANTITIES if q in r.errors), default=None)
        parts = [f"failed {len(failed)} of {len(rows)} gate cases"]
        if worst is not None and worst[0] > 1.0:
            parts.append(f"worst: {worst[1]} error {worst[0]:.2f}x its bound ({worst[2]})")
        if raised:
            parts.append(f"raised in {raised[0].case}: {raised[0].reason}")
        return "; ".join(parts)

    def raise_if_failed(self, methods: set[str] | None = None) -> None:
        """Raise GateFailure listing every failure (of ``methods`` only, when given)."""
        failing = [r for r in self.failures if methods is None or r.method in methods]
        if failing:
            kept = GateReport(failing, self.device)
            raise GateFailure(f"{len(failing)} failing gate rows on {self.device}:\n{kept.failure_message()}")

    def summary(self) -> list[dict]:
        """One row per (method, dtype): worst error/bound ratio per quantity, and the verdict
        (the engine's ``gate_verdict``; "unavailable" where no case ran)."""
        out, statuses = {}, {}
        for r in self.rows:
            key = (r.method, r.dtype)
            s = out.setdefault(key, {"method": r.method, "dtype": r.dtype, "cases": 0, "failed": 0, "reason": ""})
            statuses.setdefault(key, []).append(r.status)
            if r.status == "unavailable":
                s["reason"] = s["reason"] or r.reason
                continue
            s["cases"] += 1
            if r.status == "fail":
                s["failed"] += 1
                s.setdefault("failed cases", []).append(r.case)
                # Whether every failure so far is a gradient that is not finite (NaN or inf), not a wrong number
                # or a raise: what a reader should hear about a convention (all targets of a mean ignored).
                grads = [r.errors.get(q) for q in ("dE", "dC")]
                s["failures not finite"] = (s.get("failures not finite", True) and not r.reason
                                            and any(g is not None and not math.isfinite(g) for g in grads))
            elif r.status == "over floor":
                s["over floor"] = s.get("over floor", 0) + 1
            for q in QUANTITIES:
                if q in r.errors:
                    s[f"max {q} error"] = max(s.get(f"max {q} error", 0.0), r.errors[q])
                    ratio = r.errors[q] / r.bounds[q] if r.bounds[q] else math.inf
                    s[f"worst {q} error/bound"] = max(s.get(f"worst {q} error/bound", 0.0), ratio)
        for key, s in out.items():
            s["verdict"] = gate_verdict(statuses[key]) or "unavailable"
        return list(out.values())

    def facts(self) -> dict[str, dict]:
        """{method: {"gradients": {dtype: "pass" or "fail"}}} over the dtypes it ran in, and where it
        fails, "gradient_failures": {dtype: {"cases": how many ran, "failed": [the failing cases], "not_finite":
        whether every failure is a gradient that is not finite}}: what the report's opening table and
        recommendations read (``helpers.suite.report.FACT_KEYS``)."""
        facts: dict[str, dict] = {}
        for s in self.summary():
            if s["verdict"] == "unavailable":
                continue
            f = facts.setdefault(s["method"], {"gradients": {}})
            f["gradients"][s["dtype"]] = s["verdict"]
            if s["verdict"] == "fail":
                f.setdefault("gradient_failures", {})[s["dtype"]] = {"cases": s["cases"], "failed": s["failed cases"],
                                                                     "not_finite": s["failures not finite"]}
        return facts

    def markdown(self) -> str:
        """The summary as a Markdown table: worst error per quantity, and the verdict."""
        head = "| method | dtype | cases | loss err | dE err | dC err | worst err/bound | verdict |"
        lines = [head, "|---|---|---:|---:|---:|---:|---:|---|"]
        for s in self.summary():
            if s["verdict"] == "unavailable":
                lines.append(f"| {s['method']} | {s['dtype']} | 0 | | | | | unavailable: {s['reason']} |")
                continue
            errs = [s.get(f"max {q} error", math.nan) for q in QUANTITIES]
            worst = max(s.get(f"worst {q} error/bound", 0.0) for q in QUANTITIES)
            verdict = (f"FAIL ({s['failed']} of {s['cases']} cases: {'; '.join(s['failed cases'])})"
                       if s["verdict"] == "fail" else s["verdict"])
            if s.get("over floor"):
                verdict += f" (yardstick over the dtype floor in {s['over floor']} cases)"
            if s["reason"]:
                verdict += f" (some cases unavailable: {s['reason']})"
            cells = " | ".join(f"{e:.2e}" for e in errs)
            lines.append(f"| {method_label(s['method'])} | {s['dtype']} | {s['cases']} | {cells} | {worst:.2f} | {verdict} |")
        return "\n".join(lines)

    def plot(self, path: str | Path | None = None):
        """Worst error per method, quantity and dtype, as a multiple of its bound (pass: below 1).

        Each bar is coloured by its verdict (``bar_verdict``): a caption saying "below the line
        passes" would read wrong for the yardstick, whose bars may stand over the line and pass.
        The quantity is the bar's place in its group of three and its hatching.
        """
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        summary = [s for s in self.summary() if s["verdict"] != "unavailable"]
        dtypes = list(dict.fromkeys(s["dtype"] for s in summary))
        fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4.2), squeeze=False, sharey=True)
        shown = set()  # the verdicts some bar has: the legend names only those
        for ax, d in zip(axes[0], dtypes):
            rows = [s for s in summary if s["dtype"] == d]
            names = [method_label(s["method"]) for s in rows]
            for k, q in enumerate(QUANTITIES):
                ratios = [max(s.get(f"worst {q} error/bound", 0.0), 1e-6) for s in rows]
                xs = [i + (k - 1) * 0.27 for i in range(len(rows))]
                verdicts = [bar_verdict(s, r) for s, r in zip(rows, ratios)]
                shown.update(verdicts)
                colours = [VERDICT_COLOURS[v] for v in verdicts]
                ax.bar(xs, [r if math.isfinite(r) else 1e3 for r in ratios], width=0.27, color=colours,
                       hatch=QUANTITY_HATCHES[q], edgecolor="black", linewidth=0.5)
                for xi, r in zip(xs, ratios):
                    if not math.isfinite(r):  # NaN where the reference has none, or an inf: drawn at 1e3
                        ax.text(xi, 1e3, "NaN" if math.isnan(r) else "inf", ha="center", va="bottom", fontsize=8)
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1.5)
            ax.set_yscale("log")
            ax.set_xticks(range(len(rows)), names, rotation=35, ha="right", fontsize=9)
            ax.set_title(f"{d} on {self.device}")
        axes[0][0].set_ylabel("worst error / bound  (bound: 1)")
        handles = [Patch(facecolor=c, edgecolor="black", label=v) for v, c in VERDICT_COLOURS.items() if v in shown]
        handles += [Patch(facecolor="white", edgecolor="black", hatch=h, label=q) for q, h in QUANTITY_HATCHES.items()]
        handles.append(plt.Line2D([], [], color="black", linestyle="--", label="bound"))
        columns = min(len(handles), 4 if len(dtypes) == 1 else len(handles))  # one panel: two rows, none cut off
        fig.legend(handles=handles, loc="lower center", ncol=columns, fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, 0.08 if columns == len(handles) else 0.14, 1, 1))
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "device": self.device,
            "passed": not self.failures,
            "summary": self.summary(),
            "rows": [asdict(r) for r in self.rows],
            "setup_seconds": self.setup_seconds,
        }
        path.write_text(json.dumps(payload, indent=1, default=_json_number))
        return path


def _json_number(v):
    return None if isinstance(v, float) and not math.isfinite(v) else str(v)


def run_gate(
    methods: list[str] | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    cases: list[GateCase] | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    raise_on_failure: bool = True,
    progress: bool = False,
) -> GateReport:
    """Gate ``methods`` (default: all registered) in each dtype on each case; see the module doc.

    Unavailable methods are recorded with their reason, never silently dropped. With
    ``raise_on_failure`` a GateFailure lists every failing row after all have run.
    """
    from helpers.cce.device import default_device

    device = torch.device(device) if device is not None else default_device()
    methods = list(methods or primary_methods())
    cases = cases or gate_cases([(37, 500, 48), (130, 1999, 72)])
    # naive runs first in every case: its errors are the yardstick for the others' bounds.
    order = ["naive"] + [m for m in methods if m != "naive"]
    work = [(dtype, i, case) for dtype in dtypes for i, case in enumerate(cases)]
    rows: list[GateRow] = []
    setup_seconds: dict[str, float] = {}
    bar = _progress(len(work), progress)
    for dtype, i, case in work:
        d = dtype_name(dtype)
        t0 = _clock(device)
        E, C, x, go = case_inputs(case, dtype, device, seed + i)
        # Past 2^26 logits the float64 reference goes a row chunk at a time (its closed form): whole,
        # it would hold 8 bytes a logit twice (4 GB at 4,096 tokens of the Qwen3 head).
        chunk_rows = max(1, 2**26 // case.V) if case.N * case.V > 2**26 else None
        reference = reference_loss_and_grads(
            E, C, x, go, reduction=case.reduction, softcap=case.softcap, chunk_rows=chunk_rows
        )
        setup_seconds[f"{d} {case.name}"] = round(_clock(device) - t0, 4)
        naive_errors = None
        for name in order:
            reason = get_method(name).why_unavailable(device, dtype, case.softcap)
            if reason:
                if name in methods:
                    rows.append(GateRow(name, d, case.name, "unavailable", reason=reason))
                continue
            t0 = _clock(device)
            try:
                result = run_method(name, E, C, x, go, case)
                seconds = round(_clock(device) - t0, 4)
                errors = {q: relative_error(a, r) for q, a, r in zip(QUANTITIES, result, reference)}
                raised = ""
            except MethodUnavailable as e:
                rows.append(GateRow(name, d, case.name, "unavailable", reason=str(e)))
                continue
            except Exception as e:  # a crash is a failure of the method, recorded with the rest
                errors, raised, seconds = {}, f"{type(e).__name__}: {e}", None
            yardstick = naive_errors if name != "naive" else None
            bounds = {q: gate_bound(d, q, (yardstick or {}).get(q)) for q in QUANTITIES}
            if name == "naive":
                naive_errors = errors
            if name in methods:
                status = gate_case_status(name, errors, bounds, raised)
                rows.append(GateRow(name, d, case.name, status, errors, bounds, raised, seconds))
        bar.update(1)
    bar.close()
    report = GateReport(rows, str(device), setup_seconds)
    if raise_on_failure:
        report.raise_if_failed()
    return report



def _clock(device: torch.device) -> float:
    """perf_counter after ``device``'s queued work has finished (a GPU's kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="gate", disable=not enabled)
