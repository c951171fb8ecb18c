"""The pretend T4: a bigger GPU answering as a free Kaggle/Colab T4, checked here on a fake H200."""

import types

import pytest
import torch

import helpers.cce.device as device_module
from helpers.cce.device import PRETEND_T4_ENV, T4_MEMORY_BYTES, device_info, pretend_t4
from helpers.cce.kernels.configs import select_configs
from helpers.lab.profiles import detect_profile_name

H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=150_000_000_000,
                             shared_memory_per_block_optin=227 * 1024, multi_processor_count=132)


@pytest.fixture
def h200(monkeypatch):
    """torch believes an H200 is attached; returns the calls made to the allocator's cap."""
    caps = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: H200)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: caps.append((f, i)))
    monkeypatch.delenv(PRETEND_T4_ENV, raising=False)
    return caps


def test_an_h200_is_itself_without_the_variable(h200):
    info = device_info("cuda")
    assert info.name == "NVIDIA H200" and info.capability == (9, 0) and info.has_bf16_matmul
    assert not info.pretend_t4
    assert select_configs(torch.device("cuda")).name == "hopper-227k"
    assert detect_profile_name("cuda") == "gpu"


def test_pretend_t4_gives_a_t4s_limits_configs_and_profile(h200):
    pretend_t4()
    info = device_info("cuda")
    assert info.pretend_t4 and info.capability == (7, 5) and not info.has_bf16_matmul
    assert info.total_memory_bytes == T4_MEMORY_BYTES and info.shared_memory_per_block_bytes == 64 * 1024
    assert "as a T4" in info.describe() and "this GPU's speed" in info.describe()
    assert select_configs(torch.device("cuda")).name == "turing-64k"
    assert detect_profile_name("cuda") == "t4"
    # The allocator is capped at a T4's memory, on the current device.
    assert h200 == [(T4_MEMORY_BYTES / H200.total_memory, 0)]


def test_a_pretend_t4_refuses_what_a_t4_cannot_run(h200):
    from helpers import cce
    from helpers.compare.methods import get_method

    pretend_t4()
    assert "sm_75" in cce.why_unavailable("cuda", torch.bfloat16)
    assert cce.why_unavailable("cuda", torch.float16) is None
    reason = get_method("apple_cce").why_unavailable("cuda", torch.float16)
    assert reason and "shared memory" in reason and "64 KB" in reason


def test_the_memory_cap_is_a_fraction_of_the_pretend_t4(h200):
    from helpers.compare.measure import apply_memory_cap

    pretend_t4()
    cap = apply_memory_cap(0.9, device="cuda")
    assert cap.pretend_t4 and cap.usable_bytes == int(0.9 * T4_MEMORY_BYTES)
    assert h200[-1] == (cap.usable_bytes / H200.total_memory, 0)
    assert "pretending to be a T4" in cap.describe()


def test_on_the_cpu_the_variable_selects_the_t4_path(monkeypatch):
    monkeypatch.setenv(PRETEND_T4_ENV, "1")
    assert detect_profile_name("cpu") == "cpu-t4"
    assert select_configs(torch.device("cpu")).name == "turing-64k"
    assert not device_info("cpu").pretend_t4
    monkeypatch.delenv(PRETEND_T4_ENV)
    assert detect_profile_name("cpu") == "cpu" and select_configs(torch.device("cpu")).name == "interpreter"


def test_the_cpu_t4_profile_is_the_cpu_sizes_in_fp16():
    from helpers.lab.profiles import get_profile

    cpu, t4 = get_profile("cpu"), get_profile("cpu-t4")
    assert t4.dtypes == ("float16",) and t4.device == "cpu"
    assert t4.section("02_memory_sweep")["dtype"] == "float16"
    assert t4.section("03_convergence")["compute_dtype"] == "float16"
    assert t4.section("04_kernel_walkthrough")["dtype"] == "float16"
    assert t4.section("02_memory_sweep")["N"] == cpu.section("02_memory_sweep")["N"]
    assert cpu.section("02_memory_sweep")["dtype"] == "float32"  # the copy left the cpu profile alone


def test_the_runner_refuses_a_profile_that_contradicts_pretend_t4(monkeypatch, tmp_path):
    from helpers.suite.runner import run_suite

    monkeypatch.delenv(PRETEND_T4_ENV, raising=False)
    with pytest.raises(SystemExit, match="--pretend-t4"):
        run_suite("gpu", tmp_path, pretend_t4=True)


def teardown_function():
    import os

    os.environ.pop(PRETEND_T4_ENV, None)
    assert device_module.pretending_t4() is False
