"""Notebook 05's arms: what a loss can take is the registry entry's to say, not the arm's."""

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
