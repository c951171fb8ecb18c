"""The suite's figures: one function per figure, each taking the records a notebook measured and
returning the matplotlib Figure after saving it as PNG.

Shared conventions, so that a method looks the same in every notebook: ``method_colors`` gives each
registered method one colour for good; token counts go on a log2 axis labelled with the counts
themselves (``token_axis``); memory is in GB = 10^9 bytes (the seed article's unit).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator

from .methods import METHODS

GB = 1e9  # the seed article's unit


def method_colors() -> dict[str, tuple]:
    """One colour per registered method, in registration order (stable across notebooks)."""
    palette = plt.get_cmap("tab10").colors
    return {name: palette[i % len(palette)] for i, name in enumerate(METHODS)}


def method_markers() -> dict[str, str]:
    """One marker per registered method, so that lines lying on top of each other stay visible."""
    shapes = "os^Dv<>P*h"
    return {name: shapes[i % len(shapes)] for i, name in enumerate(METHODS)}


def method_label(name: str) -> str:
    return METHODS[name].label if name in METHODS else name


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
    micro_batch_N: int | None = None,
    latency_caveat: str = "",
    unit: tuple[str, float] = ("GB", GB),
) -> plt.Figure:
    """Peak memory against N (left) and forward+backward time against N (right).

    Left: measured points as solid lines, the theory for each method as a thin dashed line of the
    same colour (drawn past the wall too, to show where it would have gone), out-of-memory points
    as crosses on the usable-memory line, the floor dE + dC in grey, the usable memory dashed and
    the article's micro-batch dotted. Right: median time with the p10-p90 range.

    room_bytes: {N: bytes a step may use at N}, the cap minus the inputs resident at that N (None:
    no cap). It is the line a point must stay under. unit: (name, bytes), e.g. ("GB", 1e9).
    """
    unit_name, scale = unit
    colors, markers = method_colors(), method_markers()
    Ns = sorted({r["N"] for r in records})
    methods = list(dict.fromkeys(r["method"] for r in records))
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(14, 5.6))
    ooms_at: dict[int, int] = {}  # N -> OOM crosses drawn there so far, to fan them out

    for method in methods:
        rows = sorted((r for r in records if r["method"] == method), key=lambda r: r["N"])
        color, marker, label = colors.get(method, "black"), markers.get(method, "o"), method_label(method)
        ok = [r for r in rows if r["status"] == "ok"]
        ax_mem.plot([r["N"] for r in ok], [r["peak_bytes"] / scale for r in ok], marker + "-", color=color, lw=2,
                    ms=6, label=label)
        theory = [r for r in rows if r["theory_bytes"] is not None]
        ax_mem.plot([r["N"] for r in theory], [r["theory_bytes"] / scale for r in theory], "--", color=color,
                    lw=1, alpha=0.7)
        for r in (r for r in rows if r["status"] == "oom"):
            y = ((room_bytes or {}).get(r["N"]) or r["theory_bytes"] or r["lower_bound_bytes"]) / scale
            k = ooms_at[r["N"]] = ooms_at.get(r["N"], -1) + 1
            x = r["N"] * 2 ** (-0.12 * k)  # several methods out of memory at one N: side by side
            ax_mem.plot(x, y, "X", color=color, ms=13, mec="black", zorder=5)
            ax_mem.annotate(f"{label}: OOM", (x, y), textcoords="offset points", xytext=(-8, 10 + 11 * k),
                            ha="right", fontsize=8, color=color)
        if ok:
            ax_time.errorbar(
                [r["N"] for r in ok],
                [r["median_ms"] for r in ok],
                yerr=[[r["median_ms"] - r["p10_ms"] for r in ok], [r["p90_ms"] - r["median_ms"] for r in ok]],
                fmt=marker + "-", color=color, lw=2, ms=6, capsize=3, label=label,
            )

    floor = sorted({(r["N"], r["lower_bound_bytes"]) for r in records})
    ax_mem.plot([n for n, _ in floor], [b / scale for _, b in floor], "-.", color="grey", lw=1,
                label="floor: dE + dC")
    ax_mem.plot([], [], "--", color="grey", lw=1, label="theory (same colour as measured)")
    if room_bytes:
        room = sorted(room_bytes.items())
        ax_mem.plot([n for n, _ in room], [b / scale for _, b in room], "--", color="black", lw=1.2,
                    label=f"usable memory (cap minus inputs): {room[0][1] / scale:.2f} {unit_name}")
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
    ax_time.set_title("forward + backward time: median, p10-p90" + (f"\n{latency_caveat}" if latency_caveat else ""),
                      fontsize=10)
    # One legend for both panels, below them: inside, it would hide the lines it explains.
    handles, labels = ax_mem.get_legend_handles_labels()
    fig.suptitle(title)
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=8, frameon=False)
    rows_of_legend = -(-len(labels) // 5)
    fig.tight_layout(rect=(0, 0.045 * rows_of_legend + 0.02, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return fig


__all__ = ["method_colors", "method_label", "method_markers", "plot_memory_sweep", "token_axis"]
