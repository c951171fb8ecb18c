"""Widgets: shown where a person is, left out of headless runs (where interact can hang them)."""

import sys
import types

from helpers.lab import widgets


def test_headless_is_the_runner_or_a_kaggle_batch_run():
    assert widgets.headless({"HELPERS_HEADLESS": "1"})
    assert widgets.headless({"KAGGLE_KERNEL_RUN_TYPE": "Batch"})
    assert not widgets.headless({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"})
    assert not widgets.headless({})


def test_explore_says_where_the_controls_are_when_headless(monkeypatch, capsys):
    monkeypatch.setenv("HELPERS_HEADLESS", "1")
    called = []
    assert widgets.explore(lambda n: called.append(n), n=object()) is None
    assert not called and "open this notebook in Jupyter" in capsys.readouterr().out


def test_explore_hands_the_controls_to_interact_where_a_person_is(monkeypatch):
    monkeypatch.delenv("HELPERS_HEADLESS", raising=False)
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    seen = {}
    fake = types.ModuleType("ipywidgets")
    fake.interact = lambda fn, **controls: seen.update(fn=fn, **controls) or "shown"
    monkeypatch.setitem(sys.modules, "ipywidgets", fake)
    fn = lambda n: n  # noqa: E731
    assert widgets.explore(fn, n=3) == "shown" and seen == {"fn": fn, "n": 3}
