"""Per-token outputs (logprob, entropy, accuracy), the temperature and class weights against float64.

``helpers.cce.outputs.linear_cross_entropy_outputs`` against ``helpers.spec.reference_outputs``, and
``linear_cross_entropy(temperature=, weight=)`` against ``helpers.spec.reference_loss`` (which is
``F.cross_entropy(weight=)`` on z / tau): values and dE, dC, db, in fp32 and fp16 under the Triton
interpreter (bf16 is wrong there; ``scripts/gpu/cce_check.py`` covers the GPU), on an irregular shape
(N=37, V=257, D=24) with a soft cap, a bias and ignored rows. Each gate is shown able to fail: the same
comparison with the entropy's G term or the temperature's factor removed, or the weights dropped,
misses the tolerance.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import helpers.cce.backward.rows as rows_module  # noqa: E402
from helpers.cce import linear_cross_entropy, linear_cross_entropy_outputs  # noqa: E402
from helpers.cce.options import resolve_configs  # noqa: E402
from helpers.spec import reference_loss, reference_outputs, relative_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, V, D = 37, 257, 24
DTYPES = [torch.float32, torch.float16]
# As tests/cce/test_cce.py: fp32 is real fp32; fp16 rounds the products' inputs and G to 11 bits.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
IGNORED = [0, 7, 36]


def make_inputs(dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    E = (scale * torch.randn(N, D, generator=g) / D**0.25).to(dtype).to(DEVICE)
    C = (torch.randn(V, D, generator=g) / D**0.25).to(dtype).to(DEVICE)
    bias = (0.5 * torch.randn(V, generator=g)).to(dtype).to(DEVICE)
    x = torch.randint(0, V, (N,), generator=g)
    x[IGNORED] = -100
    return E, C, bias, x.to(DEVICE)


def leaves(*tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_(True) for t in tensors]


def upstream(seed):
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def run_outputs(E, C, bias, x, grads=("logprob", "entropy"), bias_grad=True, **options):
    """Ours: (logprob, entropy, correct) and (dE, dC, db) of sum(g1 logprob + g2 entropy); db None
    without ``bias_grad``."""
    E, C = leaves(E, C)
    bias = bias.detach().clone().requires_grad_(bias_grad)
    out = linear_cross_entropy_outputs(E, C, x, bias=bias, **options)
    total = sum((out._asdict()[name] * upstream(i)).sum() for i, name in enumerate(("logprob", "entropy"))
                if name in grads)
    total.backward()
    return out, (E.grad, C.grad, bias.grad)


def run_reference(E, C, bias, x, grads=("logprob", "entropy"), **options):
    E, C, bias = leaves(E, C, bias, dtype=torch.float64)
    out = reference_outputs(E, C, x, bias=bias, **options)
    total = sum((out[i] * upstream(i).double()).sum() for i, name in enumerate(("logprob", "entropy"))
                if name in grads)
    total.backward()
    return out, (E.grad, C.grad, bias.grad)


def errors(got, ref):
    return [relative_error(a, r) for a, r in zip(got, ref)]


def spec_options(options):
    return {k: v for k, v in options.items() if k in ("softcap", "temperature", "ignore_index")}


OUTPUT_CASES = {
    "plain": dict(),
    "softcap_temperature": dict(softcap=2.5, temperature=0.7),
    "hot": dict(temperature=3.0),
    "filter": dict(temperature=0.5, filter_eps=2.0**-14),
}


@pytest.fixture(params=["gemm", "gemm/narrow", "atomic"])
def backward(request):
    """The "gemm" backward as it plans itself, "gemm" with 16-row and 16-column chunks (G in the
    buffer, partial tiles), and "atomic" (which has no db)."""
    chunks = {"gemm/narrow": (16, 16)}.get(request.param)
    configs = resolve_configs(None, torch.device(DEVICE)).tuned(gemm_chunks=chunks)
    return dict(backward_impl=request.param.split("/")[0], configs=configs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", OUTPUT_CASES)
def test_outputs_against_float64(case, dtype, backward):
    opts = OUTPUT_CASES[case]
    E, C, bias, x = make_inputs(dtype, scale=2.0)
    atomic = backward["backward_impl"] == "atomic"  # no db: a bias that requires grad is refused (below)
    out, grads = run_outputs(E, C, bias, x, bias_grad=not atomic, **backward, **opts)
    ref, ref_grads = run_reference(E, C, bias, x, **spec_options(opts))
    tol = TOL[dtype]
    assert out.logprob.dtype == out.entropy.dtype == torch.float32 and out.correct.dtype == torch.bool
    torch.testing.assert_close(out.logprob.double(), ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(out.entropy.double(), ref[1], rtol=tol, atol=tol)
    assert torch.equal(out.correct, ref[2])
    assert (out.logprob[IGNORED] == 0).all() and (out.entropy[IGNORED] == 0).all() and not out.correct[IGNORED].any()
    checked = grads[:2] if atomic else grads
    for name, err in zip(("dE", "dC", "db"), errors(checked, ref_grads)):
        assert err < tol, f"{name} rel err {err:.2e}"


@pytest.mark.parametrize("which", ["logprob", "entropy"])
def test_one_output_alone_gets_its_own_gradient(which):
    """A gradient into one output only (the other unused: None in the backward)."""
    E, C, bias, x = make_inputs(torch.float32)
    opts = dict(softcap=3.0, temperature=1.3)
    _, grads = run_outputs(E, C, bias, x, grads=(which,), **opts)
    _, ref_grads = run_reference(E, C, bias, x, grads=(which,), **opts)
    assert max(errors(grads, ref_grads)) < TOL[torch.float32]


def test_logprob_is_minus_the_unreduced_loss_and_shift_and_leading_dims():
    E, C, bias, x = make_inputs(torch.float32)
    out = linear_cross_entropy_outputs(E, C, x, bias=bias, temperature=0.8)
    loss = linear_cross_entropy(E, C, x, bias=bias, temperature=0.8, reduction="none")
    torch.testing.assert_close(out.logprob, -loss, rtol=1e-6, atol=1e-6)
    # (B, T, D) with the causal shift: position t against x[t + 1], the last position ignored.
    E3, x3 = E[:36].reshape(4, 9, D), x[:36].reshape(4, 9)
    shifted = linear_cross_entropy_outputs(E3, C, x3, bias=bias, temperature=0.8, shift=True)
    assert shifted.logprob.shape == shifted.entropy.shape == shifted.correct.shape == (4, 9)
    target = torch.full_like(x3, -100)
    target[:, :-1] = x3[:, 1:]
    ref = reference_outputs(E3.reshape(36, D), C, target.reshape(-1), bias=bias, temperature=0.8)
    torch.testing.assert_close(shifted.entropy.reshape(-1).double(), ref[1], rtol=2e-5, atol=2e-5)
    assert (shifted.entropy[:, -1] == 0).all()


def test_accuracy_ties_count_as_correct():
    """A tie with the maximum counts as correct (the target is among the maxima); below it does not,
    whichever column torch.argmax would pick."""
    E, C, _, x = make_inputs(torch.float32)
    C = C.clone()
    z = E.double() @ C.double().T
    top = z.argmax(dim=1)
    x = top.clone()
    x[IGNORED] = -100
    # Rows 1-4: the target is a second column equal to the argmax's row of C: an exact tie, and the
    # target's index is above or below the argmax's.
    for i, col in zip(range(1, 5), (V - 1, V - 2, 0, 1)):
        if col != top[i]:
            C[col] = C[top[i]]
            x[i] = col
    # Rows 5-6: a target just below the maximum.
    second = z.topk(2, dim=1).indices[:, 1]
    x[5:7] = second[5:7]
    out = linear_cross_entropy_outputs(E, C, x)
    ref = reference_outputs(E, C, x)[2]
    assert torch.equal(out.correct, ref)
    zc = E.double() @ C.double().T
    assert all(zc[i, x[i]] == zc[i].max() for i in range(1, 5)) and out.correct[1:5].all()
    assert not out.correct[5:7].any()
    kept = [i for i in range(7, N) if i not in IGNORED]
    assert out.correct[kept].all()


def test_sparse_runs_gemm_and_says_so():
    E, C, bias, x = make_inputs(torch.float16)
    stats = {}
    out, grads = run_outputs(E, C, bias, x, backward_impl="sparse", stats=stats, temperature=0.9)
    _, ref_grads = run_reference(E, C, bias, x, temperature=0.9)
    assert "entropy" in stats["fallback"]
    assert max(errors(grads, ref_grads)) < TOL[torch.float16]


def test_the_gate_fails_without_the_entropy_term_or_the_temperature_factor(monkeypatch):
    """The comparison above catches a wrong G: the entropy's d S (z - lse) term dropped, or the
    logits' temperature left out of the chain rule (the reference at tau = 1 for our tau)."""
    E, C, bias, x = make_inputs(torch.float32)
    _, ref_grads = run_reference(E, C, bias, x, temperature=0.7)
    original = rows_module.RowGradient.of_outputs.__func__

    def without_d(cls, *args):
        up = original(cls, *args)
        coef = up.coef.clone()
        coef[3] = 0
        return cls(up.w, up.w_rel, up.w_scale, up.uniform, coef)

    monkeypatch.setattr(rows_module.RowGradient, "of_outputs", classmethod(without_d))
    _, grads = run_outputs(E, C, bias, x, temperature=0.7)
    assert min(errors(grads, ref_grads)) > 100 * TOL[torch.float32]
    monkeypatch.undo()
    _, grads = run_outputs(E, C, bias, x, temperature=0.7)
    assert max(errors(grads, ref_grads)) < TOL[torch.float32]
    _, untempered = run_reference(E, C, bias, x)
    assert min(errors(grads, untempered)) > 100 * TOL[torch.float32]


# The loss with a temperature and class weights: every reduction, with the options they combine with.
LOSS_CASES = {
    "weight_mean": dict(weight=True),
    "weight_sum_softcap": dict(weight=True, reduction="sum", softcap=2.5),
    "weight_none_temperature": dict(weight=True, reduction="none", temperature=0.6),
    "temperature_z_loss": dict(temperature=1.7, z_loss=0.05, reduction="none"),
    "temperature_label_smoothing": dict(temperature=0.8, label_smoothing=0.1),
    # torch weights the smoothing term per class; the z-loss stays unweighted (``helpers.cce.class_weights``).
    "weight_smoothing_softcap_z_loss": dict(weight=True, label_smoothing=0.1, softcap=2.5, z_loss=0.05),
    "weight_smoothing_none_temperature": dict(weight=True, reduction="none", label_smoothing=0.3, temperature=0.7),
    "weight_z_loss_sum": dict(weight=True, reduction="sum", z_loss=0.05),
    # Negative weights, as torch and Liger's own tests take them (a sum: a mean's divisor may be ~0).
    "signed_weight_smoothing_sum": dict(weight="signed", reduction="sum", label_smoothing=0.2, softcap=2.5),
    "signed_weight_none": dict(weight="signed", reduction="none"),
}


def class_weight(seed=3, signed=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, generator=g) if signed else torch.rand(V, generator=g) * 2
    w[:5] = 0  # some classes count for nothing
    return w.to(DEVICE)


def run_loss(E, C, bias, x, grad_output, **options):
    E, C, bias = leaves(E, C, bias)
    loss = linear_cross_entropy(E, C, x, bias=bias, **options)
    loss.backward(grad_output.expand_as(loss))
    return loss.detach(), (E.grad, C.grad, bias.grad)


def run_loss_reference(E, C, bias, x, grad_output, **options):
    E, C, bias = leaves(E, C, bias, dtype=torch.float64)
    loss = reference_loss(E, C, x, bias=bias, **options)
    loss.backward(grad_output.double().expand_as(loss))
    return loss.detach(), (E.grad, C.grad, bias.grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LOSS_CASES)
@pytest.mark.parametrize("impl", ["gemm", "sparse"])
def test_loss_with_temperature_and_weights_against_float64(case, dtype, impl):
    opts = dict(LOSS_CASES[case])
    weight = opts.pop("weight", False)
    if weight:
        opts["weight"] = class_weight(signed=weight == "signed")
    E, C, bias, x = make_inputs(dtype, scale=2.0)
    go = upstream(5) if opts.get("reduction") == "none" else torch.tensor(1.7, device=DEVICE)
    stats = {}
    loss, grads = run_loss(E, C, bias, x, go, backward_impl=impl, stats=stats, **opts)
    rloss, rgrads = run_loss_reference(E, C, bias, x, go, **opts)
    tol = TOL[dtype]
    torch.testing.assert_close(loss.double(), rloss, rtol=tol, atol=tol)
    for name, err in zip(("dE", "dC", "db"), errors(grads, rgrads)):
        assert err < tol, f"{name} rel err {err:.2e}"
    if impl == "sparse" and opts.get("temperature", 1.0) != 1.0:
        assert stats["fallback"]  # the first reason given: the temperature's, or fp32's or smoothing's no filter
        if dtype == torch.float16 and "label_smoothing" not in opts:
            assert "temperature" in stats["fallback"]


def test_weighted_loss_atomic_and_the_gate_fails_without_the_weights():
    E, C, _, x = make_inputs(torch.float32)
    w = class_weight()
    go = torch.tensor(1.0, device=DEVICE)
    E1, C1 = leaves(E, C)
    loss = linear_cross_entropy(E1, C1, x, weight=w, backward_impl="atomic", temperature=1.4)
    loss.backward()
    rloss, rgrads = run_loss_reference(E, C, torch.zeros(V, device=DEVICE), x, go, weight=w, temperature=1.4)
    torch.testing.assert_close(loss.double(), rloss, rtol=2e-5, atol=2e-5)
    assert max(errors((E1.grad, C1.grad), rgrads[:2])) < TOL[torch.float32]
    unweighted, ugrads = run_loss_reference(E, C, torch.zeros(V, device=DEVICE), x, go, temperature=1.4)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(loss.detach().double(), unweighted, rtol=2e-5, atol=2e-5)
    assert min(errors((E1.grad, C1.grad), ugrads[:2])) > 100 * TOL[torch.float32]


@pytest.mark.parametrize("impl", ["gemm", "atomic"])
def test_weighted_smoothing_weights_each_class_and_the_gate_fails_without(impl):
    """Class weights with label smoothing: torch weights the smoothing term by class, sum_c w_c (lse - z_c),
    so a row is not w_{x_i} times the unweighted smoothed row. Ours matches torch (both backwards: G's
    smoothing term carries w_v); the row-scaled loss it replaced misses the same tolerance."""
    E, C, bias, x = make_inputs(torch.float32, scale=2.0)
    w = class_weight()
    go = torch.tensor(1.0, device=DEVICE)
    opts = dict(weight=w, label_smoothing=0.4, softcap=2.5, z_loss=0.01)
    E1, C1 = leaves(E, C)
    loss = linear_cross_entropy(E1, C1, x, bias=bias, backward_impl=impl, **opts)
    loss.backward()
    rloss, rgrads = run_loss_reference(E, C, bias, x, go, **opts)
    torch.testing.assert_close(loss.detach().double(), rloss, rtol=2e-5, atol=2e-5)
    assert max(errors((E1.grad, C1.grad), rgrads[:2])) < TOL[torch.float32]
    # The row-scaled form: w_{x_i} times the unweighted row, reduced by the kept weights.
    E2, C2 = leaves(E, C, dtype=torch.float64)
    rows = reference_loss(E2, C2, x, bias=bias.double(), reduction="none", label_smoothing=0.4, softcap=2.5)
    kept = x != -100
    t = torch.where(kept, w.double()[torch.where(kept, x, 0)], 0.0)
    scaled = (rows * t).sum() / t.sum()
    scaled.backward()
    assert abs(float(scaled.detach()) - float(rloss)) > 100 * 2e-5 * abs(float(rloss))
    assert min(errors((E1.grad, C1.grad), (E2.grad, C2.grad))) > 100 * TOL[torch.float32]


@pytest.mark.parametrize("target", [V, -3])
def test_weighted_smoothing_names_a_bad_target(target):
    """The weighted rows are made in the forward, before the targets' range is read: a target outside
    [0, V) must still get the loss's own error (not an index error, a device assert on a GPU)."""
    E, C, _, x = make_inputs(torch.float32)
    x[5] = target
    with pytest.raises(ValueError, match=f"x holds target {target}, outside"):
        linear_cross_entropy(E, C, x, weight=class_weight(), label_smoothing=0.1)


def test_weighted_smoothing_is_refused_under_compile_by_name(monkeypatch):
    """The custom op's schema carries no class weights: a traced call says so instead of dropping them."""
    E, C, _, x = make_inputs(torch.float32)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match="weight with label_smoothing is not supported under torch.compile"):
        linear_cross_entropy(E, C, x, weight=class_weight(), label_smoothing=0.1)


@pytest.mark.parametrize("options", [{}, dict(label_smoothing=0.1, z_loss=0.01)], ids=["weight", "smoothing_z_loss"])
def test_weighted_mean_over_no_kept_token_is_nan_with_zero_gradients_as_torch(options):
    E, C, bias, x = make_inputs(torch.float32)
    x = torch.full_like(x, -100)
    opts = dict(weight=class_weight(), **options)
    loss, grads = run_loss(E, C, bias, x, torch.tensor(1.0, device=DEVICE), **opts)
    rloss, rgrads = run_loss_reference(E, C, bias, x, torch.tensor(1.0, device=DEVICE), **opts)
    assert math.isnan(float(loss)) and math.isnan(float(rloss))
    assert all((g == 0).all() for g in grads) and all((g == 0).all() for g in rgrads)


@pytest.mark.parametrize("temperature", [0, -1.0, float("nan"), float("inf"), "1", True, None])
def test_bad_temperature_is_named(temperature):
    E, C, bias, x = make_inputs(torch.float32)
    for call in (linear_cross_entropy, linear_cross_entropy_outputs):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            call(E, C, x, temperature=temperature)


@pytest.mark.parametrize("weight, options, error, match", [
    (torch.ones(V - 1), {}, ValueError, r"weight must have shape \(V,\) = \(257,\)"),
    (torch.ones(V, 1), {}, ValueError, "weight must have shape"),
    (torch.ones(V, dtype=torch.int64), {}, TypeError, "weight must be a floating-point tensor"),
    ([1.0] * V, {}, TypeError, "weight must be None or a torch.Tensor"),
    (torch.full((V,), float("inf")), {}, ValueError, r"weight must hold finite weights \(no NaN or inf\)"),
    (torch.full((V,), float("nan")), {}, ValueError, r"weight must hold finite weights \(no NaN or inf\)"),
    # torch refuses it too; with label smoothing its gradient came out wrong, without a loss that needed none
    (torch.ones(V), dict(requires_grad=True, label_smoothing=0.2), ValueError, "weight must not require grad"),
    (torch.ones(V), dict(requires_grad=True, reduction="sum"), ValueError, "weight must not require grad"),
])
def test_bad_weight_is_named(weight, options, error, match):
    E, C, _, x = make_inputs(torch.float32)
    weight = weight.to(DEVICE) if isinstance(weight, torch.Tensor) else weight  # a device check comes first
    options = dict(options)  # the parametrized dict stays as it was
    if options.pop("requires_grad", False):
        weight.requires_grad_(True)
    with pytest.raises(error, match=match):
        linear_cross_entropy(E, C, x, weight=weight, **options)


def test_a_weight_that_requires_grad_is_taken_where_grad_is_off():
    """As torch: an nn.Parameter of class weights in an evaluation loop (no_grad) is fine."""
    E, C, _, x = make_inputs(torch.float32)
    weight = torch.rand(V, device=DEVICE).requires_grad_(True)
    with torch.no_grad():
        got = linear_cross_entropy(E, C, x, weight=weight)
    torch.testing.assert_close(got, linear_cross_entropy(E, C, x, weight=weight.detach()))


def test_outputs_refuse_what_they_cannot_do():
    E, C, bias, x = make_inputs(torch.float32)
    with pytest.raises(ValueError, match="backward_impl must be one of"):
        linear_cross_entropy_outputs(E, C, x, backward_impl="fast")
    with pytest.raises(ValueError, match='the "atomic" backward has no db'):
        linear_cross_entropy_outputs(E, C, x, bias=bias.requires_grad_(True), backward_impl="atomic")
    with pytest.raises(TypeError, match="unexpected keyword argument 'label_smoothing'"):
        linear_cross_entropy_outputs(E, C, x, label_smoothing=0.1)
