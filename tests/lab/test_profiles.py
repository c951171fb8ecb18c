"""Run profiles: quick runs and what "auto" does on a hosted session without a GPU."""

import sys
import types

import pytest

from helpers.compare.heads import QWEN3
from helpers.lab import profiles
from helpers.lab.profiles import PROFILES, get_profile


def test_quick_applies_each_sections_overrides_and_nothing_else():
    full, quick = get_profile("gpu"), get_profile("gpu", quick=True)
    assert quick.name == "gpu-quick" and full.name == "gpu"
    assert "quick" not in full.section("05_fits")
    assert quick.section("05_fits")["fit_step"] > full.section("05_fits")["fit_step"]
    # a nested override changes only the keys it names
    assert quick.section("05_fits")["curve"]["steps"] < full.section("05_fits")["curve"]["steps"]
    assert quick.section("05_fits")["curve"]["tokens"] == full.section("05_fits")["curve"]["tokens"]
    shapes = quick.section("01_correctness")["shapes"]
    assert len(shapes) == 2 and shapes[-1][1] == QWEN3.V and shapes[-1][0] < full.section("01_correctness")["shapes"][-1][0]
    # a section without overrides is unchanged, and the table itself is not touched
    assert quick.section("04_kernel_walkthrough") == full.section("04_kernel_walkthrough")
    assert "quick" in PROFILES["gpu"].sections["05_fits"]


def test_every_profile_has_a_quick_form_with_the_same_sections():
    for name, profile in PROFILES.items():
        quick = profile.quick()
        assert set(quick.sections) == set(profile.sections), name
        assert all("quick" not in section for section in quick.sections.values()), name


@pytest.mark.parametrize("where, env, modules, hint", [
    ("Kaggle", {"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, {}, "Accelerator"),
    ("Colab", {}, {"google.colab": types.ModuleType("google.colab")}, "Change runtime type"),
])
def test_auto_on_a_hosted_cpu_session_says_to_turn_a_gpu_on(monkeypatch, where, env, modules, hint):
    monkeypatch.setattr(profiles, "detect_profile_name", lambda device=None: "cpu")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k, v in modules.items():
        monkeypatch.setitem(sys.modules, k, v)
    with pytest.raises(RuntimeError, match=f"(?s)No GPU in this {where} session.*{hint}.*profile = \"cpu\""):
        get_profile("auto")
    assert get_profile("cpu").name == "cpu"  # asked for by name, the smoke run is a choice


def test_auto_on_a_local_cpu_is_the_smoke_profile(monkeypatch):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setattr(profiles, "detect_profile_name", lambda device=None: "cpu")
    assert get_profile("auto").name == "cpu"


def test_an_unknown_profile_names_the_choices():
    with pytest.raises(ValueError, match="profile must be 'auto' or one of"):
        get_profile("h100")


@pytest.mark.parametrize("name", ["t4", "gpu"])
def test_a_quick_convergence_run_is_shorter_with_the_same_arms(name):
    full, quick = get_profile(name).section("03_convergence"), get_profile(name, quick=True).section("03_convergence")
    for part in ("finetune", "pretrain"):
        assert quick[part]["train"]["steps"] * 3 <= full[part]["train"]["steps"]
        # "train" is replaced whole: every key a training run needs is still there
        assert set(quick[part]["train"]) == set(full[part]["train"])
        assert quick[part]["methods"] == full[part]["methods"] and quick[part]["task"] == full[part]["task"]
    assert quick["pretrain"]["seeds"] == full["pretrain"]["seeds"] and len(full["pretrain"]["seeds"]) >= 3
    assert quick["pretrain"]["corpus"] == full["pretrain"]["corpus"]
    assert quick["tolerance_floor"] == full["tolerance_floor"]


def test_the_convergence_arms_are_registered_and_fair_to_the_peers():
    from helpers.compare.methods import METHODS

    for profile in PROFILES.values():
        section = profile.section("03_convergence")
        assert "tolerance_floor" in section and "tolerance" not in section
        assert "naive" in section["finetune"]["methods"]  # the fine-tuning bound's yardstick
        pretrain = section["pretrain"]["methods"]
        # Liger as the control without a filter; Apple as it ships, filter off, and as its paper advises
        assert {"liger", "apple_cce", "apple_cce_nofilter", "apple_cce_kahan_full_c"} <= set(pretrain)
        assert all(m in METHODS for m in section["finetune"]["methods"] + pretrain)
