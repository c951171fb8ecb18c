"""Notebook 05's arms: what a loss can take is the registry entry's to say, not the arm's."""

import gc
import weakref

import torch

from helpers import hf
from helpers.compare.methods import get_method
from helpers.lab import fits


def test_the_patched_arms_call_the_registrys_entries(monkeypatch):
    patched = {}
    monkeypatch.setattr(hf, "patch", lambda model, loss=None: patched.setdefault(model, loss))
    for arm in (fits.ARMS["apple_cce"], fits.EXACT):
        arm.apply(arm.name)  # a stand-in model: the arm's name
    assert patched == {"apple_cce": get_method("apple_cce"), "exact": get_method("exact")}
    assert not get_method("apple_cce").supports_bias and get_method("exact").supports_bias


def test_only_our_kernels_arm_is_ours():
    assert [name for name, arm in fits.ARMS.items() if arm.is_ours] == ["ours", "ours_1g", "ours_auto"]
    assert not fits.EXACT.is_ours


def test_the_fit_search_keeps_no_reference_to_the_model():
    """Notebook 05 deletes its model after the search so that the training curves have the card; a
    search closure kept alive (once a notebook global holding the trainer as a default argument) kept
    the weights on it, and on a 16 GB card the default loss's curve ran out of memory."""
    model = fits.build_model("tiny", "cpu", "fp32")
    trainer = fits.Trainer(model, "fp32")
    ids = torch.randint(0, 512, (4_096,), generator=torch.Generator().manual_seed(0))
    budget = 2_000_000  # the CPU's simulated card: some micro-batches fit, larger ones do not
    largest, tried = fits.largest_micro_batch(trainer, fits.ARMS["hf"], ids, 32, 32, 1_024, 32, budget_bytes=budget)
    assert tried[0] == 32 and largest in tried
    held = weakref.ref(model)
    del trainer, model
    gc.collect()
    assert held() is None
