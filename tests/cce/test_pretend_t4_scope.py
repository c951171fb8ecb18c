"""pretend_t4_scope: a pretend T4 for one block, then the process as it was (a fake H200 on the CPU)."""

import os
import types

import pytest
import torch

from helpers.cce.device import (PRETEND_ENV, PRETEND_T4_ENV, T4_MEMORY_BYTES, device_info, pretend_t4_scope,
                                pretending_t4)
from helpers.cce.kernels.configs import select_configs

H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=150_000_000_000,
                             shared_memory_per_block_optin=227 * 1024, multi_processor_count=132)


@pytest.fixture
def h200(monkeypatch):
    """torch believes an H200 is attached, capped at 0.9 of it; returns the allocator's calls."""
    calls = []
    fraction = {"now": 0.9}

    def set_fraction(f, index=None):
        calls.append(("set", f, index))
        fraction["now"] = f

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: H200)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index=None: fraction["now"])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.delenv(PRETEND_T4_ENV, raising=False)
    monkeypatch.delenv(PRETEND_ENV, raising=False)
    return calls


def test_inside_the_block_a_t4_after_it_the_h200_with_its_cap(h200):
    assert device_info("cuda").name == "NVIDIA H200"
    with pretend_t4_scope():
        info = device_info("cuda")
        assert info.pretend_t4 and info.capability == (7, 5) and info.total_memory_bytes == T4_MEMORY_BYTES
        assert select_configs(torch.device("cuda")).name == "turing-64k"
    info = device_info("cuda")
    assert not info.pretend_t4 and info.capability == (9, 0) and not pretending_t4()
    assert PRETEND_T4_ENV not in os.environ and PRETEND_ENV not in os.environ
    # The cache is freed before the T4's cap is set, and the 0.9 cap of before comes back after.
    assert h200 == [("empty_cache",), ("set", T4_MEMORY_BYTES / H200.total_memory, 0), ("set", 0.9, 0)]


def test_an_error_inside_the_block_still_restores(h200):
    with pytest.raises(ValueError, match="inside"):
        with pretend_t4_scope():
            raise ValueError("raised inside")
    assert not pretending_t4() and h200[-1] == ("set", 0.9, 0)


def test_a_process_that_was_a_pretend_t4_stays_one(monkeypatch):
    monkeypatch.delenv(PRETEND_ENV, raising=False)
    monkeypatch.setenv(PRETEND_T4_ENV, "1")  # the older switch
    with pretend_t4_scope():
        assert pretending_t4()
    assert os.environ[PRETEND_T4_ENV] == "1"


def test_on_the_cpu_the_block_selects_the_t4_configurations(monkeypatch):
    monkeypatch.delenv(PRETEND_T4_ENV, raising=False)
    monkeypatch.delenv(PRETEND_ENV, raising=False)
    with pretend_t4_scope():
        assert select_configs(torch.device("cpu")).name == "turing-64k"
    assert select_configs(torch.device("cpu")).name == "interpreter"
