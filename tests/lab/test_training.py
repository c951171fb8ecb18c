"""helpers.lab.training: the seeded training loop, the loss variants and the rare-token diagnostics of
notebook 03. Tiny shapes, fp32, exact and chunked only (the Triton arms are the notebook's job)."""

import json
import math
import warnings

import pytest
import torch

from helpers.compare.methods import Method, exact_loss, get_method
from helpers.lab import training
from helpers.lab.corpus import build_corpus


@pytest.fixture(autouse=True)
def one_thread():
    # Tensors here are tiny: a second thread only adds synchronisation (and, on a busy machine,
    # seconds of spinning).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lm_task():
    corpus = build_corpus(200, max_files=20)
    return training.CorpusLMTask(corpus, D=16, context=3, d_embed=8, d_hidden=32, batch=32, curve_tokens=500)


def small_finetune_task():
    return training.FineTuneTask(V=97, D=12, d_features=10, rows=256, batch=24)


def test_same_seed_same_losses_exactly(lm_task):
    kwargs = dict(seed=3, steps=12, lr=3e-3, warmup=2, eval_every=4)
    a = training.train(lm_task, "exact", **kwargs)
    b = training.train(lm_task, "exact", **kwargs)
    assert a.train_loss == b.train_loss and a.val_loss == b.val_loss
    assert torch.equal(a.row_drift, b.row_drift) and torch.equal(a.val_token_loss, b.val_token_loss)
    c = training.train(lm_task, "exact", **{**kwargs, "seed": 4})
    assert c.train_loss != a.train_loss
    assert a.eval_steps == [0, 4, 8, 12] and a.val_loss[-1] < a.val_loss[0]


def test_exact_and_chunked_agree_over_steps():
    task = small_finetune_task()
    exact = training.train(task, "exact", seed=0, steps=15, lr=1e-2)
    chunked = training.train(task, "chunked", seed=0, steps=15, lr=1e-2)
    assert training.max_relative_drift(chunked.train_loss, exact.train_loss) < 1e-5
    assert exact.train_loss[-1] < exact.train_loss[0]  # it trains


def test_a_wrong_loss_fails_the_ab(temporary_method):
    task = small_finetune_task()
    exact = training.train(task, "exact", seed=0, steps=10, lr=1e-2)

    def right_value_wrong_gradient(E, C, x, **kw):
        # (A gradient scaled by a constant would not do: Adam's update is invariant to it.)
        lse = (E.float() @ C.float().T).logsumexp(1).mean()
        return exact_loss(E, C, x, **kw) + 0.05 * (lse - lse.detach())

    temporary_method(Method("wrong", "wrong", "exact value, 5% of an extra push-down in the gradient",
                            right_value_wrong_gradient, lambda device, dtype, softcap: None))
    drifted = training.train(task, "wrong", seed=0, steps=10, lr=1e-2)
    assert drifted.train_loss[0] == pytest.approx(exact.train_loss[0], rel=1e-6)  # same start
    assert training.max_relative_drift(drifted.train_loss, exact.train_loss) > 1e-4  # drifts past the fp32 bound


def test_every_classifier_row_gets_a_gradient_from_the_exact_loss(lm_task):
    run = training.train(lm_task, "exact", seed=0, steps=5, lr=1e-3)
    assert (run.rows_with_grad == 5).all()
    assert run.row_drift.shape == (lm_task.V,) and (run.row_drift > 0).all()


def test_an_arm_that_cannot_run_says_why_before_training():
    assert get_method("exact").why_unavailable("cpu", torch.float32) is None
    with pytest.raises(RuntimeError, match="apple_cce cannot run on cpu.*CUDA"):
        training.train(small_finetune_task(), "apple_cce", seed=0, steps=1, lr=1e-2)


def test_the_training_presets_are_methods_of_the_registry():
    nofilter = get_method("ours_nofilter")
    assert nofilter.preset_of == "ours" and nofilter.kind == "ours" and not nofilter.counts_skips
    assert get_method("ours").counts_skips and get_method("exact").preset_of == "naive"


def test_context_windows():
    ids = torch.arange(10) * 10
    contexts, targets = training.context_windows(ids, torch.tensor([3, 9]), 3)
    assert contexts.tolist() == [[0, 10, 20], [60, 70, 80]] and targets.tolist() == [30, 90]


def test_frequency_bins_by_decade_skip_unk_and_empty_bins():
    counts = torch.tensor([500, 1, 9, 10, 99, 5000, 12_000])  # id 0 is <unk>
    bins, labels = training.frequency_bins(counts)
    assert labels == ["1–9", "10–99", "1,000–9,999", "10,000–99,999"]  # no type in 100-999
    assert bins.tolist() == [-1, 0, 0, 1, 1, 2, 3]


def test_per_bin_mean_ignores_excluded_items_and_marks_empty_bins():
    values = torch.tensor([100.0, 1.0, 3.0, 10.0, 7.0])
    bins = torch.tensor([-1, 0, 0, 2, 2])
    means = training.per_bin_mean(values, bins, 3)
    assert means[0] == 2.0 and math.isnan(means[1]) and means[2] == 8.5


def test_rare_token_diagnostic_shapes(lm_task):
    runs = {arm: [training.train(lm_task, arm, seed=s, steps=4, lr=1e-3, eval_every=2) for s in (0, 1)]
            for arm in ("exact", "chunked")}
    bins, labels = training.frequency_bins(lm_task.corpus.train_counts)
    _, val_targets = lm_task.validation_set()
    diagnostic = training.rare_token_diagnostic(runs, bins, val_targets, len(labels))
    for arm in runs:
        for quantity in training.DIAGNOSTIC_QUANTITIES:
            assert len(diagnostic[arm][quantity]) == 2 and len(diagnostic[arm][quantity][0]) == len(labels)
    comparisons, findings = training.pretraining_findings(runs, diagnostic, labels, {"chunked": "chunked"})
    assert comparisons["final_val_loss"]["chunked"]["differs"] is False
    assert any("no difference at this scale" in line for line in findings)


def test_comparison_against_the_seed_spread():
    values = {"exact": [1.0, 1.1, 0.9], "same": [1.01, 1.09, 0.91], "worse": [1.5, 1.6, 1.4]}
    c = training.compare_to_baseline(values)
    assert c["same"]["differs"] is False and c["worse"]["differs"] is True
    assert c["worse"]["effect"] == pytest.approx(0.5) and c["worse"]["seed_spread"] == pytest.approx(0.1)
    lines = training.describe_comparison("loss", c, {})
    assert "no difference" in lines[0] and "real difference" in lines[1]
    assert training.compare_to_baseline({"exact": [1.0], "x": [2.0]})["x"]["differs"] is None


def test_a_skipped_first_fp16_step_warns_nothing(temporary_method):
    # When the scaler skips the first fp16 step (inf gradients at its initial scale), torch warns that
    # the schedule stepped before the optimizer: expected, and silenced. A loss scaled by 1e6 makes
    # the first step's fp16 gradients overflow for certain.
    temporary_method(Method("huge", "huge", "exact times 1e6", lambda E, C, x, **kw: 1e6 * exact_loss(E, C, x, **kw),
                            lambda device, dtype, softcap: None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = training.train(small_finetune_task(), "huge", seed=0, steps=2, lr=1e-2, compute_dtype=torch.float16)
    assert run.skipped_steps >= 1
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    factors = [training.learning_rate_factor(s, 100, 10) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1, abs=1e-3)


def test_write_json_turns_nan_into_null(tmp_path):
    path = training.write_json(tmp_path / "r.json", {"a": [1.0, float("nan")], "b": {"c": math.inf}})
    assert json.loads(path.read_text()) == {"a": [1.0, None], "b": {"c": None}}
