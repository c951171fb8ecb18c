"""Notebook 02's figure on fake records: a method that fails the gate is drawn and labelled so, a T4's
wall appears beside this card's, an OOM cross sits at its N and at least on the wall, a smoke run is
stamped before the file is written."""

import matplotlib
import matplotlib.figure

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from helpers.lab.plots import plot_memory_sweep  # noqa: E402
from helpers.lab.profiles import SMOKE_NOTE  # noqa: E402


def point(method, N, status="ok", peak=None, theory=None):
    return {"method": method, "N": N, "status": status, "peak_bytes": peak, "theory_bytes": theory,
            "lower_bound_bytes": 3e8, "median_ms": 10.0, "p10_ms": 9.0, "p90_ms": 11.0}


RECORDS = [
    point("naive", 4096, peak=7.5e9, theory=7.5e9), point("naive", 16_384, "oom", theory=29.9e9),
    point("torch_compile", 4096, peak=1.6e9, theory=1.6e9), point("torch_compile", 16_384, "oom", theory=5.3e9),
    point("apple_cce", 4096, peak=3.2e8, theory=3.2e8), point("apple_cce", 16_384, peak=3.5e8, theory=3.5e8),
]
ROOM = {4096: int(14e9), 16_384: int(13e9)}


@pytest.fixture
def figure(tmp_path):
    fig = plot_memory_sweep(RECORDS, path=tmp_path / "sweep.png", title="test", room_bytes=ROOM,
                            t4_room_bytes={4096: int(12e9), 16_384: int(11e9)}, failed_gate={"apple_cce": "dE"})
    yield fig
    plt.close(fig)


def test_a_method_that_fails_the_gate_is_drawn_dotted_and_labelled(figure):
    memory = figure.axes[0]
    lines = {line.get_label(): line for line in memory.get_lines()}
    assert lines["Apple CCE (fails accuracy gate)"].get_linestyle() == ":"
    assert lines["naive"].get_linestyle() == "-"
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert "Apple CCE (fails accuracy gate)" in legend


def test_both_walls_are_drawn_and_named(figure):
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert "usable memory (cap minus inputs): 14.00 GB at N=4,096" in legend
    assert "a T4's usable memory (cap minus inputs): 12.00 GB at N=4,096" in legend
    assert any("under the measured line where they agree" in text for text in legend)


def test_an_oom_cross_sits_at_its_n_where_the_theory_put_it_at_least_on_the_wall(figure):
    memory = figure.axes[0]
    crosses = {tuple(line.get_xydata()[0]) for line in memory.get_lines() if line.get_marker() == "X"}
    # naive's theory (29.9 GB) is over the wall; torch.compile's (5.3 GB) under it: drawn on the wall.
    assert crosses == {(16_384, 29.9), (16_384, 13.0)}
    notes = sorted((t.get_text(), t.xyann[1]) for t in memory.texts)
    assert notes == [("naive: OOM", 0.0), ("torch.compile: OOM", -11.0)]  # stepping down from the highest cross


def test_a_smoke_run_is_stamped_in_the_saved_file(tmp_path, monkeypatch):
    saved = []
    save = matplotlib.figure.Figure.savefig

    def savefig(fig, path, **kw):
        saved.append([t.get_text() for t in fig.texts])  # what the file gets: the texts at the time of saving
        return save(fig, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    fig = plot_memory_sweep(RECORDS, path=tmp_path / "smoke.png", title="test", unit=("MB", 1e6), smoke=True)
    plain = plot_memory_sweep(RECORDS, path=tmp_path / "plain.png", title="test")
    assert any(SMOKE_NOTE in t for t in saved[0]) and "SMOKE RUN" in saved[0]
    assert not any(SMOKE_NOTE in t for t in saved[1])
    assert (tmp_path / "smoke.png").stat().st_size > 10_000
    plt.close(fig)
    plt.close(plain)


def test_the_tradeoff_curve_runs_least_memory_first_and_names_equal_points_once(tmp_path):
    """Ours as it ships under a tier's default budget of 1 GiB (``HostTuning.default_budget``, as the T4's tier
    had for a run): the same point as the 1 GiB arm, and more memory than 256 MiB. The line goes by memory,
    not by the curve's order, and one label names both (drawn in the curve's order, the line zigzagged and
    the two labels overlapped)."""
    from helpers.compare.methods.ours import BUDGET_CURVE
    from helpers.lab.plots import plot_tradeoff

    def at(method, peak, ms):
        return dict(point(method, 16_384, peak=peak), median_ms=ms)

    records = [at("ours", 1.41e9, 29.1), at("ours_budget_256m", 0.41e9, 520.0), at("ours_budget_512m", 0.84e9, 31.0),
               at("ours_budget_1g", 1.41e9, 29.0), at("ours_budget_4g", 4.6e9, 27.5), at("liger", 0.38e9, 80.6)]
    fig = plot_tradeoff(records, BUDGET_CURVE, path=tmp_path / "tradeoff.png", title="t")
    ax = fig.axes[0]
    xs = list(ax.lines[0].get_xdata())
    assert xs == sorted(xs), xs
    labels = [t.get_text() for t in ax.texts if t.get_text() and not t.get_text().startswith("not drawn")]
    assert labels == ["256M", "512M", "default-1G", "4G"], labels
    plt.close(fig)
