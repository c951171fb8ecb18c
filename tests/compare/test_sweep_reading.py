"""What notebook 02 reads from a sweep, on small fakes of a GPU run (no GPU here): the pivot sorted by
memory, the verdicts (with time), the report's headline and facts, which methods to sweep, how many
tokens fit, and the pretend-T4 pass (run on the CPU, where only the kernel configurations change)."""

import os

import pytest
import torch

from helpers.cce.device import PRETEND_ENV, PRETEND_T4_ENV, T4_MEMORY_BYTES
from helpers.compare.gate import GateReport, GateRow
from helpers.compare.measure import MemoryCap
from helpers.compare.methods.baselines import naive_loss
from helpers.compare.methods import Method
from helpers.compare.heads import QWEN3
from helpers.compare.sweep import MethodPlan, plan_methods, run_pretend_t4_sweep
from helpers.compare.units import timed_calls
from helpers.compare.sweep_results import describe_methods, headline, memory_order, report_facts, results_pivot
from helpers.compare.theory import (
    T4_CAPABILITY,
    card,
    fits_table,
    input_bytes,
    largest_n_that_fits,
    predicted_peak_bytes,
    t4_card,
)
from helpers.suite.report import FACT_KEYS

V_QWEN, D_QWEN = QWEN3.V, QWEN3.D
GIB = 1024**3


def point(method, N, status="ok", peak_gb=None, ms=None, theory_gb=None, dtype="bfloat16", device="NVIDIA H200",
          error=""):
    return {
        "method": method, "N": N, "status": status, "dtype": dtype, "device": device, "error": error,
        "peak_bytes": None if peak_gb is None else int(peak_gb * 1e9), "median_ms": ms, "p10_ms": ms, "p90_ms": ms,
        "theory_bytes": None if theory_gb is None else int(theory_gb * 1e9), "lower_bound_bytes": int(0.3e9),
    }


# A GPU run's shape, numbers rounded from the H200 measurements (ANCHORS): naive out of memory at 131k.
H200 = [
    *(point("naive", N, peak_gb=gb, ms=ms, theory_gb=gb) for N, gb, ms in [(4096, 7.47, 13), (16_384, 29.9, 52)]),
    point("naive", 131_072, "oom", theory_gb=239.0, error="OutOfMemoryError"),
    *(point("torch_compile", N, peak_gb=gb, ms=ms, theory_gb=gb) for N, gb, ms in
      [(4096, 1.57, 9), (16_384, 5.32, 32), (131_072, 40.4, 250)]),
    *(point("liger", N, peak_gb=gb, ms=ms, theory_gb=gb) for N, gb, ms in
      [(4096, 0.33, 20), (16_384, 0.384, 62), (131_072, 0.89, 480)]),
    *(point("apple_cce", N, peak_gb=gb, ms=ms, theory_gb=gb) for N, gb, ms in
      [(4096, 0.32, 14), (16_384, 0.347, 46), (131_072, 0.58, 370)]),
]


# ---------------------------------------------------------------------------------------------
# The pivot, the verdicts, the headline, the facts
# ---------------------------------------------------------------------------------------------


def test_memory_order_puts_the_flat_methods_first_and_the_earliest_wall_last():
    records = H200 + [point("chunked", 4096, peak_gb=2.0, ms=100), point("chunked", 16_384, "oom"),
                      point("chunked", 131_072, "skipped after OOM")]
    assert memory_order(records) == ["apple_cce", "liger", "torch_compile", "naive", "chunked"]


def test_memory_order_compares_the_flat_methods_where_they_all_ran_not_below_anothers_wall():
    """naive stops at N = 128; ours is lighter at 64 but heavier at 128, where the flat methods still run."""
    records = [point("naive", 64, peak_gb=0.2), point("naive", 128, "oom"),
               point("ours", 64, peak_gb=0.076), point("ours", 128, peak_gb=0.118),
               point("liger", 64, peak_gb=0.080), point("liger", 128, peak_gb=0.099)]
    assert memory_order(records) == ["liger", "ours", "naive"]
    assert results_pivot(records).splitlines()[0].endswith("least memory first (at N=128):")


def test_the_pivot_reads_like_the_articles_table():
    table = results_pivot(H200, {"apple_cce": "Apple CCE", "naive": "naive"}, failed_gate={"apple_cce": "dE 0.0078"})
    lines = table.splitlines()
    assert lines[0].startswith("Peak GB above the inputs / forward+backward ms")
    assert lines[2] == "| method | N=4,096 | N=16,384 | N=131,072 |"
    assert lines[4] == "| Apple CCE † | 0.32 / 14.0 | 0.35 / 46.0 | 0.58 / 370 |"
    assert lines[7] == "| naive | 7.47 / 13.0 | 29.90 / 52.0 | **OOM** |"
    assert "† fails the quick accuracy gate in bfloat16" in lines[-1]
    ratio = results_pivot(H200 + [point("torch_lce", 4096, peak_gb=0.6, ms=5)], cell="theory_ratio")
    assert "| liger | 1.000 | 1.000 | 1.000 |" in ratio and "| torch_lce | 2.00× floor |  |  |" in ratio
    with pytest.raises(ValueError, match="cell must be"):
        results_pivot(H200, cell="peak")


def test_the_pivot_says_what_a_time_is_one_call_in_a_smoke_run_a_median_otherwise():
    def caption(repeats):
        return results_pivot([{**r, "repeats": n} for r, n in zip(H200, repeats)]).splitlines()[0]

    assert "ms (one timed call each)" in caption([1] * len(H200))
    assert "ms (median of 7 calls)" in caption([7] * len(H200))
    assert "ms (median of 5-7 calls)" in caption([5] + [7] * (len(H200) - 1))
    assert timed_calls([None, 1, 1]) == "one timed call each" and timed_calls([]) == "median"


def test_verdicts_say_what_grows_with_what_and_how_fast_next_to_torch_compile():
    said = describe_methods(H200, V_QWEN)
    assert said["naive"].startswith("grows with the logits N·V: 12.0 bytes per logit")
    assert "hit the wall at N=131,072 (out of memory)" in said["naive"]
    assert said["liger"].startswith("grows with N·D (the gradients), not N·V (the logits)")
    assert "flat" not in said["liger"] and "×" not in said["liger"].split(";")[0]
    assert "480 ms at N=131,072 (3.66 µs per token, 1.92× torch.compile)" in said["liger"]
    assert "52.0 ms at N=16,384" in said["naive"] and "1.62× torch.compile" in said["naive"]
    assert "(1.91 µs per token)." in said["torch_compile"]  # the yardstick, without a ratio to itself


def test_smoke_verdicts_say_only_what_ran():
    smoke = [point("ours", 16, peak_gb=5e-5, ms=200, dtype="float32", device="x86_64"),
             point("ours", 128, peak_gb=1.8e-4, ms=2000, dtype="float32", device="x86_64"),
             point("naive", 16, peak_gb=5e-5, ms=1, dtype="float32", device="x86_64"),
             point("naive", 128, "oom", dtype="float32", device="x86_64")]
    said = describe_methods(smoke, 257, smoke=True)
    assert said == {"ours": "2 points measured (N=16 to 128).",
                    "naive": "one point measured (N=16); out of memory at N=128 (the simulated cap)."}
    assert "the pipeline ran: 3 points of 2 methods measured, 1 out of memory at the simulated cap (naive at N=128)" \
        == headline(smoke, smoke=True)


def test_the_headline_is_one_line_of_result():
    t4 = [point("naive", 4096, peak_gb=7.5, ms=60, dtype="float16"),
          point("naive", 8192, "oom", dtype="float16"), point("naive", 16_384, "skipped after OOM", dtype="float16"),
          point("liger", 16_384, peak_gb=1.3, ms=200, dtype="float16")]
    line = headline(H200, labels={"apple_cce": "Apple CCE"}, t4_records=t4)
    assert line == ("At N=16,384 on NVIDIA H200 (bfloat16) the loss step's peak ranges from 0.35 GB (Apple CCE) "
                    "to 29.90 GB (naive); as a T4 (float16) naive runs out of memory from N=8,192.")
    assert "\n" not in line
    # Without a point at 16,384 (a quick run without it), the largest N measured.
    assert headline([r for r in H200 if r["N"] != 16_384]).startswith("At N=131,072")


def test_report_facts_from_this_card_and_the_t4_sweep():
    t4 = [point("naive", 8192, "oom", dtype="float16"), point("naive", 16_384, "skipped after OOM", dtype="float16"),
          point("liger", 16_384, peak_gb=1.3, ms=200, dtype="float16"),
          point("ours", 16_384, peak_gb=0.5, ms=90, dtype="float16")]
    plan = MethodPlan(["naive", "liger", "ours"], {"ours": "ours [float16] N=257: dE error 0.01 > bound 0.003"},
                      {"apple_cce": "its backward needs 96 KB of shared memory; a T4 has 64 KB"})
    facts = report_facts(H200, t4_records=t4, t4_plan=plan)
    assert facts["naive"]["runs_on_t4"] == "out of memory on a T4 from N=8,192"
    assert facts["naive"]["sweep"]["points"]["16384"] == {"status": "ok", "peak_bytes": 29_900_000_000, "seconds": 0.052}
    assert facts["liger"]["sweep"]["dtype"] == "bfloat16"
    assert facts["liger"]["sweep"]["points"]["16384"] == {"status": "ok", "peak_bytes": 384_000_000, "seconds": 0.062}
    assert facts["liger"]["t4_peak_bytes_16k"] == 1_300_000_000 and facts["liger"]["runs_on_t4"] is True
    assert facts["apple_cce"]["runs_on_t4"].startswith("cannot run on a T4: its backward needs")
    assert facts["apple_cce"]["sweep"]["points"]["16384"]["peak_bytes"] == 347_000_000
    assert facts["ours"]["t4_peak_bytes_16k"] == 500_000_000
    assert facts["ours"]["runs_on_t4"].startswith("runs, but fails the float16 accuracy gate")
    assert {key for fact in facts.values() for key in fact} <= set(FACT_KEYS)
    # Every N swept is a point (the REPORT recommends per token count); no T4 sweep, no T4 facts.
    assert set(report_facts(H200)["liger"]) == {"sweep"}
    assert set(report_facts(H200)["liger"]["sweep"]["points"]) == {str(r["N"]) for r in H200 if r["method"] == "liger"}


# ---------------------------------------------------------------------------------------------
# Which methods are swept
# ---------------------------------------------------------------------------------------------


def _method(name, availability=lambda device, dtype, softcap: None):
    return Method(name, name, "a test method", naive_loss, availability)


def test_a_method_that_fails_the_gate_is_swept_and_marked(temporary_method):
    temporary_method(_method("precise"))
    temporary_method(_method("sloppy"))
    temporary_method(_method("absent", lambda device, dtype, softcap: "needs a GPU"))
    gate = GateReport([
        GateRow("precise", "float16", "N=37", "pass"),
        GateRow("sloppy", "float16", "N=37", "fail", {"dE": 0.0078}, {"dE": 0.006}),
        GateRow("absent", "float16", "N=37", "unavailable", reason="needs a GPU"),
    ], "cpu")
    plan = plan_methods(["precise", "sloppy", "absent"], gate, "cpu", torch.float16)
    assert plan.swept == ["precise", "sloppy"]
    assert plan.failed_gate == {"sloppy": "sloppy [float16] N=37: dE error 0.0078 > bound 0.006"}
    assert plan.unavailable == {"absent": "needs a GPU"}


# ---------------------------------------------------------------------------------------------
# How many tokens fit
# ---------------------------------------------------------------------------------------------


def test_naive_on_a_t4_by_hand():
    # 12·N·V for the loss, (N·D + V·D)·2 + 8·N of inputs, under 90% of a T4's 15 GiB.
    t4 = t4_card(0.9)
    usable = int(0.9 * T4_MEMORY_BYTES)
    assert t4.cap.usable_bytes == usable and t4.dtype == "float16" and t4.capability == T4_CAPABILITY
    by_hand = (usable - V_QWEN * D_QWEN * 2) // (12 * V_QWEN + 2 * D_QWEN + 8)
    N = largest_n_that_fits("naive", V_QWEN, D_QWEN, "float16", t4.cap, T4_CAPABILITY)
    assert N == by_hand == 7771
    assert 4096 < N < 8192  # the article: 4,096 ran, 8,192 ran out of memory


@pytest.mark.parametrize("method", ["naive", "torch_compile", "chunked", "liger", "apple_cce", "ours"])
@pytest.mark.parametrize("dtype, capability", [("bfloat16", (9, 0)), ("float16", (7, 5)), ("float32", (8, 0))])
def test_the_answer_fits_and_one_more_token_does_not(method, dtype, capability):
    cap = card("a 24 GB card", 24e9, dtype, capability).cap
    N = largest_n_that_fits(method, V_QWEN, D_QWEN, dtype, cap, capability)

    def fits(n):
        return predicted_peak_bytes(method, n, V_QWEN, D_QWEN, dtype, capability) <= cap.room_for(
            input_bytes(n, V_QWEN, D_QWEN, dtype))

    assert N > 0 and fits(N) and not fits(N + 1)


def test_on_the_cpu_the_budget_is_on_the_peak_alone():
    budget = MemoryCap("cpu", 300_000, None, None)
    # naive at V = 257: 12·257 = 3,084 bytes a token, inputs not counted: 300,000 // 3,084 = 97.
    assert largest_n_that_fits("naive", 257, 32, "float32", budget) == 97


def test_what_cannot_be_answered_says_why():
    t4 = t4_card().cap
    assert largest_n_that_fits("torch_lce", V_QWEN, D_QWEN, "float16", t4) is None  # no formula
    assert largest_n_that_fits("naive", V_QWEN, D_QWEN, "float16", MemoryCap("cuda", 10**8, 10**8, 1.0)) == 0
    for bad in (0, -5, 2.5, True, "257"):
        with pytest.raises(ValueError, match="V must be a positive whole number"):
            largest_n_that_fits("naive", bad, D_QWEN, "float16", t4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        largest_n_that_fits("naive", V_QWEN, D_QWEN, "float8", t4)
    with pytest.raises(ValueError, match="no memory cap"):
        largest_n_that_fits("naive", V_QWEN, D_QWEN, "float16", MemoryCap("cpu", None, None, None))


@pytest.mark.parametrize("memory, fraction, dtype, capability, message", [
    (0, 0.9, "float16", (7, 5), "positive number of bytes"),
    (float("nan"), 0.9, "float16", (7, 5), "positive number of bytes"),
    ("16", 0.9, "float16", (7, 5), "positive number of bytes"),
    (16e9, 0, "float16", (7, 5), "memory_fraction must be in"),
    (16e9, 1.5, "float16", (7, 5), "memory_fraction must be in"),
    (16e9, 0.9, "bfloat16", (7, 5), "bfloat16 needs bf16 tensor cores"),
    (16e9, 0.9, "float16", (7,), "capability must be"),
])
def test_a_bad_card_is_refused_with_what_was_wrong(memory, fraction, dtype, capability, message):
    with pytest.raises(ValueError, match=message):
        card("bad", memory, dtype, capability, fraction)


def test_the_fits_table():
    cards = [card("an 80 GB card", 80e9, "bfloat16", (9, 0)), t4_card()]
    table = fits_table(["naive", "torch_lce", "apple_cce", "ours"], V_QWEN, D_QWEN, cards, {"naive": "naive"},
                       cannot_run={"T4": {"apple_cce": "64 KB of shared memory is too little"}})
    head, lines = table.splitlines()[:2], table.splitlines()[2:]
    assert head == ["The largest N at this head (V = 151,936, D = 1,024), per card:", ""]
    assert lines[0] == "| method | an 80 GB card (72.00 GB usable, bfloat16) | T4 (14.50 GB usable, float16) |"
    # (72e9 - V·D·2) // (12·V + 2·D + 8) = 39,275, rounded down to three significant digits
    assert (72 * 10**9 - V_QWEN * D_QWEN * 2) // (12 * V_QWEN + 2 * D_QWEN + 8) == 39_275
    assert lines[2] == "| naive | 39,200 | 7,771 |"
    assert lines[3] == "| torch_lce | no formula | no formula |"
    assert lines[4].endswith("| cannot run [1] |") and lines[-1] == (
        "- [1] apple_cce on T4: 64 KB of shared memory is too little")


# ---------------------------------------------------------------------------------------------
# The pretend-T4 pass
# ---------------------------------------------------------------------------------------------


def test_the_pretend_t4_pass_runs_as_a_t4_and_leaves_the_process_as_it_was(tmp_path, monkeypatch):
    # On the CPU the scope changes only the kernel configurations (no T4 memory to pretend); a GPU's
    # allocator cap inside the scope is tested with a fake H200 in tests/cce/test_pretend_t4_scope.py.
    from helpers.compare import sweep

    monkeypatch.delenv(PRETEND_T4_ENV, raising=False)
    monkeypatch.delenv(PRETEND_ENV, raising=False)
    seen = []
    run_sweep = sweep.run_sweep
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **kw: seen.append(os.environ.get(PRETEND_ENV)) or
                        run_sweep(*a, **kw))
    settings = {"dtype": "float16", "N": [16, 128], "warmup": 0, "repeats": 1, "gate_shapes": [(37, 257, 24)],
                "cpu_budget_bytes": 200_000, "seed": 0}
    done = run_pretend_t4_sweep(["naive", "chunked", "apple_cce"], settings, V=257, D=16, device="cpu",
                                memory_fraction=0.9, store=tmp_path / "points.jsonl", progress=False)
    assert seen == ["t4"] and PRETEND_ENV not in os.environ and PRETEND_T4_ENV not in os.environ
    assert done.dtype == "float16" and done.Ns == [16, 128] and done.cap.usable_bytes == 200_000
    assert done.plan.swept == ["naive", "chunked"] and "apple_cce" in done.plan.unavailable
    status = {(r["method"], r["N"]): r["status"] for r in done.records}
    assert status == {("naive", 16): "ok", ("chunked", 16): "ok", ("naive", 128): "oom", ("chunked", 128): "oom"}
    assert all(r["pretend"] == "t4" and r["dtype"] == "float16" for r in done.records)


def test_memory_order_ranks_methods_that_share_a_wall_by_their_peak_below_it():
    records = [point("naive", 64, peak_gb=2.0), point("naive", 128, "oom"),
               point("torch_compile", 64, peak_gb=0.5), point("torch_compile", 128, "oom"),
               point("ours", 64, peak_gb=0.1), point("ours", 128, peak_gb=0.2)]
    assert memory_order(records) == ["ours", "torch_compile", "naive"]
    # A method that never measured a peak (an error at every N) does not pull the comparison down.
    records += [point("broken", 64, "error"), point("broken", 128, "error"),
                point("liger", 64, peak_gb=0.05), point("liger", 128, peak_gb=0.9)]
    assert memory_order(records)[:2] == ["ours", "liger"]


def test_the_theorys_agreement_names_the_method_it_misses():
    """02 says above its fits table, which come from the formulas, where a formula missed this run's peaks."""
    from helpers.compare.sweep_results import theory_agreement

    def point(method, N, peak, theory):
        return {"method": method, "N": N, "status": "ok", "peak_bytes": peak, "theory_bytes": theory}

    agree = [point("naive", 16, 100, 100), point("ours", 16, 104, 100), point("torch_lce", 16, 900, None)]
    assert theory_agreement(agree) == "Every formula agreed with this run's measured peaks within 10% (farthest: 4.0%)."
    missed = agree + [point("ours", 128, 217, 100), {"method": "ours", "N": 256, "status": "oom"}]
    said = theory_agreement(missed, {"ours": "ours (Triton CCE)"})
    assert "ours (Triton CCE) 2.17x its formula at N=128" in said and "naive" not in said
    assert theory_agreement([point("torch_lce", 16, 900, None)]) == "No measured point had a formula to compare with."
