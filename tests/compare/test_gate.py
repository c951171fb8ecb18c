"""The gate passes correct methods, reports unavailable ones, and catches wrong ones."""

import json
import math

import pytest
import torch

from helpers.compare.gate import GateCase, GateFailure, gate_cases, run_gate
from helpers.compare.methods.baselines import naive_loss
from helpers.compare.methods import Method

SHAPES = [(23, 301, 40), (9, 517, 24)]
CASES = gate_cases(SHAPES)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # bf16 is fine for pure-PyTorch methods on CPU


def test_correct_methods_pass_in_every_dtype():
    report = run_gate(["naive", "chunked"], DTYPES, CASES, device="cpu")
    assert not report.failures
    assert report.passed("chunked", torch.bfloat16)
    assert len(report.rows) == 2 * len(DTYPES) * len(CASES)


def test_unavailable_methods_are_reported_not_dropped():
    report = run_gate(["chunked", "apple_cce"], (torch.float32,), CASES[:1], device="cpu")
    cce_rows = [r for r in report.rows if r.method == "apple_cce"]
    assert cce_rows and all(r.status == "unavailable" and "CUDA GPU" in r.reason for r in cce_rows)
    assert not report.passed("apple_cce")


class ScaledGradient(torch.autograd.Function):
    """Identity forward; backward scales the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def _wrong(name, implementation):
    return Method(name, name, "deliberately wrong", implementation, lambda d, t, s: None)


def gradient_times_1_01(E, C, x, **kw):
    return naive_loss(ScaledGradient.apply(E, 1.01), ScaledGradient.apply(C, 1.01), x, **kw)


def softcap_dropped(E, C, x, *, softcap=None, **kw):
    return naive_loss(E, C, x, **kw)


def upstream_gradient_ignored(E, C, x, **kw):
    loss = naive_loss(E, C, x, **kw)
    return ScaledGradient.apply(loss, 1.0 / 0.73) if loss.dim() == 0 else loss


def nan_when_all_ignored_gradients(E, C, x, **kw):
    loss = naive_loss(E, C, x, **kw)
    if (x != -100).any() or kw["reduction"] != "mean":
        return loss
    return loss + E.sum() * math.nan  # NaN loss, as torch, but NaN gradients too: wrong


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "wrong, broken_quantities",
    [
        (gradient_times_1_01, {"dE", "dC"}),
        (softcap_dropped, {"loss", "dE", "dC"}),
        (upstream_gradient_ignored, {"dE", "dC"}),
    ],
)
def test_the_gate_catches_a_wrong_method(temporary_method, dtype, wrong, broken_quantities):
    temporary_method(_wrong("wrong", wrong))
    with pytest.raises(GateFailure) as failure:
        run_gate(["naive", "wrong"], (dtype,), CASES, device="cpu")
    message = str(failure.value)
    assert "wrong [" in message and "naive [" not in message
    assert any(f": {q} error" in message for q in broken_quantities)


def test_the_gate_catches_nan_gradients(temporary_method):
    temporary_method(_wrong("nan_grads", nan_when_all_ignored_gradients))
    report = run_gate(["nan_grads"], (torch.float32,), CASES, device="cpu", raise_on_failure=False)
    failed = {r.case for r in report.failures}
    assert failed == {c.name for c in CASES if c.ignore == "all" and c.reduction == "mean"}


def test_a_crashing_method_is_a_failure_not_a_crash(temporary_method):
    def crash(E, C, x, **kw):
        raise RuntimeError("kernel exploded")

    temporary_method(_wrong("crash", crash))
    report = run_gate(["crash"], (torch.float32,), CASES[:1], device="cpu", raise_on_failure=False)
    assert report.failures and "kernel exploded" in report.failures[0].reason
    assert "kernel exploded" in report.failure_message()


def test_a_method_asking_for_several_calls_is_gated_on_its_last(temporary_method):
    """``Method.gate_calls``: the calls reuse the case's leaves (a path keyed by their addresses, ours' backward
    graphs, is reached from the third) and the last call's result is gated: a method wrong only in its third
    call fails, one wrong only before it passes."""
    import dataclasses

    def nth_call_wrong(n):
        calls = {}

        def loss(E, C, x, **kw):
            calls[id(C)] = calls.get(id(C), 0) + 1
            return naive_loss(E, C, x, **kw) * (1.02 if calls[id(C)] == n else 1.0)
        return loss

    temporary_method(dataclasses.replace(_wrong("wrong_third", nth_call_wrong(3)), gate_calls=3))
    temporary_method(dataclasses.replace(_wrong("wrong_first", nth_call_wrong(1)), gate_calls=3))
    report = run_gate(["wrong_third", "wrong_first"], (torch.float32,), CASES[:2], device="cpu", raise_on_failure=False)
    assert report.failing_methods() == {"wrong_third"}, report.failure_message()


def test_cases_cover_reductions_ignores_and_softcap():
    assert {c.reduction for c in CASES} == {"mean", "sum", "none"}
    assert {c.ignore for c in CASES} == {"none", "some", "all"}
    assert any(c.softcap for c in CASES)
    assert all(isinstance(c, GateCase) for c in CASES)


def test_report_writes_json_and_markdown(tmp_path):
    report = run_gate(["naive", "apple_cce"], (torch.float32,), CASES[:2], device="cpu")
    path = report.to_json(tmp_path / "gate.json")
    assert '"passed": true' in path.read_text()
    table = report.markdown()
    assert "| naive | float32 | 2 |" in table and "unavailable" in table
    # Where the gate's time goes: each method that ran, and each case's inputs and float64 reference.
    written = json.loads(path.read_text())
    ran = [r for r in written["rows"] if r["status"] != "unavailable"]
    assert ran and all(r["seconds"] > 0 for r in ran)
    assert all(r["seconds"] is None for r in written["rows"] if r["status"] == "unavailable")
    assert sorted(written["setup_seconds"]) == sorted(f"float32 {c.name}" for c in CASES[:2])
    assert all(s >= 0 for s in written["setup_seconds"].values())


def test_naive_over_its_floor_is_reported_not_failed(monkeypatch):
    import helpers.compare.gate as gate
    import helpers.compare.verdicts as verdicts

    tight = {dtype: {q: 1e-12 for q in gate.QUANTITIES} for dtype in verdicts.GATE_FLOOR}
    monkeypatch.setattr(verdicts, "GATE_FLOOR", tight)
    report = run_gate(["naive", "chunked"], (torch.float16,), CASES[:2], device="cpu", raise_on_failure=False)
    naive_rows = [r for r in report.rows if r.method == "naive"]
    assert naive_rows and all(r.status == "over floor" for r in naive_rows)
    assert report.passed("naive") and "over the dtype floor" in report.markdown()
    # chunked is judged against 2x naive's errors, which it beats or fails on its own merits
    assert all(r.method == "chunked" for r in report.failures)


def test_each_bar_of_the_figure_is_coloured_by_its_verdict(monkeypatch, tmp_path):
    import matplotlib.colors

    import helpers.compare.gate as gate
    import helpers.compare.verdicts as verdicts

    tight = {dtype: {q: 1e-12 for q in gate.QUANTITIES} for dtype in verdicts.GATE_FLOOR}
    monkeypatch.setattr(verdicts, "GATE_FLOOR", tight)  # naive over its floor everywhere; chunked fails some bars
    report = run_gate(["naive", "chunked"], (torch.float16,), CASES[:2], device="cpu", raise_on_failure=False)
    fig = report.plot(tmp_path / "gate.png")
    assert (tmp_path / "gate.png").is_file()
    bars = fig.axes[0].patches  # grouped by quantity: loss (naive, chunked), dE (...), dC (...)
    colours = [matplotlib.colors.to_hex(b.get_facecolor()) for b in bars]
    summary = {s["method"]: s for s in report.summary()}
    for k, q in enumerate(gate.QUANTITIES):
        for i, method in enumerate(["naive", "chunked"]):
            want = gate.bar_verdict(summary[method], summary[method][f"worst {q} error/bound"])
            assert colours[2 * k + i] == gate.VERDICT_COLOURS[want], (method, q)
    assert {gate.bar_verdict(summary["naive"], 5.0), gate.bar_verdict(summary["chunked"], 5.0)} == {
        "yardstick over the floor", "fail"}
    assert gate.bar_verdict(summary["chunked"], 0.5) == "pass"
    assert gate.bar_verdict(summary["naive"], float("nan")) == "fail"  # a stray NaN is never the dtype's limit
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    drawn = [v for v, c in gate.VERDICT_COLOURS.items() if c in colours]  # the legend names only the verdicts drawn
    assert labels[:len(drawn)] == drawn and {"loss", "dE", "dC", "bound"} <= set(labels[len(drawn):])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["naive", "chunked (PyTorch)"]  # the labels


def test_facts_give_each_method_its_verdict_per_dtype_it_ran_in(temporary_method):
    temporary_method(_wrong("wrong", gradient_times_1_01))
    report = run_gate(["chunked", "wrong", "apple_cce"], (torch.float32, torch.float16), CASES[:2], device="cpu",
                      raise_on_failure=False)
    facts = report.facts()
    assert facts["chunked"] == {"gradients": {"float32": "pass", "float16": "pass"}}
    cases = [c.name for c in CASES[:2]]
    assert facts["wrong"] == {"gradients": {"float32": "fail", "float16": "fail"},
                              "gradient_failures": {d: {"cases": 2, "failed": cases, "not_finite": False}
                                                    for d in ("float32", "float16")}}
    assert f"FAIL (2 of 2 cases: {'; '.join(cases)})" in report.markdown()
    assert "apple_cce" not in facts  # unavailable on a CPU: nothing measured, no verdict


def gradient_times_nan(E, C, x, **kw):
    return naive_loss(ScaledGradient.apply(E, float("nan")), ScaledGradient.apply(C, float("nan")), x, **kw)


def test_a_failure_whose_gradients_are_not_finite_says_so(temporary_method):
    """The REPORT tells a convention (NaN gradients where torch's cross_entropy gives 0) from a wrong kernel
    by this fact (``verdicts.recommend``), not by the failing case's name."""
    temporary_method(_wrong("nan_grads", gradient_times_nan))
    report = run_gate(["nan_grads"], (torch.float32,), CASES[:1], device="cpu", raise_on_failure=False)
    assert report.facts()["nan_grads"]["gradient_failures"]["float32"]["not_finite"] is True


def test_a_realistic_case_draws_targets_that_repeat():
    """The realistic case's targets follow a Zipf-shaped softmax: some token is the target of many
    rows (what a gradient summed in 16 bits over row chunks gets wrong), unlike the uniform cases."""
    from helpers.compare.gate import case_inputs, gate_cases

    cases = gate_cases([(37, 257, 24)], [(64, 521, 16)])
    uniform, realistic = cases[0], cases[-1]
    assert realistic.regime == "realistic" and realistic.name.endswith("realistic targets")
    assert all(c.regime == "uniform" for c in cases[:-1]) and len(gate_cases([(37, 257, 24)])) == len(cases) - 1
    _, _, x, _ = case_inputs(realistic, torch.float32, "cpu", seed=0)
    _, _, x_uniform, _ = case_inputs(uniform, torch.float32, "cpu", seed=0)
    assert torch.bincount(x).max() >= 6 > torch.bincount(x_uniform).max()
