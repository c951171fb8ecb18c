"""Distillation's divergence without logits: ``helpers.cce.distill.linear_kl_div`` against float64.

``linear_kl_div`` against ``helpers.spec.reference_kl_div`` (``F.kl_div`` on float64 logits): the loss
and dE_s, dC_s, db_s, for every kind (forward KL, reverse KL, JSD), in fp32 and fp16 under the Triton
interpreter (bf16 is wrong there; ``scripts/gpu/distill_check.py`` covers the GPU), on an irregular
shape (N=37, V=257, D_s=24, D_t=40) with a temperature, a soft cap, both biases, ignored tokens and
every reduction. Most cases run with wider tiles than the interpreter tier's (``WIDE``: the
interpreter's time is per tile; still several row blocks, vocabulary splits and a partial last tile);
one runs the tier's own tiles with 16 x 16 G chunks (G in the buffer, several row chunks). Each gate
is shown able to fail: the same comparison with the reverse KL's or the JSD's row term dropped from G,
or the teacher's lse off by two in the backward, or the wrong kind, temperature or soft cap in the
reference, misses the tolerance. A tiny training loop distils a fixed teacher into a student.
"""

import math
import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import helpers.cce.distill as distill  # noqa: E402
from helpers.cce import linear_kl_div  # noqa: E402
from helpers.cce.kernels.configs import LaunchConfig, tier  # noqa: E402
from helpers.cce.options import resolve_configs  # noqa: E402
from helpers.spec import DIVERGENCES, reference_kl_div, relative_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, V, D_S, D_T = 37, 257, 24, 40
DTYPES = [torch.float32, torch.float16]
# As tests/cce/test_outputs.py: fp32 is real fp32; fp16 rounds the products' inputs and G to 11 bits.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
IGNORED = [0, 7, 36]
_WIDE = LaunchConfig(32, 128, 32, 1, 1, GROUP_N=2)
# The interpreter tier with 32 x 128 tiles (64 columns in the two-tile kernels): 2 row blocks, 5 tiles a row.
WIDE = (replace(tier("interpreter"), forward={2: _WIDE, 4: _WIDE}, backward_gemm={2: _WIDE, 4: _WIDE})
        if DEVICE == "cpu" else None)


def make_inputs(dtype, seed=0):
    """A student and a teacher that disagree (the teacher's logits twice the scale), biases, targets."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)

    E_s, C_s = randn(N, D_S, scale=D_S**-0.25), randn(V, D_S, scale=D_S**-0.25)
    E_t, C_t = randn(N, D_T, scale=2 * D_T**-0.25), randn(V, D_T, scale=D_T**-0.25)
    bias_s, bias_t = randn(V, scale=0.5), randn(V, scale=0.5)
    x = torch.randint(0, V, (N,), generator=g)
    x[IGNORED] = -100
    return dict(E_s=E_s, C_s=C_s, E_t=E_t, C_t=C_t, bias_s=bias_s, bias_t=bias_t), x.to(DEVICE)


def upstream(shape, seed=5):
    if not shape:
        return torch.tensor(1.7, device=DEVICE)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def run_ours(heads, biases=True, configs=WIDE, **options):
    """(loss, (dE_s, dC_s, db_s)) of ours; db_s None without ``biases``."""
    E_s, C_s, b_s = (heads[k].detach().clone().requires_grad_(True) for k in ("E_s", "C_s", "bias_s"))
    loss = linear_kl_div(E_s, C_s, heads["E_t"], heads["C_t"], bias_s=b_s if biases else None,
                         bias_t=heads["bias_t"] if biases else None, configs=configs, **options)
    loss.backward(upstream(loss.shape))
    return loss.detach(), (E_s.grad, C_s.grad, b_s.grad)


def run_reference(heads, biases=True, x=None, ignore_index=-100, **options):
    """The same in float64 (``reference_kl_div`` takes a mask: targets become one here)."""
    E_s, C_s, b_s = (heads[k].detach().double().requires_grad_(True) for k in ("E_s", "C_s", "bias_s"))
    if x is not None:
        options["mask"] = (x != ignore_index) & options.get("mask", True)
    loss = reference_kl_div(E_s, C_s, heads["E_t"].double(), heads["C_t"].double(), bias_s=b_s if biases else None,
                            bias_t=heads["bias_t"].double() if biases else None, **options)
    loss.backward(upstream(loss.shape).double())
    return loss.detach(), (E_s.grad, C_s.grad, b_s.grad)


def errors(got, ref):
    return [relative_error(a, r) for a, r in zip(got, ref) if r is not None]


def assert_within_naive(heads, bound, biases=True, **options):
    """Ours' fp32 gradients (dE_s, dC_s and db_s with ``biases``) within ``bound`` times the naive fp32
    path's error against float64 (``reference_kl_div`` on full fp32 logits: torch's log_softmax)."""
    _, grads = run_ours(heads, biases=biases, **options)
    _, ref_grads = run_reference(heads, biases=biases, **options)
    names = ("E_s", "C_s", "bias_s") if biases else ("E_s", "C_s")
    leaves = [heads[k].detach().clone().requires_grad_(True) for k in names]
    bias = dict(bias_s=leaves[2], bias_t=heads["bias_t"]) if biases else {}
    naive = reference_kl_div(leaves[0], leaves[1], heads["E_t"], heads["C_t"], dtype=torch.float32, **bias,
                             **options)
    naive.backward(upstream(naive.shape))
    for name, ours, theirs in zip(["d" + k for k in names], errors(grads[:len(names)], ref_grads[:len(names)]),
                                  errors([t.grad for t in leaves], ref_grads[:len(names)])):
        assert ours < bound * theirs, f"{name}: {ours:.2e} against naive's {theirs:.2e}"


def mask_of(x):
    return x != -100


CASES = {
    # The trainer's labels pick the tokens; no bias, no cap, tau = 1.
    "mean_targets": lambda x: dict(reduction="mean", x=x),
    # Everything at once, each token its own upstream gradient.
    "none_everything": lambda x: dict(reduction="none", mask=mask_of(x), temperature=0.7, softcap=2.5),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_against_float64(kind, case, dtype):
    heads, x = make_inputs(dtype)
    options = dict(CASES[case](x), kind=kind)
    biases = case != "mean_targets"
    loss, grads = run_ours(heads, biases=biases, **options)
    ref, ref_grads = run_reference(heads, biases=biases, **options)
    tol = TOL[dtype]
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    if loss.dim():
        assert (loss[IGNORED] == 0).all()
    assert grads[2] is None if not biases else grads[2] is not None
    for name, err in zip(("dE_s", "dC_s", "db_s"), errors(grads, ref_grads)):
        assert err < tol, f"{name} rel err {err:.2e}"
    assert (grads[0][IGNORED] == 0).all()


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_a_student_deep_in_its_soft_caps_saturation_keeps_its_gradient(kind):
    """The student's pre-cap logits ~12 caps (a bias of 30 under a cap of 2.5), fp32: tanh rounds to 1,
    so 1 - t^2 was 0 and every gradient 0 (relative error 1), while the cap's slope is ~1e-10; formed
    as r (2 - r) from r = 1 - t (``slope_from_gap``) it is kept to fp32's accuracy."""
    heads, x = make_inputs(torch.float32)
    heads["bias_s"] = heads["bias_s"] + 30.0
    options = dict(kind=kind, reduction="sum", softcap=2.5)
    _, grads = run_ours(heads, **options)
    _, ref_grads = run_reference(heads, **options)
    assert ref_grads[0].abs().max() > 1e-12
    for name, err in zip(("dE_s", "dC_s", "db_s"), errors(grads, ref_grads)):
        assert err < 1e-4, f"{name} rel err {err:.2e}"


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_sum_with_a_temperature_and_beta(kind):
    heads, x = make_inputs(torch.float32, seed=1)
    options = dict(kind=kind, reduction="sum", temperature=2.0, beta=0.3, mask=mask_of(x))
    loss, grads = run_ours(heads, **options)
    ref, ref_grads = run_reference(heads, **options)
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=2e-5)
    assert max(errors(grads, ref_grads)) < TOL[torch.float32]


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_a_cold_temperature_keeps_the_naive_paths_accuracy(kind, seed):
    """tau = 0.1, fp32: |s| ~ 50, where one fp32 lse a row (ulp ~4e-6) shifted every log q and the
    gradients erred 2.6-2.9x (forward), 2.8-3.1x (reverse) and 10-14x (JSD) the naive path's (torch in
    fp32, log_softmax's (z - m) - l) against float64; with each head's (m, l) kept apart, K normalised
    by the backward's own sum q and the KLs' sums over the heads' centred gap: at most 1.44x on these seeds."""
    heads, _ = make_inputs(torch.float32, seed=seed)
    assert_within_naive(heads, 2, kind=kind, reduction="sum", temperature=0.1)


@pytest.mark.parametrize("tau", [1.0, 0.1])
def test_a_student_sharper_than_its_flat_teacher_keeps_the_naive_paths_accuracy(tau):
    """The reverse KL with the student's logits 8x the usual scale and the teacher's all but flat, fp32:
    formed from t - s (~1 / tau) its G erred 3-36x the naive path's on the student's top column, where
    the true G is damped by 1 - q; from the heads' centred gap c, as small as their log-probabilities."""
    heads, _ = make_inputs(torch.float32, seed=1)
    heads["E_s"] = heads["E_s"] * 8
    heads["E_t"] = heads["E_t"] * 0.01
    options = dict(kind="reverse", reduction="sum", temperature=tau)
    assert_within_naive(heads, 2, biases=False, **options)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_jsd_weighted_to_the_student_keeps_the_naive_paths_accuracy(seed):
    """beta = 0.1, tau = 2, fp32: M ~ q, so log q/M ~ beta (log p - log q) is small, and formed as
    log q - log M (two numbers of log V's size) the gradient erred 1.8-2.8x the naive path's against
    float64; from g = log p - log q (the centred gap less the log sums' difference) as
    -log(beta e^g + 1 - beta): 0.6-0.8x."""
    heads, _ = make_inputs(torch.float32, seed=seed)
    options = dict(kind="jsd", beta=0.1, temperature=2.0, reduction="sum")
    assert_within_naive(heads, 1.5, biases=False, **options)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_a_jsd_near_zero_keeps_fp32s_relative_precision(beta):
    """A teacher within ~1% of its student: every row's JSD is 2e-6 to 3e-5, a sum of first-order terms
    beta p log p/M + (1 - beta) q log q/M that cancel, which gave rows 3e-3 to 1.5e-2 relative error (the
    naive fp32 path's: 2e-3 to 9e-3). Summed as beta (p log p/M - p + M) + (1 - beta) (q log q/M - q + M),
    each term >= 0 and second order: within 1e-5 of float64, row by row (the logits' own fp32 rounding,
    ~1e-7 of gaps of ~1e-2, leaves about that); the bound is 1e-4."""
    heads, _ = make_inputs(torch.float32, seed=4)
    noise = torch.randn(heads["E_s"].shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    heads["E_t"] = heads["E_s"] + 0.01 * noise * heads["E_s"].std()
    heads["C_t"] = heads["C_s"]
    options = dict(kind="jsd", beta=beta, reduction="none", temperature=1.0)
    loss, _ = run_ours(heads, biases=False, **options)
    ref, _ = run_reference(heads, biases=False, **options)
    assert ref.min() > 0 and ref.max() < 1e-3
    rows = ((loss.double() - ref).abs() / ref).max().item()
    assert rows < 1e-4, f"worst row's relative error {rows:.2e}"


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_a_large_soft_cap_keeps_the_naive_paths_accuracy(kind):
    """Logits of ~1 under a cap of 50, fp32: the cap's 16-bit form, cap (1 - r), carries ~cap x 6e-8 where
    fp32 holds 6e-8 relative, and the gradients erred 2.9-8x the naive path's against float64 (forward
    ~3.5x, reverse ~6x, JSD ~5x: ``scripts/experiments/softcap_precision.py``); fp32 inputs take tanh's
    series below |z| = 0.4 caps (``soft_cap_and_gap``'s PRECISE)."""
    heads, _ = make_inputs(torch.float32, seed=2)
    options = dict(kind=kind, reduction="sum", softcap=50.0)
    assert_within_naive(heads, 2, biases=False, **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the interpreter tier's tiles)")
def test_the_tiers_own_tiles_with_narrow_chunks():
    """The interpreter tier's 16 x 16 tiles (the forward's splits merged; 16-row, 16-column G chunks
    in the buffer, several row chunks folding dC), the JSD in fp16 with every option."""
    heads, x = make_inputs(torch.float16, seed=2)
    configs = resolve_configs(None, torch.device(DEVICE)).tuned(gemm_chunks=(16, 16))
    options = dict(kind="jsd", reduction="none", mask=mask_of(x), temperature=1.3, softcap=3.0)
    stats = {}
    loss, grads = run_ours(heads, configs=configs, stats=stats, **options)
    ref, ref_grads = run_reference(heads, **options)
    torch.testing.assert_close(loss.double(), ref, rtol=3e-3, atol=3e-3)
    assert max(errors(grads, ref_grads)) < TOL[torch.float16]
    assert stats["forward_passes"] == 2 and stats["g_kernels"]["caller"] == stats["launches"] > 3


def _broken(monkeypatch, break_rows):
    """``linear_kl_div`` with its forward's row statistics changed by ``break_rows`` before the backward."""
    original = distill.distill_forward

    def forward(*args, **kwargs):
        return break_rows(original(*args, **kwargs))

    monkeypatch.setattr(distill, "distill_forward", forward)


@pytest.mark.parametrize("kind, break_rows", [
    ("reverse", lambda rows: rows._replace(row_stat=torch.zeros_like(rows.row_stat))),  # G without -KL q
    ("jsd", lambda rows: rows._replace(row_stat=torch.zeros_like(rows.row_stat))),  # G without -K q
    ("forward", lambda rows: rows._replace(norm_t=rows.norm_t + 1.0)),  # p off by a factor e^2 in G
], ids=["reverse_without_kl", "jsd_without_k", "forward_with_p_off"])
def test_the_gradient_gate_fails_with_a_wrong_g(kind, break_rows, monkeypatch):
    heads, x = make_inputs(torch.float32)
    options = dict(kind=kind, mask=mask_of(x), temperature=0.8)
    _, ref_grads = run_reference(heads, **options)
    _broken(monkeypatch, break_rows)
    _, grads = run_ours(heads, **options)
    assert min(errors(grads, ref_grads)) > 100 * TOL[torch.float32]
    monkeypatch.undo()
    _, grads = run_ours(heads, **options)
    assert max(errors(grads, ref_grads)) < TOL[torch.float32]


def test_the_value_and_gradient_gates_fail_with_the_wrong_reference():
    """Ours with a temperature and a soft cap against the reference of another kind, without the
    temperature, or without the cap: each misses the tolerance by far."""
    heads, x = make_inputs(torch.float32)
    options = dict(kind="forward", reduction="none", mask=mask_of(x), temperature=0.7, softcap=2.5)
    loss, grads = run_ours(heads, **options)
    for wrong in (dict(kind="reverse"), dict(temperature=1.0), dict(softcap=None)):
        ref, ref_grads = run_reference(heads, **{**options, **wrong})
        assert relative_error(loss, ref) > 100 * TOL[torch.float32], wrong
        assert min(errors(grads, ref_grads)) > 100 * TOL[torch.float32], wrong


def test_teacher_gets_no_gradient_and_leading_dims():
    """(B, T, D) hidden states; the teacher's tensors require grad and get none; mask and targets
    combine (a token counts where both keep it)."""
    heads, x = make_inputs(torch.float32)
    E_s = heads["E_s"][:36].reshape(4, 9, D_S).clone().requires_grad_(True)
    E_t = heads["E_t"][:36].reshape(4, 9, D_T).clone().requires_grad_(True)
    C_t = heads["C_t"].clone().requires_grad_(True)
    mask = torch.ones(4, 9, dtype=torch.bool, device=DEVICE)
    mask[:, -1] = False
    x3 = x[:36].reshape(4, 9)
    loss = linear_kl_div(E_s, heads["C_s"], E_t, C_t, kind="reverse", reduction="none", mask=mask, x=x3,
                         configs=WIDE)
    assert loss.shape == (4, 9) and (loss[:, -1] == 0).all() and (loss[x3 == -100] == 0).all()
    loss.sum().backward()
    assert E_t.grad is None and C_t.grad is None and E_s.grad is not None
    ref = reference_kl_div(E_s.detach(), heads["C_s"], E_t.detach(), C_t.detach(), kind="reverse",
                           reduction="none", mask=mask & (x3 != -100))
    torch.testing.assert_close(loss.double(), ref.double(), rtol=2e-5, atol=2e-5)


def test_mean_over_no_kept_token_is_nan_with_zero_gradients_as_torch():
    heads, x = make_inputs(torch.float32)
    mask = torch.zeros(N, dtype=torch.bool, device=DEVICE)
    loss, grads = run_ours(heads, kind="jsd", mask=mask)
    ref, ref_grads = run_reference(heads, kind="jsd", mask=mask)
    assert math.isnan(float(loss)) and math.isnan(float(ref))
    assert all((g == 0).all() for g in grads) and all((g == 0).all() for g in ref_grads)


def test_a_student_learns_its_teacher():
    """A few Adam steps on a student's E_s, C_s and bias against a fixed teacher of another width:
    the forward KL falls to a fraction of where it started, and the JSD with it."""
    torch.manual_seed(0)
    n, v, d_s, d_t = 24, 97, 16, 24
    E_t, C_t = torch.randn(n, d_t, device=DEVICE), torch.randn(v, d_t, device=DEVICE) / d_t**0.5
    student = [torch.randn(n, d_s, device=DEVICE).requires_grad_(True),
               (torch.randn(v, d_s, device=DEVICE) / d_s**0.5).requires_grad_(True),
               torch.zeros(v, device=DEVICE, requires_grad=True)]
    optimizer = torch.optim.Adam(student, lr=0.1)
    with torch.no_grad():  # the forward alone
        start_jsd = float(linear_kl_div(*student[:2], E_t, C_t, kind="jsd", bias_s=student[2], configs=WIDE))
    losses = []
    for _ in range(12):
        optimizer.zero_grad()
        loss = linear_kl_div(*student[:2], E_t, C_t, temperature=2.0, bias_s=student[2], configs=WIDE)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        end_jsd = float(linear_kl_div(*student[:2], E_t, C_t, kind="jsd", bias_s=student[2], configs=WIDE))
    assert losses[-1] < 0.3 * losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert end_jsd < 0.5 * start_jsd, (start_jsd, end_jsd)


def _bad(**change):
    heads, x = make_inputs(torch.float32)
    return {**heads, **change}


@pytest.mark.parametrize("change, error, match", [
    (dict(temperature=0), ValueError, "temperature must be a finite number > 0"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number > 0"),
    (dict(temperature=-1.0), ValueError, "temperature must be a finite number > 0"),
    (dict(C_t=torch.zeros(V - 1, D_T)), ValueError, r"C_t must have C_s's vocabulary V = 257"),
    (dict(E_t=torch.zeros(N - 1, D_T)), ValueError, r"E_t must have E_s's leading shape \(37,\)"),
    (dict(C_t=torch.zeros(V, D_T + 1)), ValueError, "E_t and C_t must share the teacher's hidden size"),
    (dict(C_s=torch.zeros(V, D_S + 1)), ValueError, "E_s and C_s must share the student's hidden size"),
    (dict(E_t=torch.zeros(N, D_T, dtype=torch.float16)), TypeError, r"E_t must have E_s's dtype \(torch.float32\)"),
    (dict(C_s=torch.zeros(V, D_S, dtype=torch.float64)), TypeError, "C_s must have E_s's dtype"),
    (dict(E_s=torch.zeros(N, D_S, dtype=torch.float64), C_s=torch.zeros(V, D_S, dtype=torch.float64)), TypeError,
     "E_s must be one of float32, float16, bfloat16"),
    (dict(kind="kl"), ValueError, r"kind must be one of \('forward', 'reverse', 'jsd'\), got 'kl'"),
    (dict(kind="jsd", beta=0.0), ValueError, r"beta must be a number in \(0, 1\) for kind='jsd'"),
    (dict(kind="jsd", beta=1.5), ValueError, r"beta must be a number in \(0, 1\)"),
    (dict(reduction="batchmean"), ValueError, "reduction must be one of"),
    (dict(softcap=-1.0), ValueError, "softcap must be None or a finite positive number"),
    (dict(softcap=float("inf")), ValueError, "softcap must be None or a finite positive number"),
    (dict(softcap=1e-35), ValueError, "softcap must be at least 1e-30"),
    (dict(temperature=1e-40), ValueError, "temperature must be at least 1 / 3.4e"),
    (dict(ignore_index=None, x=torch.zeros(N, dtype=torch.int64)), TypeError, "ignore_index must be an int"),
    (dict(bias_t=torch.zeros(V + 1)), ValueError, r"bias_t must be \(V,\) = \(257,\)"),
    (dict(bias_s=torch.zeros(V, dtype=torch.float16)), TypeError, "bias_s must have E_s's dtype"),
    (dict(mask=torch.ones(N)), TypeError, "mask must hold bool"),
    (dict(mask=torch.ones(N + 1, dtype=torch.bool)), ValueError, r"mask must have E_s's leading shape"),
    (dict(x=torch.zeros(N)), TypeError, "x must hold integer targets"),
    (dict(C_s=torch.zeros(V)), ValueError, r"C_s must be 2-D"),
    (dict(E_t=[[0.0]]), TypeError, "E_t must be a torch.Tensor, got list"),
    (dict(stats=[]), ValueError, "stats must be a dict"),
])
def test_bad_input_is_named(change, error, match):
    args = _bad()
    # On the inputs' device, so that the check under test is the one that answers (a device check comes first).
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()})
    with pytest.raises(error, match=match):
        linear_kl_div(args.pop("E_s"), args.pop("C_s"), args.pop("E_t"), args.pop("C_t"), **args)

