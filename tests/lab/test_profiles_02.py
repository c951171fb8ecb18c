"""Notebook 02's profile sections: which runs get a second, pretend-T4 sweep, and what a quick run keeps."""

import pytest

from helpers.compare.sweep import ARTICLE_MICRO_BATCH_N, ARTICLE_N
from helpers.lab.profiles import get_profile


def test_a_bigger_gpu_sweeps_again_as_a_t4_and_a_t4_does_not():
    gpu, t4 = get_profile("gpu").section("02_memory_sweep"), get_profile("t4").section("02_memory_sweep")
    assert gpu["t4_sweep"]["dtype"] == "float16" and gpu["t4_sweep"]["N"] == ARTICLE_N
    assert {k: v for k, v in t4.items() if k not in ("V", "D", "t4_sweep")} == gpu["t4_sweep"]  # the same sweep
    assert t4["t4_sweep"] is None
    assert get_profile("cpu-t4").section("02_memory_sweep")["t4_sweep"] is None  # already the T4's path
    cpu = get_profile("cpu").section("02_memory_sweep")["t4_sweep"]
    assert cpu["dtype"] == "float16" and cpu["cpu_budget_bytes"] and len(cpu["N"]) <= 2


@pytest.mark.parametrize("name", ["t4", "gpu"])
def test_a_quick_run_is_shorter_and_keeps_the_points_the_report_reads(name):
    full, quick = get_profile(name).section("02_memory_sweep"), get_profile(name, quick=True).section("02_memory_sweep")
    assert len(quick["N"]) < len(full["N"]) and quick["repeats"] < full["repeats"]
    assert ARTICLE_MICRO_BATCH_N in quick["N"]
    assert quick["dtype"] == full["dtype"] and quick["gate_shapes"] == full["gate_shapes"]
    if full["t4_sweep"]:
        assert len(quick["t4_sweep"]["N"]) < len(full["t4_sweep"]["N"])
        assert {8192, ARTICLE_MICRO_BATCH_N} <= set(quick["t4_sweep"]["N"])  # naive's wall, the article's micro-batch
        assert quick["t4_sweep"]["gate_shapes"] == full["t4_sweep"]["gate_shapes"]
    # the table itself is left as it was
    assert get_profile(name).section("02_memory_sweep") == full
