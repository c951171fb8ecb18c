"""``backward_impl="auto"`` (``helpers.cce.auto``), on the CPU: "sparse" where the bits pay, "gemm"
elsewhere, remembered per problem, with no bits made for a remembered "gemm".

Inputs from ``helpers.compare.inputs``: ``realistic`` (a peaked softmax: at these sizes its bits mark
30-60% of the pairs) and ``uniform`` (flat: every pair), on a tier whose density limit (90%) and
minimum size (none) let the small shapes run the sparse backward, as in ``tests/cce/test_sparse.py``.
fp32 and fp16 (the interpreter computes bf16 wrongly).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

import helpers.cce.ops as ops  # noqa: E402  (the forward the loss runs: ops.cce_forward)
from helpers.cce import (  # noqa: E402
    LinearCrossEntropy,
    cce_backward,
    cce_forward,
    forget_backward_choices,
    linear_cross_entropy,
    resolve_options,
)
from helpers.cce.auto import RECORD  # noqa: E402
from helpers.cce.options import resolve_configs, sparse_auto_eps  # noqa: E402
from helpers.compare.inputs import make_inputs  # noqa: E402
from helpers.spec import reference_loss_and_grads, relative_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, V, D = 45, 700, 24


@pytest.fixture(autouse=True)
def fresh_record():
    """Each test starts with nothing remembered, and leaves nothing behind."""
    forget_backward_choices()
    yield
    forget_backward_choices()


def small(**knobs):
    """The device's tier with the sparse backward allowed at these sizes (``tests/cce/test_sparse.py``'s
    knobs), a probe every 3 calls of a remembered "gemm", then ``knobs``."""
    return resolve_configs(None, torch.device(DEVICE)).tuned(
        **{"pilot_columns": 128, "dense_fallback": 0.9, "sparse_min_pairs": 0, "auto_probe_calls": 3, **knobs})


def inputs(dtype, regime, n=N, seed=1):
    E, C, x = make_inputs(n, V, D, torch.float32, "cpu", regime=regime, seed=seed)
    return E.to(dtype).to(DEVICE), C.to(dtype).to(DEVICE), x.to(DEVICE)


def step(E, C, x, **options):
    """(dE, dC, stats, whether the forward made bits) of one call through autograd."""
    made_bits = []
    real = ops.cce_forward

    def spy(*args, **kwargs):
        made_bits.append(kwargs.get("emit_activity", False))
        return real(*args, **kwargs)

    ops.cce_forward = spy
    try:
        Eg, Cg = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
        stats = {}
        linear_cross_entropy(Eg, Cg, x, stats=stats, **options).backward()
    finally:
        ops.cce_forward = real
    (bits,) = made_bits
    return Eg.grad, Cg.grad, stats, bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sparse_on_a_peaked_softmax_gemm_on_a_flat_one(dtype):
    """The first call probes (bits), and the sparse backward's own decision stands: it runs on the
    peaked softmax and hands over to "gemm" on the flat one. fp32's "auto" eps is off, which leaves
    nothing to skip: a threshold is given."""
    eps = dict(filter_eps=2.0**-16) if dtype == torch.float32 else {}
    _, _, peaked, bits = step(*inputs(dtype, "realistic"), configs=small(), **eps)
    assert bits and peaked["backward"] == "sparse" and peaked["fallback"] is None
    assert peaked["auto"].startswith("probe") and peaked["density"] < 0.9
    forget_backward_choices()  # the same problem (shapes, options) with another softmax: probe it afresh
    _, _, flat, bits = step(*inputs(dtype, "uniform"), configs=small(), **eps)
    assert bits and flat["backward"] == "gemm" and "mark 100%" in flat["fallback"]
    assert flat["auto"].startswith("probe")


def test_the_probe_and_remember_cycle():
    """Flat softmax: a probe (bits, "gemm" after them), then "gemm" without bits for
    ``auto_probe_calls`` calls, then a probe again. Peaked: every call "sparse", with bits, each
    backward deciding again."""
    E, C, x = inputs(torch.float16, "uniform")
    seen = [step(E, C, x, configs=small())[2:] for _ in range(5)]
    assert [bits for _, bits in seen] == [True, False, False, True, False]
    assert [stats["backward"] for stats, _ in seen] == ["gemm"] * 5
    assert [stats["auto"].split(":")[0] for stats, _ in seen] == ["probe", "remembered", "remembered", "probe",
                                                                  "remembered"]
    assert "mark 100% of the pairs" in seen[1][0]["auto"] and "at call 1" in seen[1][0]["auto"]
    assert "fallback" not in seen[1][0]  # a remembered "gemm" is "gemm" from the start
    forget_backward_choices()
    E, C, x = inputs(torch.float16, "realistic")
    seen = [step(E, C, x, configs=small())[2:] for _ in range(3)]
    assert all(bits for _, bits in seen) and all(stats["backward"] == "sparse" for stats, _ in seen)
    assert seen[2][0]["auto"].startswith("remembered:") and "at call 2" in seen[2][0]["auto"]


def test_a_softmax_that_flattens_is_seen_on_the_next_call_and_one_that_sharpens_within_the_probe_period():
    """One problem (same shapes and options), its softmax changing under it, as in training."""
    peaked, flat = inputs(torch.float16, "realistic"), inputs(torch.float16, "uniform")
    assert step(*peaked, configs=small())[2]["backward"] == "sparse"
    assert step(*flat, configs=small())[2]["fallback"]  # still a sparse call: it looks, and hands over
    assert [step(*peaked, configs=small())[2]["backward"] for _ in range(3)] == ["gemm", "gemm", "sparse"]


def test_a_probe_without_a_backward_restarts_the_count():
    """A forward with grad enabled and no backward: its bits teach nothing, the decision stands."""
    E, C, x = inputs(torch.float16, "uniform")
    step(E, C, x, configs=small())
    step(E, C, x, configs=small())
    step(E, C, x, configs=small())
    linear_cross_entropy(E.clone().requires_grad_(True), C, x, configs=small())  # call 4: the probe, forgotten
    assert [step(E, C, x, configs=small())[3] for _ in range(4)] == [False, False, True, False]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the interpreter tier's tiles)")
def test_autos_gemm_is_gemms_and_its_sparse_is_sparses():
    """Whichever backward "auto" runs, it runs as asked for by name, so the filter's "auto" eps
    follows the backward that runs: a remembered "gemm" and a probed or remembered "sparse" bit for
    bit; the probe's hand-over to "gemm" to the rounding of its lse (the sorted forward with bits
    sums the row in another order)."""
    E, C, x = inputs(torch.float16, "uniform")
    gemm = step(E, C, x, backward_impl="gemm", configs=small())
    dE, dC, stats, _ = step(E, C, x, configs=small())
    assert stats["fallback"] and relative_error(dE, gemm[0]) < 1e-4 and relative_error(dC, gemm[1]) < 1e-4
    dE, dC, stats, _ = step(E, C, x, configs=small())
    assert stats["auto"].startswith("remembered") and torch.equal(dE, gemm[0]) and torch.equal(dC, gemm[1])
    forget_backward_choices()
    E, C, x = inputs(torch.float16, "realistic")
    sparse = step(E, C, x, backward_impl="sparse", configs=small())
    assert sparse[2]["backward"] == "sparse"
    for _ in range(2):
        dE, dC, stats, _ = step(E, C, x, configs=small())
        assert torch.equal(dE, sparse[0]) and torch.equal(dC, sparse[1])
        assert stats["eps"] == sparse[2]["eps"] == 2.0**-10 / 44  # B / T, T = 44 tiles of 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the interpreter tier's tiles)")
def test_the_sparse_backwards_hand_over_is_gemms():
    """Asked for by name on a flat softmax, "sparse" hands over to "gemm" with "gemm"'s own eps: bit
    for bit "gemm"'s from the same lse."""
    E, C, x = inputs(torch.float16, "uniform")
    dE, dC, stats, bits = step(E, C, x, backward_impl="sparse", configs=small())
    assert bits and stats["backward"] == "gemm" and stats["fallback"] and "auto" not in stats
    configs = small()
    sparse = resolve_options(torch.float16, filter_eps=sparse_auto_eps(torch.float16, V, 16), sort_vocab=True)
    _, lse, r, _ = cce_forward(E, C, x, sparse, configs, emit_activity=True)
    gE, gC, _ = cce_backward(E, C, x, lse, r, torch.full((N,), 1.0 / N), resolve_options(torch.float16, vocabulary=V), configs,
                             backward_impl="gemm")
    assert torch.equal(dE, gE) and torch.equal(dC, gC)


@pytest.mark.parametrize("regime", ["realistic", "uniform"])
def test_fp16_gradients_within_the_naive_paths_error(regime):
    """Against float64, each call of "auto" (the probe, then a remembered decision) within 1.5x of
    the naive fp16 path's error (fp16 logits, fp32 softmax)."""
    E, C, x = inputs(torch.float16, regime)
    _, rdE, rdC = reference_loss_and_grads(E, C, x, torch.tensor(1.0))
    En, Cn = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    F.cross_entropy((En @ Cn.T).float(), x).backward()
    for _ in range(2):
        dE, dC, stats, _ = step(E, C, x, configs=small())
        assert stats["backward"] == ("sparse" if regime == "realistic" else "gemm")
        assert relative_error(dE, rdE) <= 1.5 * relative_error(En.grad, rdE), stats
        assert relative_error(dC, rdC) <= 1.5 * relative_error(Cn.grad, rdC), stats


def test_fp32_gradients_against_float64():
    """fp32: "auto" eps is off, so "gemm" with no probe, exact to fp32's rounding; with a small
    threshold the sparse backward runs, and drops only what the threshold allows."""
    E, C, x = inputs(torch.float32, "realistic")
    _, rdE, rdC = reference_loss_and_grads(E, C, x, torch.tensor(1.0))
    dE, dC, stats, bits = step(E, C, x, configs=small())
    assert not bits and stats["backward"] == "gemm" and "filter is off" in stats["auto"]
    assert relative_error(dE, rdE) < 2e-5 and relative_error(dC, rdC) < 2e-5
    eps = 2.0**-16
    dE, dC, stats, bits = step(E, C, x, configs=small(), filter_eps=eps)
    assert bits and stats["backward"] == "sparse"
    dropped = 44 * eps  # at most T eps of a row's |G| mass (out of <= 2), T = 44 tiles of 16 columns
    assert stats["skipped_mass_max"] <= dropped
    assert relative_error(dE, rdE) < dropped and relative_error(dC, rdC) < dropped


@pytest.mark.parametrize("options, why", [
    (dict(label_smoothing=0.1), "label smoothing"),
    (dict(full_c=True), "FullC"),
    (dict(filter_eps=None), "filter is off"),
    (dict(configs="interpreter"), "pairs, fewer than"),  # too small for the index: the tier's own minimum
])
def test_what_sparse_cannot_skip_is_gemm_from_the_plan(options, why):
    """Options that need every pair, or a problem too small: "gemm" at the entry, no bits, nothing
    remembered."""
    E, C, x = inputs(torch.float16, "realistic")
    _, _, stats, bits = step(E, C, x, **{"configs": small(), **options})
    assert not bits and stats["backward"] == "gemm" and why in stats["auto"] and "fallback" not in stats
    assert not RECORD._seen


def test_no_gradient_no_probe():
    E, C, x = inputs(torch.float16, "realistic")
    with torch.no_grad():
        linear_cross_entropy(E, C, x, configs=small())
    linear_cross_entropy(E, C, x, configs=small())  # nothing requires grad
    assert not RECORD._seen


def test_problems_are_remembered_apart():
    """Another N (to the next power of two) or other options: another problem, its own probe."""
    E, C, x = inputs(torch.float16, "uniform")
    step(E, C, x, configs=small())
    assert not step(E, C, x, configs=small())[3]
    assert not step(E[:40], C, x[:40], configs=small())[3]  # 40 and 45 both round to 64
    assert step(E[:30], C, x[:30], configs=small())[3]
    assert step(E, C, x, configs=small(), softcap=20.0)[3]


def test_the_module_and_the_host_function_take_the_default():
    """``LinearCrossEntropy`` (and ``helpers.hf.patch``, through ``linear_cross_entropy``) default to
    "auto"; ``cce_backward``, which runs after the forward, takes a backward by name only."""
    E, C, x = inputs(torch.float16, "uniform")
    Eg = E.clone().requires_grad_(True)
    stats = {}
    LinearCrossEntropy(configs=small(), stats=stats)(Eg, C, x).backward()
    assert stats["backward"] == "gemm" and stats["auto"].startswith("probe")
    with pytest.raises(ValueError, match="decides before the forward"):
        cce_backward(E, C, x, torch.zeros(N), torch.ones(N), torch.ones(N), backward_impl="auto")
