"""The "sparse" backward (``backward_impl="sparse"``) against float64, on the CPU.

The sparse backward drops, per row, the tiles whose |G| mass is below eps, so its reference is the
float64 gradient with that rule applied exactly (``filtered_reference``): the sparse path must match
it within rounding, whatever the forward's bits over-marked, however rows and tiles were blocked. Its
distance to the unfiltered spec is the dropped mass, bounded by the rule and reported in ``stats``.
Shapes are irregular (partial tiles, packs and row blocks everywhere); inputs come from the two
regimes of ``helpers.compare.inputs``: ``realistic`` (sparse) and ``uniform`` (dense: the sparse
path hands over to "gemm", or, forced to run, must equal it within rounding).
"""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import helpers.cce.backward.pair_index as pair_index  # noqa: E402
from helpers.cce import cce_backward, cce_forward, linear_cross_entropy, resolve_options  # noqa: E402
from helpers.cce.kernels.configs import tier  # noqa: E402
from helpers.cce.options import resolve_configs, sparse_auto_eps  # noqa: E402
from helpers.cce.shared import vocabulary_order  # noqa: E402
from helpers.compare.inputs import make_inputs  # noqa: E402
from helpers.spec import reference_logits, reference_loss, reference_loss_and_grads, relative_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Sized for the interpreter tier's 16-column tiles (44 tiles at V = 700): at a GPU tier's 64-128 columns
# the realistic regime's bits mark 90-96% of the pairs at these sizes and the sparse path hands over
# (measured on an H200). The GPU's check of the sparse backward, at sizes it pays: scripts/gpu/cce_check.py
# --random-sparse.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the interpreter tier's tiles)")
N, V, D = 45, 700, 24  # 3 row blocks of the forward's 16, 44 tiles of 16 columns (the last partial)
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
EPS = 2.0**-12  # coarse enough that the realistic regime skips most pairs at this size


def small(**knobs):
    """The device's tier with the host knobs these shapes need (``HostTuning``): a pilot of 128 sorted
    positions, so that both forward launches (pilot, splits) run; the dense fallback at 90% of the
    pairs (at these sizes the realistic regime marks 30-60%); and no size too small for the sparse
    path; then ``knobs``."""
    return resolve_configs(None, torch.device(DEVICE)).tuned(
        **{"pilot_columns": 128, "dense_fallback": 0.9, "sparse_min_pairs": 0, **knobs})


def inputs(dtype, regime="realistic", n=N, v=V, d=D, ignore=(), seed=1):
    E, C, x = make_inputs(n, v, d, torch.float32, "cpu", regime=regime, seed=seed)
    x[list(ignore)] = -100
    return E.to(dtype).to(DEVICE), C.to(dtype).to(DEVICE), x.to(DEVICE)


def unpack(bits, T):
    """(T, N) int64: the bits one per (tile, row)."""
    return torch.stack([(bits[t // 8] >> (t % 8)) & 1 for t in range(T)]).to(torch.int64)


def upstream(reduction, n=N):
    if reduction == "none":
        return torch.randn(n, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    return torch.tensor(1.7, device=DEVICE)


def filtered_reference(E, C, x, go, eps, order, block_v, *, reduction="mean", softcap=None, z_loss=0.0,
                       bias=None, grad_lse=None):
    """(dE, dC, db) in float64 with the sparse rule applied exactly. Row i's gradient with respect to
    its logits is w_i G_i with G_i = a_i S - b_i [v = x_i] (times the soft cap's chain rule) and the
    coefficients of ``helpers.cce.backward.rows.RowGradient``: g_i the loss's upstream gradient, h_i the
    lse's (``grad_lse``), w = max(|g|, |h|), a = (g (1 + 2 zl lse) + h) / w, b = g / w. A row's G in a
    tile (of sorted positions when ``order``) is dropped when its |G| mass there, before the soft cap's
    derivative, is below eps."""
    n, v = E.shape[0], C.shape[0]
    kept = x != -100
    z = reference_logits(E, C, bias=bias)
    t = None
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z = softcap * t
    lse = torch.logsumexp(z, dim=1)
    n_kept = kept.sum()
    g = go.double() if reduction == "none" else go.double().expand(n) / (n_kept if reduction == "mean" else 1)
    g = torch.where(kept, g, 0.0)
    h = grad_lse.double() if grad_lse is not None else torch.zeros(n, dtype=torch.float64)
    w = torch.maximum(g.abs(), h.abs())
    safe = torch.where(w > 0, w, 1.0)
    G = torch.exp(z - lse[:, None]) * ((g * (1 + 2 * z_loss * lse) + h) / safe)[:, None]
    G[torch.arange(n)[kept], x[kept]] -= (g / safe)[kept]
    order = order if order is not None else torch.arange(v)
    tiles = -(-v // block_v)

    def tiled(M):
        return torch.nn.functional.pad(M[:, order], (0, tiles * block_v - v)).view(n, tiles, block_v)

    keep = tiled(G).abs().sum(-1, keepdim=True) >= eps  # judged before the soft cap's derivative
    if t is not None:
        G = G * (1 - t * t)
    Gs = tiled(G) * keep
    G = torch.empty_like(G)
    G[:, order] = Gs.view(n, -1)[:, :v]
    G = G * w[:, None]
    return G @ C.double(), G.T @ E.double(), G.sum(0)


def spec_gradients(E, C, x, go, *, reduction="mean", bias=None, grad_lse=None, **options):
    """(dE, dC, db) of sum(go * loss) + sum(grad_lse * lse) in float64 by autograd through
    ``helpers.spec.reference_loss`` (no filter): the unfiltered spec, lse's gradient included."""
    E64, C64 = (t.detach().double().requires_grad_(True) for t in (E, C))
    b64 = bias.detach().double().requires_grad_(True) if bias is not None else None
    loss = reference_loss(E64, C64, x, reduction=reduction, bias=b64, **options)
    total = (loss * go.double()).sum()
    if grad_lse is not None:
        lse = torch.logsumexp(reference_logits(E64, C64, options.get("softcap"), bias=b64), dim=1)
        total = total + (lse * grad_lse.double()).sum()
    total.backward()
    return E64.grad, C64.grad, b64.grad if b64 is not None else None


def lse_gradient(n=N, seed=4):
    """A gradient flowing into the returned lse, of either sign and the size of a mean's 1 / N."""
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) / n).to(DEVICE)


def run_sparse(E, C, x, go, *, eps=EPS, sort=False, reduction="mean", stats=None, bias=None, grad_lse=None,
               need=None, configs=None, **options):
    """(dE, dC, db, activity) from the sparse backward through cce_forward / cce_backward (so the
    test holds the bits); ``need`` (dE, dC, db) defaults to every gradient there is; ``configs``
    defaults to ``small()``."""
    dtype = E.dtype
    configs = configs or small()
    o = resolve_options(dtype, filter_eps=eps, sort_vocab=sort, reduction=reduction, **options)
    _, lse, r, activity = cce_forward(E, C, x, o, configs, v_splits=3, bias=bias, emit_activity=True,
                                   return_lse=grad_lse is not None)
    grad_rows = go.float().expand(E.shape[0]) if go.dim() == 0 else go.float()
    if reduction == "mean":
        grad_rows = grad_rows / (x != -100).sum().clamp(min=1)
    need = need or (True, True, bias is not None)
    dE, dC, db = cce_backward(E, C, x, lse, r, grad_rows, o, configs, stats=stats, backward_impl="sparse",
                              activity=activity, bias=bias, grad_lse=grad_lse, need=need)
    return dE, dC, db, activity


CASES = {
    "mean": dict(),
    "sum_sorted": dict(reduction="sum", sort=True),
    "none_ignored": dict(reduction="none", ignore=[0, 7, 44]),
    "softcap_sorted": dict(softcap=15.0, sort=True, ignore=[5]),
    "z_loss": dict(z_loss=1e-3, reduction="none"),
    "everything_sorted": dict(z_loss=1e-3, softcap=15.0, reduction="none", ignore=[1, 30], sort=True),
    # A bias on the head: in the forward's bits (sorted: each position's own entry), G and db.
    "bias": dict(bias=True, ignore=[6]),
    "bias_everything_sorted": dict(bias=True, z_loss=1e-3, softcap=15.0, reduction="none", ignore=[1, 30],
                                   sort=True),
    # A gradient into the returned lse: G's softmax coefficient a = (g (1 + 2 zl lse) + h) / w, and
    # ignored rows get G = (h / |h|) S, with no target term.
    "lse_grad": dict(grad_lse=True, ignore=[6]),
    "lse_grad_everything_sorted": dict(grad_lse=True, bias=True, z_loss=1e-3, softcap=15.0, reduction="none",
                                       ignore=[1, 30], sort=True),
}


def head_bias(dtype, v=V, seed=3):
    """A bias (V,) of the size trained heads have (~0.5): it moves which tiles carry the mass."""
    return (0.5 * torch.randn(v, generator=torch.Generator().manual_seed(seed))).to(dtype).to(DEVICE)


# Every case in fp16; in fp32 the cases that combine the others (the same kernels, CI's minutes).
FP32_CASES = ("mean", "everything_sorted", "bias_everything_sorted", "lse_grad_everything_sorted")


@pytest.mark.parametrize("dtype, case", [(torch.float16, c) for c in CASES]
                         + [(torch.float32, c) for c in FP32_CASES], ids=str)
def test_matches_the_filtered_float64_gradient(case, dtype):
    opts = dict(CASES[case])
    ignore, sort, reduction = opts.pop("ignore", ()), opts.pop("sort", False), opts.get("reduction", "mean")
    E, C, x = inputs(dtype, ignore=ignore)
    bias = head_bias(dtype) if opts.pop("bias", False) else None
    grad_lse = lse_gradient() if opts.pop("grad_lse", False) else None
    go = upstream(reduction)
    stats = {}
    dE, dC, db, act = run_sparse(E, C, x, go, sort=sort, stats=stats, bias=bias, grad_lse=grad_lse, **opts)
    assert stats["fallback"] is None, stats["fallback"]
    assert 0 < stats["kept_pairs"] <= stats["marked"] < stats["pairs"]
    rdE, rdC, rdb = filtered_reference(E, C, x, go, EPS, act.order, act.block_v, bias=bias, grad_lse=grad_lse,
                                       **opts)
    assert dE.dtype == dtype and dC.dtype == dtype
    assert relative_error(dE, rdE) < TOL[dtype], relative_error(dE, rdE)
    assert relative_error(dC, rdC) < TOL[dtype], relative_error(dC, rdC)
    assert (db is None) == (bias is None)
    if bias is not None:
        assert db.dtype == dtype and relative_error(db, rdb) < TOL[dtype], relative_error(db, rdb)
    # Against the unfiltered spec, the gradient that was dropped: bounded by the mass each row lost
    # (its |G| mass: T eps at most; its softmax mass too while |a| >= 1, i.e. with no gradient into
    # the lse, where g and h of opposite signs can make a row's |a| small).
    sdE, sdC, _ = spec_gradients(E, C, x, go, bias=bias, grad_lse=grad_lse, **opts)
    assert relative_error(dE, sdE) < 0.05
    assert grad_lse is not None or stats["skipped_mass_max"] < act.tiles * EPS


def test_the_filtered_reference_at_eps_0_is_the_spec():
    """The reference's coefficients (RowGradient's a, b, w, written out again in float64) against
    autograd through the spec, every option at once: with nothing filtered the two must agree."""
    E, C, x = inputs(torch.float32, ignore=[1, 30])
    bias, grad_lse, go = head_bias(torch.float32), lse_gradient(), upstream("none")
    opts = dict(reduction="none", softcap=15.0, z_loss=1e-3, bias=bias, grad_lse=grad_lse)
    got = filtered_reference(E, C, x, go, 0.0, None, 16, **opts)
    for g, want in zip(got, spec_gradients(E, C, x, go, **opts)):
        assert relative_error(g, want) < 1e-12


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_uniform_hands_over_to_gemm(dtype):
    """A dense softmax: the bits mark every pair, "gemm" runs, and its result is the gemm's."""
    E, C, x = inputs(dtype, regime="uniform")
    go = upstream("mean")
    stats = {}
    dE, dC, _, _ = run_sparse(E, C, x, go, stats=stats)
    assert stats["fallback"] and "mark" in stats["fallback"] and stats["density"] > 0.9
    o = resolve_options(dtype, filter_eps=EPS)
    _, lse, r = cce_forward(E, C, x, o, small(), v_splits=3)
    gE, gC, _ = cce_backward(E, C, x, lse, r, go.float().expand(N) / N, o, small(), backward_impl="gemm")
    assert torch.equal(dE, gE) and torch.equal(dC, gC)


@pytest.mark.parametrize("limit, runs_sparse", [(0.01, False), (0.99, True)])
def test_the_tiers_density_limit_decides(limit, runs_sparse):
    """The tier's ``dense_fallback`` decides (Hopper's is not the T4's)."""
    E, C, x = inputs(torch.float16)
    E.requires_grad_(True)
    C.requires_grad_(True)
    stats = {}
    configs = small(dense_fallback=limit)
    linear_cross_entropy(E, C, x, backward_impl="sparse", filter_eps=EPS, configs=configs, stats=stats).backward()
    assert (stats["fallback"] is None) == runs_sparse, stats["fallback"]
    if not runs_sparse:
        assert stats["fallback"].endswith("(> 1%)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_uniform_forced_sparse_equals_gemm(dtype):
    """Forced past the fallback on a dense softmax, the sparse kernels compute every pair and agree
    with the "gemm" backward within rounding (nothing is below eps on this softmax)."""
    E, C, x = inputs(dtype, regime="uniform", ignore=[4])
    go = upstream("none")
    stats = {}
    dE, dC, _, _ = run_sparse(E, C, x, go, reduction="none", stats=stats, configs=small(dense_fallback=1.01))
    assert stats["fallback"] is None and stats["kept_pairs"] == stats["pairs"]
    o = resolve_options(dtype, filter_eps=EPS, reduction="none")
    _, lse, r = cce_forward(E, C, x, o, small())
    gE, gC, _ = cce_backward(E, C, x, lse, r, go.float(), o, small(), backward_impl="gemm")
    assert relative_error(dE, gE) < TOL[dtype] and relative_error(dC, gC) < TOL[dtype]
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go, reduction="none")
    assert relative_error(dE, rdE) < TOL[dtype] and relative_error(dC, rdC) < TOL[dtype]


def test_a_trained_models_softmax_forced_sparse_matches_the_filtered_float64_gradient():
    """The "trained" regime (``helpers.compare.trained``): a softmax no generator of ours shaped. At
    these sizes its bits mark most pairs, so it would run "gemm"; forced past the fallback, the
    sparse kernels match the filtered float64 gradient on it, sorted, with an ignored row."""
    E, C, x = inputs(torch.float16, regime="trained", ignore=[3])
    go = upstream("mean")
    stats = {}
    dE, dC, _, act = run_sparse(E, C, x, go, sort=True, stats=stats, configs=small(dense_fallback=1.01))
    assert stats["fallback"] is None and 0 < stats["kept_pairs"] <= stats["marked"]
    rdE, rdC, _ = filtered_reference(E, C, x, go, EPS, act.order, act.block_v)
    assert relative_error(dE, rdE) < TOL[torch.float16], relative_error(dE, rdE)
    assert relative_error(dC, rdC) < TOL[torch.float16], relative_error(dC, rdC)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("sort", [False, True])
def test_forward_bits_never_miss_a_tile(sort, bias):
    """Every (row, tile) whose softmax mass reaches eps is marked, with the vocabulary splits, the
    pilot and the seeds (and a bias, read at each sorted position's own row); and the bits do not
    change the loss."""
    E, C, x = inputs(torch.float32, ignore=[9])
    bias = head_bias(torch.float32) if bias else None
    o = resolve_options(torch.float32, filter_eps=EPS, sort_vocab=sort, softcap=20.0)
    loss, lse, r, act = cce_forward(E, C, x, o, small(), v_splits=3, bias=bias, emit_activity=True)
    loss0, lse0, r0 = cce_forward(E, C, x, o, small(), v_splits=3, bias=bias)
    torch.testing.assert_close(lse, lse0, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-5)
    z = reference_logits(E, C, 20.0, bias=bias)
    S = torch.softmax(z, dim=1)
    if act.order is not None:
        S = S[:, act.order]
    T, bv = act.tiles, act.block_v
    mass = torch.nn.functional.pad(S, (0, T * bv - V)).view(N, T, bv).sum(-1)
    marked = unpack(act.bits, T).T.bool()  # (N, T)
    assert not ((mass >= EPS) & ~marked).any()
    assert marked.sum() < 2 * (mass >= EPS).sum()  # the bound is tight enough to skip most pairs
    assert act.pilot == (128 if sort else 0)


@pytest.fixture
def row_invariant_dot(monkeypatch):
    """Under the interpreter, ``tl.dot`` whose every output element sums its products in one order
    that does not depend on the other rows of the tile, as a GPU's MMA does.

    The interpreter's dot is numpy's matmul, whose BLAS picks its kernel by CPU: OpenBLAS's Haswell
    kernels (taken on AMD EPYC) give a row different last bits depending on the rows beside it,
    the SkylakeX ones do not. A test of our own sum order across different packings would then
    pass or fail by machine. numpy's einsum, unoptimized, sums each element's products in k order.
    """
    if DEVICE == "cuda":
        return
    from triton.runtime import interpreter

    blas_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8: the interpreter's own
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        products = np.einsum("...ik,...kj->...ij", a.data.astype(acc), b.data.astype(acc), optimize=False)
        return interpreter.TensorHandle(products + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.parametrize("dtype", [torch.float16], ids=str)  # fp32 takes the same paths (CI's minutes)
def test_blocks_do_not_change_a_bit(dtype, row_invariant_dot):
    """Small Y (many row blocks) and small Gc (many tile ranges): the same bits as one of each, and
    two runs give the same bits (deterministic). The packs differ between the two, so a row's
    products sit beside other rows: ``row_invariant_dot`` makes the interpreter's dot indifferent
    to that, as the GPU's is."""
    E, C, x = inputs(dtype, ignore=[3])
    go = upstream("none")
    first = run_sparse(E, C, x, go, reduction="none", sort=True, stats=(s1 := {}))
    again = run_sparse(E, C, x, go, reduction="none", sort=True)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    floors = small(y_lanes=1,  # the floor: one row's packs
                   gc_bytes=1,  # the floor: one pack, a tile of more in windows
                   index_bytes=1,  # the floor: one row block, one byte of tiles
                   segment_rows=4)  # several segments per row block
    blocked = run_sparse(E, C, x, go, reduction="none", sort=True, stats=(s2 := {}), configs=floors)
    assert s2["row_blocks"] > s1["row_blocks"] and s2["tile_ranges"] > s1["tile_ranges"]
    assert s2["gc_windows"] > 0 and s1["gc_windows"] == 0
    assert s2["index_batches"] > s1["index_batches"]
    assert torch.equal(first[0], blocked[0]) and torch.equal(first[1], blocked[1])


@pytest.mark.parametrize("gc", ["whole", "windows"])
@pytest.mark.parametrize("which", ["dC_db", "db_only"])
def test_split_tiles_match_the_reference_and_repeat(which, gc):
    """Tiles whose packs are split over programs (as the Qwen3 head's at N = 131,072, where every
    row marks the first tiles), summed in a second pass: the filtered float64 gradient within
    rounding, the same bits on a second run, and db from the same sums. "windows": Gc holds one
    pack, so every tile of more comes window by window, each split going on from its sum so far."""
    configs = small(dc_programs=4096, gc_bytes=1 if gc == "windows" else None)
    E, C, x = inputs(torch.float32, ignore=[3])
    bias = head_bias(torch.float32)
    go = upstream("none")
    need = (True, True, True) if which == "dC_db" else (False, False, True)
    first = run_sparse(E, C, x, go, reduction="none", sort=True, bias=bias, need=need, stats=(stats := {}),
                       configs=configs)
    again = run_sparse(E, C, x, go, reduction="none", sort=True, bias=bias, need=need, configs=configs)
    assert stats["split_ranges"] > 0 and (stats["gc_windows"] > 0) == (gc == "windows"), stats
    for a, b in zip(first[:3], again[:3]):
        assert (a is None and b is None) or torch.equal(a, b)
    rdE, rdC, rdb = filtered_reference(E, C, x, go, EPS, first[3].order, first[3].block_v, reduction="none",
                                       bias=bias)
    assert relative_error(first[2], rdb) < TOL[torch.float32]
    if which == "dC_db":
        assert relative_error(first[1], rdC) < TOL[torch.float32]
        assert relative_error(first[0], rdE) < TOL[torch.float32]


def test_bits_past_the_last_tile_are_ignored():
    """The last byte of bits holds 8 tiles; those past the vocabulary (T = 44 here: 4 of them) must
    not be listed as pairs, whatever the bits there say. The forward leaves them clear (a threshold
    that underflowed to 0 would not); before the fix, set, they made the dC pass write past its list."""
    E, C, x = inputs(torch.float32)
    go = upstream("mean")
    o = resolve_options(torch.float32, filter_eps=EPS)
    _, lse, r, act = cce_forward(E, C, x, o, small(), v_splits=3, emit_activity=True)
    assert act.tiles % 8
    act.bits[-1] |= 0xFF << (act.tiles % 8) & 0xFF
    grad_rows = go.float().expand(N) / (x != -100).sum()
    stats = {}
    dE, dC, _ = cce_backward(E, C, x, lse, r, grad_rows, o, small(), stats=stats, backward_impl="sparse", activity=act)
    assert stats["fallback"] is None
    rdE, rdC, _ = filtered_reference(E, C, x, go, EPS, act.order, act.block_v)
    assert relative_error(dE, rdE) < TOL[torch.float32] and relative_error(dC, rdC) < TOL[torch.float32]


def test_too_small_a_problem_runs_gemm_without_bits():
    """Below ``HostTuning.sparse_min_pairs`` the index costs more than it saves: no bits in the forward, "gemm"."""
    E, C, x = inputs(torch.float32)
    E.requires_grad_(True)
    C.requires_grad_(True)
    stats = {}
    loss = linear_cross_entropy(E, C, x, backward_impl="sparse", filter_eps=EPS, stats=stats,
                                configs=small(sparse_min_pairs=N * 1000))
    loss.backward()
    assert "pairs, fewer than" in stats["fallback"], stats
    ref = reference_loss_and_grads(E.detach(), C.detach(), x)
    assert relative_error(E.grad, ref[1]) < 1e-3 and relative_error(C.grad, ref[2]) < 1e-3


def test_y_lives_in_dC_when_it_fits():
    """At a vocabulary big enough for a few rows' packs, Y costs no memory of its own."""
    E, C, x = inputs(torch.float16, v=8195, d=16, n=20)
    go = upstream("mean", n=20)
    stats = {}
    dE, dC, _, act = run_sparse(E, C, x, go, sort=True, stats=stats)
    assert stats["fallback"] is None and stats["y_in_dC"]
    # the bits, the order and Gc: every pack of the dC pass (fewer bytes here than its 4 MiB floor)
    gc_bytes = stats["pack_lanes_dC"] * act.block_v * 2
    assert gc_bytes < 4 * 2**20 and stats["extra_bytes"] == act.nbytes() + gc_bytes
    rdE, rdC, _ = filtered_reference(E, C, x, go, EPS, act.order, act.block_v)
    assert relative_error(dE, rdE) < TOL[torch.float16] and relative_error(dC, rdC) < TOL[torch.float16]


@pytest.mark.parametrize("options, why", [
    (dict(label_smoothing=0.1), "label smoothing"),
    (dict(full_c=True), "FullC"),
    (dict(filter_eps=None), "filter is off"),
])
def test_options_that_need_every_pair_run_gemm(options, why):
    E, C, x = inputs(torch.float16)
    go = upstream("mean")
    stats = {}
    E_, C_ = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    opts = dict(dict(filter_eps=EPS), **options)
    linear_cross_entropy(E_, C_, x, backward_impl="sparse", configs=small(), stats=stats, **opts).backward(go)
    assert why in stats["fallback"]
    spec = {k: v for k, v in options.items() if k == "label_smoothing"}
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go, **spec)
    tol = 0.02 if options.get("full_c") else TOL[torch.float16]  # FullC: dE filtered (per row block)
    assert relative_error(E_.grad, rdE) < tol and relative_error(C_.grad, rdC) < TOL[torch.float16]


def test_z_loss_beyond_the_forwards_margin_runs_gemm():
    """The forward halved eps for z-loss's factor 1 + 2 zl lse; past 2 the bits may miss: "gemm"."""
    E, C, x = inputs(torch.float32)
    stats = {}
    run_sparse(E, C, x, upstream("mean"), z_loss=1.0, stats=stats)
    assert "z-loss" in stats["fallback"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_trainer_inputs_through_autograd(dtype):
    """(B, T, D) hidden states, the causal shift and a bias that requires grad, as ``helpers.hf``
    calls it: api flattens and shifts before the backward, which computes dE, dC and db sparsely."""
    B, T = 3, 15
    E, C, x = inputs(dtype, n=B * T)
    bias = head_bias(dtype)
    Eg, Cg, bg = (t.clone().requires_grad_(True) for t in (E.reshape(B, T, D), C, bias))
    stats = {}
    linear_cross_entropy(Eg, Cg, x.reshape(B, T), bias=bg, shift=True, backward_impl="sparse", filter_eps=EPS,
                         sort_vocab=True, stats=stats, configs=small()).backward()
    assert stats["fallback"] is None, stats["fallback"]
    shifted = torch.full((B, T), -100, dtype=x.dtype, device=DEVICE)
    shifted[:, :-1] = x.reshape(B, T)[:, 1:]
    order = vocabulary_order(E, C)
    rdE, rdC, rdb = filtered_reference(E, C, shifted.reshape(-1), torch.tensor(1.0), EPS, order,
                                       stats["block_v"], bias=bias)
    assert Eg.grad.shape == (B, T, D) and bg.grad.dtype == dtype
    for got, want in ((Eg.grad.reshape(-1, D), rdE), (Cg.grad, rdC), (bg.grad, rdb)):
        assert relative_error(got, want) < TOL[dtype], relative_error(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_loss_on_the_returned_lse(dtype):
    """return_lse=True and a caller's z-loss on it, 1e-2 mean(lse^2): every row's lse gets
    h = 2e-2 lse / N (ignored rows too), which the sparse backward folds into G's coefficient a."""
    E, C, x = inputs(dtype, ignore=[2, 40])
    Eg, Cg = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    stats = {}
    loss, lse = linear_cross_entropy(Eg, Cg, x, return_lse=True, backward_impl="sparse", filter_eps=EPS,
                                     sort_vocab=True, stats=stats, configs=small())
    (loss + 1e-2 * (lse**2).mean()).backward()
    assert stats["fallback"] is None, stats["fallback"]
    h = 2e-2 * lse.detach() / N  # autograd's gradient into the lse, in fp32 as the backward gets it
    rdE, rdC, _ = filtered_reference(E, C, x, torch.tensor(1.0), EPS, vocabulary_order(E, C), stats["block_v"],
                                     grad_lse=h)
    assert relative_error(Eg.grad, rdE) < TOL[dtype] and relative_error(Cg.grad, rdC) < TOL[dtype]


def test_only_the_lse_gets_a_gradient():
    """The loss unused: G = S in every row, ignored rows included, with no target term."""
    E, C, x = inputs(torch.float32, ignore=[2])
    bias = head_bias(torch.float32)
    Eg, Cg, bg = (t.clone().requires_grad_(True) for t in (E, C, bias))
    stats = {}
    _, lse = linear_cross_entropy(Eg, Cg, x, bias=bg, return_lse=True, backward_impl="sparse", filter_eps=EPS,
                                  sort_vocab=False, stats=stats, configs=small())
    lse.sum().backward()
    assert stats["fallback"] is None, stats["fallback"]
    rdE, rdC, rdb = filtered_reference(E, C, x, torch.tensor(0.0), EPS, None, stats["block_v"], bias=bias,
                                       grad_lse=torch.ones(N))
    for got, want in ((Eg.grad, rdE), (Cg.grad, rdC), (bg.grad, rdb)):
        assert relative_error(got, want) < TOL[torch.float32], relative_error(got, want)


def test_a_coefficient_past_the_forwards_bound_runs_gemm():
    """Bits made without a gradient into the lse in mind (|a| <= 1), then one of the loss's sign:
    |a| reaches 2, the bits may miss tiles, so "gemm" runs, and its result is gemm's to the bit."""
    E, C, x = inputs(torch.float32)
    o = resolve_options(torch.float32, filter_eps=EPS, reduction="sum")
    _, lse, r, act = cce_forward(E, C, x, o, small(), emit_activity=True)
    g, h = torch.ones(N), torch.full((N,), 0.5)
    stats = {}
    got = cce_backward(E, C, x, lse, r, g, o, small(), stats=stats, backward_impl="sparse", activity=act, grad_lse=h)
    assert "exceeds the 1 the forward's bits were made for" in stats["fallback"]
    want = cce_backward(E, C, x, lse, r, g, o, small(), backward_impl="gemm", grad_lse=h)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rows_without_a_gradient_keep_their_bits():
    """A first backward in which half the rows have no gradient skips them without clearing their
    bits: a second through the same graph, with every row's, still gets every row right."""
    E, C, x = inputs(torch.float32, ignore=[3])
    Eg, Cg = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    stats = {}
    loss = linear_cross_entropy(Eg, Cg, x, reduction="none", backward_impl="sparse", filter_eps=EPS, stats=stats,
                                sort_vocab=False, configs=small())
    half = upstream("none") * (torch.arange(N, device=DEVICE) % 2 == 0)
    for go in (half, upstream("none")):
        Eg.grad = Cg.grad = None
        loss.backward(go, retain_graph=True)
        assert stats["fallback"] is None, stats["fallback"]
        rdE, rdC, _ = filtered_reference(E, C, x, go, EPS, None, stats["block_v"], reduction="none")
        assert relative_error(Eg.grad, rdE) < TOL[torch.float32] and relative_error(Cg.grad, rdC) < 2e-5


NEEDS = {  # (dE, dC, db): which of E, C and the bias require a gradient
    "E": (True, False, False),
    "C": (False, True, False),
    "bias": (False, False, True),
    "E_bias": (True, False, True),
    "C_bias": (False, True, True),
}


@pytest.mark.parametrize("dtype", [torch.float16], ids=str)  # fp32 takes the same paths (CI's minutes)
@pytest.mark.parametrize("which", NEEDS)
def test_only_the_gradients_asked_for(which, dtype):
    """A frozen C (or E, or bias) gets no gradient and no pass of its own: no dE pass without dE
    (row_blocks 0), no dC pass without dC or db (tile_ranges 0), dC's pass without its products for
    db alone. What is computed matches the filtered float64 reference, and the filter keeps the pairs
    the full backward keeps."""
    need = NEEDS[which]
    E, C, x = inputs(dtype, ignore=[4])
    bias = head_bias(dtype)
    leaves = [t.clone().requires_grad_(n) for t, n in zip((E, C, bias), need)]
    stats, full = {}, {}
    loss = linear_cross_entropy(*leaves[:2], x, bias=leaves[2], reduction="sum", backward_impl="sparse",
                                filter_eps=EPS, sort_vocab=True, stats=stats, configs=small())
    loss.backward()
    assert stats["fallback"] is None, stats["fallback"]
    assert (stats["row_blocks"] > 0) == need[0] and (stats["tile_ranges"] > 0) == (need[1] or need[2])
    # The full backward (its forward splits the vocabulary otherwise, so its bits over-mark other
    # pairs): the filter keeps the same ones.
    act = run_sparse(E, C, x, torch.tensor(1.0), reduction="sum", sort=True, bias=bias, stats=full)[3]
    assert stats["kept_pairs"] == full["kept_pairs"]
    refs = filtered_reference(E, C, x, torch.tensor(1.0), EPS, act.order, stats["block_v"], reduction="sum",
                              bias=bias)
    for leaf, wanted, ref in zip(leaves, need, refs):
        assert (leaf.grad is not None) == wanted
        if wanted:
            assert relative_error(leaf.grad, ref) < TOL[dtype], relative_error(leaf.grad, ref)


def test_all_ignored():
    E, C, x = inputs(torch.float32, ignore=range(N))
    E_, C_ = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    loss = linear_cross_entropy(E_, C_, x, backward_impl="sparse", configs=small(), filter_eps=EPS)
    loss.backward()
    assert torch.isnan(loss) and not E_.grad.any() and not C_.grad.any()


def test_auto_eps_is_a_row_budget_over_the_tiles():
    """ "auto" under "sparse": B / T per tile (2^-10 / T in fp16: at most 2^-10 of a row's mass);
    fp32 "auto" stays off (and so runs "gemm")."""
    block_v = tier("interpreter").sparse_for(torch.float16).BLOCK_V
    assert sparse_auto_eps(torch.float16, V, block_v) == 2.0**-10 / 44
    assert sparse_auto_eps(torch.bfloat16, 256_000, 128) == 2.0**-7 / 2000
    assert sparse_auto_eps(torch.float32, V, block_v) is None
    assert sparse_auto_eps(torch.float16, V, block_v, label_smoothing=0.1) is None
    E, C, x = inputs(torch.float16)
    stats = {}
    E_, C_ = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    linear_cross_entropy(E_, C_, x, backward_impl="sparse", configs=small(), stats=stats, sort_vocab=True).backward()
    assert stats["eps"] == 2.0**-10 / 44
    assert stats["fallback"] is None or "mark" in stats["fallback"]
    assert stats["fallback"] is not None or stats["skipped_mass_max"] <= 2.0**-10 * 1.01


def test_through_autograd_twice_with_retained_graph():
    """The backward fixes the bits up in place; a second backward through the graph sees the same."""
    E, C, x = inputs(torch.float16, ignore=[2])
    E_, C_ = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    loss = linear_cross_entropy(E_, C_, x, backward_impl="sparse", configs=small(), filter_eps=EPS, sort_vocab=True,
                                reduction="sum")
    loss.backward(retain_graph=True)
    first = E_.grad.clone(), C_.grad.clone()
    E_.grad = C_.grad = None
    loss.backward()
    assert torch.equal(first[0], E_.grad) and torch.equal(first[1], C_.grad)
    dE, dC, _, _ = run_sparse(E, C, x, torch.tensor(1.0), reduction="sum", sort=True)
    assert torch.equal(dE, first[0]) and torch.equal(dC, first[1])


def test_non_contiguous_inputs():
    E, C, x = inputs(torch.float32, n=2 * N, d=2 * D)
    E_view = E.T.contiguous().T[::2, 1::2]
    C_view = C[:, ::2]
    x_view = torch.stack([x[:N], x[N:]], dim=1)[:, 0]
    go = upstream("mean")
    dE, dC, _, act = run_sparse(E_view, C_view, x_view, go, sort=True)
    rdE, rdC, _ = filtered_reference(E_view, C_view, x_view, go, EPS, act.order, act.block_v)
    assert relative_error(dE, rdE) < TOL[torch.float32] and relative_error(dC, rdC) < TOL[torch.float32]


def test_no_bits_without_a_backward(monkeypatch):
    """Inputs that need no gradient: the forward emits no bits (and the loss is the same)."""
    import helpers.cce.ops as ops

    asked = []
    real = ops.cce_forward
    monkeypatch.setattr(ops, "cce_forward", lambda *a, **k: asked.append(k.get("emit_activity", False)) or real(*a, **k))
    E, C, x = inputs(torch.float32)
    with_grad = linear_cross_entropy(E.clone().requires_grad_(True), C, x, backward_impl="sparse", configs=small(),
                                     filter_eps=EPS)
    plain = linear_cross_entropy(E, C, x, backward_impl="sparse", configs=small(), filter_eps=EPS)
    assert asked == [True, False] and with_grad.grad_fn is not None
    torch.testing.assert_close(plain, with_grad.detach())


def random_bits(T, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, ((T + 7) // 8, N), dtype=torch.uint8, generator=g)
    bits[-1] &= (1 << (T % 8)) - 1 if T % 8 else 255  # no marks past the last tile
    live = torch.rand(N, generator=g) < 0.7
    return bits, live


@pytest.mark.parametrize("rows", [1, 4, 128], ids=lambda r: f"segments_of_{r}")
def test_the_pair_index_lists_every_marked_pair_by_group_tile_row(rows):
    """``pair_index.build`` against the unpacked bits: positions, counts, rows, the dE pass's
    row-major slots and the packs, for row blocks of odd sizes and a range of bytes."""
    T, N, P = 21, 37, 3
    bits, live = random_bits(T, N)
    marked = unpack(bits, T) * live  # (T, N)
    row_slot = torch.zeros(N + 1, dtype=torch.int64)
    torch.cumsum(marked.sum(0), 0, out=row_slot[1:])
    live8 = live.to(torch.uint8)
    blocks = [(0, 10), (10, 11), (11, 30), (30, 37)]
    seg_start, seg_group = pair_index.segments(blocks, rows)
    index = pair_index.build(bits, live8, seg_start, seg_group, 0, bits.shape[0], int(marked.sum()), P,
                             row_slot=row_slot, group_slot0=[int(row_slot[n0]) for n0, _ in blocks], segment_rows=rows)
    pos = packs = 0
    for g, (n0, n1) in enumerate(blocks):
        for t in range(index.tiles):
            rows_t = [r for r in range(n0, n1) if t < T and marked[t, r]]
            assert int(index.pair_off[g, t]) == pos and int(index.pair_cnt[g, t]) == len(rows_t)
            assert int(index.pack_off[g * index.tiles + t]) == packs
            assert index.pair_row[pos:pos + len(rows_t)].tolist() == rows_t
            # Slot: the row's first, from its block's first row, plus its marked tiles before t.
            want = [int(row_slot[r] - row_slot[n0] + marked[:t, r].sum()) for r in rows_t]
            assert index.pair_slot[pos:pos + len(rows_t)].tolist() == want
            pos += len(rows_t)
            packs += -(-len(rows_t) // P)
    assert int(index.pack_off[-1]) == packs
    # The dC pass's: every row in one group, bytes [1, 3) (tiles 8..23, those past T empty).
    cnt, seg_start, seg_group = pair_index.tile_counts(bits, live8, N, rows)
    assert torch.equal(cnt.sum(0)[:T].long(), marked.sum(1))
    index = pair_index.build(bits, live8, seg_start, seg_group, 1, 2, int(marked[8:].sum()), P,
                             cnt=cnt[:, 8:24], segment_rows=rows)
    want = [r for t in range(8, T) for r in range(N) if marked[t, r]]
    assert index.tile0 == 8 and index.pair_row.tolist() == want


def test_the_popcount_of_rows_agrees_with_the_unpacked_bits_in_any_slicing():
    import helpers.cce.activity as activity

    T, N = 21, 37
    bits, live = random_bits(T, N)
    marked = unpack(bits, T)
    for rows in (5, 8192):  # slices that split the rows, and one that holds them all
        assert torch.equal(activity.popcount_rows(bits, count_rows=rows), marked.sum(0))
        assert torch.equal(activity.popcount_rows(bits, live, count_rows=rows), marked.sum(0) * live)


@pytest.mark.parametrize("sort", [False, True], ids=["unsorted", "sorted"])
def test_a_row_sure_of_its_target_loses_no_gradient_mass_in_the_stats(sort):
    """A row that predicts its target surely has |G| ~ 0 everywhere, its target tile included, so
    the filter drops that tile; the stats must count the |G| mass it lost (~0), not the softmax
    mass (~1), or every confident row reads as a row that lost everything (seen on the H200 at the
    Qwen3 head, realistic, N = 16,384: skipped_mass_max = 1.0)."""
    E, C, x = inputs(torch.float32)
    x[0] = int(C.norm(dim=1).argmax())  # the longest row of C: no other logit can match its own
    z = C.double() @ C[x[0]].double()
    margin = float(z[x[0]] - torch.cat([z[:x[0]], z[x[0] + 1:]]).max())
    E[0] = C[x[0]] * (30.0 / margin)
    S_x = torch.softmax(reference_logits(E[:1], C).double(), dim=1)[0, x[0]]
    assert 2 * (1 - S_x) < EPS  # the premise: row 0's whole |G| mass is below one tile's eps
    go = upstream("mean")
    stats = {}
    dE, dC, _, act = run_sparse(E, C, x, go, sort=sort, stats=stats)
    assert stats["fallback"] is None, stats["fallback"]
    assert stats["skipped_mass_max"] < act.tiles * EPS, stats["skipped_mass_max"]
    rdE, rdC, _ = filtered_reference(E, C, x, go, EPS, act.order, act.block_v)
    assert relative_error(dE, rdE) < TOL[torch.float32] and relative_error(dC, rdC) < TOL[torch.float32]
