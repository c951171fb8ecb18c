"""Each public option of ``linear_cross_entropy`` has one owner: validated and resolved once, at the
call's entry, into a ``CCEPlan`` (``helpers.cce.options``) that the forward and the backward only read.
The table below names, per keyword, the field of the plan that carries it (or the one place in
``api`` that uses it); a keyword added without an owner fails ``test_every_keyword_has_one_owner``."""

import inspect

import pytest
import torch

import helpers.cce.api as api
import helpers.cce.options as options_module
from helpers.cce import linear_cross_entropy
from helpers.cce.kernels.configs import tier
from helpers.cce.options import CCEPlan, auto_filter_eps
from helpers.compare.inputs import make_inputs

# keyword -> (a non-default value, where the plan holds it)
OWNERS = {
    "bias": (None, "need[2] (a bias that requires grad), and the kernels' bias argument"),
    "ignore_index": (-7, "options.ignore_index"),
    "reduction": ("sum", "options.reduction"),
    "shift": (True, "api: the targets shifted before the autograd function"),
    "softcap": (20.0, "options.softcap"),
    "z_loss": (1e-3, "options.z_loss"),
    "label_smoothing": (0.1, "options.label_smoothing"),
    "return_lse": (True, "return_lse"),
    "filter_eps": (2.0**-10, "options.filter_eps"),
    "sort_vocab": (True, "options.sort_vocab"),
    "accumulation": ("kahan", "options.accumulation"),
    "full_c": (True, "options.full_c"),
    "full_e": (True, "options.full_e"),
    "configs": ("interpreter", "configs"),
    "backward_impl": ("atomic", "backward_impl"),
    "stats": ({}, "api: handed to the backward beside the plan, filled there"),
    "temperature": (0.5, "options.temperature"),
    "weight": (None, "api: the kernels' unweighted rows ('none' in the plan) weighted after the autograd function"),
    "memory_budget": (2**30, "api: checked at the entry, the schedule chosen once (helpers.cce.schedules)"),
}


def test_every_keyword_has_one_owner():
    keywords = [name for name, p in inspect.signature(linear_cross_entropy).parameters.items()
                if p.kind == p.KEYWORD_ONLY]
    assert sorted(keywords) == sorted(OWNERS)


def planned(monkeypatch, E, C, x, **options) -> CCEPlan:
    """The plan ``linear_cross_entropy`` hands to its autograd function."""
    seen = []
    real = api.LinearCrossEntropyFunction.apply
    monkeypatch.setattr(api.LinearCrossEntropyFunction, "apply", lambda *a: seen.append(a[4]) or real(*a))
    linear_cross_entropy(E, C, x, **options)
    (plan,) = seen
    return plan


@pytest.mark.parametrize("name", [n for n, (_, where) in OWNERS.items() if not where.startswith("api")
                                  and n != "bias"])
def test_each_option_lands_in_its_one_field(name, monkeypatch):
    E, C, x = make_inputs(37, 301, 24, torch.float32, "cpu", requires_grad=True)
    value, where = OWNERS[name]
    plan = planned(monkeypatch, E, C, x, **{name: value})
    got = plan
    for part in where.split("."):
        got = getattr(got, part)
    want = tier(value) if name == "configs" else value
    assert got == want, (name, got)


def test_the_bias_gradient_and_the_inputs_gradients_are_planned_once(monkeypatch):
    E, C, x = make_inputs(37, 301, 24, torch.float32, "cpu")
    bias = torch.zeros(301, requires_grad=True)
    assert planned(monkeypatch, E, C, x, bias=bias).need == (False, False, True)
    with torch.no_grad():
        assert planned(monkeypatch, E, C, x, bias=bias).need == (False, False, False)
    with pytest.raises(ValueError, match="no db"):  # checked once, at the entry
        linear_cross_entropy(E, C, x, bias=bias, backward_impl="atomic")


def test_the_configs_are_resolved_once_per_call(monkeypatch):
    """The device's tier is looked up at the entry only; forward and backward read the plan's."""
    calls = []
    real = options_module.select_configs
    monkeypatch.setattr(options_module, "select_configs", lambda device: calls.append(device) or real(device))
    E, C, x = make_inputs(37, 301, 24, torch.float32, "cpu", requires_grad=True)
    for impl in ("gemm", "atomic", "sparse"):
        calls.clear()
        linear_cross_entropy(E, C, x, backward_impl=impl, filter_eps="auto").backward()
        assert len(calls) == 1, impl


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("backward_impl", ["gemm", "sparse"])
def test_auto_filter_eps_has_one_owner(dtype, backward_impl, monkeypatch):
    """"auto" means ``auto_filter_eps``'s value, per tile for the dense backwards, per row for "sparse"."""
    E, C, x = make_inputs(37, 301, 24, dtype, "cpu", requires_grad=True)
    plan = planned(monkeypatch, E, C, x, backward_impl=backward_impl)
    sparse = dict(vocabulary=301, block_v=plan.configs.sparse_for(dtype).BLOCK_V) if backward_impl == "sparse" else {}
    assert plan.options.filter_eps == auto_filter_eps(dtype, **sparse)


def test_the_sparse_decision_before_any_bit_is_made_is_the_plans(monkeypatch):
    """Too few pairs, or options that need every pair: the plan says so, the forward makes no bits,
    and the backward's fallback reason is the plan's."""
    E, C, x = make_inputs(37, 301, 24, torch.float16, "cpu", requires_grad=True)
    stats = {}
    plan = planned(monkeypatch, E, C, x, backward_impl="sparse", stats=stats)
    assert "pairs, fewer than" in plan.sparse_reason and not plan.emit_activity
    small = tier("interpreter").tuned(sparse_min_pairs=0)
    assert planned(monkeypatch, E, C, x, backward_impl="sparse", configs=small).emit_activity
    assert "label smoothing" in planned(monkeypatch, E, C, x, backward_impl="sparse", configs=small,
                                        label_smoothing=0.1, filter_eps=2.0**-10).sparse_reason
