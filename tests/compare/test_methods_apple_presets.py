"""Apple CCE's presets for the pretraining A/B: filter off, and the paper's Kahan-FullC where the
installed cut-cross-entropy has it. Apple's kernels need a CUDA GPU; here a stand-in module takes
the call, so what is tested is what the adapters ask Apple's code for, and what they say where it
cannot run."""

import importlib.metadata
import sys
import types

import pytest
import torch

from helpers.compare import methods
from helpers.compare.methods import peers
from helpers.compare.methods import METHODS
from helpers.compare.methods.peers import apple_cce_impls


def test_the_presets_are_apple_cces():
    for name in ("apple_cce_nofilter", "apple_cce_kahan_full_c"):
        preset = METHODS[name]
        assert preset.preset_of == "apple_cce" and preset.kind == "peer" and not preset.counts_skips
        assert name not in methods.primary_methods()
    # filter off is a plain option of every version: Apple CCE's own rules, nothing more
    assert METHODS["apple_cce_nofilter"].availability is METHODS["apple_cce"].availability
    labels = [m.label for m in METHODS.values()]
    assert len(labels) == len(set(labels))  # one name per method


@pytest.mark.skipif(importlib.util.find_spec("cut_cross_entropy") is None, reason="cut-cross-entropy not installed")
def test_the_installed_version_says_whether_it_has_kahan_full_c():
    version = importlib.metadata.version("cut-cross-entropy")
    reason = METHODS["apple_cce_kahan_full_c"].why_unavailable("cpu", torch.bfloat16)
    if "cce_kahan_full_c" in apple_cce_impls():
        assert "CUDA GPU" in reason  # it has the preset; this CPU is what stops it
    else:
        assert apple_cce_impls() >= {"cce", "torch_compile"}
        assert f"cut-cross-entropy {version} has no Kahan-FullC" in reason and "github.com/apple" in reason


def fake_apple(monkeypatch, impls):
    """A stand-in cut_cross_entropy: its impl enum has ``impls``; its loss records what it was asked."""
    calls = []
    module = types.ModuleType("cut_cross_entropy")
    module.LinearCrossEntropyImpl = type("LinearCrossEntropyImpl", (), {"__members__": {i.upper(): i for i in impls}})

    def linear_cross_entropy(e, c, targets, **options):
        calls.append(options)
        return (e.float() @ c.float().T).logsumexp(1).mean()

    module.linear_cross_entropy = linear_cross_entropy
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", module)
    monkeypatch.setattr(peers, "_installed", lambda name: True)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "25.1.1")
    return calls


def test_without_the_preset_kahan_full_c_says_so_before_anything_else(monkeypatch):
    fake_apple(monkeypatch, ["cce", "torch_compile"])
    monkeypatch.setattr(peers, "_apple_cce_reason", lambda device, dtype, softcap: None)  # as on a big GPU
    reason = METHODS["apple_cce_kahan_full_c"].why_unavailable("cpu", torch.bfloat16)
    assert reason.startswith("cut-cross-entropy 25.1.1 has no Kahan-FullC (impl='cce_kahan_full_c'")


def test_with_the_preset_each_adapter_asks_apple_for_its_setting(monkeypatch):
    calls = fake_apple(monkeypatch, ["cce", "torch_compile", "cce_kahan_full_c", "cce_exact"])
    monkeypatch.setattr(peers, "_apple_cce_reason", lambda device, dtype, softcap: None)
    assert METHODS["apple_cce_kahan_full_c"].why_unavailable("cpu", torch.bfloat16) is None
    E, C, x = torch.randn(5, 8), torch.randn(11, 8), torch.randint(0, 11, (5,))
    METHODS["apple_cce_kahan_full_c"](E, C, x)
    METHODS["apple_cce_nofilter"].implementation(E, C, x, reduction="sum")  # its availability: a CPU says no
    assert calls[0]["impl"] == "cce_kahan_full_c" and "filter_eps" not in calls[0]
    assert calls[1]["filter_eps"] is None and "impl" not in calls[1] and calls[1]["reduction"] == "sum"
    # where Apple's own checks stop it (a CPU, a T4's shared memory), the preset says the same
    monkeypatch.setattr(peers, "_apple_cce_reason", lambda device, dtype, softcap: "needs a CUDA GPU")
    assert METHODS["apple_cce_kahan_full_c"].why_unavailable("cpu", torch.bfloat16) == "needs a CUDA GPU"
