"""helpers.lab.training and helpers.lab.convergence: the seeded training loop, the loss variants
and the rare-token diagnostics of notebook 03. Tiny shapes, fp32, exact and chunked only (the Triton
arms are the notebook's job)."""

import json
import math
import warnings

import pytest
import torch

from helpers.compare import verdicts
from helpers.compare.methods.baselines import exact_loss
from helpers.compare.methods import Method, get_method
from helpers.lab import convergence, training
from helpers.compare.corpus import build_corpus


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
    assert convergence.max_relative_drift(chunked.train_loss, exact.train_loss) < 1e-5
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
    assert convergence.max_relative_drift(drifted.train_loss, exact.train_loss) > 1e-4  # drifts past the fp32 bound


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
    bins, labels = convergence.frequency_bins(counts)
    assert labels == ["1–9", "10–99", "1,000–9,999", "10,000–99,999"]  # no type in 100-999
    assert bins.tolist() == [-1, 0, 0, 1, 1, 2, 3]


def test_per_bin_mean_ignores_excluded_items_and_marks_empty_bins():
    values = torch.tensor([100.0, 1.0, 3.0, 10.0, 7.0])
    bins = torch.tensor([-1, 0, 0, 2, 2])
    means = convergence.per_bin_mean(values, bins, 3)
    assert means[0] == 2.0 and math.isnan(means[1]) and means[2] == 8.5


def test_rare_token_diagnostic_shapes(lm_task):
    runs = {arm: [training.train(lm_task, arm, seed=s, steps=4, lr=1e-3, eval_every=2) for s in (0, 1)]
            for arm in ("exact", "chunked")}
    bins, labels = convergence.frequency_bins(lm_task.corpus.train_counts)
    _, val_targets = lm_task.validation_set()
    diagnostic = convergence.rare_token_diagnostic(runs, bins, val_targets, len(labels))
    for arm in runs:
        for quantity in convergence.DIAGNOSTIC_QUANTITIES:
            assert len(diagnostic[arm][quantity]) == 2 and len(diagnostic[arm][quantity][0]) == len(labels)
    comparisons, findings = convergence.pretraining_findings(runs, diagnostic, labels, {"chunked": "chunked"})
    assert comparisons["final_val_loss"]["chunked"]["verdict"] == "equivalent"  # the same arithmetic in fp32
    assert any("equivalent within" in line for line in findings)
    table = convergence.bin_table(comparisons["bins"]["val_loss"], labels, {"chunked": "chunked"})
    assert table.startswith("| method | seen") and "| chunked |" in table
    assert set(comparisons["bins"]) == {"val_loss", "row_drift"} and len(comparisons["bins"]["val_loss"]) == len(labels)


def test_comparison_is_paired_by_seed():
    # Seeds move the loss by ~0.1; "shifted" sits 0.05 above exact on every seed: invisible against
    # the seed spread, plain once each seed is compared with its own exact run (margin: half of 0.1).
    values = {"exact": [1.0, 1.1, 0.9], "shifted": [1.0501, 1.1499, 0.95], "noisy": [1.05, 1.05, 0.95]}
    c = convergence.outcomes_against(values)
    assert c["shifted"]["verdict"] == "undecided" and c["shifted"]["same_sign_seeds"] == 3  # 0.05 sits on the margin
    assert c["shifted"]["effect"] == pytest.approx(0.05) and c["shifted"]["seed_spread"] == pytest.approx(0.1)
    # differences +0.05, -0.05, +0.05: the interval (t = 4.30 at 2 degrees of freedom) is wide
    assert c["noisy"]["verdict"] == "undecided"
    assert c["noisy"]["ci95"] == pytest.approx(4.303 * torch.tensor([0.05, -0.05, 0.05]).std().item() / math.sqrt(3))
    far = convergence.outcomes_against({"exact": [1.0, 1.1, 0.9], "x": [1.3, 1.401, 1.2]})["x"]
    assert far["verdict"] == "worse"
    assert convergence.outcomes_against({"exact": [1.0], "x": [2.0]})["x"]["verdict"] == "undecided"
    # the row drift is no loss: its margin has no nats floor
    assert convergence.outcomes_against({"exact": [1.0, 1.0], "x": [1.001, 1.001]}, floor=0.0)["x"]["margin"] == 0.0


def test_t_quantile_matches_the_t_distribution():
    t_quantile = verdicts.t_quantile
    assert t_quantile(1) == pytest.approx(12.706) and t_quantile(2) == pytest.approx(4.303)
    assert t_quantile(100) == t_quantile(30) > 1.96  # wider than the truth, never narrower
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 31):
        assert t_quantile(df) == pytest.approx(stats.t.ppf(0.975, df), abs=6e-4)
        assert t_quantile(df, 0.90) == pytest.approx(stats.t.ppf(0.95, df), abs=6e-4)
    with pytest.raises(ValueError, match="2 seeds"):
        t_quantile(0)


def test_paired_difference_per_point():
    arm = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    base = torch.tensor([[0.0, 2.0], [2.0, 3.0]])  # differences [[1, 0], [1, 1]]
    mean, half = convergence.paired_difference(arm, base)
    assert mean.tolist() == [1.0, 0.5]
    assert half[0] == 0 and half[1] == pytest.approx(12.706 * math.sqrt(0.5) / math.sqrt(2))
    mean, half = convergence.paired_difference([[1.0]], [[0.5]])
    assert mean.tolist() == [0.5] and math.isnan(half[0])


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


def test_the_fine_tuning_bound_is_calibrated_on_naive():
    bound = verdicts.finetune_bound
    assert bound(1e-3, floor=4e-3) == 4e-3  # naive nearly exact: the floor
    assert bound(5e-3, floor=4e-3) == pytest.approx(1e-2)  # twice naive's drift
    assert bound(0.0, floor=1e-4) == 1e-4  # fp32: naive is exact
    assert bound(math.inf, floor=1e-3) == 1e-3  # a diverged yardstick calibrates nothing
    assert bound(math.nan, floor=1e-3) == 1e-3


def test_filter_skip_summary():
    runs = [training.TrainRun("ours", 0, [1.0] * 3, filter_skipped=[0.0, 0.5, 0.25]),
            training.TrainRun("ours", 1, [1.0] * 3, filter_skipped=[0.0, 0.1, 0.75])]
    summary = convergence.filter_skip_summary(runs)
    assert summary == pytest.approx({"mean": 1.6 / 6, "first": 0.0, "last": 0.5, "max": 0.75})
    assert convergence.filter_skip_summary([training.TrainRun("exact", 0, [1.0])]) is None


def _rare_token_case(effect_rarest, drift_rarest, effect_middle):
    """A diagnostic and its comparisons with two bins, exact and one arm over 3 seeds."""
    base_loss = [[11.0, 5.0], [11.1, 5.1], [10.9, 4.9]]
    base_drift = [[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]
    wobble = [0.001, -0.001, 0.0]  # a little seed noise on each paired difference
    diagnostic = {
        "exact": {"val_loss": base_loss, "row_drift": base_drift},
        "apple_cce": {"val_loss": [[a + effect_rarest + w, b + effect_middle + w] for (a, b), w in zip(base_loss, wobble)],
                      "row_drift": [[a + drift_rarest + w, b + w] for (a, b), w in zip(base_drift, wobble)]},
    }
    bins = {q: [convergence.outcomes_against({arm: [s[b] for s in d[q]] for arm, d in diagnostic.items()},
                                          floor=None if q == "val_loss" else 0.0)
                for b in range(2)] for q in ("val_loss", "row_drift")}
    return diagnostic, bins


def test_rare_token_reading_explains_a_filter_that_helps_the_rarest_and_costs_the_middle():
    diagnostic, bins = _rare_token_case(effect_rarest=-0.4, drift_rarest=-0.9, effect_middle=+0.2)
    lines = convergence.describe_rare_tokens(diagnostic, bins, ["1–9", "10–99"], 32768, {"apple_cce": "Apple CCE"})
    assert "ln 32,768 = 10.40 nats" in lines[0] and "Lower is better" in lines[0]
    assert "11.00 nats on tokens seen 1–9 times" in lines[1] and "worse than uniform guessing" in lines[1]
    assert "while it scores 5.00 on tokens seen 10–99 times" in lines[1] and "pushes it back up" in lines[1]
    assert lines[2].startswith("Apple CCE: better than exact on the rarest tokens by 0.4 nats (margin ±0.05).")
    assert "moved 0.9 less than exact's" in lines[2] and "pays on tokens seen 10–99 times" in lines[2]


def test_rare_token_reading_of_an_arm_that_starves_the_rarest_or_matches_exact():
    diagnostic, bins = _rare_token_case(effect_rarest=+0.3, drift_rarest=-0.9, effect_middle=0.0)
    lines = convergence.describe_rare_tokens(diagnostic, bins, ["1–9", "10–99"], 32768, {})
    assert "worse than exact on the rarest tokens by 0.3 nats" in lines[2] and "starves rare tokens" in lines[2]
    diagnostic, bins = _rare_token_case(effect_rarest=0.0, drift_rarest=0.0, effect_middle=0.0)
    lines = convergence.describe_rare_tokens(diagnostic, bins, ["1–9", "10–99"], 32768, {"apple_cce": "Apple CCE"})
    assert lines[-1] == "Apple CCE: no frequency bin measurably worse than exact's."
    assert not any("-0.00" in line for line in lines)
    diagnostic["exact"]["val_loss"] = [[math.nan, 5.0]] * 3
    lines = convergence.describe_rare_tokens(diagnostic, bins, ["1–9", "10–99"], 32768, {})
    assert "nothing to read" in lines[-1]


def test_rare_token_reading_gives_no_mechanism_when_no_bin_beats_guessing():
    """After a few steps every bin is near ln V: "worse than guessing" on the rarest says nothing about rare tokens."""
    diagnostic, bins = _rare_token_case(effect_rarest=0.0, drift_rarest=0.0, effect_middle=0.0)
    diagnostic["exact"]["val_loss"] = [[10.6, 10.5], [10.7, 10.6], [10.5, 10.4]]
    lines = convergence.describe_rare_tokens(diagnostic, bins, ["1–9", "10–99"], 32768, {})
    assert "no better than guessing on the more frequent tokens either (10.50 at best" in lines[1]
    assert "pushes it back up" not in lines[1]


def _pre(verdict, effect=0.0):
    return verdicts.Outcome(verdict, "pretraining", effect, 0.0055, 0.001, 0.0007, 0.011, 3)


def _ft(drift, bound=1e-2):
    return verdicts.Outcome("equivalent" if drift <= bound else "different", "fine-tuning", drift, bound, drift=drift)


def test_convergence_facts_give_one_row_per_method_with_its_presets_as_caveats():
    finetune = {"ours": _ft(5e-4), "ours_nofilter": _ft(4e-4), "liger": _ft(0.14), "chunked": _ft(4e-4)}
    pretrain = {"ours": _pre("equivalent"), "ours_nofilter": _pre("equivalent"), "liger": _pre("equivalent", 0.00127),
                "apple_cce": _pre("undecided", -0.0074), "apple_cce_nofilter": _pre("worse", 0.0334)}
    not_run = {"apple_cce_kahan_full_c": "cut-cross-entropy 25.1.1 has no Kahan-FullC"}
    labels = {"apple_cce_nofilter": "Apple CCE (filter off)", "apple_cce_kahan_full_c": "Apple CCE (Kahan-FullC)"}
    facts = convergence.convergence_facts(finetune, pretrain, "bfloat16", labels, not_run=not_run,
                                       caveats={"liger": ["computes no dC without E's gradient"]})
    assert set(facts) == {"ours", "liger", "chunked", "apple_cce"}  # no yardstick, no preset row
    assert facts["ours"]["convergence"]["bfloat16"]["verdict"] == "equivalent" and facts["ours"]["caveats"] == []
    # one verdict per method per dtype, from both parts: the fine-tuning drift decides Liger's here
    assert facts["liger"]["convergence"]["bfloat16"]["verdict"] == "different"
    assert facts["liger"]["caveats"] == ["computes no dC without E's gradient"]
    assert facts["apple_cce"]["convergence"]["bfloat16"]["verdict"] == "undecided"
    assert facts["apple_cce"]["caveats"][0].startswith("Apple CCE (filter off): trains worse than exact in bfloat16")
    assert facts["apple_cce"]["caveats"][1] == ("Apple CCE (Kahan-FullC): not trained here: cut-cross-entropy 25.1.1 "
                                                "has no Kahan-FullC")
    facts = convergence.convergence_facts({}, {}, "bfloat16", {}, not_run={"apple_cce": "a CPU"})
    assert facts["apple_cce"] == {"caveats": ["not trained here: a CPU"]}


def test_the_headline_says_both_parts_with_the_engines_words():
    labels = {"liger": "Liger", "apple_cce": "Apple CCE", "ours": "ours"}
    line = convergence.convergence_headline({"ours": _ft(5e-4), "liger": _ft(0.14)},
                                         {"ours": _pre("equivalent"), "apple_cce": _pre("worse", 0.046)}, labels)
    assert line == ("fine-tuning: Liger past the bound (largest drift 0.14, bound 0.01; its loss ends higher than "
                    "exact's); the other 1 equivalent to exact (margin 0.01); pretraining: Apple CCE worse by 0.046 "
                    "nats (95% CI ±0.001, 3 paired seeds, 4.2x the seed-to-seed spread 0.011; margin ±0.0055); "
                    "the other 1 equivalent to exact (margin 0.0055 nats)")
    line = convergence.convergence_headline({"ours": _ft(5e-4)}, {"ours": _pre("equivalent")}, labels)
    assert line == ("fine-tuning: all 1 equivalent to exact (margin 0.01); pretraining: all 1 equivalent to exact "
                    "(margin 0.0055 nats)")
    assert convergence.convergence_headline({}, {}, labels) == "fine-tuning: no arm ran; pretraining: no arm ran"


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    factors = [training.learning_rate_factor(s, 100, 10) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1, abs=1e-3)


def test_write_json_turns_nan_into_null(tmp_path):
    path = training.write_json(tmp_path / "r.json", {"a": [1.0, float("nan")], "b": {"c": math.inf}})
    assert json.loads(path.read_text()) == {"a": [1.0, None], "b": {"c": None}}
