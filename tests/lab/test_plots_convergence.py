"""Notebook 03's figures: each shows what its title says, from fake runs (no training here)."""

import math

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from helpers.lab import convergence, plots
from helpers.lab.training import TrainRun


@pytest.fixture(autouse=True)
def close_figures():
    yield
    matplotlib.pyplot.close("all")


def test_running_max_drift_is_the_verdicts_number_as_the_run_goes():
    reference = [2.0, 2.0, 2.0, 2.0]
    losses = [2.0, 2.2, 2.1, 1.0]
    drift = plots.running_max_drift(losses, reference)
    assert drift.tolist() == pytest.approx([0.0, 0.1, 0.1, 0.5])
    assert drift[-1] == convergence.max_relative_drift(losses, reference)


def test_finetune_figure_zooms_on_the_end_and_names_arms_equal_to_exact():
    steps = 50
    exact = list(np.linspace(10, 2, steps))
    runs = {"exact": TrainRun("exact", 0, exact), "naive": TrainRun("naive", 0, exact),
            "liger": TrainRun("liger", 0, [v * 1.01 for v in exact])}
    fig = plots.plot_finetune_ab(runs, {"naive": "naive", "liger": "Liger"}, tolerance=2e-2)
    left, right = fig.axes
    assert min(line.get_xdata()[0] for line in left.get_lines()) >= 0.8 * steps  # the last 20% only
    assert "equal to exact at every step: naive" in right.get_title()
    drawn = {line.get_label(): line for line in right.get_lines()}
    assert "naive" not in drawn and right.get_yscale() == "log"
    assert np.nanmax(drawn["Liger"].get_ydata()) == pytest.approx(0.01)
    assert "bound 0.02" in drawn


def test_pretraining_figure_draws_the_paired_difference_and_its_interval():
    evals = list(range(0, 101, 10))
    def run(arm, seed, offset):
        return TrainRun(arm, seed, [1.0], eval_steps=evals, val_loss=[10 - 0.05 * s + offset for s in evals])

    base = [0.0, 0.3, -0.3]  # seeds far apart...
    runs = {"exact": [run("exact", s, b) for s, b in enumerate(base)],
            "apple_cce": [run("apple_cce", s, b + d) for s, (b, d) in enumerate(zip(base, [0.04, 0.05, 0.06]))]}
    fig = plots.plot_pretrain_curves(runs, {"apple_cce": "Apple CCE"})
    left, right = fig.axes
    assert min(line.get_xdata()[0] for line in left.get_lines()) >= 80
    (line,) = [l for l in right.get_lines() if l.get_label() == "Apple CCE"]
    assert line.get_ydata() == pytest.approx([0.05] * len(evals))  # ...but 0.05 apart, paired
    band = right.collections[0].get_paths()[0].vertices[:, 1]
    half = 4.303 * 0.01 / math.sqrt(3)  # t(2) x sd of (0.04, 0.05, 0.06) / sqrt(3)
    assert band.min() == pytest.approx(0.05 - half) and band.max() == pytest.approx(0.05 + half)


def test_rare_token_figure_marks_uniform_guessing_and_compares_paired():
    diagnostic = {"exact": {"val_loss": [[11.0, 5.0], [11.2, 5.2]], "row_drift": [[1.0, 2.0], [1.0, 2.0]]},
                  "apple_cce": {"val_loss": [[10.6, 5.1], [10.8, 5.3]], "row_drift": [[0.1, 2.0], [0.1, 2.0]]}}
    fig = plots.plot_rare_token_diagnostic(diagnostic, ["1–9", "10–99"], {}, uniform_loss=math.log(32768))
    loss, delta_loss, delta_drift = fig.axes
    assert any(l.get_ydata()[0] == pytest.approx(math.log(32768)) for l in loss.get_lines())
    for ax, want in ((delta_loss, [-0.4, 0.1]), (delta_drift, [-0.9, 0.0])):
        (bars,) = [c for c in ax.containers if c.get_label() == "apple_cce"]
        assert bars.lines[0].get_ydata() == pytest.approx(want)  # each arm minus exact, seed by seed


def test_filter_figure_shows_each_runs_share_skipped():
    fig = plots.plot_filter_skipped({"pretraining, ours": [0.0, 0.5, 1.0]})
    (line,) = fig.axes[0].get_lines()
    assert line.get_ydata().tolist() == [0.0, 50.0, 100.0] and "mean 50.0%" in line.get_label()
