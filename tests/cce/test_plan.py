"""Each public option of ``linear_cross_entropy`` has one owner: validated and resolved once, at the
call's entry, into a ``CCEPlan`` (``helpers.cce.options``) that the forward and the backward only read.
The table below names, per keyword, the field of the plan that carries it (or the one place in
``api`` that uses it); a keyword added without an owner fails ``test_every_keyword_has_one_owner``."""

import inspect
from dataclasses import replace

import pytest
import torch

import helpers.cce.api as api
import helpers.cce.options as options_module
from helpers.cce import forget_backward_choices, linear_cross_entropy
from helpers.cce.kernels.configs import tier
from helpers.cce.options import CCEPlan, auto_filter_eps
from helpers.compare.inputs import make_inputs

# The plan is host arithmetic; its tests call the loss on CPU tensors.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the Triton interpreter)")

# The interpreter's tier with the sparse backward allowed at these sizes ("auto" may probe).
SPARSE_HERE = tier("interpreter").tuned(sparse_min_pairs=0)

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
    "backward_impl": ("atomic", "backward_impl"),  # "auto": resolved to one of them, why in ``auto``
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
    for impl in ("gemm", "atomic", "sparse", "auto"):
        calls.clear()
        linear_cross_entropy(E, C, x, backward_impl=impl, filter_eps="auto").backward()
        assert len(calls) == 1, impl


@pytest.mark.parametrize("backward_impl", ["gemm", "sparse"])
def test_a_shards_threshold_is_the_whole_vocabularys(backward_impl):
    """"auto" bounds what a row loses over the whole vocabulary: a rank holding one shard of C (the
    vocabulary-parallel loss passes ``vocabulary``) takes the threshold of all V classes, not of its
    shard's, so the ranks together drop at most the budget."""
    from helpers.cce.options import plan_call

    E = torch.randn(37, 24, dtype=torch.float16)
    C = torch.randn(40_000, 24, dtype=torch.float16)
    kw = dict(backward_impl=backward_impl, configs=SPARSE_HERE, return_lse=False, need=(True, True, False),
              wants_db=False)
    whole = plan_call(E, C, **kw).options.filter_eps
    shard = plan_call(E, C[:10_000], vocabulary=40_000, **kw).options.filter_eps
    alone = plan_call(E, C[:10_000], **kw).options.filter_eps
    assert shard == whole and alone > whole, (shard, whole, alone)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("backward_impl, configs", [("gemm", None), ("sparse", None), ("auto", None),
                                                    ("auto", SPARSE_HERE)], ids=str)
def test_auto_filter_eps_and_sort_have_one_owner(dtype, backward_impl, configs, monkeypatch):
    """"auto" means ``auto_filter_eps``'s value for the backward that runs, per tile for the dense
    backwards, per row for "sparse", and "auto" sort means sorted for "sparse" only; "sparse" carries
    the options "gemm" runs with if it hands over (``CCEPlan.fallback``): "gemm"'s, unsorted.
    "auto" at the interpreter's tier is too small for "sparse"; with ``SPARSE_HERE`` fp16 probes it."""
    forget_backward_choices()
    E, C, x = make_inputs(37, 301, 24, dtype, "cpu", requires_grad=True)
    plan = planned(monkeypatch, E, C, x, backward_impl=backward_impl, configs=configs)
    ran = plan.backward_impl
    assert ran == (backward_impl if backward_impl != "auto" else
                   "sparse" if configs and dtype == torch.float16 else "gemm")
    sparse = dict(block_v=plan.configs.sparse_for(dtype).BLOCK_V) if ran == "sparse" else {}
    assert plan.options.filter_eps == auto_filter_eps(dtype, vocabulary=301, **sparse)
    assert plan.options.sort_vocab == (ran == "sparse")
    assert (plan.auto is None) == (backward_impl != "auto")
    if ran == "sparse":
        assert plan.fallback == replace(plan.options, filter_eps=auto_filter_eps(dtype, vocabulary=301), sort_vocab=False)
    else:
        assert plan.fallback is None
    forget_backward_choices()


def test_a_number_and_an_explicit_sort_are_used_as_given_by_every_backward(monkeypatch):
    E, C, x = make_inputs(37, 301, 24, torch.float16, "cpu", requires_grad=True)
    for impl in ("gemm", "sparse", "auto"):
        forget_backward_choices()
        plan = planned(monkeypatch, E, C, x, backward_impl=impl, configs=SPARSE_HERE, filter_eps=2.0**-9,
                       sort_vocab=False)
        assert plan.backward_impl == ("gemm" if impl == "gemm" else "sparse")
        assert plan.options.filter_eps == 2.0**-9 and not plan.options.sort_vocab
        assert plan.fallback is None or plan.fallback == plan.options
    forget_backward_choices()
    with pytest.raises(ValueError, match="sort_vocab"):
        linear_cross_entropy(E, C, x, sort_vocab="yes")
    with pytest.raises(ValueError, match="backward_impl"):
        linear_cross_entropy(E, C, x, backward_impl="fastest")


def test_auto_decides_at_the_entry_what_sparse_cannot_skip(monkeypatch):
    """"auto" with options that need every pair, or no gradient: "gemm" in the plan, no probe."""
    forget_backward_choices()
    E, C, x = make_inputs(37, 301, 24, torch.float16, "cpu", requires_grad=True)
    plan = planned(monkeypatch, E, C, x, configs=SPARSE_HERE, label_smoothing=0.1)
    assert plan.backward_impl == "gemm" and "label smoothing" in plan.auto.why and plan.auto.key is None
    with torch.no_grad():
        plan = planned(monkeypatch, E, C, x, configs=SPARSE_HERE)
    assert plan.backward_impl == "gemm" and plan.auto.why == "no gradient is wanted" and not plan.emit_activity
    plan = planned(monkeypatch, E, C, x, configs=SPARSE_HERE)
    assert plan.backward_impl == "sparse" and plan.emit_activity and plan.auto.why.startswith("probe")
    forget_backward_choices()


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


def test_a_problems_plan_is_resolved_once_and_each_call_still_checked(monkeypatch):
    """``plan_call`` keeps the resolved plans of the last problems (resolving one is host time a call with
    few tokens pays before its first launch): the same problem gets the same plan object back, another
    option value another plan; a value equal to an accepted one but of a refused type is still refused
    (True is 1 to a dict); an unhashable value gets its own error, not the cache's; "auto" still asks its
    record on every call."""
    from helpers.cce.auto import RECORD
    from helpers.cce.options import plan_call

    E, C = torch.randn(37, 24, dtype=torch.float16), torch.randn(300, 24, dtype=torch.float16)
    kw = dict(backward_impl="gemm", configs=None, return_lse=False, need=(True, True, False), wants_db=False)
    first = plan_call(E, C, z_loss=1, **kw)
    assert plan_call(E, C, z_loss=1, **kw) is first and first.options.z_loss == 1.0
    assert plan_call(E, C, z_loss=2, **kw).options.z_loss == 2.0
    assert plan_call(E[:5], C, z_loss=1, **kw) is not first  # another N
    with pytest.raises(ValueError, match="z_loss must be a finite number"):
        plan_call(E, C, z_loss=True, **kw)
    with pytest.raises(ValueError, match="z_loss must be a finite number"):
        plan_call(E, C, z_loss=[1], **kw)
    # The least recently used problem goes first: a problem used between 64 others keeps its plan.
    from helpers.cce import options

    monkeypatch.setattr(options, "_PLANS", {})
    rows = torch.randn(options._PLANS_KEPT + 1, 24, dtype=torch.float16)  # a problem per N
    hot = plan_call(rows, C, z_loss=1, **kw)
    others = []
    for n in range(1, options._PLANS_KEPT + 1):
        others.append(plan_call(rows[:n], C, z_loss=1, **kw))
        assert plan_call(rows, C, z_loss=1, **kw) is hot
    assert len(options._PLANS) == options._PLANS_KEPT
    assert plan_call(rows[:2], C, z_loss=1, **kw) is others[1]  # kept
    assert plan_call(rows[:1], C, z_loss=1, **kw) is not others[0]  # the least recently used: resolved again
    asked = []
    choose = RECORD.choose
    monkeypatch.setattr(RECORD, "choose", lambda *a, **k: asked.append(a) or choose(*a, **k))
    auto = dict(kw, backward_impl="auto", configs=SPARSE_HERE)
    plans = [plan_call(E, C, **auto) for _ in range(3)]
    assert len(asked) == 3 and all(p.backward_impl in ("gemm", "sparse") for p in plans)
