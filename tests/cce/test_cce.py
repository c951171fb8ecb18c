"""Our Triton Cut Cross-Entropy (``helpers.cce``) against the float64 reference, on the CPU.

Runs the kernels under the Triton interpreter in fp32 and fp16 (bf16 is wrong there, see
the GPU check ``scripts/gpu/cce_check.py`` covers it). Shapes are tiny and irregular
(N=37, V=301, D=24 against 16x32x16 tiles) so every kernel sees partial tiles in every dimension.
Both backwards run: "atomic" and "gemm" (the default), forced to 3 row chunks by the
``backward_impl`` fixture, and again with a 16-column budget; ``scripts/gpu/cce_check.py`` checks the
default on a GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import helpers.cce.backward.gemm  # noqa: E402
from helpers.cce.kernels.configs import HostTuning, tier  # noqa: E402
from helpers.cce.kernels.logits import exp_of, slope_from_gap, soft_cap, soft_cap_and_gap  # noqa: E402
from helpers.cce import (  # noqa: E402
    CCEOptions,
    cce_backward,
    cce_forward,
    linear_cross_entropy,
    resolve_options,
    why_unavailable,
)
from helpers.compare.inputs import make_inputs as regime_inputs  # noqa: E402
from helpers.spec import reference_loss_and_grads, relative_error  # noqa: E402
from helpers.compare.heads import GEMMA2, QWEN3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, V, D = 37, 301, 24
DTYPES = [torch.float32, torch.float16]
# Relative L2 error allowed against float64: fp32 is real fp32 (ieee dots); fp16 rounds the
# inputs of each product and G to 11 bits, as the naive fp16 path does.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def make_inputs(dtype, n=N, v=V, d=D, scale=1.0, seed=0, ignore=(), ignore_index=-100):
    """The uniform regime (``helpers.compare.inputs``), E scaled by ``scale`` (a larger scale makes
    the softmax more peaked), with the targets at ``ignore`` ignored."""
    E, C, x = regime_inputs(n, v, d, torch.float32, "cpu", regime="uniform", seed=seed)
    x[list(ignore)] = ignore_index
    return (scale * E).to(dtype).to(DEVICE), C.to(dtype).to(DEVICE), x.to(DEVICE)


def upstream(reduction, n=N, seed=1):
    if reduction == "none":
        return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return torch.tensor(1.7, device=DEVICE)  # a non-1 scalar, so a missing scale shows


@pytest.fixture(params=["atomic", "gemm", "gemm/G_in_dE"])
def backward_impl(request):
    """Each backward in turn; "gemm" with small chunks: 3 row chunks of 16 at N=37, G in dC's and
    dE's unwritten rows (``gemm_plan``) in chunks as wide as those allow, dC staged 64 columns at a
    time, a buffer of 64 where no place has room; "gemm/G_in_dE": a budget of 16 columns (V_c <= D =
    24, below a tile), so chunks narrower than a tile land in the buffer and partial tiles abound."""
    chunks = {"gemm": (16, 64), "gemm/G_in_dE": (16, 16)}.get(request.param)
    return dict(backward_impl=request.param.split("/")[0], configs=tier_with(gemm_chunks=chunks))


def tier_with(**knobs):
    """The interpreter's tier with some host knobs changed (``HostTuning``), on every device: these tests'
    shapes, chunk counts and skipped tiles are its 32-column tiles' (a GPU tier's 256 columns leave
    their 301-column vocabulary no room in place and skip differently); a GPU compiles its kernels
    like any other. The shipped tiers are checked on a GPU by scripts/gpu/cce_check.py and the bench."""
    return tier("interpreter").tuned(**knobs)


def run_ours(E, C, x, grad_output, **options):
    E = E.detach().clone().requires_grad_(True)
    C = C.detach().clone().requires_grad_(True)
    loss = linear_cross_entropy(E, C, x, **options)
    loss.backward(grad_output.expand_as(loss))
    return loss.detach(), E.grad, C.grad


def check(got, ref, dtype, loss_tol=None):
    loss, dE, dC = got
    rloss, rdE, rdC = ref
    assert loss.dtype == torch.float32 and dE.dtype == dtype and dC.dtype == dtype
    tol = loss_tol or TOL[dtype]
    torch.testing.assert_close(loss.double(), rloss, rtol=tol, atol=tol, equal_nan=True)
    assert relative_error(dE, rdE) < TOL[dtype], f"dE rel err {relative_error(dE, rdE):.2e}"
    assert relative_error(dC, rdC) < TOL[dtype], f"dC rel err {relative_error(dC, rdC):.2e}"


# Options the reference spec covers: compared with reference_loss_and_grads.
SPEC_CASES = {
    "mean": dict(),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "ignore_some_mean": dict(ignore=[0, 7, 36]),
    "ignore_some_none": dict(ignore=[0, 7, 36], reduction="none"),
    "ignore_custom_index": dict(ignore=[3, 4], ignore_index=-1, reduction="sum"),
    "softcap": dict(softcap=2.5, scale=4.0),
    "softcap_none": dict(softcap=2.5, scale=4.0, reduction="none"),
    "filter_off": dict(filter_eps=None),
    "filter_eps": dict(filter_eps=2.0**-12),
    "sort_vocab": dict(sort_vocab=True, filter_eps=2.0**-12),
    "kahan": dict(accumulation="kahan"),
    "full_c": dict(full_c=True, filter_eps=2.0**-12),
    "full_e": dict(full_e=True, filter_eps=2.0**-12),
    "int32_targets": dict(int32=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SPEC_CASES)
def test_against_reference(case, dtype, backward_impl):
    opts = dict(SPEC_CASES[case])
    ignore, scale, int32 = opts.pop("ignore", ()), opts.pop("scale", 1.0), opts.pop("int32", False)
    ignore_index = opts.get("ignore_index", -100)
    E, C, x = make_inputs(dtype, scale=scale, ignore=ignore, ignore_index=ignore_index)
    if int32:
        x = x.int()
    go = upstream(opts.get("reduction", "mean"))
    spec = {k: opts[k] for k in ("ignore_index", "reduction", "softcap") if k in opts}
    check(run_ours(E, C, x, go, **backward_impl, **opts),
          reference_loss_and_grads(E, C, x, go, **spec), dtype)


# Options only our formula covers (z-loss, label smoothing), alone and combined with the rest.
EXTRA_CASES = {
    "z_loss": dict(z_loss=0.1),
    "z_loss_none": dict(z_loss=0.1, reduction="none"),
    "label_smoothing": dict(label_smoothing=0.1),
    "label_smoothing_sum": dict(label_smoothing=0.25, reduction="sum"),
    "everything": dict(z_loss=0.05, label_smoothing=0.2, softcap=3.0, ignore=[1, 2, 30],
                       reduction="none", filter_eps=2.0**-14, sort_vocab=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", EXTRA_CASES)
def test_z_loss_and_label_smoothing(case, dtype, backward_impl):
    opts = dict(EXTRA_CASES[case])
    E, C, x = make_inputs(dtype, ignore=opts.pop("ignore", ()))
    go = upstream(opts.get("reduction", "mean"))
    ref_opts = {k: opts[k] for k in ("reduction", "softcap", "z_loss", "label_smoothing") if k in opts}
    check(run_ours(E, C, x, go, **backward_impl, **opts),
          reference_loss_and_grads(E, C, x, go, **ref_opts), dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction, backward_impl):
    """torch: mean over zero kept tokens is NaN with zero gradients; sum is 0; none is zeros."""
    E, C, x = make_inputs(torch.float32, ignore=range(N))
    go = upstream(reduction)
    loss, dE, dC = run_ours(E, C, x, go, reduction=reduction, **backward_impl)
    rloss, rdE, rdC = reference_loss_and_grads(E, C, x, go, reduction=reduction)
    torch.testing.assert_close(loss.double(), rloss, equal_nan=True)
    assert torch.isnan(loss).any().item() == (reduction == "mean")
    assert not dE.any() and not dC.any() and not rdE.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(dtype, backward_impl):
    E, C, x = make_inputs(dtype, n=2 * N, v=V, d=2 * D)
    E_view = E.T.contiguous().T[::2, 1::2]  # (N, D), column-major and strided
    C_view = C[:, ::2]  # (V, D), row stride 2D
    x_view = torch.stack([x[:N], x[N:]], dim=1)[:, 0]  # (N,), stride 2
    assert not (E_view.is_contiguous() or C_view.is_contiguous() or x_view.is_contiguous())
    go = upstream("mean")
    check(run_ours(E_view, C_view, x_view, go, **backward_impl),
          reference_loss_and_grads(E_view, C_view, x_view, go), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("accumulation", ["fp32", "kahan"])
@pytest.mark.parametrize("impl", ["atomic", "gemm"])
def test_chunked_host_paths(dtype, accumulation, impl):
    """Vocabulary splits in the forward, row and vocabulary chunks in the backward, and the sort
    (for "gemm", vocabulary chunks of 100: not a multiple of BLOCK_V, partial tiles in each)."""
    E, C, x = make_inputs(dtype, ignore=[5])
    options = resolve_options(dtype, filter_eps=None, sort_vocab=True, accumulation=accumulation)
    loss_rows, lse, r = cce_forward(E, C, x, options, v_splits=3)
    go = upstream("none")
    dE, dC, _ = cce_backward(E, C, x, lse, r, go, options, n_chunk=16, v_chunk=100, backward_impl=impl)
    rloss, rdE, rdC = reference_loss_and_grads(E, C, x, go, reduction="none")
    torch.testing.assert_close(loss_rows.double(), rloss, rtol=TOL[dtype], atol=TOL[dtype])
    assert relative_error(dE, rdE) < TOL[dtype] and relative_error(dC, rdC) < TOL[dtype]


@pytest.mark.parametrize("impl", ["atomic", "gemm"])
def test_kahan_compensates_the_folds_of_dC(impl):
    """With one-row chunks dC is folded N times: plain rounding loses accuracy, Kahan keeps it."""
    E, C, x = make_inputs(torch.float16, v=64)
    go = upstream("sum")
    errors = {}
    for accumulation in ("fp32", "kahan"):
        options = resolve_options(torch.float16, filter_eps=None, accumulation=accumulation)
        _, lse, r = cce_forward(E, C, x, options)
        grad_rows = go.expand(N).float()
        _, dC, _ = cce_backward(E, C, x, lse, r, grad_rows, options, n_chunk=1, v_chunk=64,
                             backward_impl=impl)
        errors[accumulation] = relative_error(dC, reference_loss_and_grads(E, C, x, go, reduction="sum")[2])
    assert errors["kahan"] < 0.6 * errors["fp32"], errors
    assert errors["kahan"] < TOL[torch.float16]


def peaked_inputs(dtype, d=64, frequent=4, alpha=30.0):
    """Zipf-like data: every row's softmax sits on two of a few frequent tokens (x_i and one more).

    E_i = alpha (C_{x_i} + C_{y_i}) with unit rows of C and x, y drawn from ``frequent`` tokens
    scattered over the vocabulary: z is ~alpha at x and y and ~alpha * 0.2 elsewhere, so S < 1e-6
    outside the frequent tokens' columns and every tile without one is skippable.
    """
    g = torch.Generator().manual_seed(3)
    C = F.normalize(torch.randn(V, d, generator=g), dim=1)
    tokens = torch.randperm(V, generator=g)[:frequent]
    x = tokens[torch.randint(0, frequent, (N,), generator=g)]
    y = tokens[torch.randint(0, frequent, (N,), generator=g)]
    E = alpha * (C[x] + C[y])
    return E.to(dtype).to(DEVICE), C.to(dtype).to(DEVICE), x.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_filter_skips_tiles_when_the_softmax_is_peaked(dtype, backward_impl):
    """The filter must skip tiles on peaked data, more after the vocabulary sort, and stay right."""
    E, C, x = peaked_inputs(dtype)
    go = upstream("none")
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go, reduction="none")
    skipped = {}
    for name, eps, sort in (("off", None, False), ("on", 2.0**-12, False), ("sorted", 2.0**-12, True)):
        options = resolve_options(dtype, filter_eps=eps, sort_vocab=sort)
        _, lse, r = cce_forward(E, C, x, options)
        stats = {}
        dE, dC, _ = cce_backward(E, C, x, lse, r, go, options, stats=stats, **backward_impl)
        skipped[name] = stats["skipped"] / stats["tiles"]
        # What the filter drops is below eps per entry, ~1e-6 here: under fp16's rounding, and a
        # visible 3e-5 in fp32 (where "auto" keeps the filter off).
        tol = TOL[dtype] if eps is None else max(TOL[dtype], 1e-4)
        assert relative_error(dE, rdE) < tol and relative_error(dC, rdC) < tol, (name, relative_error(dE, rdE))
    # 3 row blocks x 10 vocabulary blocks; 4 frequent tokens touch at most 4 vocabulary blocks,
    # and after the sort they share the first one.
    assert skipped["off"] == 0 and skipped["on"] >= 0.5, skipped
    assert skipped["sorted"] >= 0.85 and skipped["sorted"] > skipped["on"], skipped
    print(f"tiles skipped, {dtype}, {backward_impl['backward_impl']}: {skipped}")


def test_filter_keeps_a_flat_softmax_whose_entries_are_each_below_eps(backward_impl):
    """A soft cap flattens the softmax: every entry ~1/V sits under eps, yet together they are the
    whole gradient. Skipping tiles by their largest entry (the paper's rule) dropped them all and
    put dE off by 2.3e-2 on the H200 (soft cap 4, V = 151,936, bf16); the row-mass rule keeps them.
    Here eps = 1e-3 over V = 2,053 (entries ~5e-4) reproduces it at an interpreter-sized shape."""
    E, C, x = make_inputs(torch.float16, n=37, v=2053, d=24)
    go = upstream("mean", n=37)
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go, softcap=0.5)
    _, dE, dC = run_ours(E, C, x, go, softcap=0.5, filter_eps=1e-3, **backward_impl)
    assert relative_error(dE, rdE) < TOL[torch.float16] and relative_error(dC, rdC) < TOL[torch.float16]


def forced(impl):
    """backward_impl=impl, and for "sparse" a tier that runs it whatever the size (no hand-over to "gemm")."""
    if impl != "sparse":
        return dict(backward_impl=impl)
    return dict(backward_impl="sparse", configs=tier_with(dense_fallback=1.0, sparse_min_pairs=0))


def saturated_soft_cap():
    """Pre-cap logits ~35x the cap (|z| ~ 170, softcap 5), one row, fp16: the soft cap's derivative
    1 - tanh^2 shrinks every entry of G, the largest softmax entries most."""
    torch.manual_seed(1)
    E = (torch.randn(1, 33) * 30).half().to(DEVICE)
    C = torch.randn(5003, 33).half().to(DEVICE)
    x = torch.randint(0, 5003, (1,)).to(DEVICE)
    go = upstream("mean", n=1)
    return (E, C, x, go), reference_loss_and_grads(E, C, x, go, softcap=5.0)


def test_a_saturated_soft_cap_without_the_filter_is_as_close_as_fp16_allows():
    (E, C, x, go), (_, rdE, rdC) = saturated_soft_cap()
    _, dE, dC = run_ours(E, C, x, go, softcap=5.0, filter_eps=None, backward_impl="gemm")
    assert relative_error(dE, rdE) < 3e-3 and relative_error(dC, rdC) < 3e-3


@pytest.mark.parametrize("impl", ["gemm", "atomic", "sparse"])
def test_filter_keeps_a_saturated_soft_caps_gradient(impl):
    """The row's whole |G| mass is ~6e-3 here. Judged after the cap's derivative, "auto"'s per-tile
    threshold dropped a few percent of it ("gemm", "atomic": dE 1.9e-2, dC 1.5e-2 relative error; 9e-4
    and 8e-4 with the filter off, the test above); judged before it (``gradient_tile.py``), as close as
    the filter off. "sparse": 2.7e-3 before, 1.9e-3 now (its limit: the test below)."""
    (E, C, x, go), (_, rdE, rdC) = saturated_soft_cap()
    stats = {}
    _, dE, dC = run_ours(E, C, x, go, softcap=5.0, filter_eps="auto", stats=stats, **forced(impl))
    assert stats["backward"] == impl
    assert relative_error(dE, rdE) < 3e-3 and relative_error(dC, rdC) < 3e-3


@pytest.mark.xfail(strict=True, reason="known: sorted, the unsaturated columns fill tiles of their own whose softmax "
                   "mass is below eps, and they carry the row's gradient (README, Caveats)")
def test_sparse_keeps_a_saturated_soft_caps_gradient_at_a_coarser_eps():
    """"sparse" at an explicit eps of 1e-4 on the saturated row: 6.1e-2 (7.4e-2 with the mass taken after
    the cap's derivative); "gemm" and "atomic" 9.2e-4, as with the filter off."""
    (E, C, x, go), (_, rdE, rdC) = saturated_soft_cap()
    _, dE, dC = run_ours(E, C, x, go, softcap=5.0, filter_eps=1e-4, **forced("sparse"))
    assert relative_error(dE, rdE) < 3e-3 and relative_error(dC, rdC) < 3e-3


@pytest.mark.parametrize("impl", ["gemm", "atomic", "sparse"])
def test_a_row_deep_in_the_soft_caps_saturation_keeps_its_gradient(impl):
    """Row 0's pre-cap logits are 11-13 caps: tanh rounds to 1 in fp32, so 1 - t^2 was 0 and the row's
    dE 0 (relative error 1), while the cap's slope is ~1e-10 and torch's float64 dE is not 0. The slope
    formed as r (2 - r) from r = 1 - t (``slope_from_gap``) keeps it; the other rows are unsaturated."""
    torch.manual_seed(0)
    V, D = 300, 16
    C = torch.randn(V, D) / 8
    C[:, 0] = 1.0
    E = torch.randn(4, D)
    E[0] = 0.0
    E[0, 0] = 12.0  # row 0's logits: 12 + C[:, 1] E[0, 1] = 12 (+ what the cap's slope weighs)
    E[0, 1] = 8.0
    x = torch.tensor([3, 7, 11, 19])
    go = upstream("mean", n=4)
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go, softcap=1.0)
    assert rdE[0].abs().max() > 1e-12  # the reference's row is not 0
    stats = {}
    _, dE, dC = run_ours(E.to(DEVICE), C.to(DEVICE), x.to(DEVICE), go, softcap=1.0, filter_eps=1e-7,
                         stats=stats, **forced(impl))
    assert stats["backward"] == impl
    assert relative_error(dE[0:1].cpu(), rdE[0:1]) < 1e-4
    assert relative_error(dE.cpu(), rdE) < 1e-5 and relative_error(dC.cpu(), rdC) < 1e-5


@triton.jit
def cap_kernel(z_ptr, capped_ptr, forward_ptr, slope_ptr, softcap, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(z_ptr + offs, mask=mask, other=0.0)
    capped, gap = soft_cap_and_gap(z, softcap)
    tl.store(capped_ptr + offs, capped, mask=mask)
    tl.store(forward_ptr + offs, soft_cap(z, softcap), mask=mask)
    tl.store(slope_ptr + offs, slope_from_gap(gap), mask=mask)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's arithmetic; on a GPU the saturation tests run the kernels")
@pytest.mark.parametrize("softcap", [1.0, 30.0, 0.37])
def test_the_soft_caps_slope_is_accurate_where_a_logit_can_carry_its_row(softcap):
    """``soft_cap_and_gap`` and ``slope_from_gap`` (every backward's chain rule through the cap), run under the
    interpreter on y = z / softcap from -60 to 60 and the special values: the capped logit has the forward's
    bits (``soft_cap``: the backward's softmax is the forward's) and is within 2e-7 * softcap of float64's;
    for y >= 0, the side where a logit can carry its row's softmax, the slope is within 2e-5 relative of
    float64's 1 / cosh^2 until 2^(z k) overflows (y ~ 44; the exponent's own rounding, 2^-24 of ~2.9 y,
    is most of it); for y < 0 it is within 5e-7 absolute, as 1 - t^2 was (README, Caveats); inf gives 0
    and NaN gives 0."""
    y = torch.cat([torch.linspace(-60, 60, 4001), torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])])
    z = (y * softcap).float()
    capped, forward, slope = (torch.empty_like(z) for _ in range(3))
    cap_kernel[(1,)](z, capped, forward, slope, softcap, z.numel(), BLOCK=4096)
    assert torch.equal(capped[:-2], forward[:-2]) and capped[-2].isnan() and capped[-1] == 0  # the forward's bits
    y64 = z.double() / softcap
    finite = y64.isfinite()
    assert (capped.double() - softcap * torch.tanh(y64))[finite].abs().max() < 2e-7 * softcap
    exact = 1 / torch.cosh(y64) ** 2
    positive = finite & (y64 >= 0) & (y64 < 43)
    assert ((slope.double() - exact)[positive].abs() / exact[positive]).max() < 2e-5
    assert exact[finite & (y64 > 9) & (y64 < 43)].min() > 0 and slope[finite & (y64 > 9) & (y64 < 43)].min() > 0
    assert (slope.double() - exact)[finite & (y64 < 0)].abs().max() < 5e-7
    assert slope[-4] == 0 and slope[-3] == 0 and slope[-2] == 0 and slope[-1] == 1


@triton.jit
def precise_cap_kernel(z_ptr, capped_ptr, forward_ptr, softcap, n, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(z_ptr + offs, mask=mask, other=0.0)
    capped, _ = soft_cap_and_gap(z, softcap, PRECISE)
    tl.store(capped_ptr + offs, capped, mask=mask)
    tl.store(forward_ptr + offs, soft_cap(z, softcap, PRECISE), mask=mask)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's arithmetic; on a GPU the saturation tests run the kernels")
@pytest.mark.parametrize("softcap", [30.0, 2.5])
def test_the_precise_soft_cap_keeps_small_logits_to_fp32s_precision(softcap):
    """The cap's fp32-input form (``soft_cap_and_gap``'s PRECISE): from y = z / softcap = 1e-6 to 50 (both
    signs), the capped logit within 8 x 2^-24 relative of float64's softcap tanh(y) (measured 4.5-5.3, the
    worst just above |y| = 0.4, where the exp form takes over), and ``soft_cap`` gives the same bits. The
    16-bit inputs' form, 1 - r, is ~1e-6 relative at |y| ~ 0.03 (a logit of 1 under a cap of 30) and 1e-1
    at 1e-6, which is why fp32 inputs take the other."""
    y = torch.cat([torch.logspace(-6, 1.7, 3000), -torch.logspace(-6, 1.7, 3000)])
    z = (y * softcap).float()
    reference = softcap * torch.tanh(z.double() / softcap)
    ulps = {}
    for precise in (True, False):
        capped, forward = torch.empty_like(z), torch.empty_like(z)
        precise_cap_kernel[(1,)](z, capped, forward, softcap, z.numel(), PRECISE=precise, BLOCK=8192)
        assert torch.equal(capped, forward)
        ulps[precise] = ((capped.double() - reference).abs() / (reference.abs() * 2.0**-24)).max().item()
    assert ulps[True] < 8 and ulps[False] > 1e3, ulps


@triton.jit
def exp_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, exp_of(tl.load(x_ptr + offs, mask=offs < n), True), mask=offs < n)


def test_the_precise_exp_is_within_an_ulp_everywhere():
    """``exp_of``'s PRECISE form (fp32 operations alone), here and on a GPU (where ``tl.exp`` is ex2.approx of
    a rounded product, off by ~|x| 6e-8 relative): within 1 fp32 ulp of float64's exp over fp32's whole
    range, normal results (measured 0.62 on the interpreter), bit for bit torch's result where exp is
    subnormal or overflows, and exp(-inf) = 0, exp(inf) = inf, exp(nan) = nan."""
    x = torch.cat([torch.linspace(-110.0, 95.0, 400_001), torch.linspace(-1e-3, 1e-3, 2001),
                   torch.tensor([float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 88.72, 88.73, -87.3, -103.9])])
    x = x.float().to(DEVICE)
    y = torch.empty_like(x)
    exp_kernel[(triton.cdiv(x.numel(), 8192),)](x, y, x.numel(), BLOCK=8192)
    exact = torch.exp(x.double())
    normal = (exact > torch.finfo(torch.float32).tiny) & (exact < torch.finfo(torch.float32).max)
    ulps = (y.double() - exact)[normal].abs() / (exact[normal] * torch.finfo(torch.float32).eps)
    assert ulps.max() < 1, ulps.max()
    torch.testing.assert_close(y[~normal], torch.exp(x[~normal]), rtol=0, atol=2 * 2.0**-149, equal_nan=True)
    assert y[-9:-6].tolist()[:2] == [0.0, float("inf")] and y[-7].isnan()


def test_every_exp_a_gradient_takes_can_be_precise():
    """The kernels' exps go through ``exp_of`` (PRECISE for fp32 inputs), all but its own 16-bit form and the
    activity bits' threshold (a bound, not a value): on a GPU a bare ``tl.exp`` of fp32 is ex2.approx of a
    rounded product, ~|x| 6e-8 relative, where torch's softmax keeps ~1 ulp."""
    import glob

    import helpers.cce.kernels as kernels

    allowed = {"logits.py": 1, "lse_forward.py": 2}
    for path in sorted(glob.glob(os.path.join(os.path.dirname(kernels.__file__), "*.py"))):
        with open(path) as f:
            bare = f.read().count("tl.exp(")
        assert bare == allowed.get(os.path.basename(path), 0), (path, bare)


def fp32_ratios(impl, n, v, d, seed, scale=1.0, **options):
    """(dE, dC) errors against float64 of ours (``impl``, no filter) over the naive fp32 path's (torch on the
    full fp32 logits, the cap by ``torch.tanh``): a "sum" with a non-1 upstream gradient."""
    E, C, x = make_inputs(torch.float32, n=n, v=v, d=d, seed=seed, scale=scale)
    go = upstream("sum")
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go, reduction="sum", **options)
    En, Cn = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    z = En @ Cn.T
    if options.get("softcap"):
        z = options["softcap"] * torch.tanh(z / options["softcap"])
    F.cross_entropy(z / options.get("temperature", 1.0), x, reduction="sum").backward(go)
    stats = {}
    filter_eps = 1e-7 if impl == "sparse" else None  # "sparse" is the filter's backward: it drops ~nothing here
    _, dE, dC = run_ours(E, C, x, go, reduction="sum", filter_eps=filter_eps, stats=stats, **options, **forced(impl))
    assert stats["backward"] == impl
    return relative_error(dE, rdE) / relative_error(En.grad, rdE), relative_error(dC, rdC) / relative_error(Cn.grad, rdC)


@pytest.mark.parametrize("impl", ["gemm", "atomic", "sparse"])
def test_a_flat_softmax_keeps_fp32s_gradients_at_the_naive_paths_accuracy(impl):
    """Rows whose target is not confident (p ~ 1/V): the target column's a p - b was formed from the forward's
    non-target mass r as (a - b) - a r, r ~ 1 - 1/V to its relative precision (a sum of V terms over the
    lse: ~1e-6), so ~1e-6 absolute where the naive path's p - 1 rounds at 6e-8: dE erred up to 1.7x and dC
    up to 2.7x the naive fp32 path's. Where r >= 1/2 the backward now takes 1 - exp(z_x - lse)
    (``target_complement``): at most 1.14x on these shapes."""
    for shape in ((64, 1000, 48, 0), (37, 301, 24, 1)):
        ratios = fp32_ratios(impl, *shape)
        assert max(ratios) < 1.4, f"{shape}: dE, dC errors {ratios} times the naive path's"


@pytest.mark.parametrize("impl", ["gemm", "atomic", "sparse"])
def test_large_logits_keep_fp32s_gradients_at_the_naive_paths_accuracy(impl):
    """Logits of rms ~10 (lse ~ 30): one fp32 lse a row, rounded to ulp(lse) / 2 (~1e-6), shifted every
    S = exp(z - lse) of the row, and fp32 dE and dC erred 1.4-2.7x the naive path's, which takes
    (z - m) - log s. The forward now keeps each split's and the merge's rounding (``sum_rounding``; lo
    beside r) and the backward folds exp(-lo) into each row's coefficient.

    On one CPU machine (2026-12-07: torch 2.13.0+cpu, Triton 3.9.0) "sparse" erred 3.5-4.2x the naive path's
    here while "gemm" stayed at 0.65x; on an AMD EPYC with AVX-512 and the same versions (2026-12-08) "sparse"
    is within 0.02 of "gemm" at seeds 0-11 (0.37-1.30x). Not understood, so the failure says where it ran."""
    for seed in (0, 1):
        ratios = fp32_ratios(impl, 48, 301, 32, seed, scale=10.0)
        if max(ratios) >= 1.3:
            import platform

            import numpy

            gemm = fp32_ratios("gemm", 48, 301, 32, seed, scale=10.0)
            where = (f"{platform.processor() or platform.machine()}, torch {torch.__version__} "
                     f"({torch.backends.cpu.get_cpu_capability()}), numpy {numpy.__version__}")
            pytest.fail(f"seed {seed}: dE, dC errors {ratios} times the naive path's (gemm's: {gemm}) on {where}")


@pytest.mark.parametrize("impl", ["gemm", "atomic"])
def test_a_cold_temperature_keeps_fp32s_gradients_at_the_naive_paths_accuracy(impl):
    """At a temperature of 0.1 the forward and the backward each form z / tau and subtract the lse; compiled
    with FMA contraction, the two rounded differently and on an H200 fp32 gradients erred 1.4-2.3x the naive
    path's (``scripts/experiments/exp_precision.py``), while the interpreter (numpy: no contraction) gave
    0.6-0.8x. fp32 inputs now compile without it (``helpers.cce.options.fp_fusion``); this is the check a
    GPU run makes."""
    for seed in (0, 1, 2):
        ratios = fp32_ratios(impl, 48, 301, 32, seed, temperature=0.1)
        assert max(ratios) < 1.5, f"seed {seed}: dE, dC errors {ratios} times the naive path's"


@pytest.mark.parametrize("impl", ["gemm", "atomic", "sparse"])
def test_a_large_soft_cap_keeps_fp32s_gradients_at_the_naive_paths_accuracy(impl):
    """Gemma-2's final cap is 30 (its attention's 50); fp32 logits of ~1 sit at y = z / cap ~ 0.02, where the
    cap's 16-bit form, cap (1 - r), carries ~cap x 6e-8 absolute: dC erred 2.7-2.8x the naive fp32 path's
    against float64 (cap 50). fp32 inputs take tanh's series there (``soft_cap_and_gap``'s PRECISE) in every
    kernel that caps, the forward's, the target logit's and each backward's here (the forward-gradients
    schedule's in tests/cce/test_forward_grads.py): 0.8-0.9x."""
    ratios = fp32_ratios(impl, 48, 301, 32, 3, softcap=50.0)
    assert max(ratios) < 1.5, f"dE, dC errors {ratios} times the naive path's"


def test_every_kernel_caps_its_logits_through_one_function():
    """The forward's capped logits must be the backward's bit for bit (the backward's softmax is exp(z - lse)
    with the forward's lse), so every kernel caps through ``soft_cap`` / ``soft_cap_and_gap``: no kernel
    divides by the cap or calls a tanh of its own (read from the kernels' code, docstrings and comments
    aside)."""
    import ast
    import pathlib

    import helpers.cce.kernels as kernels

    own = []
    for path in sorted(pathlib.Path(kernels.__file__).parent.glob("*.py")):
        if path.name == "logits.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and "softcap" in ast.unparse(node.right):
                own.append(f"{path.name}:{node.lineno} divides by the cap: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("tanh", "tanh_and_gap"):
                own.append(f"{path.name}:{node.lineno} calls {ast.unparse(node.func)}")
    assert not own, own


@pytest.mark.parametrize("impl", ["gemm", "atomic", "sparse"])
def test_an_inf_in_E_under_a_soft_cap_leaves_dE_finite(impl):
    """A soft cap maps an infinite logit to +-cap with a zero derivative: torch's dE is finite. A
    padding column's logit is E . 0 = NaN there; the cap's derivative must be 0 there, not NaN, or the
    on-chip products ("atomic", unsorted "sparse") spread the NaN over the row ("gemm" stores G masked)."""
    torch.manual_seed(0)
    E = torch.randn(8, 16).half()
    C = (torch.randn(100, 16) / 4).half()  # V = 100: every tier's tiles leave padding columns
    x = torch.randint(0, 100, (8,))
    E[0, 0] = float("inf")
    E64 = E.double().requires_grad_(True)
    F.cross_entropy(5.0 * torch.tanh(E64 @ C.double().T / 5.0), x).backward()
    Eg = E.to(DEVICE).requires_grad_(True)
    stats = {}
    linear_cross_entropy(Eg, C.to(DEVICE), x.to(DEVICE), softcap=5.0, filter_eps=1e-3, sort_vocab=False,
                         stats=stats, **forced(impl)).backward()
    assert stats["backward"] == impl
    assert torch.isfinite(E64.grad).all() and torch.isfinite(Eg.grad).all()
    assert relative_error(Eg.grad.cpu(), E64.grad) < 3e-3


@pytest.mark.parametrize("full", ["full_c", "full_e"])
def test_full_c_and_full_e_keep_one_gradient_exact(full, backward_impl):
    """A coarse eps drops real gradient; FullC keeps dC exact (dE filtered), FullE the reverse."""
    E, C, x = make_inputs(torch.float32, scale=2.0)
    go = upstream("mean")
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go)
    _, dE, dC = run_ours(E, C, x, go, filter_eps=0.5, **backward_impl,
                         **{full: True})  # drops real row mass
    exact, filtered = (dC, dE) if full == "full_c" else (dE, dC)
    ref_exact, ref_filtered = (rdC, rdE) if full == "full_c" else (rdE, rdC)
    assert relative_error(exact, ref_exact) < TOL[torch.float32]
    assert relative_error(filtered, ref_filtered) > 100 * TOL[torch.float32]


def test_fp16_accuracy_matches_the_naive_path(backward_impl):
    """fp16 dE and dC within 1.5x of the naive fp16 path's error against float64."""
    E, C, x = make_inputs(torch.float16, n=64, v=1000, d=48)
    go = upstream("mean")
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go)
    En = E.clone().requires_grad_(True)
    Cn = C.clone().requires_grad_(True)
    F.cross_entropy((En @ Cn.T).float(), x).backward(go)
    _, dE, dC = run_ours(E, C, x, go, filter_eps=None, **backward_impl)
    assert relative_error(dE, rdE) <= 1.5 * relative_error(En.grad, rdE)
    assert relative_error(dC, rdC) <= 1.5 * relative_error(Cn.grad, rdC)


@pytest.mark.parametrize("mode", ["rounded", "upcast"])
@pytest.mark.parametrize("n_chunk", [None, 16])
def test_gemm_products_as_on_a_gpu(mode, n_chunk):
    """On the CPU "gemm" makes its products from fp32 copies ("upcast"). On a GPU it uses cuBLAS
    with an fp32 output, or as a fallback ("rounded") fp16 products, and with one row chunk writes
    dC in fp16 straight from the GEMM: the paths run here with "rounded", whose fp16 matmuls stand
    in for cuBLAS's. Rows with different upstream gradients and ignored rows (g_rel E operand)."""
    E, C, x = make_inputs(torch.float16, d=64, ignore=[3, 20])  # D >= BLOCK_V: dE's rows hold a chunk
    go = upstream("none")
    options = resolve_options(torch.float16, filter_eps=None)
    _, lse, r = cce_forward(E, C, x, options)
    stats = {}
    dE, dC, _ = cce_backward(E, C, x, lse, r, go, options, tier_with(product_mode=mode), n_chunk=n_chunk, v_chunk=64,
                             stats=stats, backward_impl="gemm")
    # Chunks at most 64 wide (5 or more a row chunk), G never in a buffer (fp16, dE wanted).
    assert stats["products"] == mode and stats["launches"] >= (3 if n_chunk else 1) * 5
    assert stats["g_places"]["buffer"] == 0 and stats["g_places"]["dE"] + stats["g_places"]["dC"] == stats["launches"]
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go, reduction="none")
    assert relative_error(dE, rdE) < TOL[torch.float16] and relative_error(dC, rdC) < TOL[torch.float16]


@pytest.mark.parametrize("N, V, D, block_v, v_chunk, max_cols, rows_chunk", [
    (8192, GEMMA2.V, GEMMA2.D, 256, 2304, 16_384, 8192),  # the Gemma-2-2B head
    (16_384, QWEN3.V, QWEN3.D, 256, 1024, 8192, 16_384),  # Qwen3, one row chunk
    (131_072, QWEN3.V, QWEN3.D, 256, 2048, 8192, 16_384),  # Qwen3, eight row chunks
    (37, 301, 24, 32, 64, 10_000, 16),  # the tests' shape: D below a tile
    (100, 1031, 64, 16, 48, 100, 32),  # ragged row chunks, a small cap
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("need_dE", [True, False])
@pytest.mark.parametrize("share", [0.0, 0.08])
def test_gemm_plan_keeps_G_where_nothing_is_live(N, V, D, block_v, v_chunk, max_cols, rows_chunk, dtype, need_dE,
                                                 share):
    """Each G chunk of ``gemm_plan`` lies in dE's rows not yet written (from the row chunk's first
    free row), in dC's rows after its own chunk (first row chunk only), or in the buffer; the chunks
    cover the vocabulary in order, tile-aligned but the last; without a buffer share, 16-bit inputs
    with dE wanted never need the buffer when D holds a tile; with one, the buffer and dE's
    accumulator stay within it (or the buffer is the fallback's, ``v_chunk`` wide)."""
    gemm = helpers.cce.backward.gemm
    host = HostTuning(gemm_chunks=(rows_chunk, v_chunk), g_in_place_bytes=max_cols * rows_chunk * dtype.itemsize,
                      g_buffer_lb_share=share, g_chunk_host_us=0.0)  # the host-bound buffer: the next test
    plan = gemm.gemm_plan(N, V, D, dtype, block_v, need_dE=need_dE, host=host)
    lb = (need_dE * N + V) * D * dtype.itemsize
    accumulator = rows_chunk * D * 4 if need_dE and dtype != torch.float32 else 0
    places = set()
    for n0, n1, chunks in plan.row_chunks:
        rows = n1 - n0
        assert [c[0] for c in chunks] == [0] + [c[1] for c in chunks[:-1]] and chunks[-1][1] == V
        for v0, v1, place in chunks:
            cols = v1 - v0
            places.add(place)
            assert v1 == V or cols % block_v == 0 or place == "buffer"
            assert cols <= max(max_cols, v_chunk)
            if place == "dE":
                first_free = n0 if dtype != torch.float32 else n1
                assert need_dE and rows * cols <= (N - first_free) * D
            elif place == "dC":
                assert n0 == 0 and rows * cols <= (V - v1) * D  # after dC[v0:v1], inside dC
            else:
                assert cols <= v_chunk or rows * cols * dtype.itemsize + accumulator <= share * lb
    if dtype != torch.float32 and need_dE and D >= block_v and share == 0:
        assert "buffer" not in places
    assert plan.buffer_elements == 0 or "buffer" in places


@pytest.mark.parametrize("N, chunks_without, chunks_with", [(128, 4, 2), (1024, 9, 5)])
def test_gemm_plan_buffer_ends_the_narrowing_tail(N, chunks_without, chunks_with):
    """With few tokens at the Qwen3 head dC's room halves chunk by chunk (9 G launches at 1,024 tokens);
    the buffer share ends that tail in fewer launches, and the predicted peak stays under 1.1 LB (the
    host-bound rule aside, the next test)."""
    from helpers.cce.schedules import lower_bound_bytes, recompute_extra_bytes

    shipped = tier("hopper-227k").tuned(g_chunk_host_us=0.0)
    lb = lower_bound_bytes(N, QWEN3.V, QWEN3.D, 2)
    for share, want in ((0.0, chunks_without), (shipped.host.g_buffer_lb_share, chunks_with)):
        configs = shipped.tuned(g_buffer_lb_share=share)
        plan = helpers.cce.gemm_plan(N, QWEN3.V, QWEN3.D, torch.bfloat16, configs.backward_gemm_for(torch.bfloat16).BLOCK_V,
                                     host=configs.host)
        assert len(plan.row_chunks[0][2]) == want
        assert recompute_extra_bytes(N, QWEN3.V, QWEN3.D, 2, configs) <= 0.1 * lb


@pytest.mark.parametrize("tier_name, without, at_most", [("hopper-227k", 58, 2), ("ampere-163k", 58, 3),
                                                          ("turing-64k", 52, 52)])
def test_gemm_plan_buffer_where_every_chunk_in_place_is_host_bound(tier_name, without, at_most):
    """Notebook 03's head (N 4,096, V 32,768, D 256): dC's row holds 256 of G's 4,096-row columns, so
    chunks in place are ~1,800 columns, 58 of them, each a fraction of the host's time per chunk on
    the GPU. A buffer for chunks that are not host-bound at the tier's rate, within its cap, takes
    their place: few chunks where the GPU is fast. On a T4 none (its G products on CUDA cores,
    ``triton_tflops``, make each chunk in place ~4x its host time: 13 chunks and a 22 MB buffer when
    they were priced at its tensor cores' rate). Where the widest chunk in place is
    not host-bound (the Qwen3 and Gemma-2-2B heads), the plan is the same with the rule and without;
    on a tiny head the buffer holds at most its share of the whole G."""
    from helpers.cce.schedules import recompute_extra_bytes

    shipped = tier(tier_name)
    dtype = torch.float16 if tier_name.startswith("turing") else torch.bfloat16
    block_v = shipped.backward_gemm_for(dtype).BLOCK_V

    def plan(N, V, D, configs):
        return helpers.cce.gemm_plan(N, V, D, dtype, block_v, host=configs.host,
                                     tensor_cores=shipped.backward_gemm_for(dtype).tensor_cores)

    off = shipped.tuned(g_chunk_host_us=0.0)
    chunks = len(plan(4096, 32_768, 256, shipped).row_chunks[0][2])
    assert len(plan(4096, 32_768, 256, off).row_chunks[0][2]) == without and chunks <= at_most
    accumulator = 4096 * 256 * 4
    assert recompute_extra_bytes(4096, 32_768, 256, 2, shipped) <= shipped.host.g_buffer_max_bytes + 2 * accumulator
    for N, V, D in ((1024, QWEN3.V, QWEN3.D), (16_384, QWEN3.V, QWEN3.D), (8192, GEMMA2.V, GEMMA2.D)):
        assert plan(N, V, D, shipped) == plan(N, V, D, off), (N, V, D)
    # A tiny head (notebook 06's on the CPU, fp32): every chunk in place is host-bound, and the buffer
    # stays within its share of the whole G, not all of it.
    tiny = helpers.cce.gemm_plan(64, 509, 32, torch.float32, shipped.backward_gemm_for(torch.float32).BLOCK_V,
                                 host=shipped.host)
    assert 0 < tiny.buffer_elements <= shipped.host.g_buffer_max_g_share * 64 * 509


@pytest.mark.parametrize("mode", ["rounded", "upcast"])
@pytest.mark.parametrize("dtype, need, n_chunk, share", [
    (torch.float16, (True, True, False), None, 0.0),  # G in dC's rows, then dE's
    (torch.float16, (True, True, False), None, 0.5),  # all three places
    (torch.float16, (True, True, True), 16, 0.0),  # several row chunks: dE's later rows; db
    (torch.float32, (True, True, False), None, 0.0),  # no room in dE: dC's rows, then the buffer
    (torch.float16, (False, True, False), None, 0.0),  # a frozen body: no dE
])
def test_every_place_of_G_gives_the_reference(mode, dtype, need, n_chunk, share):
    """Wide chunks in place (``HostTuning.g_in_place_bytes`` small enough for several), against float64.
    The interpreter's tier on every device: where a chunk fits depends on the tiles' width (a GPU
    tier's 256 columns leave these 701 no room in place)."""
    configs = tier("interpreter").tuned(product_mode=mode, gemm_chunks=(n_chunk or 61, 32),
                                        g_in_place_bytes=61 * 96 * dtype.itemsize, g_buffer_lb_share=share)
    E, C, x = make_inputs(dtype, n=61, v=701, d=64, ignore=[3, 20])
    bias = torch.randn(701, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE) if need[2] else None
    go = upstream("none", n=61)
    options = resolve_options(dtype, filter_eps=None)
    _, lse, r = cce_forward(E, C, x, options, bias=bias)
    stats = {}
    dE, dC, db = cce_backward(E, C, x, lse, r, go, options, configs, stats=stats, backward_impl="gemm", bias=bias,
                              need=need)
    E64, C64 = E.double().requires_grad_(need[0]), C.double().requires_grad_(True)
    b64 = bias.double().requires_grad_(True) if bias is not None else None
    logits = E64 @ C64.T + (b64 if b64 is not None else 0)
    loss = F.cross_entropy(logits, x, reduction="none")
    loss.backward(go.double())
    if need[0]:
        assert relative_error(dE, E64.grad) < TOL[dtype]
    else:
        assert dE is None
    assert relative_error(dC, C64.grad) < TOL[dtype]
    if need[2]:
        assert relative_error(db, b64.grad) < TOL[dtype]
    places = stats["g_places"]
    expected = {(torch.float16, True, None, 0.0): ("dC", "dE"), (torch.float16, True, None, 0.5): ("dC", "dE", "buffer"),
                (torch.float16, True, 16, 0.0): ("dC", "dE"), (torch.float32, True, None, 0.0): ("dC", "buffer"),
                (torch.float16, False, None, 0.0): ("dC", "buffer")}
    assert {p for p, k in places.items() if k} == set(expected[(dtype, need[0], n_chunk, share)]), places


def test_gemm_chunks_bound_the_scratch():
    """Gemma-2-2B head, bf16: all rows in one fp32 dE accumulator (75.5 MB <= LB / 16) and G chunks
    of 2,304 columns (37.7 MB <= LB / 32); a long Qwen3 batch splits its rows."""
    from helpers.cce import gemm_chunks

    N, V, D = 8192, GEMMA2.V, GEMMA2.D
    lb = (N + V) * D * 2
    n_chunk, v_chunk = gemm_chunks(N, V, D, torch.bfloat16, 256)
    assert (n_chunk, v_chunk) == (8192, 2304)
    assert n_chunk * D * 4 <= lb / 16 and n_chunk * v_chunk * 2 <= lb / 32
    n_chunk, v_chunk = gemm_chunks(131_072, QWEN3.V, QWEN3.D, torch.bfloat16, 256)
    lb = (131_072 + QWEN3.V) * QWEN3.D * 2
    assert n_chunk < 131_072 and n_chunk * 1024 * 4 <= max(64 * 2**20, lb / 16) and v_chunk % 256 == 0
    assert n_chunk * v_chunk * 2 <= max(32 * 2**20, lb / 32)


def test_bad_backward_impl_names_the_argument():
    E, C, x = make_inputs(torch.float32)
    with pytest.raises(ValueError, match="backward_impl"):
        cce_backward(E, C, x, torch.zeros(N), torch.ones(N), torch.ones(N), backward_impl="v2")


BAD_INPUTS = [
    (lambda E, C, x: (E, C, torch.full_like(x, V)), ValueError, "x holds target"),
    (lambda E, C, x: (E, C, torch.full_like(x, -5)), ValueError, "x holds target"),
    (lambda E, C, x: (E, C[:, :-1], x), ValueError, "share the hidden size D"),
    (lambda E, C, x: (E, C.to("meta"), x), ValueError, "one device"),
    (lambda E, C, x: (E.double(), C.double(), x), TypeError, "E must be one of"),
    (lambda E, C, x: (E, C.half(), x), TypeError, "C must have E's dtype"),
    (lambda E, C, x: (E[None], C, x), ValueError, "x must have E's leading shape"),
    (lambda E, C, x: (E, C, x[:, None]), ValueError, "x must have E's leading shape"),
    (lambda E, C, x: (E, C, x.float()), TypeError, "integer class indices"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_inputs_name_the_argument(case):
    make, error, message = BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        linear_cross_entropy(*make(*make_inputs(torch.float32)))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(filter_eps=-1.0), "filter_eps"),
        (dict(filter_eps="high"), "filter_eps"),
        (dict(z_loss=-0.1), "z_loss"),
        (dict(label_smoothing=1.5), "label_smoothing"),
        (dict(accumulation="bf16"), "accumulation"),
        (dict(sort_vocab="yes"), "sort_vocab"),
        (dict(reduction="avg"), "reduction"),
        (dict(softcap=-1.0), "softcap"),
        (dict(softcap=float("inf")), "softcap must be None or a finite positive number"),
        (dict(softcap=True), "softcap must be None or a finite positive number"),
        (dict(backward_impl="fast"), "backward_impl"),
    ],
)
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(*make_inputs(torch.float32), **options)


@pytest.mark.parametrize("ignore_index", [None, 1.5, True, torch.tensor(5)])
def test_an_ignore_index_that_is_not_an_int_is_named(ignore_index):
    """Torch takes an int; these reached the kernels (a crash inside the interpreter, or 1.5 taken silently)."""
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        linear_cross_entropy(*make_inputs(torch.float32), ignore_index=ignore_index)


def test_filter_eps_defaults_from_the_dtype_and_the_vocabulary():
    """"auto": the dtype's eps per 256 columns up to 8,192 classes, then lower, so that a row drops at
    most the sparse backward's budget (2^-7 of its |G| mass in bf16, 2^-10 in fp16) over the whole
    vocabulary; the vocabulary is required for it."""
    for V in (301, 8192):
        assert resolve_options(torch.bfloat16, vocabulary=V).filter_eps == 2.0**-12
        assert resolve_options(torch.float16, vocabulary=V).filter_eps == 2.0**-15
    assert resolve_options(torch.bfloat16, vocabulary=262_144).filter_eps == 2.0**-17
    assert resolve_options(torch.float16, vocabulary=262_144).filter_eps == 2.0**-20
    for V in (8192, 151_936, 262_144):  # the bound: eps x V / 256 tiles' worth of mass <= the budget
        assert resolve_options(torch.bfloat16, vocabulary=V).filter_eps * V / 256 <= 2.0**-7
    assert resolve_options(torch.float32, vocabulary=301).filter_eps is None
    assert resolve_options(torch.bfloat16, vocabulary=301, label_smoothing=0.1).filter_eps is None
    assert resolve_options(torch.bfloat16, filter_eps=0).filter_eps is None
    assert resolve_options(torch.float32, filter_eps=1e-3).filter_eps == 1e-3
    assert isinstance(resolve_options(torch.float32, filter_eps=None), CCEOptions)
    with pytest.raises(ValueError, match="vocabulary"):
        resolve_options(torch.bfloat16)


def test_why_unavailable_speaks_plainly():
    assert "float64" in why_unavailable("cpu", torch.float64)
    assert "CUDA" in why_unavailable("mps", torch.float32)
    if torch.cuda.is_available():
        return
    assert why_unavailable("cpu", torch.float32) is None
    assert why_unavailable("cpu", torch.float16) is None
    assert "bfloat16" in why_unavailable("cpu", torch.bfloat16)


@pytest.mark.parametrize("impl", ["atomic", "gemm"])
def test_the_filter_threshold_scales_with_the_tile_width(impl):
    """eps is per 256 vocabulary columns (``helpers.cce.options.tile_eps``): a tile of the
    interpreter's 32 columns is held to eps / 8. A uniform softmax over 64 columns puts |G| mass 0.5
    in each row's non-target tile: kept at eps = 3.9 (0.49 per tile), skipped at 4.1 (0.51)."""
    from helpers.cce.kernels.configs import tier

    cfg = tier("interpreter").backward_gemm_for(torch.float32)
    assert cfg.BLOCK_V == 32 and tier("interpreter").for_dtype(torch.float32)[1].BLOCK_V == 32
    E = torch.zeros(16, 8, device=DEVICE)  # all logits 0: S = 1/64 everywhere
    C = torch.randn(64, 8, device=DEVICE)
    x = torch.zeros(16, dtype=torch.long, device=DEVICE)  # every target in the first tile
    for eps, skipped in ((3.9, 0), (4.1, 1)):
        stats = {}
        E_ = E.clone().requires_grad_(True)
        linear_cross_entropy(E_, C.clone().requires_grad_(True), x, filter_eps=eps, backward_impl=impl,
                             stats=stats, configs=tier("interpreter")).backward()
        assert stats["skipped"] == skipped, (eps, stats)


@pytest.mark.parametrize("tma,subtile,filtered,sort", [
    (False, 1, True, False),  # pointer loads and stores, the filter
    (True, 2, True, False),  # descriptors, G in two column blocks
    (True, 1, False, True),  # the sorted vocabulary (C gathered), no filter
])
def test_the_persistent_g_kernel_gives_the_same_bits(tma, subtile, filtered, sort):
    """A G kernel whose programs each walk several tiles (``LaunchConfig.persistent``, the
    interpreter's 3 programs) writes the bits of one program per tile, and skips the same tiles."""
    import dataclasses

    from helpers.cce.kernels.configs import tier

    dtype = torch.float16
    base = tier("interpreter")
    plain = dataclasses.replace(base.backward_gemm[2], tma=tma)
    walked = dataclasses.replace(plain, persistent=1, g_subtile=subtile)
    E, C, x = make_inputs(dtype, n=45, v=203, d=40, ignore=[3])
    options = resolve_options(dtype, filter_eps="auto" if filtered else None, vocabulary=203, sort_vocab=sort)
    _, lse, r = cce_forward(E, C, x, options)
    go = upstream("mean", n=45)
    results = []
    for cfg in (plain, walked):
        stats = {}
        configs = dataclasses.replace(base, backward_gemm={**base.backward_gemm, 2: cfg})
        results.append((cce_backward(E, C, x, lse, r, go, options, configs, stats=stats, backward_impl="gemm"), stats))
    (dE0, dC0, _), s0 = results[0]
    (dE1, dC1, _), s1 = results[1]
    assert torch.equal(dE0, dE1) and torch.equal(dC0, dC1)
    assert s0["tiles"] == s1["tiles"] and s0.get("skipped") == s1.get("skipped")


@pytest.mark.parametrize("impl", ["atomic", "gemm", "sparse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiles_of_128_columns_form_g_in_two_halves(impl, dtype):
    """Every backward with 128-column tiles, whose G is formed a column half at a time
    (``gradient_and_softmax_tile``; the interpreter tier's 32 columns never are): V = 301 gives a last
    tile of 45 columns, a partial left half and an all-padding right one. The soft cap, ignored rows and
    per-row gradients against float64; with z-loss, label smoothing, class weights and the sorted
    vocabulary as well, against the same call on the 32-column tiles."""
    import dataclasses

    from helpers.cce.kernels.configs import LaunchConfig

    wide = LaunchConfig(16, 128, 16, 1, 1, GROUP_N=2)
    base = tier("interpreter")
    configs = dataclasses.replace(base, forward={2: wide, 4: wide}, backward={2: wide, 4: wide},
                                  backward_gemm={2: wide, 4: wide},
                                  sparse={2: LaunchConfig(16, 64, 16, 1, 1), 4: LaunchConfig(16, 64, 16, 1, 1)})
    E, C, x = make_inputs(dtype, scale=4.0, ignore=[0, 7, 36])
    go = upstream("none")
    spec = dict(softcap=3.0, reduction="none")
    check(run_ours(E, C, x, go, backward_impl=impl, configs=configs, filter_eps=2.0**-12, **spec),
          reference_loss_and_grads(E, C, x, go, **spec), dtype)
    weight = torch.rand(V, generator=torch.Generator().manual_seed(3)).to(DEVICE) + 0.5
    everything = dict(spec, z_loss=0.05, label_smoothing=0.2, weight=weight, filter_eps=2.0**-14,
                      sort_vocab=impl == "sparse", backward_impl=impl)
    got = run_ours(E, C, x, go, configs=configs, **everything)
    narrow = run_ours(E, C, x, go, configs=base, **everything)
    for a, b in zip(got, narrow):
        assert relative_error(a, b) < TOL[dtype] / 4, relative_error(a, b)


def _row_gradient_torch(grad_rows, grad_lse, kept, lse, rows, z_loss, label_smoothing):
    """``RowGradient.of`` as the torch expressions its kernels replaced: (w, w_rel, w_scale, coef), coef's
    second row the target column's t = (a - b) - a r, its first a exp(-lo) (``rows``: r and the lse's
    rounding lo)."""
    r, lo = rows.view(2, -1)
    g = torch.where(kept, grad_rows.to(torch.float32), 0.0)
    h = grad_lse.to(torch.float32) if grad_lse is not None else torch.zeros_like(g)
    w = torch.maximum(g.abs(), h.abs())
    safe = torch.where(w > 0, w, 1.0)
    a = (g * (1.0 + 2.0 * z_loss * lse) + h) / safe
    coef = torch.stack([a * torch.exp(-lo), (g * (2.0 * z_loss * lse + label_smoothing) + h) / safe - a * r,
                        g * label_smoothing / safe])
    w_scale = w.amax().reshape(1)
    return w, torch.where(w_scale > 0, w / w_scale, 0.0), w_scale, coef


@pytest.mark.parametrize("N", [1, 37, 2500, 9000])
@pytest.mark.parametrize("case", ["mean", "divided", "none", "lse", "nan", "all_ignored", "no_loss_gradient"])
def test_row_gradient_kernels_match_the_torch_expressions(N, case):
    """``RowGradient.of``'s kernels give the torch expressions' values: a mean's expanded scalar, a
    mean's scalar and its divisor n_kept (the division the loss's backward made in torch: g / max(n, 1)),
    a "none" gradient in bf16, a gradient into the lse, a NaN at a kept row (NaN w and w_scale, as torch
    gives), every row ignored (w_scale 0, w_rel 0), no gradient into the loss (only the lse's); one
    program walking several blocks (2,500 rows) and one program a block with the second launch (9,000,
    past ``ONE_PROGRAM_ROWS``). The same bits under the interpreter; on a GPU within fp32's rounding (a
    compiled kernel divides and fuses multiply-adds as the hardware does)."""
    from helpers.cce.backward.rows import RowGradient

    gen = torch.Generator().manual_seed(N)
    lse = torch.randn(N, generator=gen).to(DEVICE)
    r = torch.cat([torch.rand(N, generator=gen).pow(8),  # non-target masses down to ~1e-30
                   torch.randn(N, generator=gen) * 1e-6]).to(DEVICE)  # the lse's rounding
    kept = (torch.rand(N, generator=gen) > 0.3).to(DEVICE)
    grad_lse = torch.randn(N, generator=gen).to(DEVICE) if case in ("lse", "nan", "no_loss_gradient") else None
    divisor = None
    if case in ("mean", "all_ignored"):
        grad_rows = torch.full((1,), 0.01, device=DEVICE).expand(N)
        if case == "all_ignored":
            kept[:] = False
    elif case == "divided":  # the loss's backward for a mean: its scalar gradient and n_kept
        grad_rows, divisor = torch.tensor(0.37, device=DEVICE), kept.sum()
    else:
        grad_rows = torch.randn(N, generator=gen).to(torch.bfloat16).to(DEVICE)
    if case == "nan":
        grad_rows[N // 2], kept[N // 2] = float("nan"), True
    options = resolve_options(torch.float32, filter_eps=None, z_loss=1e-3, label_smoothing=0.1)
    # Rows kept by targets and ignore_index (the loss's own call), or by a mask and 0 (the vocabulary-parallel loss).
    x = torch.where(kept, torch.arange(N, device=DEVICE) % 7, -100)
    labels, ignore = (x, -100) if N % 2 else (kept, 0)
    given = None if case == "no_loss_gradient" else grad_rows
    up = RowGradient.of(given, grad_lse, labels, ignore, lse, r, options, divisor)
    if case == "divided":  # torch's division, as the loss's backward made it before the kernel did
        grad_rows = (grad_rows.to(torch.float32) / divisor.clamp(min=1)).expand(N)
    elif case == "no_loss_gradient":
        grad_rows = torch.zeros(N, device=DEVICE)
    want = _row_gradient_torch(grad_rows, grad_lse, kept, lse, r, options.z_loss, options.label_smoothing)
    # A GPU: fp32's rounding, relative to the terms (a coefficient g (1 + 2 zl lse) + h near 0 cancels).
    rtol, atol = (0.0, 0.0) if DEVICE == "cpu" else (1e-6, 1e-6)
    for got, expected in zip((up.w, up.w_rel, up.w_scale, up.coef[1:]), (*want[:3], want[3][1:])):
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
    # a exp(-lo): exp_of's exp and torch's may differ by an ulp.
    torch.testing.assert_close(up.coef[0], want[3][0], rtol=max(rtol, 2.4e-7), atol=atol, equal_nan=True)
    assert up.uniform == (case in ("mean", "all_ignored", "divided") or N == 1 and grad_lse is None)
    assert bool(up.w_scale.isnan()) == (case == "nan")
