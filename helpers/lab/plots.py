"""The suite's figures: one function per figure, each taking what a notebook measured and returning
the matplotlib Figure (the memory sweep's saves itself as PNG; the notebook saves the others).

Shared conventions, so that a method looks the same in every notebook: ``method_colors`` gives each
registered method one colour for good; token counts go on a log2 axis labelled with the counts
themselves (``token_axis``); memory is in GB = 10^9 bytes (the seed article's unit).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator

from helpers.compare.methods import METHODS, method_label
from helpers.compare.units import GB, memory_unit, timed_calls
from helpers.lab.profiles import SMOKE_NOTE
from helpers.lab.convergence import paired_difference
from helpers.lab.training import TrainRun


def mark_smoke(fig: plt.Figure) -> plt.Figure:
    """Stamp a smoke run's figure so that, saved and shared, it is not read as a result."""
    fig.text(0.5, 0.5, "SMOKE RUN", fontsize=60, color="grey", alpha=0.15, rotation=25, ha="center", va="center",
             weight="bold", zorder=0)
    # Under the watermark, along it: a corner would sit on a title, a legend or a "not drawn" note.
    fig.text(0.5, 0.5, "\n\n\n\n" + SMOKE_NOTE, fontsize=8, color="firebrick", alpha=0.6, rotation=25, ha="center",
             va="center", zorder=0)
    return fig


def method_colors() -> dict[str, tuple]:
    """One colour per registered method, in registration order (stable across notebooks)."""
    palette = plt.get_cmap("tab10").colors
    return {name: palette[i % len(palette)] for i, name in enumerate(METHODS)}


def method_markers() -> dict[str, str]:
    """One marker per registered method, so that lines lying on top of each other stay visible."""
    shapes = "os^Dv<>P*h"
    return {name: shapes[i % len(shapes)] for i, name in enumerate(METHODS)}


def token_axis(ax, Ns: list[int]) -> None:
    """Log2 x axis with a tick at each N measured, labelled 1,024 / 16k style."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(Ns))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{n // 1024}k" if n >= 8192 else f"{n:,}" for n in sorted(set(Ns))])
    ax.set_xlabel("tokens N")


def plot_memory_sweep(
    records: list[dict],
    *,
    path: str | Path,
    title: str,
    room_bytes: dict[int, int] | None = None,
    t4_room_bytes: dict[int, int] | None = None,
    micro_batch_N: int | None = None,
    latency_caveat: str = "",
    unit: tuple[str, float] = ("GB", GB),
    failed_gate: Iterable[str] = (),
    smoke: bool = False,
) -> plt.Figure:
    """Peak memory against N (left) and forward+backward time against N (right); saved to ``path``.

    Left: measured points as solid lines (hollow markers of decreasing size, so that lines lying on
    each other stay visible), the theory for each method as a thin dashed line of the same colour
    (under the measured line where they agree; drawn past the wall too, to show where it would have
    gone), an out-of-memory point as a cross at its N, where the theory says it would have been
    (on the usable-memory line when the theory has it lower, or no formula), the floor dE + dC in grey, the
    usable memory dashed black, a T4's dashed red and the article's micro-batch dotted. Right:
    median time with the p10-p90 range.

    room_bytes: {N: bytes a step may use at N}, the cap minus the inputs resident at that N (None:
    no cap). t4_room_bytes: the same for a T4 (on a bigger card: where a T4 would stop). unit:
    (name, bytes), e.g. ("GB", 1e9). failed_gate: methods that failed the accuracy gate, drawn
    dotted and labelled so (their memory and time stand; their gradients do not). smoke: stamp the
    figure as a smoke run (``mark_smoke``) before it is saved.
    """
    unit_name, scale = unit
    colors, markers = method_colors(), method_markers()
    failed_gate = set(failed_gate)
    Ns = sorted({r["N"] for r in records})
    methods = list(dict.fromkeys(r["method"] for r in records))
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(14, 5.6))
    ooms: list[tuple[int, float, str, tuple]] = []  # (N, y, label, colour) of each out-of-memory point

    for i, method in enumerate(methods):
        rows = sorted((r for r in records if r["method"] == method), key=lambda r: r["N"])
        color, marker, label = colors.get(method, "black"), markers.get(method, "o"), method_label(method)
        style = dict(ls=":", alpha=0.75) if method in failed_gate else dict(ls="-")
        label += " (fails accuracy gate)" if method in failed_gate else ""
        hollow = dict(marker=marker, ms=max(4.0, 11 - 1.3 * i), mfc="none", mew=1.6)
        ok = [r for r in rows if r["status"] == "ok"]
        ax_mem.plot([r["N"] for r in ok], [r["peak_bytes"] / scale for r in ok], color=color, lw=2, label=label,
                    **style, **hollow)
        theory = [r for r in rows if r["theory_bytes"] is not None]
        ax_mem.plot([r["N"] for r in theory], [r["theory_bytes"] / scale for r in theory], "--", color=color,
                    lw=1, alpha=0.7)
        for r in (r for r in rows if r["status"] == "oom"):
            # Where it would have been; at least the usable memory, which it went past.
            y = max(r["theory_bytes"] or 0, (room_bytes or {}).get(r["N"]) or 0) or r["lower_bound_bytes"]
            ooms.append((r["N"], y / scale, label, color))
        if ok:
            ax_time.errorbar(
                [r["N"] for r in ok],
                [r["median_ms"] for r in ok],
                yerr=[[r["median_ms"] - r["p10_ms"] for r in ok], [r["p90_ms"] - r["median_ms"] for r in ok]],
                color=color, lw=2, capsize=3, label=label, **style, **hollow,
            )

    # The crosses, each labelled on its left; at one N the labels step down from the highest cross
    # (which the axes include), so that crosses close together do not write over each other.
    for N in sorted({n for n, *_ in ooms}):
        for k, (_, y, label, color) in enumerate(sorted((o for o in ooms if o[0] == N), key=lambda o: -o[1])):
            ax_mem.plot(N, y, "X", color=color, ms=13, mec="black", zorder=5)
            ax_mem.annotate(f"{label}: OOM", (N, y), textcoords="offset points", xytext=(-12, -11 * k), ha="right",
                            va="center", fontsize=8, color=color,
                            bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.8))
    floor = sorted({(r["N"], r["lower_bound_bytes"]) for r in records})
    ax_mem.plot([n for n, _ in floor], [b / scale for _, b in floor], "-.", color="grey", lw=1,
                label="floor: dE + dC")
    ax_mem.plot([], [], "--", color="grey", lw=1, label="theory: thin dashed, same colour (under the measured "
                "line where they agree)")
    for walls, color, name in ((room_bytes, "black", "usable memory"),
                               (t4_room_bytes, "firebrick", "a T4's usable memory")):
        if walls:
            wall = sorted(walls.items())
            ax_mem.plot([n for n, _ in wall], [b / scale for _, b in wall], "--", color=color, lw=1.2,
                        label=f"{name} (cap minus inputs): {wall[0][1] / scale:.2f} {unit_name} at N={wall[0][0]:,}")
    for ax in (ax_mem, ax_time):
        if micro_batch_N is not None and Ns and Ns[0] <= micro_batch_N <= Ns[-1]:
            ax.axvline(micro_batch_N, ls=":", color="dimgrey", lw=1.5,
                       label=f"article's micro-batch (N={micro_batch_N:,})" if ax is ax_mem else None)
        token_axis(ax, Ns)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # 1-2-5: labels on narrow ranges too
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.grid(True, which="major", alpha=0.3)
    ax_mem.set_ylabel(f"peak memory above the inputs, {unit_name} (log)")
    ax_mem.set_title("loss forward + backward: peak memory")
    ax_time.set_ylabel("forward + backward, ms (log)")
    timed = timed_calls([r.get("repeats") for r in records])
    spread = "" if timed == "one timed call each" else ", p10-p90"
    ax_time.set_title(f"forward + backward time: {timed}{spread}" + (f"\n{latency_caveat}" if latency_caveat else ""),
                      fontsize=10)
    # One legend for both panels, below them: inside, it would hide the lines it explains.
    handles, labels = ax_mem.get_legend_handles_labels()
    fig.suptitle(title)
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.025 if smoke else 0))
    rows_of_legend = -(-len(labels) // 4)
    fig.tight_layout(rect=(0, 0.045 * rows_of_legend + (0.045 if smoke else 0.02), 1, 1))
    if smoke:
        mark_smoke(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return fig


def plot_scale(s, *, path: str | Path) -> plt.Figure:
    """How the loss scales with tokens (``helpers.lab.scale``; ``s`` a ``ScaleSlice``). Left:
    forward+backward time against N, log-log, one line per method (a point not timed is left out:
    the table says why) and the four-product floor dashed black. Right: ours' fraction of the floor
    (the floor's time over ours'), 100% being the four products at the measured matmul rate and
    nothing else. Saved as PNG at ``path``."""
    colors, markers = method_colors(), method_markers()
    fig, (ax_time, ax_floor) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    for method in s.methods:
        timed = [s.ok(method, N) for N in s.Ns if s.ok(method, N)]
        if timed:
            failing = any(s.failed_gate(method, p["N"]) for p in timed)
            ax_time.plot([p["N"] for p in timed], [p["fwd_bwd_ms"] for p in timed], color=colors.get(method, "grey"),
                         marker=markers.get(method, "o"), lw=2,
                         label=method_label(method) + (" † (failed the gate, timed anyway)" if failing else ""))
    if s.matmul_tflops:
        ax_time.plot(s.Ns, [s.floor_ms(N) for N in s.Ns], "--", color="black", lw=1.2,
                     label=f"four-product floor ({s.matmul_tflops:,.0f} TFLOP/s)")
    token_axis(ax_time, s.Ns)
    ax_time.set_yscale("log")
    ax_time.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_time.set_ylabel("forward + backward, ms (median, log)")
    ax_time.set_title("time against tokens")
    ax_time.grid(True, which="major", alpha=0.3)
    ax_time.legend(fontsize=8)
    top = 0.0
    for method in s.ours:
        share = [(N, 100 * s.fraction_of_floor(method, N)) for N in s.Ns if s.fraction_of_floor(method, N)]
        if share:
            ax_floor.plot(*zip(*share), color=colors.get(method, "grey"), marker=markers.get(method, "o"), lw=2,
                          label=method_label(method))
            top = max(top, *(p for _, p in share))
    token_axis(ax_floor, s.Ns)
    if top:
        ax_floor.axhline(100, color="black", ls="--", lw=1.2, label="the floor: four products, nothing else")
        ax_floor.set_ylim(0, max(105, 1.1 * top))
        ax_floor.legend(fontsize=8, loc="lower right")
    else:
        ax_floor.text(0.5, 0.5, "no matmul rate on record (or ours not timed):\nno floor to hold ours to",
                      transform=ax_floor.transAxes, ha="center", va="center", color="dimgrey")
    ax_floor.set_ylabel("floor time / ours' time, % (the floor's speed reached)")
    ax_floor.set_title("ours against the four-product floor")
    ax_floor.grid(True, alpha=0.3)
    fig.suptitle(f"{s.label} head (V={s.V:,}, D={s.D:,}), {s.dtype}, {s.regime} inputs: "
                 f"{s.device.get('name', 'unknown device')}")
    fig.tight_layout(rect=(0, 0.02 if s.smoke else 0, 1, 1))
    if s.smoke:
        mark_smoke(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return fig


# A log axis's minor ticks labelled at 2 and 5 times a power of ten only: a span within one decade keeps
# some labels, a wide one does not crowd.
_leading_2_and_5 = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else "")


def plot_tradeoff(records: list[dict], curve: Iterable[str], *, path: str | Path, title: str,
                  failed_gate: dict[str, str] | None = None, smoke: bool = False) -> plt.Figure:
    """Time against memory, one panel per N (notebook 02): ours under each memory budget of ``curve``
    (registry keys, least memory first) as one line, each point labelled with its budget, and every
    other method of ``records`` (sweep records) as a point. x: peak above the inputs, GB (log; MB under 0.1 GB);
    y: forward+backward, ms (median, log: a slow peer does not flatten the rest). A point that ran out
    of memory or failed is left out and named under its panel; a method in ``failed_gate`` is marked †.
    Saved as PNG at ``path``."""
    curve, failed_gate = list(curve), failed_gate or {}
    colors, markers = method_colors(), method_markers()
    unit, scale = memory_unit(max((r["peak_bytes"] or 0 for r in records if r["status"] == "ok"), default=0))
    Ns = sorted({r["N"] for r in records})
    fig, axes = plt.subplots(1, len(Ns), figsize=(6.5 * len(Ns), 5), squeeze=False)
    for ax, N in zip(axes[0], Ns):
        at_N = {r["method"]: r for r in records if r["N"] == N}
        ok = {m: r for m, r in at_N.items() if r["status"] == "ok" and r.get("median_ms")}
        # Least memory first: ours as it ships need not be the least (a tier's default budget,
        # ``HostTuning.default_budget``, may be a number), and equal peaks keep the curve's order, so that
        # one label names them.
        line = sorted(((ok[m]["peak_bytes"] / scale, ok[m]["median_ms"], m) for m in curve if m in ok),
                      key=lambda p: (round(p[0], 2), curve.index(p[2])))
        if line:
            ax.plot([p[0] for p in line], [p[1] for p in line], "-", color=colors["ours"], lw=2, marker="o",
                    label="ours, memory_budget 256 MiB to 64 GiB and its default")
            groups = []  # budgets that ran the same schedule land on one point: one label for them
            for gb, ms, m in line:
                # curve[0]: ours as it ships, its default budget ("min"; 1 GiB on a T4)
                budget = "default" if m == curve[0] else m.removeprefix("ours_budget_").upper()
                if groups and abs(gb / groups[-1][0] - 1) < 0.01:
                    groups[-1][2].append(budget)
                else:
                    groups.append((gb, ms, [budget]))
            for gb, ms, budgets in groups:
                text = budgets[0] if len(budgets) == 1 else f"{budgets[0]}-{budgets[-1]}"
                ax.annotate(text, (gb, ms), textcoords="offset points", xytext=(5, 5), fontsize=8,
                            color=colors["ours"])
        for m, r in ok.items():
            if m not in curve:
                ax.plot(r["peak_bytes"] / scale, r["median_ms"], linestyle="none", marker=markers.get(m, "s"),
                        markersize=10, color=colors.get(m, "grey"),
                        label=method_label(m) + (" † (fails the gate)" if m in failed_gate else ""))
        missing = [f"{method_label(m)}: {r['status']}" for m, r in at_N.items() if m not in ok]
        if missing:
            ax.text(0.01, -0.16, "not drawn: " + "; ".join(missing), transform=ax.transAxes, fontsize=7,
                    color="dimgrey", va="top", wrap=True)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(_leading_2_and_5)
        ax.set_xlabel(f"peak memory above the inputs, {unit} (log)")
        ax.set_ylabel("forward + backward, ms (median, log)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(_leading_2_and_5)
        ax.set_title(f"N = {N:,} tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    # Wrapped to the figure's width: one panel (a T4's single N) clipped a long title at both ends.
    fig.suptitle(textwrap.fill(title, width=int(9 * fig.get_figwidth())))
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    if smoke:
        mark_smoke(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return fig


__all__ = [
    "plot_decision",
    "plot_tradeoff",
    "method_colors",
    "method_label",
    "method_markers",
    "plot_filter_skipped",
    "plot_finetune_ab",
    "plot_memory_sweep",
    "plot_pretrain_curves",
    "plot_rank_frequency",
    "plot_scale",
    "plot_rare_token_diagnostic",
    "running_max_drift",
    "token_axis",
]


# ---------------------------------------------------------------------------------------------
# Notebook 03: the convergence A/B
# ---------------------------------------------------------------------------------------------


def plot_rank_frequency(counts, vocab_size: int):
    """Training count of every type by rank, log-log: the long tail the pretraining A/B is about.
    ``counts`` holds every distinct training type's count; the vocabulary keeps the first
    ``vocab_size - 1`` ranks."""
    counts = np.sort(np.asarray(counts))[::-1]
    rank = np.arange(1, counts.size + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(rank, counts, lw=1.5)
    ax.axvline(vocab_size - 1, color="red", lw=1, label=f"vocabulary cap ({vocab_size:,} ids with <unk>)")
    ax.set(xlabel="rank of the type", ylabel="occurrences in the training split",
           title="The corpus's long tail (Zipf)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _tail_start(steps: np.ndarray, tail: float, keep: int = 2) -> int:
    """Index of the first of ``steps`` in the last ``tail`` of the run, keeping at least ``keep``
    points: every arm lies on exact at the scale of the whole run (10 nats down to 2), and the
    differences are visible only near the end."""
    cut = steps[-1] - tail * (steps[-1] - steps[0])
    return int(min(np.searchsorted(steps, cut), max(0, steps.size - keep)))


def running_max_drift(losses, reference) -> np.ndarray:
    """max over steps 1..t of |loss - reference| / |reference|, for each t: the fine-tuning
    verdict's number as the run goes (its last entry is ``helpers.lab.convergence.max_relative_drift``)."""
    a, r = np.asarray(losses, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    return np.maximum.accumulate(np.abs(a - r) / np.abs(r))


def _arm_style(name: str, baseline: str, i: int) -> dict:
    """Colour and marker of the method everywhere; the baseline thick and black; distinct dashes
    so that arms lying on one another stay visible."""
    if name == baseline:
        return dict(color="black", lw=2.2, ls="-")
    return dict(color=method_colors().get(name, "grey"), marker=method_markers().get(name, "o"),
                ls=("--", ":", "-.", (0, (5, 1)), (0, (1, 1)))[i % 5], lw=1.4, ms=5, markevery=0.2)


def plot_finetune_ab(runs: dict[str, TrainRun], labels: dict[str, str], tolerance: float, baseline: str = "exact",
                     tail: float = 0.2):
    """Left: training loss over the last ``tail`` of the steps. Right: each arm's drift from the
    baseline so far (``running_max_drift``, the number the verdict judges), log scale, with the
    bound. An arm equal to the baseline at every step has no point on a log axis: the title
    names it instead."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    reference = np.asarray(runs[baseline].train_loss)
    steps = np.arange(1, reference.size + 1)
    start = _tail_start(steps, tail)
    identical = []
    for i, (name, run) in enumerate(runs.items()):
        style, label = _arm_style(name, baseline, i), labels.get(name, name)
        left.plot(steps[start:], np.asarray(run.train_loss)[start:], label=label, **style)
        if name == baseline:
            continue
        drift = running_max_drift(run.train_loss, reference)
        if not (drift > 0).any():
            identical.append(label)
            continue
        right.plot(steps, np.where(drift > 0, drift, np.nan), label=label, **style)
    right.axhline(tolerance, color="black", ls="--", lw=1, label=f"bound {tolerance:.2g}")
    right.set_yscale("log")
    left.set(xlabel="step", ylabel="training loss (nats)",
             title=f"Fine-tuning: the last {tail:.0%} of the steps")
    title = "Fine-tuning: largest drift from exact so far"
    if identical:
        title += "\nequal to exact at every step: " + ", ".join(identical)
    right.set(xlabel="step", ylabel="max |loss − exact| / exact so far", title=title)
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_pretrain_curves(runs: dict[str, list[TrainRun]], labels: dict[str, str], baseline: str = "exact",
                         tail: float = 0.2):
    """Left: validation loss per arm over the last ``tail`` of the steps, mean over seeds with a
    min-max band. Right: each arm minus the baseline, paired by seed, over the whole run: the mean
    and its 95% confidence band (the yardstick the findings use)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    base = np.array([r.val_loss for r in runs[baseline]])  # (seeds, evals)
    for i, (name, arm_runs) in enumerate(runs.items()):
        steps = np.asarray(arm_runs[0].eval_steps)
        start = _tail_start(steps, tail)
        val = np.array([r.val_loss for r in arm_runs])
        style, label = _arm_style(name, baseline, i), labels.get(name, name)
        left.plot(steps[start:], val.mean(0)[start:], label=f"{label} ({len(arm_runs)} seeds)", **style)
        left.fill_between(steps[start:], val.min(0)[start:], val.max(0)[start:], color=style["color"], alpha=0.15)
        if name != baseline:
            mean, half = (t.numpy() for t in paired_difference(val, base))
            right.plot(steps, mean, label=label, **style)
            right.fill_between(steps, mean - half, mean + half, color=style["color"], alpha=0.15)
    right.axhline(0, color="black", lw=0.8)
    left.set(xlabel="step", ylabel="validation loss (nats, exact fp32)",
             title=f"Pretraining: validation loss, the last {tail:.0%} of the steps")
    right.set(xlabel="step", ylabel="Δ validation loss vs exact (nats)",
              title="Pretraining: difference from exact, paired by seed (95% CI)")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_rare_token_diagnostic(diagnostic: dict, bin_labels: list[str], labels: dict[str, str],
                               uniform_loss: float | None = None, baseline: str = "exact"):
    """Per training-frequency bin: the validation loss of each arm (mean over seeds, min-max bars),
    with uniform guessing (ln V) for scale; then each arm minus the baseline, paired by seed (mean
    and 95% confidence interval), on that loss and on how far the bin's classifier rows moved from
    their initialisation. ``diagnostic[arm][quantity]`` is (seeds, bins)."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    x = np.arange(len(bin_labels))
    arms = list(diagnostic)
    others = [a for a in arms if a != baseline]
    width = 0.8 / max(1, len(arms))
    for i, name in enumerate(arms):
        color = "black" if name == baseline else method_colors().get(name, "grey")
        values = np.array(diagnostic[name]["val_loss"], dtype=float)  # (seeds, bins)
        mean = values.mean(0)
        err = np.stack([mean - values.min(0), values.max(0) - mean])
        axes[0].bar(x + (i - (len(arms) - 1) / 2) * width, mean, width, yerr=err, capsize=2, color=color,
                    label=labels.get(name, name))
    if uniform_loss is not None:
        axes[0].axhline(uniform_loss, color="dimgrey", ls="--", lw=1.2,
                        label=f"uniform guessing, ln V = {uniform_loss:.2f}")
    step = 0.8 / max(1, len(others))
    for ax, quantity in zip(axes[1:], ("val_loss", "row_drift")):
        base = np.array(diagnostic[baseline][quantity], dtype=float)
        for i, name in enumerate(others):
            mean, half = (t.numpy() for t in paired_difference(np.array(diagnostic[name][quantity], dtype=float), base))
            ax.errorbar(x + (i - (len(others) - 1) / 2) * step, mean, yerr=half, fmt=method_markers().get(name, "o"),
                        color=method_colors().get(name, "grey"), capsize=3, label=labels.get(name, name))
        ax.axhline(0, color="black", lw=0.8)
    for ax in axes:
        ax.set_xticks(x, bin_labels, rotation=20)
        ax.set_xlabel("times the token occurs in the training split")
    axes[0].set(ylabel="validation loss (nats; lower is better)", title="Loss on validation tokens, by frequency")
    axes[1].set(ylabel="Δ validation loss vs exact (nats)", title="Difference from exact, paired by seed (95% CI)")
    axes[2].set(ylabel="Δ ‖C_v − C_v(init)‖ vs exact", title="How much farther each row moved than exact's")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_filter_skipped(series: dict[str, list[float]]):
    """The fraction of logit tiles our filter skipped at each step, one line per run (its label
    says which part and arm). A flat line at 0: the filter never fired, and every tile was
    multiplied in full."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (label, fractions) in enumerate(series.items()):
        fractions = np.asarray(fractions, dtype=float)
        ax.plot(np.arange(1, fractions.size + 1), 100 * fractions, ls=("-", "--", ":", "-.")[i % 4], lw=1.5,
                label=f"{label} (mean {fractions.mean():.1%})")
    ax.set(xlabel="step", ylabel="logit tiles skipped (%)", ylim=(-2, 102),
           title="Our gradient filter: the share of the backward it skipped")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_decision(methods: dict[str, dict], *, trained: bool, title: str = "") -> plt.Figure:
    """The REPORT's decision figure: one panel per token count the recommendations are given for
    (``helpers.compare.verdicts.REGIME_TOKENS``, where 02 measured it), each method a point at its
    peak memory and loss-step time, marked with the verdict engine's reading: filled where the
    method may be recommended (gate passed, trains like exact or is a baseline), hollow where a
    verdict is missing or undecided, a red cross where it fails the gate or trains worse or
    differently. ``methods``: the REPORT's facts."""
    from helpers.compare.verdicts import REGIME_TOKENS, why_not_recommended

    colors, markers = method_colors(), method_markers()
    counts = [n for n in REGIME_TOKENS if any(
        ((f.get("sweep") or {}).get("points") or {}).get(str(n), {}).get("status") == "ok" for f in methods.values())]
    fig, axes = plt.subplots(1, max(1, len(counts)), figsize=(4.6 * max(1, len(counts)), 4.6), squeeze=False)
    dtype, seen = None, {}
    for ax, n in zip(axes[0], counts):
        for name, facts in methods.items():
            sweep = facts.get("sweep") or {}
            p = (sweep.get("points") or {}).get(str(n)) or {}
            if p.get("status") != "ok" or not p.get("peak_bytes") or not p.get("seconds"):
                continue
            dtype = sweep.get("dtype")
            why = why_not_recommended(name, facts, dtype, trained)
            bad = why is not None and any(w in why for w in ("fails", "worse", "differently"))
            color = colors.get(name, "black")
            style = ({"marker": "X", "color": "firebrick", "markersize": 10} if bad else
                     {"marker": markers.get(name, "o"), "color": color, "markersize": 9,
                      "markerfacecolor": color if why is None else "white", "markeredgewidth": 1.5})
            x, y = p["peak_bytes"] / GB, p["seconds"] * 1e3
            handle, = ax.plot([x], [y], linestyle="none", **style)
            seen.setdefault(name, (handle, method_label(name) + (f" ({why})" if why else "")))
            ax.annotate(method_label(name).split(" (")[0], (x, y), textcoords="offset points", xytext=(6, 2),
                        fontsize=7, color="firebrick" if bad else color)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers, no crowded minor labels
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set(title=f"{n:,} tokens", xlabel="peak memory of one loss step, GB")
        ax.grid(True, which="both", alpha=0.25)
    axes[0][0].set_ylabel("forward + backward, ms")
    fig.suptitle(f"Which loss: time against memory{f', {dtype}' if dtype else ''}; lower left is better"
                 + (f"\n{title}" if title else ""), fontsize=10)
    fig.legend([h for h, _ in seen.values()], [label for _, label in seen.values()], loc="lower center",
               ncol=min(3, max(1, len(seen))), fontsize=7, frameon=False,
               title="filled: may be recommended; hollow: a verdict missing; red X: fails a verdict", title_fontsize=7)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    return fig
