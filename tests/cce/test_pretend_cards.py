"""The pretend cards: one table of GPUs (T4, A100-40GB, A100-80GB, L4), and a fake H200 answering as
each. The T4's own behaviour (fp16, its profile) is tests/cce/test_device.py's; here the other
cards, above all a pretend A100: the gpu profile, bf16, the A100 tier's configurations."""

import json
import os
import types

import pytest
import torch

from helpers.cce.device import (CARDS, PRETEND_ENV, PRETEND_T4_ENV, CardSpec, card_spec, device_info, pretend,
                                pretend_scope, pretended_card, pretending_t4)
from helpers.cce.kernels.configs import select_configs, tier_for_capability, tier_for_card
from helpers.lab.profiles import detect_profile_name, get_profile, profile_for_card

GiB = 1024**3
H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=150_000_000_000,
                             shared_memory_per_block_optin=227 * 1024, multi_processor_count=132)
REAL_T4 = types.SimpleNamespace(name="Tesla T4", major=7, minor=5, total_memory=15_835_660_288,
                                shared_memory_per_block_optin=64 * 1024, multi_processor_count=40)


def fake_gpu(monkeypatch, props):
    """torch believes ``props`` is attached; returns the calls made to the allocator's cap."""
    caps = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: caps.append((f, i)))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i=None: 1.0, raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return caps


@pytest.fixture(autouse=True)
def no_pretence(monkeypatch):
    """No card before each test, and none after it (``pretend`` sets the variable itself: a set
    then a delete makes monkeypatch restore what was there, nothing, whatever the test did)."""
    for name in (PRETEND_ENV, PRETEND_T4_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def h200(monkeypatch):
    return fake_gpu(monkeypatch, H200)


# --- the table --------------------------------------------------------------------------------


def test_the_table_holds_each_cards_real_specs():
    spec = {key: (c.capability, c.memory_bytes, c.shared_memory_per_block_bytes, c.multiprocessors, c.bf16)
            for key, c in CARDS.items()}
    assert spec == {
        "t4": ((7, 5), 15 * GiB, 65_536, 40, False),
        "a100-40gb": ((8, 0), 40 * GiB, 166_912, 108, True),
        "a100-80gb": ((8, 0), 80 * GiB, 166_912, 108, True),
        "l4": ((8, 9), 23_034 * 1024**2, 101_376, 58, True),
    }
    assert round(CARDS["l4"].memory_bytes / GiB, 1) == 22.5  # as nvidia-smi counts a 24 GB L4 with ECC on


@pytest.mark.parametrize("key, tier", [("t4", "turing-64k"), ("a100-40gb", "ampere-163k"),
                                       ("a100-80gb", "ampere-163k"), ("l4", "ampere-99k")])
def test_each_card_gets_the_tier_its_shared_memory_selects(key, tier):
    card = CARDS[key]
    assert tier_for_card(card).name == tier
    assert tier_for_capability(card.capability).name == tier  # the arithmetic without a device agrees
    assert tier_for_card(card).shared_memory_bytes <= card.shared_memory_per_block_bytes  # it fits


def test_bf16_is_the_capabilitys_and_only_the_t4_runs_the_t4_profile():
    for card in CARDS.values():
        assert card.bf16 == (card.capability >= (8, 0))
        assert profile_for_card(card) == ("gpu" if card.key != "t4" else "t4")
        assert profile_for_card(card, on_gpu=False) == ("cpu" if card.key != "t4" else "cpu-t4")
    assert [c.a_label for c in CARDS.values()] == ["a T4", "an A100-40GB", "an A100-80GB", "an L4"]


def test_an_unknown_card_is_refused_with_the_list(monkeypatch):
    with pytest.raises(ValueError, match="a100-40gb, a100-80gb, l4"):
        card_spec("v100")
    assert card_spec("A100-40GB") is CARDS["a100-40gb"]
    monkeypatch.setenv(PRETEND_ENV, "a100")  # a typo in the variable: loud, not the device as itself
    with pytest.raises(ValueError, match="no card 'a100'"):
        pretended_card()


def test_the_older_variable_still_means_a_t4(monkeypatch):
    monkeypatch.setenv(PRETEND_T4_ENV, "1")
    assert pretended_card() is CARDS["t4"] and pretending_t4()
    monkeypatch.setenv(PRETEND_ENV, "l4")  # the new one wins
    assert pretended_card() is CARDS["l4"] and not pretending_t4()


# --- a pretend A100 on a fake H200 --------------------------------------------------------------


def test_a_pretend_a100_has_an_a100s_limits_tier_and_the_gpu_profile(h200):
    card = pretend("a100-40gb")
    assert isinstance(card, CardSpec) and os.environ[PRETEND_ENV] == "a100-40gb" and not pretending_t4()
    info = device_info("cuda")
    assert info.pretend == "a100-40gb" and info.pretend_card is card and not info.pretend_t4
    assert info.capability == (8, 0) and info.real_capability == (9, 0) and info.has_bf16_matmul
    assert (info.total_memory_bytes, info.shared_memory_per_block_bytes, info.multiprocessors) == (40 * GiB, 166_912, 108)
    assert info.name == "NVIDIA H200 as an A100-40GB" and "a pretend A100-40GB" in info.describe()
    assert select_configs(torch.device("cuda")).name == "ampere-163k"
    assert h200 == [(40 * GiB / H200.total_memory, 0)]  # the allocator capped at an A100's memory
    assert detect_profile_name("cuda") == "gpu"
    profile = get_profile("auto")
    assert profile.name == "gpu" and "bfloat16" in profile.dtypes
    assert profile.section("02_memory_sweep")["dtype"] == "bfloat16"
    assert "as a pretend A100-40GB" in profile.description and "ampere-163k" in profile.description
    assert "T4" not in profile.description


def test_a_pretend_a100_runs_bf16_and_apple_cce(h200):
    from helpers import cce
    from helpers.compare.methods import get_method

    pretend("a100-80gb")
    assert cce.why_unavailable("cuda", torch.bfloat16) is None
    assert get_method("apple_cce").why_unavailable("cuda", torch.bfloat16) is None  # 163 KB per block is enough


def test_the_pretend_card_is_on_record(h200):
    from helpers.compare.measure import apply_memory_cap
    from helpers.compare.results_file import run_meta

    pretend("l4")
    device = run_meta("cuda", command=["x"])["device"]
    assert device["pretend"] == "l4" and device["capability"] == [8, 9] and device["real_capability"] == [9, 0]
    assert "a pretend L4" in device["description"]
    json.dumps(device)  # a results file can hold it
    cap = apply_memory_cap(0.9, device="cuda")
    assert cap.pretend == "l4" and not cap.pretend_t4 and cap.usable_bytes == int(0.9 * CARDS["l4"].memory_bytes)
    assert "pretending to be an L4" in cap.describe()
    # notebook 05's 16 GB wall on any card is a T4's
    assert apply_memory_cap(0.9, card_bytes=CARDS["t4"].memory_bytes, device="cuda").pretend == "t4"


def test_the_scope_puts_the_card_before_back(h200, monkeypatch):
    pretend("a100-40gb")
    with pretend_scope("t4") as card:  # notebook 02's T4 pass, inside a pretend A100's run
        assert card.key == "t4" and device_info("cuda").capability == (7, 5)
        assert select_configs(torch.device("cuda")).name == "turing-64k"
    assert os.environ[PRETEND_ENV] == "a100-40gb" and device_info("cuda").pretend == "a100-40gb"
    assert h200[-1] == (1.0, 0)  # the fraction of before


def test_a_smaller_gpu_cannot_pretend_to_be_a_bigger_card(monkeypatch):
    fake_gpu(monkeypatch, REAL_T4)
    with pytest.raises(ValueError, match="cannot pretend to be an A100-40GB: it has less compute capability"):
        pretend("a100-40gb")
    assert PRETEND_ENV not in os.environ
    assert pretend("t4").key == "t4"  # a card can pretend to be itself (torch sees 14.75 of its 15 GiB)


# --- on the CPU: the card's configurations under the interpreter --------------------------------


@pytest.mark.parametrize("key, tier, profile", [("a100-40gb", "ampere-163k", "cpu"), ("l4", "ampere-99k", "cpu"),
                                                ("t4", "turing-64k", "cpu-t4")])
def test_on_the_cpu_the_card_selects_its_tier_and_profile(monkeypatch, key, tier, profile):
    monkeypatch.setenv(PRETEND_ENV, key)
    assert select_configs(torch.device("cpu")).name == tier
    assert detect_profile_name("cpu") == profile
    assert device_info("cpu").pretend is None  # a CPU has no card's memory to pretend


# --- the command line and the runner -------------------------------------------------------------


def test_the_runner_takes_the_cards_profile_and_refuses_another(monkeypatch, tmp_path):
    from helpers.suite.runner import run_suite

    with pytest.raises(SystemExit, match="--pretend a100-40gb runs an A100-40GB's profile"):
        run_suite("t4", tmp_path, pretend="a100-40gb")
    with pytest.raises(SystemExit, match="contradict"):
        run_suite("auto", tmp_path, pretend_t4=True, pretend="l4")
    fake_gpu(monkeypatch, REAL_T4)
    with pytest.raises(SystemExit, match="cannot pretend to be an L4"):
        run_suite("auto", tmp_path, pretend="l4")


def test_the_command_line_passes_the_card(monkeypatch):
    import helpers.compare.bench as bench
    import helpers.suite.runner as runner
    from helpers.__main__ import main

    seen = {}
    monkeypatch.setattr(runner, "run_suite", lambda *a, **kw: seen.update(run=kw["pretend"]) or [])
    assert main(["run", "--pretend", "a100-40gb"]) == 0 and seen["run"] == "a100-40gb"
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: seen.update(bench=os.environ.get(PRETEND_ENV)) or [])
    assert main(["bench", "--pretend", "l4", "--shapes", "tiny"]) == 0 and seen["bench"] == "l4"
    with pytest.raises(SystemExit):
        main(["bench", "--pretend", "v100"])
