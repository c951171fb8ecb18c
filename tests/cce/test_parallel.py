"""The vocabulary-parallel loss (``helpers.cce.parallel``) against the single-device loss and float64.

CPU only: the ranks are processes (``torch.multiprocessing`` spawn, the gloo backend), 2 and 4 of them,
each running the kernels under the Triton interpreter (fp32 and fp16; bf16 is wrong there and
``scripts/gpu/vocab_parallel.py`` covers the GPU and NCCL). Every rank builds the same E, C, bias and x
from one seed, keeps its slice C[s_r : s_r + V_r] and compares its loss, dE, dC_r and db_r with
``linear_cross_entropy`` on the whole C and with autograd through ``helpers.spec.reference_loss`` in
float64, for every option; V = 67 is odd (slices of 34/33 and 17/17/17/16 rows), a case puts every
target in rank 0's slice (the other ranks own none), one splits unevenly by hand. The gates are shown
able to fail: the smoothing term divided by the slice's V_r instead of V misses the tolerance. Then
the errors of bad setups, raised alike on every rank.
"""

import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import helpers  # noqa: F401  (the Triton interpreter on the CPU, before any kernel is defined)
from helpers.cce import linear_cross_entropy, linear_cross_entropy_outputs
from helpers.cce.parallel import vocab_parallel_cross_entropy, vocab_parallel_outputs
from helpers.lab.parallel import stop_rank
from helpers.spec import reference_logits, reference_loss, reference_outputs, relative_error

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU processes under the Triton interpreter; on GPUs "
                       "scripts/gpu/vocab_parallel.py checks the loss over NCCL"),
]

N, V, D = 23, 67, 16  # V odd: no world size divides it
IGNORED = [0, 9, 22]
# As tests/cce/test_outputs.py: fp32 is real fp32; fp16 rounds the products' inputs and G to 11 bits.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}

# (name, options): the loss's options; "bias", "weight" and "targets" are the test's own switches.
CASES = [
    ("plain", {}),
    ("bias+softcap", dict(bias=True, softcap=3.0)),
    ("z_loss+return_lse", dict(z_loss=1e-2, return_lse=True, bias=True)),
    ("label_smoothing", dict(label_smoothing=0.1, bias=True, softcap=3.0)),
    ("temperature+weight", dict(temperature=0.7, weight=True)),
    ("sum", dict(reduction="sum", softcap=2.0)),
    ("none", dict(reduction="none", bias=True)),
    ("atomic", dict(backward_impl="atomic", z_loss=1e-3)),
    ("partial dE", dict(dE_reduction="none", bias=True)),
    ("shift (B, T, D)", dict(shift=True)),
    ("sort_vocab", dict(sort_vocab=True, softcap=3.0)),
    ("one owner", dict(targets="rank 0", label_smoothing=0.2)),
    ("every token ignored", dict(targets="ignored", bias=True)),
]
FP16_CASES = ["plain", "bias+softcap", "label_smoothing", "partial dE"]


def spawn(worker, world: int, *args):
    """Run ``worker(rank, world, *args)`` on ``world`` gloo processes; a failing rank fails the test.
    The ranks meet through a file (no port to collide with another test's under xdist)."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_entry, args=(world, os.path.join(folder, "rendezvous"), worker, args), nprocs=world)


def _entry(rank, world, rendezvous, worker, args):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        worker(rank, world, *args)
    except BaseException:
        stop_rank(finished=False)
        raise
    stop_rank(finished=True)


def even_split(world: int) -> list[tuple[int, int]]:
    """(vocab_start, V_r) of each rank: V / world rows, the first V % world ranks one more."""
    sizes = [V // world + (r < V % world) for r in range(world)]
    return [(sum(sizes[:r]), sizes[r]) for r in range(world)]


def make_inputs(dtype, targets=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = (torch.randn(N, D, generator=g) / D**0.25).to(dtype)
    C = (torch.randn(V, D, generator=g) / D**0.25).to(dtype)
    bias = (0.5 * torch.randn(V, generator=g)).to(dtype)
    weight = torch.rand(V, generator=g) + 0.5
    x = torch.randint(0, V, (N,), generator=g)
    if targets == "rank 0":
        x = torch.randint(0, 16, (N,), generator=g)  # inside rank 0's slice for 2 and 4 ranks
    x[IGNORED] = -100
    if targets == "ignored":
        x[:] = -100
    return E, C, bias, weight, x


def leaves(*tensors, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_(True) for t in tensors]


def loss_options(case: dict) -> dict:
    return {k: v for k, v in case.items() if k not in ("bias", "weight", "targets", "dE_reduction")}


def backward_total(loss, lse, reduction):
    """What the test backpropagates: the loss (weighted per row for "none") plus, with the lse, 0.1 mean(lse^2)."""
    total = loss
    if reduction == "none":
        total = (loss * torch.linspace(-1.0, 2.0, loss.numel()).reshape(loss.shape).to(loss.dtype)).sum()
    if lse is not None:
        total = total + 0.1 * (lse.to(torch.float64 if loss.dtype == torch.float64 else lse.dtype) ** 2).mean()
    return total


def run_case(rank, world, dtype, case, split):
    """[(what, ours, single-device, float64)] of one case on this rank."""
    start, size = split[rank]
    E, C, bias, weight, x = make_inputs(dtype, case.get("targets"))
    options = loss_options(case)
    shift = options.get("shift", False)
    if shift:  # (B, T, D) with the causal shift done by the loss
        E, x = E[:22].reshape(2, 11, D), x[:22].reshape(2, 11)
    b = bias if case.get("bias") else None
    w = weight if case.get("weight") else None
    reduction = options.get("reduction", "mean")
    return_lse = options.get("return_lse", False)

    E1, C1, b1 = leaves(E, C[start:start + size], None if b is None else b[start:start + size])
    out = vocab_parallel_cross_entropy(E1, C1, x, vocab_start=start, vocab_size=V, bias_local=b1, weight=w,
                                       dE_reduction=case.get("dE_reduction", "all_reduce"), **options)
    loss, lse = out if return_lse else (out, None)
    backward_total(loss, lse, reduction).backward()
    dE = E1.grad
    if case.get("dE_reduction") == "none":  # each rank holds its partial sum: the caller's all_reduce
        dE = dE.clone()
        dist.all_reduce(dE)

    E2, C2, b2 = leaves(E, C, b)
    single = linear_cross_entropy(E2, C2, x, bias=b2, weight=w, **options)
    single_loss, single_lse = single if return_lse else (single, None)
    backward_total(single_loss, single_lse, reduction).backward()

    E3, C3, b3 = leaves(E, C, b, dtype=torch.float64)
    x3 = x
    if shift:
        x3 = torch.full_like(x, -100)
        x3[:, :-1] = x[:, 1:]
    spec = {k: v for k, v in options.items() if k in ("softcap", "z_loss", "label_smoothing", "temperature",
                                                       "reduction")}
    E3_flat, x3_flat = E3.reshape(-1, D), x3.reshape(-1)
    ref = reference_loss(E3_flat, C3, x3_flat, bias=b3, weight=None if w is None else w.double(), **spec)
    ref_lse = None
    if return_lse:
        ref_lse = torch.logsumexp(reference_logits(E3_flat, C3, options.get("softcap"), torch.float64, b3,
                                                   options.get("temperature", 1.0)), dim=1)
    backward_total(ref.reshape(loss.shape), ref_lse, reduction).backward()

    rows = slice(start, start + size)
    results = [("loss", loss, single_loss, ref), ("dE", dE, E2.grad, E3.grad), ("dC_r", C1.grad, C2.grad[rows],
                                                                                  C3.grad[rows])]
    if b is not None:
        results.append(("db_r", b1.grad, b2.grad[rows], b3.grad[rows]))
    if return_lse:
        results.append(("lse", lse, single_lse, ref_lse.reshape(lse.shape)))
    return results


def check_cases(rank, world, dtype, names, split_kind):
    split = even_split(world) if split_kind == "even" else [(0, 5), (5, 40), (45, 22)][:world]
    failures = []
    for name, case in CASES:
        if name not in names:
            continue
        for what, ours, single, ref in run_case(rank, world, dtype, case, split):
            if ref.isnan().all():  # a mean over no token: NaN, as torch (the gradients are 0)
                ok = bool(ours.isnan().all()) if what == "loss" else bool((ours == 0).all())
                if not ok:
                    failures.append(f"{name}: {what} not as torch's for no kept token")
                continue
            for against, r in (("float64", ref), ("single-device", single)):
                err = relative_error(ours, r)
                if not err <= TOL[dtype]:
                    failures.append(f"{name}: {what} against {against}: relative error {err:.2e} > {TOL[dtype]}")
    assert not failures, f"rank {rank} of {world}, {dtype}:\n" + "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_device_and_float64_fp32(world):
    spawn(check_cases, world, torch.float32, [name for name, _ in CASES], "even")


@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_device_and_float64_fp16(world):
    spawn(check_cases, world, torch.float16, FP16_CASES, "even")


def test_uneven_hand_split():
    """Three ranks holding 5, 40 and 22 rows: slices need not be equal, only contiguous."""
    spawn(check_cases, 3, torch.float32, ["plain", "label_smoothing", "bias+softcap"], "hand")


def check_outputs(rank, world, dtype):
    start, size = even_split(world)[rank]
    E, C, bias, _, x = make_inputs(dtype)
    g1, g2 = torch.randn(N, generator=torch.Generator().manual_seed(1)), torch.linspace(-1, 1, N)
    options = dict(softcap=3.0, temperature=0.8)
    E1, C1, b1 = leaves(E, C[start:start + size], bias[start:start + size])
    out = vocab_parallel_outputs(E1, C1, x, vocab_start=start, vocab_size=V, bias_local=b1, **options)
    ((out.logprob * g1).sum() + (out.entropy * g2).sum()).backward()
    E2, C2, b2 = leaves(E, C, bias)
    single = linear_cross_entropy_outputs(E2, C2, x, bias=b2, **options)
    ((single.logprob * g1).sum() + (single.entropy * g2).sum()).backward()
    E3, C3, b3 = leaves(E, C, bias, dtype=torch.float64)
    ref = reference_outputs(E3, C3, x, bias=b3, **options)
    ((ref[0] * g1.double()).sum() + (ref[1] * g2.double()).sum()).backward()
    rows = slice(start, start + size)
    failures = []
    for what, ours, one, r in [("logprob", out.logprob, single.logprob, ref[0]),
                               ("entropy", out.entropy, single.entropy, ref[1]),
                               ("dE", E1.grad, E2.grad, E3.grad), ("dC_r", C1.grad, C2.grad[rows], C3.grad[rows]),
                               ("db_r", b1.grad, b2.grad[rows], b3.grad[rows])]:
        for against, reference in (("float64", r), ("single-device", one)):
            err = relative_error(ours, reference)
            if not err <= TOL[dtype]:
                failures.append(f"{what} against {against}: {err:.2e}")
    if not torch.equal(out.correct, single.correct) or not torch.equal(out.correct, ref[2]):
        failures.append(f"correct: {out.correct.tolist()} against float64's {ref[2].tolist()}")
    if not out.correct.any():
        failures.append("no token is correct: the accuracy check tests nothing")
    assert not failures, f"rank {rank} of {world}, {dtype}:\n" + "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_outputs(world, dtype):
    spawn(check_outputs, world, dtype)


def check_smoothing_mutation(rank, world):
    """The smoothing term over V_r (the slice) instead of V: dC_r misses the tolerance."""
    import helpers.cce.parallel as parallel

    real = parallel.replace

    def unscaled(obj, **changes):  # drops the V_r / V factor the backward puts on c
        if "coef" in changes:
            changes["coef"] = obj.coef
        return real(obj, **changes)

    parallel.replace = unscaled
    try:
        results = run_case(rank, world, torch.float32, dict(label_smoothing=0.3), even_split(world))
    finally:
        parallel.replace = real
    errors = {what: relative_error(ours, ref) for what, ours, _, ref in results}
    assert errors["dC_r"] > 100 * TOL[torch.float32], errors


def test_gate_catches_smoothing_over_the_slice():
    spawn(check_smoothing_mutation, 2)


def expect_error(match, fn):
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as error:
        assert match in str(error), f"expected {match!r} in: {error}"
        return str(error)
    raise AssertionError(f"no error; expected one saying {match!r}")


def check_errors(rank, world):
    E, C, bias, _, x = make_inputs(torch.float32)
    start, size = even_split(world)[rank]
    C_r = C[start:start + size]

    def call(C_local=C_r, vocab_start=start, targets=x, group=None, **options):
        return vocab_parallel_cross_entropy(E, C_local, targets, vocab_start=vocab_start, vocab_size=V, group=group,
                                            **options)

    # Shards of different D: rank 1's slice has one more column.
    wide = torch.randn(size, D + 1) if rank == 1 else C_r
    expect_error("must share the hidden size D" if rank == 1 else "rank(s) [1] refused their inputs",
                 lambda: call(C_local=wide))
    # Every rank consistent with itself, the ranks not with each other: E and C one column wider on rank 1.
    E_wide = torch.randn(E.shape[0], D + 1) if rank == 1 else E
    expect_error("different D", lambda: vocab_parallel_cross_entropy(E_wide, wide, x, vocab_start=start, vocab_size=V))
    # Slices that overlap, leave a gap, or pass vocab_size.
    expect_error("held twice", lambda: call(C_local=C[30:] if rank == 1 else C[:40], vocab_start=30 * rank))
    expect_error("held by no rank", lambda: call(C_local=C[40:] if rank == 1 else C[:30], vocab_start=40 * rank))
    expect_error("does not match the declared vocabulary range",
                 lambda: call(C_local=torch.randn(40, D) if rank == 1 else C[:34], vocab_start=34 * rank))
    # A group of one with a sharded head: each rank alone in its own group.
    singles = [dist.new_group([r]) for r in range(world)]
    expect_error("the process group has one rank", lambda: call(group=singles[rank]))
    # Ranks that disagree on the targets or on the options.
    other = x.clone()
    other[3] = (other[3] + rank) % V
    expect_error("different targets", lambda: call(targets=other))
    expect_error("different loss options", lambda: call(softcap=1.0 + rank))
    # Targets outside [0, V), an unknown dE_reduction, and the "sparse" backward.
    bad = x.clone()
    bad[4] = V
    expect_error("outside [0, V=67)", lambda: call(targets=bad))
    expect_error("dE_reduction must be one of", lambda: call(dE_reduction="reduce_scatter"))
    expect_error('backward_impl="sparse" is not supported', lambda: call(backward_impl="sparse"))
    weight = torch.ones(V)
    expect_error("weight with label_smoothing or z_loss is not supported by the vocabulary-parallel loss",
                 lambda: call(weight=weight, label_smoothing=0.1))
    # A refusal on one rank only (its own argument checks): raised there, and every other rank stops too,
    # rather than waiting in the layout's all_gather until the group times out.
    half = C_r.half() if rank == 1 else C_r
    expect_error("C must have E's dtype" if rank == 1 else "rank(s) [1] refused their inputs", lambda: call(C_local=half))
    listed = C_r.tolist() if rank == 0 else C_r
    expect_error("C must be a torch.Tensor" if rank == 0 else "rank(s) [0] refused their inputs",
                 lambda: call(C_local=listed))
    expect_error("stats must be a dict" if rank == 1 else "rank(s) [1] refused their inputs",
                 lambda: vocab_parallel_outputs(E, C_r, x, vocab_start=start, vocab_size=V,
                                                stats=[] if rank == 1 else None))
    expect_error("vocab_size must be in [1, 2^62)" if rank == 1 else "rank(s) [1] refused their inputs",
                 lambda: vocab_parallel_cross_entropy(E, C_r, x, vocab_start=start, vocab_size=-5 if rank == 1 else V,
                                                      weight=torch.ones(V)))
    expect_error('backward_impl must be "gemm" or "atomic"', lambda: call(backward_impl="auto"))
    # The backward's all_reduce of dE is collective: ranks that disagree on wanting dE are refused.
    E_grad = E.clone().requires_grad_(rank == 0)
    expect_error("different loss options",
                 lambda: vocab_parallel_cross_entropy(E_grad, C_r, x, vocab_start=start, vocab_size=V))
    # After all of these, a good call still works (no rank left behind in a collective).
    assert torch.isfinite(call())
    # The range is checked on the targets as scored: a first target the causal shift drops may be anything,
    # as for the single-device loss (it was refused before the shift).
    dropped = x.clone()
    dropped[0] = V + 5
    torch.testing.assert_close(call(targets=dropped, shift=True), call(targets=x, shift=True))


def test_bad_setups_raise_on_every_rank():
    spawn(check_errors, 2)


def test_without_torch_distributed_initialised():
    E, C, _, _, x = make_inputs(torch.float32)
    expect_error("needs torch.distributed initialised",
                 lambda: vocab_parallel_cross_entropy(E, C, x, vocab_start=0, vocab_size=V))
