"""What a trainer needs from linear_cross_entropy: (..., D) inputs, the causal shift, a bias, the
per-token lse (differentiable), gradients only for what requires them, and the module form; each
against the float64 spec, in fp32 and fp16 (the Triton interpreter's dtypes)."""

import pytest
import torch

import helpers.cce.backward as backward_module
from helpers.cce import LinearCrossEntropy, linear_cross_entropy
from helpers.cce.kernels.configs import tier
from helpers.compare.inputs import make_inputs
from helpers.spec import reference_loss, relative_error

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
DTYPES = [torch.float32, torch.float16]
# CPU tensors under the Triton interpreter: where a GPU is present the interpreter is off and our
# kernels refuse CPU tensors, so these run on the CPU only (on a GPU scripts/gpu/cce_check.py checks
# the options' matrix, not these API forms).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the Triton interpreter)")


def inputs(dtype, B=2, T=9, V=97, D=24, seed=0):
    E, C, x = make_inputs(B * T, V, D, torch.float32, regime="uniform", seed=seed)
    bias = torch.randn(V, generator=torch.Generator().manual_seed(seed + 7))
    x[3] = -100
    return E.reshape(B, T, D).to(dtype), C.to(dtype), x.reshape(B, T), bias.to(dtype)


def reference(E, C, x, bias=None, grad_output=1.0, lse_weight=0.0, **options):
    """(loss, lse, dE, dC, db) in float64 by autograd, with ``lse_weight * mean(lse^2)`` added to the
    loss (a caller's z-loss on the returned lse) when lse_weight is given."""
    E64 = E.detach().double().reshape(-1, E.shape[-1]).requires_grad_(True)
    C64 = C.detach().double().requires_grad_(True)
    b64 = bias.detach().double().requires_grad_(True) if bias is not None else None
    loss = reference_loss(E64, C64, x.reshape(-1), bias=b64, **options)
    z = E64 @ C64.T + (b64 if b64 is not None else 0)
    if options.get("softcap"):
        z = options["softcap"] * torch.tanh(z / options["softcap"])
    lse = torch.logsumexp(z, dim=1)
    total = (loss * torch.as_tensor(grad_output, dtype=torch.float64)).sum() + lse_weight * (lse**2).mean()
    total.backward()
    return (loss.detach(), lse.detach(), E64.grad.reshape(E.shape), C64.grad,
            b64.grad if b64 is not None else None)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_leading_dimensions_bias_and_shift(dtype, reduction):
    E, C, x, bias = inputs(dtype)
    Eg, Cg, bg = leaves(E, C, bias)
    loss = linear_cross_entropy(Eg, Cg, x, bias=bg, reduction=reduction, shift=True, softcap=20.0)
    go = torch.randn(x.shape) if reduction == "none" else torch.tensor(1.3)
    (loss * go).sum().backward()
    # The spec on the shifted targets: position t scored against x[:, t + 1], the last ignored.
    shifted = torch.full_like(x, -100)
    shifted[:, :-1] = x[:, 1:]
    ref_loss, _, rdE, rdC, rdb = reference(E, C, shifted, bias, go.double().reshape(-1) if reduction == "none"
                                           else go.double(), reduction=reduction, softcap=20.0)
    assert loss.shape == (x.shape if reduction == "none" else ())
    assert relative_error(loss.reshape(-1), ref_loss.reshape(-1)) < TOL[dtype]
    assert Eg.grad.shape == E.shape and Eg.grad.dtype == dtype and bg.grad.dtype == dtype
    for got, want in ((Eg.grad, rdE), (Cg.grad, rdC), (bg.grad, rdb)):
        assert relative_error(got, want) < TOL[dtype], relative_error(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_with_the_filter_the_sort_and_several_chunks(dtype):
    from helpers.cce.options import resolve_configs

    # 3 row chunks x 4 vocabulary chunks
    configs = resolve_configs(None, torch.device("cpu")).tuned(gemm_chunks=(7, 32))
    E, C, x, bias = inputs(dtype)
    Eg, Cg, bg = leaves(E, C, bias)
    linear_cross_entropy(Eg, Cg, x, bias=bg, sort_vocab=True, filter_eps=None, configs=configs).backward()
    _, _, rdE, rdC, rdb = reference(E, C, x, bias)
    for got, want in ((Eg.grad, rdE), (Cg.grad, rdC), (bg.grad, rdb)):
        assert relative_error(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backward_impl", ["gemm", "atomic"])
def test_the_returned_lse_is_right_and_differentiable(dtype, backward_impl):
    E, C, x, _ = inputs(dtype)
    Eg, Cg = leaves(E, C)
    loss, lse = linear_cross_entropy(Eg, Cg, x, return_lse=True, z_loss=1e-3, backward_impl=backward_impl)
    (loss + 0.5 * (lse**2).mean()).backward()  # a caller's own z-loss on the lse
    ref_loss, ref_lse, rdE, rdC, _ = reference(E, C, x, z_loss=1e-3, lse_weight=0.5)
    assert lse.shape == x.shape and lse.dtype == torch.float32
    assert relative_error(lse.reshape(-1), ref_lse) < 1e-6
    assert relative_error(loss, ref_loss) < TOL[dtype]
    assert relative_error(Eg.grad, rdE) < TOL[dtype] and relative_error(Cg.grad, rdC) < TOL[dtype]


@pytest.mark.parametrize("backward_impl", ["gemm", "atomic", "sparse"])
def test_a_class_id_as_ignore_index_keeps_the_lse_gradient_of_its_column(backward_impl):
    """ignore_index=0 is a class (torch allows it): at an ignored row the lse's gradient reaches every
    column, column 0 among them. (The forward gave such a row no target; G gave column 0 the target's
    coefficient, 0 there, so dE and dC lost S_i0 of the lse's gradient.)"""
    E, C, x, _ = inputs(torch.float32)
    x = torch.where(x < 0, 5, x)
    x[0, 1], x[1, 4] = 0, 0  # ignored rows: their target is ignore_index, class 0
    Eg, Cg = leaves(E, C)
    stats = {}
    # "sparse" at this size and density (no minimum of pairs, no dense hand-over), with a filter far below
    # G's entries (fp32's "auto" is off)
    sparse = dict(filter_eps=1e-9, configs=tier("interpreter").tuned(sparse_min_pairs=0, dense_fallback=1.01),
                  stats=stats)
    loss, lse = linear_cross_entropy(Eg, Cg, x, ignore_index=0, return_lse=True, backward_impl=backward_impl,
                                     **(sparse if backward_impl == "sparse" else dict(filter_eps=None)))
    (loss + 0.5 * (lse**2).mean()).backward()
    assert backward_impl != "sparse" or stats["backward"] == "sparse", stats
    ref_loss, ref_lse, rdE, rdC, _ = reference(E, C, x, ignore_index=0, lse_weight=0.5)
    assert relative_error(lse.reshape(-1), ref_lse) < 1e-6 and relative_error(loss, ref_loss) < 2e-5
    assert relative_error(Eg.grad, rdE) < 2e-5 and relative_error(Cg.grad, rdC) < 2e-5


def test_leading_dimensions_count_as_rows_for_the_plan():
    """"auto" decides on N = B T rows, as for the flattened call (it counted B (row, tile) pairs, and the
    plan's key took T for D); one token of shape (D,) with a 0-d target is one row, as torch takes it."""
    E, C, x, _ = inputs(torch.float16)
    said = []
    for e, t in ((E, x), (E.reshape(-1, E.shape[-1]), x.reshape(-1))):
        stats = {}
        linear_cross_entropy(e.clone().requires_grad_(True), C, t, stats=stats).backward()
        said.append(stats["auto"])
    assert said[0] == said[1], said
    Eg, Cg = leaves(E[0, 0].float(), C.float())
    loss = linear_cross_entropy(Eg, Cg, x[0, 0])
    loss.backward()
    ref_loss, _, rdE, rdC, _ = reference(E[0, 0].float()[None], C.float(), x[0, 0][None])
    assert relative_error(loss, ref_loss) < 2e-5 and relative_error(Eg.grad[None], rdE) < 2e-5
    with pytest.raises(ValueError, match="shift=True needs targets with a sequence dimension"):
        linear_cross_entropy(Eg, Cg, x[0, 0], shift=True)


def test_only_the_lse_used_still_backpropagates():
    E, C, x, _ = inputs(torch.float32)
    Eg, Cg = leaves(E, C)
    _, lse = linear_cross_entropy(Eg, Cg, x, return_lse=True)
    lse.sum().backward()
    E64, C64 = E.double().reshape(-1, E.shape[-1]).requires_grad_(True), C.double().requires_grad_(True)
    torch.logsumexp(E64 @ C64.T, dim=1).sum().backward()
    assert relative_error(Eg.grad.reshape(-1, E.shape[-1]), E64.grad) < 1e-5
    assert relative_error(Cg.grad, C64.grad) < 1e-5


@pytest.mark.parametrize("which", ["E", "C", "bias"])
def test_only_the_gradients_asked_for_are_computed(which, monkeypatch):
    asked = []
    real = backward_module.backward_gemm
    monkeypatch.setattr(backward_module, "backward_gemm",
                        lambda *args, **kw: asked.append(args[-1]) or real(*args, **kw))
    E, C, x, bias = inputs(torch.float32)
    tensors = {"E": E, "C": C, "bias": bias}
    tensors[which] = tensors[which].clone().requires_grad_(True)
    linear_cross_entropy(tensors["E"], tensors["C"], x, bias=tensors["bias"]).backward()
    assert asked == [(which == "E", which == "C", which == "bias")]
    _, _, rdE, rdC, rdb = reference(E, C, x, bias)
    want = {"E": rdE, "C": rdC, "bias": rdb}[which]
    assert relative_error(tensors[which].grad, want) < TOL[torch.float32]
    assert all(t.grad is None for name, t in tensors.items() if name != which)


def test_the_module_form():
    E, C, x, bias = inputs(torch.float32)
    loss_fn = LinearCrossEntropy(shift=True, reduction="sum")
    assert "shift=True" in repr(loss_fn)
    torch.testing.assert_close(loss_fn(E, C, x, bias), linear_cross_entropy(E, C, x, bias=bias, shift=True,
                                                                            reduction="sum"))
    with pytest.raises(ValueError, match="call time"):
        LinearCrossEntropy(C=C)


@pytest.mark.parametrize("call, message", [
    (lambda E, C, x, b: linear_cross_entropy(E, C, x[:, :-1]), "x must have E's leading shape"),
    (lambda E, C, x, b: linear_cross_entropy(E, C, x, bias=b[:-1]), "bias must be"),
    (lambda E, C, x, b: linear_cross_entropy(E, C, x, bias=b.double()), "bias must have C's dtype"),
    (lambda E, C, x, b: linear_cross_entropy(E, C, x, shift=1), "shift and return_lse must be True or False"),
    (lambda E, C, x, b: linear_cross_entropy(E, C, x, bias=b.requires_grad_(True), backward_impl="atomic"),
     "needs backward_impl"),
    # Each once reached a kernel or the planner, or ran with a silent meaning:
    (lambda E, C, x, b: linear_cross_entropy(E, C, x, ignore_index=10**20), "ignore_index must fit in int64"),
    (lambda E, C, x, b: linear_cross_entropy(E, C, x.int(), ignore_index=2**32 - 100),
     r"ignore_index=4294967196 does not fit x's dtype \(int32\)"),
    (lambda E, C, x, b: linear_cross_entropy(E, C, x, configs=3), "configs must be None, a tier's name or a CCEConfigs"),
    (lambda E, C, x, b: linear_cross_entropy(E, C, x, label_smoothing=True), "label_smoothing must be a number"),
    (lambda E, C, x, b: linear_cross_entropy(E, C, x, z_loss=float("inf")), "z_loss must be a finite number"),
    (lambda E, C, x, b: linear_cross_entropy(E, C, x, z_loss=-1.0, weight=torch.ones(C.shape[0])),
     "z_loss must be a finite number"),  # class weights route the z-loss around the kernels' check
    (lambda E, C, x, b: linear_cross_entropy(E, C, x, filter_eps=float("inf")), "filter_eps must be 'auto', None or a "
     "finite number"),  # inf skipped every tile: every gradient 0
])
def test_bad_arguments_are_named(call, message):
    E, C, x, bias = inputs(torch.float32)
    with pytest.raises((ValueError, TypeError), match=message):
        call(E, C, x, bias)
