"""The verdict engine: practical margins with a sign, three outcomes, and recommendations that name
their evidence. Each fixture below carries one defect an expert found in an earlier REPORT."""

import math

import pytest

from helpers.compare import verdicts
from helpers.compare.methods import method_label
from helpers.compare.verdicts import (
    BETTER,
    DIFFERENT,
    EQUIVALENT,
    UNDECIDED,
    WORSE,
    Outcome,
    combine,
    finetune_outcome,
    pretrain_outcome,
    recommend,
    signed,
)

EXACT = [4.000, 4.011, 3.989]  # final validation losses of exact over 3 seeds: spread 0.011, as on an H200 in bf16


def shifted(effect, wobble=(0.0003, -0.0003, 0.0)):
    return [e + effect + w for e, w in zip(EXACT, wobble)]


def test_a_difference_inside_the_margin_is_equivalent_however_significant():
    # Liger in bf16: +0.00127 nats, its interval far from 0, about a ninth of a seed's spread
    o = pretrain_outcome(shifted(0.00127), EXACT)
    assert o.margin == pytest.approx(0.0055, rel=0.01) and o.verdict == EQUIVALENT
    assert "equivalent within ±0.0055 nats" in o.describe()


def test_a_large_difference_is_worse_with_its_size_in_seed_noise():
    # Liger in fp16: +0.136 nats
    o = pretrain_outcome(shifted(0.136, (0.01, -0.01, 0.0)), EXACT)
    assert o.verdict == WORSE and o.effect == pytest.approx(0.136)
    assert o.describe().startswith("pretraining: worse by 0.136 nats") and "12.4x the seed-to-seed spread" in o.describe()


def test_lower_than_exact_is_better_never_worse_and_a_wide_interval_is_undecided():
    o = pretrain_outcome(shifted(-0.05, (0.002, -0.002, 0.0)), EXACT)
    assert o.verdict == BETTER and "better by 0.05 nats" in o.describe()
    # Apple CCE in bf16: -0.0074 ± 0.0059 (95%): neither inside nor wholly beyond the margin
    o = pretrain_outcome(shifted(-0.0074, (0.0024, -0.0024, 0.0)), EXACT)
    assert o.verdict == UNDECIDED and "too few seeds" in o.describe()
    assert pretrain_outcome([4.1], [4.0]).verdict == UNDECIDED  # one seed: no interval
    assert pretrain_outcome([math.nan, 4.0, 4.0], EXACT).verdict == WORSE  # a diverged run


def test_the_margin_never_collapses_below_its_floor():
    o = pretrain_outcome([1.0 + 1e-9, 2.0, 3.0], [1.0, 2.0, 3.0 - 1e-9])
    assert o.verdict == EQUIVALENT
    o = pretrain_outcome([1.0 + 1e-4, 1.0, 1.0], [1.0, 1.0, 1.0])  # no seed spread at all: the floor stands
    assert o.margin == verdicts.PRETRAIN_MARGIN_FLOOR_NATS and o.verdict == EQUIVALENT


def test_fine_tuning_is_judged_on_the_bound_with_the_sign_of_the_last_steps():
    exact = [10.0 - 0.01 * i for i in range(100)]
    assert finetune_outcome(exact, exact, 1e-3).verdict == EQUIVALENT
    drifted = [e * 1.1 for e in exact]
    o = finetune_outcome(drifted, exact, 1e-3)
    assert o.verdict == DIFFERENT and o.drift == pytest.approx(0.1) and "ends higher" in o.describe()
    assert verdicts.finetune_bound(5e-3, 4e-3) == pytest.approx(1e-2) and verdicts.finetune_bound(math.inf, 1e-3) == 1e-3


def test_one_verdict_per_method_from_its_parts():
    eq = Outcome(EQUIVALENT, "pretraining", 0.0, 0.005)
    assert combine([eq, Outcome(EQUIVALENT, "fine-tuning", 0.0, 1e-3, drift=0.0)]) == EQUIVALENT
    assert combine([eq, Outcome(WORSE, "pretraining", 0.1, 0.005)]) == WORSE
    assert combine([Outcome(DIFFERENT, "fine-tuning", 0.1, 1e-3, drift=0.1), Outcome(BETTER, "pretraining", -0.1, 0.005)]) == DIFFERENT
    assert combine([eq, Outcome(BETTER, "pretraining", -0.1, 0.005)]) == BETTER
    assert combine([eq, Outcome(UNDECIDED, "pretraining", 0.01, 0.005)]) == UNDECIDED
    assert combine([]) is None


def test_a_zero_is_never_printed_as_minus_zero():
    assert signed(-0.0) == "0" and signed(0.0) == "0" and signed(-0.00256) == "-0.0026" and signed(0.00127) == "+0.0013"


# ---------------------------------------------------------------------------------------------
# Recommendations, from fixture facts that hold each defect of an earlier REPORT
# ---------------------------------------------------------------------------------------------

ALL = ["01_correctness", "02_memory_sweep", "03_convergence", "05_fits"]


def test_memory_claims_name_the_lightest_even_when_it_is_a_peer(facts_kit):
    said = "\n".join(recommend(facts_kit.h200(), ALL, t4=False))
    at16 = next(s for s in said.splitlines() if s.startswith("At 16,384 tokens"))
    assert "least memory: Liger, 0.38 GB" in at16  # not ours (0.41)
    assert "fastest at near-least memory (within 1.5x): ours (Triton CCE), 46 ms (Liger 62 ms)" in at16
    assert "fastest overall: torch.compile, 31 ms at 5.32 GB, 14.0x the least memory" in at16
    assert "Lighter, but not recommended: Apple CCE 0.35 GB (fails the gradient gate in bfloat16)" in at16


def test_the_crossover_at_long_context_is_stated_with_its_numbers(facts_kit):
    said = recommend(facts_kit.h200(), ALL, t4=False)
    assert "Liger is faster than ours (Triton CCE) from 65,536 tokens (118 ms against 155 ms); " \
           "ours (Triton CCE) is faster below." in said
    assert any(s.startswith("At 4,096 tokens") for s in said) and any(s.startswith("At 65,536 tokens") for s in said)


def test_a_within_margin_difference_never_disqualifies(facts_kit):
    said = recommend(facts_kit.h200(), ALL, t4=False)
    assert not any("Avoid Liger" in s for s in said)
    assert "Avoid Apple CCE in bfloat16: its gradients fail the float64 gate (01)." in said


def test_a_run_without_03_recommends_nothing_for_training(facts_kit):
    facts = facts_kit.h200()
    for f in facts.values():
        f.pop("convergence", None)
    said = recommend(facts, ["01_correctness", "02_memory_sweep", "05_fits"], t4=True)
    assert said[0] == ("Not measured in this run: 03 (training against exact). What needs them is not recommended "
                       "below.")
    at16 = next(s for s in said if s.startswith("At 16,384 tokens"))
    # only the baselines (the standard loss) can be recommended without a training verdict
    assert "least memory: torch.compile" in at16 and "Liger" in at16 and "notebook 03 did not run" in at16
    assert "On a T4 (fp16): no recommendation, because notebook 03" in "\n".join(said)


def test_a_t4_run_recommends_from_fp16_verdicts_only(facts_kit):
    facts = {
        "liger": {"gradients": {"float16": "pass"}, "convergence": facts_kit.trained("float16", WORSE, 0.136),
                  "runs_on_t4": True, "t4_peak_bytes_16k": 380_000_000},
        "ours": {"gradients": {"float16": "pass"}, "convergence": facts_kit.trained("float16", EQUIVALENT),
                 "runs_on_t4": True, "t4_peak_bytes_16k": 410_000_000},
        "apple_cce": {"runs_on_t4": "needs ~96 KB of shared memory, a T4 offers 64 KB"},
    }
    said = "\n".join(recommend(facts, ALL, t4=True))
    assert "On a T4 (fp16), at 16,384 tokens: ours (Triton CCE), 0.41 GB" in said
    assert "Avoid Liger for training in float16: it trains worse than exact (pretraining: worse by 0.136 nats" in said
    assert "Cannot run on a T4: Apple CCE (needs ~96 KB" in said


def test_the_whole_step_finding_is_a_headline():
    facts = {m: {"whole_step": {"tokens": 16384, "precision": "bf16", "peak_bytes": p, "tokens_per_s": t}}
             for m, p, t in (("naive", 7_740_000_000, 30_000), ("liger", 2_670_088_192, 39_300),
                             ("ours", 2_670_088_192, 40_800), ("apple_cce", 2_670_284_800, 42_900))}
    line = verdicts.whole_step_sentence(facts)
    assert line.startswith("In a whole training step at 16,384 tokens (05), Liger, ours (Triton CCE) and Apple CCE "
                           "peak within 0.0% of each other (2.67 GB, against 7.74 GB for transformers' default loss)")
    assert "the loss no longer decides a step's memory" in line
    assert recommend(facts, ALL, t4=False)[0] == line


def test_notebook_05_defers_training_verdicts_to_03():
    """05's twenty steps from random weights cannot say whether a loss trains like exact: it says
    only whether the first steps agree, and names 03 wherever training verdicts come up."""
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "notebooks" / "05_fits.py").read_text()
    assert "trains like the default" not in source and "trains differently" not in source
    for line in source.splitlines():
        if any(phrase in line for phrase in verdicts.TRAINS.values()) or "trains like" in line:
            assert "03" in line, line
    assert "verdicts.first_steps_agree(" in source


def test_budget_sentences_say_what_a_budget_bought_and_leave_out_what_it_did_not():
    """A budget that ran another schedule and passed the gate is said beside "min" and the fastest
    other method; one that ran "min" again (the same peak) or failed the gate is not."""
    from helpers.compare.verdicts import budget_sentences

    def sweep(peak, seconds):
        return {"dtype": "bfloat16", "points": {"16384": {"status": "ok", "peak_bytes": peak, "seconds": seconds}}}

    methods = {
        "ours": {"sweep": sweep(412e6, 0.035), "budgets": {
            "ours_budget_256m": {**sweep(412e6, 0.035), "gate": "pass"},
            "ours_budget_512m": {**sweep(870e6, 0.030), "gate": "pass"},
            "ours_budget_1g": {**sweep(1414e6, 0.029), "gate": "fail"},
        }},
        "torch_compile": {"sweep": sweep(5323e6, 0.0316)},
    }
    [sentence] = budget_sentences(methods)
    assert "16,384 tokens" in sentence and "512MiB" in sentence and "30 ms" in sentence
    assert "256MiB" not in sentence and "1GiB" not in sentence
    assert "torch.compile's 31.6 ms" in sentence and "its default 35 ms" in sentence
    assert budget_sentences({"ours": {"sweep": sweep(412e6, 0.035)}}) == []


def _fit(tokens, at_limit=False):
    return {"largest_step_tokens_16gb": tokens, **({"largest_step_at_search_limit": True} if at_limit else {})}


def test_a_loss_that_fits_fewer_tokens_than_the_default_is_named():
    """Ours fitting 96 tokens where the default and Liger fit the search's 128 is not "every loss fits 128"."""
    said = verdicts.whole_step_fit_sentences({"naive": _fit(128, True), "liger": _fit(128, True), "ours": _fit(96)})
    assert not any("every loss" in s for s in said)
    assert said[0].startswith("Largest whole Qwen3-0.6B training step on a 16 GB card (05): Liger, 128 tokens or more "
                              "(the search's limit), against 128 tokens or more (the search's limit) with")
    assert said[1] == f"Fit fewer tokens than transformers' default loss (05): {method_label('ours')}, 96 tokens."


def test_every_loss_fits_only_when_every_count_equals_the_defaults():
    same = verdicts.whole_step_fit_sentences({"naive": _fit(4096), "liger": _fit(4096), "ours": _fit(4096)})
    assert len(same) == 1 and "every loss that ran fits 4,096 tokens, as transformers' default loss does" in same[0]
    more = verdicts.whole_step_fit_sentences({"naive": _fit(4096), "liger": _fit(32768), "ours": _fit(65536)})
    assert len(more) == 1 and f"{method_label('ours')}, 65,536 tokens, against 4,096 tokens" in more[0]
    assert "ties" not in more[0]  # one loss named


def test_a_loss_that_fits_nothing_is_not_dropped_and_the_default_leads_when_it_fits_most():
    nothing = verdicts.whole_step_fit_sentences({"naive": _fit(4096), "liger": _fit(4096), "ours": _fit(0)})
    assert not any("every loss" in s for s in nothing)
    assert nothing[-1] == f"Fit fewer tokens than transformers' default loss (05): {method_label('ours')}, not even one sequence."
    fewer = verdicts.whole_step_fit_sentences({"naive": _fit(4096), "liger": _fit(2048), "ours": _fit(1024)})
    assert fewer[0].endswith("transformers' default loss fits the most, 4,096 tokens.")
    assert "Liger, 2,048 tokens" in fewer[1] and f"{method_label('ours')}, 1,024 tokens" in fewer[1]
    alone = verdicts.whole_step_fit_sentences({"naive": _fit(4096)})
    assert alone == ["Largest whole Qwen3-0.6B training step on a 16 GB card (05): transformers' default loss, 4,096 tokens."]


def test_avoid_names_the_failing_cases_so_one_degenerate_case_reads_as_one(facts_kit):
    facts = facts_kit.h200()
    facts["apple_cce"]["gradient_failures"] = {"bfloat16": {"cases": 12, "failed": ["N=37 V=257 D=24 mean, ignore all"]}}
    said = recommend(facts, ALL, t4=False)  # facts from before "not_finite": the plain sentence
    assert ("Avoid Apple CCE in bfloat16: its gradients fail the float64 gate (01) in 1 of 12 cases "
            "(bfloat16: [N=37 V=257 D=24 mean, ignore all]).") in said
    facts["apple_cce"]["gradient_failures"]["bfloat16"]["not_finite"] = True
    said = recommend(facts, ALL, t4=False)
    assert ("Avoid Apple CCE where a micro-batch can be all padding: its gradients are not finite when every target "
            "of a mean is ignored, where torch's cross_entropy gives 0, so one such micro-batch puts NaN into the "
            "weights (01: the float64 gate in 1 of 12 cases (bfloat16: [N=37 V=257 D=24 mean, ignore all]); every "
            "other case it ran passes).") in said
    # A failure that is not that convention keeps the plain sentence, with its cases.
    facts["apple_cce"]["gradient_failures"]["bfloat16"]["failed"].append("N=37 V=257 D=24 sum, ignore some")
    said = recommend(facts, ALL, t4=False)
    assert ("Avoid Apple CCE in bfloat16: its gradients fail the float64 gate (01) in 2 of 12 cases (bfloat16: "
            "[N=37 V=257 D=24 mean, ignore all] [N=37 V=257 D=24 sum, ignore some]).") in said
