"""The specification: its options against torch and against its own closed form, and the one
relative-error function everything reports."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers.compare.inputs import make_inputs
from helpers.spec import reference_loss, reference_loss_and_grads, reference_outputs, relative_error

OPTION_CASES = {
    "mean": dict(),
    "sum, ignored": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "softcap": dict(softcap=3.0),
    "z-loss": dict(z_loss=1e-3),
    "label smoothing": dict(label_smoothing=0.2),
    "everything": dict(reduction="none", softcap=5.0, z_loss=1e-3, label_smoothing=0.1, ignore_index=-1),
}


def inputs(ignore_index=-100):
    E, C, x = make_inputs(23, 97, 12, torch.float64, regime="uniform", seed=3)
    x[::5] = ignore_index
    return E, C, x


@pytest.mark.parametrize("options", OPTION_CASES.values(), ids=OPTION_CASES)
def test_the_chunked_closed_form_is_the_autograd_spec(options):
    E, C, x = inputs(options.get("ignore_index", -100))
    go = torch.randn(23, dtype=torch.float64) if options.get("reduction") == "none" else torch.tensor(0.7)
    chunked = reference_loss_and_grads(E, C, x, go, chunk_rows=4, **options)
    autograd = reference_loss_and_grads(E, C, x, go, **options)
    for got, want in zip(chunked, autograd):
        assert relative_error(got, want) < 1e-12


def test_label_smoothing_and_z_loss_follow_their_definitions():
    E, C, x = inputs()
    z = E @ C.T
    kept = x != -100
    lse = torch.logsumexp(z, 1)
    rows = lse - 0.8 * z.gather(1, x.clamp(min=0)[:, None])[:, 0] - 0.2 * z.mean(1) + 1e-3 * lse**2
    want = torch.where(kept, rows, 0.0).sum() / kept.sum()
    got = reference_loss(E, C, x, label_smoothing=0.2, z_loss=1e-3)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(reference_loss(E, C, x, label_smoothing=0.2),
                               F.cross_entropy(z, x, label_smoothing=0.2))


def test_relative_error_handles_nan_positions_zero_references_and_shapes():
    r = torch.tensor([1.0, float("nan"), 2.0])
    assert relative_error(torch.tensor([1.0, float("nan"), 2.0]), r) == 0.0
    assert relative_error(torch.tensor([1.0, 0.0, 2.0]), r) == math.inf  # a NaN gone missing
    assert relative_error(torch.tensor([1.0, float("nan"), float("inf")]), r) == math.inf
    assert relative_error(torch.tensor([0.0, 3.0]), torch.zeros(2)) == 3.0  # ||a - r|| when r is 0
    big = torch.randn(20_000, 3)
    assert relative_error(big * 1.01, big, chunk_rows=1000) == pytest.approx(0.01, rel=1e-6)
    with pytest.raises(ValueError, match="one shape"):
        relative_error(torch.zeros(2), torch.zeros(3))


def test_relative_error_over_sequences_is_the_error_of_their_concatenation():
    g = torch.Generator().manual_seed(0)
    refs = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g), torch.randn(2, 4, 6, generator=g)]
    got = [r + 0.01 * torch.randn(r.shape, generator=g) for r in refs]
    flat = relative_error(torch.cat([t.reshape(-1) for t in got]), torch.cat([t.reshape(-1) for t in refs]))
    assert relative_error(got, refs) == pytest.approx(flat, rel=1e-12)
    assert relative_error(tuple(got), tuple(refs), chunk_rows=2) == pytest.approx(flat, rel=1e-12)
    got[1] = got[1].clone()
    got[1][0] = float("inf")
    assert relative_error(got, refs) == math.inf  # one bad tensor spoils the whole
    with pytest.raises(ValueError, match="one length"):
        relative_error(got[:2], refs)
    with pytest.raises(ValueError, match="sequences"):
        relative_error(got[0], refs)


def test_temperature_weight_and_outputs_follow_their_definitions():
    """The temperature divides the capped logits; the weight is torch's; the outputs are
    log_softmax at the target, lse - sum p z, and the target among the maxima (ties included)."""
    E, C, x = make_inputs(19, 53, 8, torch.float64, "cpu", regime="uniform", seed=2)
    x[[1, 4]] = -100
    z = 2.0 * torch.tanh((E @ C.T) / 2.0) / 0.6
    w = torch.rand(53, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for reduction in ("mean", "sum", "none"):
        got = reference_loss(E, C, x, softcap=2.0, temperature=0.6, weight=w, reduction=reduction)
        torch.testing.assert_close(got, F.cross_entropy(z, x, weight=w, reduction=reduction))
    kept = x != -100
    rows = kept.nonzero()[:, 0]
    mean = (w[x[rows]] * (torch.logsumexp(z[rows], 1) - z[rows, x[rows]])).sum() / w[x[rows]].sum()
    torch.testing.assert_close(reference_loss(E, C, x, softcap=2.0, temperature=0.6, weight=w), mean)
    logprob, entropy, correct = reference_outputs(E, C, x, softcap=2.0, temperature=0.6)
    lse = torch.logsumexp(z, 1)
    p = torch.softmax(z, 1)
    torch.testing.assert_close(entropy[rows], (lse - (p * z).sum(1))[rows])
    torch.testing.assert_close(logprob[rows], (z[rows, x[rows]] - lse[rows]))
    assert (entropy[~kept] == 0).all() and (logprob[~kept] == 0).all() and not correct[~kept].any()
    assert torch.equal(correct[rows], z[rows].argmax(1) == x[rows])
    # Class weights with label smoothing and the z-loss: torch weights the smoothing term per class; the
    # z-loss is unweighted, a mean dividing it by the kept count (Liger's definition).
    eps, zl = 0.3, 0.1
    t = w[x[rows]]
    lse_kept = torch.logsumexp(z[rows], 1)
    smoothed = (1 - eps) * t * (lse_kept - z[rows, x[rows]]) + eps / 53 * (w * (lse_kept[:, None] - z[rows])).sum(1)
    expected = smoothed.sum() / t.sum() + zl * (lse_kept**2).sum() / len(rows)
    got = reference_loss(E, C, x, softcap=2.0, temperature=0.6, weight=w, label_smoothing=eps, z_loss=zl)
    torch.testing.assert_close(got, expected)
    C[x[0]] = C[z[0].argmax()]  # a tie at row 0: the target is among the maxima
    assert reference_outputs(E, C, x, softcap=2.0, temperature=0.6)[2][0]


def test_the_soft_caps_slope_holds_where_one_minus_tanh_squared_rounds_to_zero():
    from helpers.spec import softcap_slope

    a = torch.linspace(-60, 60, 12001, dtype=torch.float64)
    want = 1 / torch.cosh(a) ** 2
    assert ((softcap_slope(a, 1.0) - want).abs() / want).max() < 1e-14
    deep = torch.tensor([20.0, -25.0], dtype=torch.float64)
    assert (1 - torch.tanh(deep) ** 2 == 0).all() and (softcap_slope(deep, 1.0) > 0).all()
    assert softcap_slope(torch.tensor([0.0], dtype=torch.float64), 3.0).item() == 1.0
