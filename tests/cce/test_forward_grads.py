"""The "forward_grads" schedule and the memory budget (``helpers.cce.schedules``,
``helpers.cce.forward_grads``) against the float64 reference, on the CPU.

Under the Triton interpreter in fp32 and fp16 (bf16 is wrong there; the GPU gate covers it), on a
tiny irregular shape (N=37, V=301, D=24 against the interpreter's 32-column row blocks), in one chunk
and in chunks of 16 rows (the budget chosen so that the chooser gives them), with fp16's logits held
in 16 bits and, as where fp16 could overflow, in fp32. Gradients must stay within the gate's bound:
max(the dtype's floor, 2 x the naive path's error) (``helpers.compare.verdicts.gate_bound``).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.cce import linear_cross_entropy  # noqa: E402
from helpers.cce.kernels.configs import tier  # noqa: E402
from helpers.cce.schedules import (  # noqa: E402
    MemoryBudgetError,
    choose_schedule,
    forward_grads_extra_bytes,
    recompute_extra_bytes,
    recompute_rows,
)
from helpers.compare.inputs import make_inputs as regime_inputs  # noqa: E402
from helpers.compare.methods.baselines import naive_loss  # noqa: E402
from helpers.compare.verdicts import gate_bound  # noqa: E402
from helpers.spec import reference_loss, reference_loss_and_grads, relative_error  # noqa: E402

N, V, D = 37, 301, 24
DTYPES = [torch.float32, torch.float16]
# CPU tensors under the interpreter (module doc): a GPU's interpreter is off and the kernels refuse
# them. The schedules on a GPU: scripts/gpu/schedule_check.py.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the Triton interpreter)")
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
ROWS = 16
# The interpreter's tier: "one" chunk, "several" of ROWS rows, and several with fp16 logits held in
# fp32 (the limit at 0). At this shape one fp16 chunk takes less memory than dC's fp32 accumulator,
# so the chunks are fixed (``HostTuning.forward_grads_rows``) rather than left to the budget, and dC's
# accumulator is fp32 but where the case is dC accumulated in fp16 (``dC_in_dtype_chunks``). No host
# time per launch and no time per byte: at D = 24 either would rightly make recompute the faster.
FREE = tier("interpreter").tuned(launch_us=0.0, bandwidth_gbs=1e12)
CONFIGS = {"one": FREE,
           "several": FREE.tuned(forward_grads_rows=ROWS, dC_in_dtype_chunks=0),
           "fp32_logits": FREE.tuned(forward_grads_rows=ROWS, fp16_logit_limit=0.0, dC_in_dtype_chunks=0),
           # A budget below dC's fp32 accumulator: dC accumulated in fp16 itself, rounded once a chunk.
           "dC_in_dtype": FREE.tuned(forward_grads_rows=ROWS)}


def inputs(dtype, ignore=(), scale=1.0, bias=False):
    E, C, x = regime_inputs(N, V, D, torch.float32, "cpu", regime="uniform", seed=0)
    x[list(ignore)] = -100
    b = torch.randn(V, generator=torch.Generator().manual_seed(2)).to(dtype) if bias else None
    return (scale * E).to(dtype), C.to(dtype), x, b


def budget_for(dtype, rows, logits_itemsize=None, bias=False, fp32_dC=True):
    """The least budget whose chunks take ``rows`` rows (``forward_grads_extra_bytes``)."""
    b = dtype.itemsize
    return forward_grads_extra_bytes(N, V, D, b, rows, logits_itemsize or b, need=(True, True, bias), fp32_dC=fp32_dC,
                                     fp16=dtype == torch.float16)


def run(E, C, x, bias, go, **options):
    E = E.clone().requires_grad_(True)
    C = C.clone().requires_grad_(True)
    b = bias.clone().requires_grad_(True) if bias is not None else None
    stats = {}
    loss = linear_cross_entropy(E, C, x, bias=b, stats=stats, **options)
    loss.backward(go)
    return loss.detach(), E.grad, C.grad, (b.grad if b is not None else None), stats


CASES = {
    "mean": dict(),
    "sum": dict(reduction="sum"),
    "ignore_some": dict(ignore=[0, 7, 36]),
    "softcap": dict(softcap=2.5, scale=4.0),
    "bias": dict(bias=True),
    "z_loss": dict(z_loss=0.1, reduction="sum"),
    "label_smoothing": dict(label_smoothing=0.2),
    "temperature": dict(temperature=0.7),
    "everything": dict(z_loss=0.05, label_smoothing=0.2, softcap=3.0, ignore=[1, 2, 30], bias=True,
                       reduction="sum"),
}



def test_a_large_soft_cap_keeps_fp32s_gradients_at_the_naive_paths_accuracy():
    """As tests/cce/test_cce.py's test of that name, through this schedule's row kernel: logits of ~1
    under a cap of 50, fp32, dE and dC within 1.5x the naive fp32 path's error against float64 (the cap's
    16-bit form gave dC ~3x), and the same rows without a cap (1.06x and 0.96x; this schedule's row kernel
    sums a row's mass in one program, so its non-target mass alone gave 1.11x and 1.02x)."""
    E, C, x, _ = inputs(torch.float32)
    go = torch.tensor(1.7)
    for softcap in (50.0, None):
        loss, dE, dC, _, stats = run(E, C, x, None, go, reduction="sum", softcap=softcap, configs=CONFIGS["several"],
                                     memory_budget=budget_for(torch.float32, ROWS))
        assert stats["schedule"] == "forward_grads", stats["why"]
        _, rdE, rdC = reference_loss_and_grads(E, C, x, go, reduction="sum", softcap=softcap)
        En, Cn = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
        z = En @ Cn.T if softcap is None else softcap * torch.tanh(En @ Cn.T / softcap)
        torch.nn.functional.cross_entropy(z, x, reduction="sum").backward(go)
        for name, ours, naive in (("dE", relative_error(dE, rdE), relative_error(En.grad, rdE)),
                                  ("dC", relative_error(dC, rdC), relative_error(Cn.grad, rdC))):
            assert ours < 1.5 * naive, f"softcap {softcap}, {name}: {ours:.2e} against naive's {naive:.2e}"


def test_large_logits_keep_fp32s_gradients_at_the_naive_paths_accuracy():
    """Logits of rms ~10 (lse ~ 30), fp32: the row kernel's softmax as exp(z - lse) took lse's own rounding
    (~1e-6) into every entry of the row, and dE and dC erred 2.9x and 2.7x the naive fp32 path's against
    float64; as exp((z - m) - log s), as torch's log_softmax, 1.03x and 1.02x."""
    E, C, x, _ = inputs(torch.float32, scale=10.0)
    go = torch.tensor(1.7)
    _, dE, dC, _, stats = run(E, C, x, None, go, reduction="sum", configs=CONFIGS["several"],
                              memory_budget=budget_for(torch.float32, ROWS))
    assert stats["schedule"] == "forward_grads", stats["why"]
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go, reduction="sum")
    En, Cn = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(En @ Cn.T, x, reduction="sum").backward(go)
    for name, ours, naive in (("dE", relative_error(dE, rdE), relative_error(En.grad, rdE)),
                              ("dC", relative_error(dC, rdC), relative_error(Cn.grad, rdC))):
        assert ours < 1.5 * naive, f"{name}: {ours:.2e} against naive's {naive:.2e}"

@pytest.mark.parametrize("chunks", ["one", "several", "fp32_logits", "dC_in_dtype"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_forward_grads_against_reference(case, dtype, chunks):
    if chunks == "fp32_logits" and dtype != torch.float16:
        pytest.skip("fp32 logits are for fp16 inputs")
    if chunks == "dC_in_dtype":
        pytest.skip("dC accumulated in its own dtype is bf16's (fp16 holds its gradients in fp32): not on the CPU")
    opts = dict(CASES[case])
    E, C, x, bias = inputs(dtype, opts.pop("ignore", ()), opts.pop("scale", 1.0), opts.pop("bias", False))
    rows = N if chunks == "one" else ROWS
    z_bytes = 4 if chunks == "fp32_logits" else None
    go = torch.tensor(1.7)  # a non-1 scalar, so a missing scale shows
    in_dtype = chunks == "dC_in_dtype"
    budget = budget_for(dtype, rows, z_bytes, bias is not None, fp32_dC=not in_dtype)  # exactly the predicted extra
    loss, dE, dC, db, stats = run(E, C, x, bias, go, memory_budget=budget, configs=CONFIGS[chunks], **opts)
    assert stats["schedule"] == "forward_grads" and stats["rows"] == rows, stats["why"]
    assert stats["predicted_extra_bytes"] == budget
    if dtype != torch.float32 and chunks != "one":
        assert stats["dC_accumulator"] == ("dtype" if in_dtype else "fp32"), stats["why"]
    assert stats["logits_dtype"] == ("float32" if chunks == "fp32_logits" or dtype == torch.float32 else "float16")
    rloss, rdE, rdC = reference_loss_and_grads(E, C, x, go, bias=bias, **opts)
    assert loss.dtype == torch.float32 and dE.dtype == dtype and dC.dtype == dtype
    torch.testing.assert_close(loss.double(), rloss, rtol=TOL[dtype], atol=TOL[dtype])
    assert relative_error(dE, rdE) < TOL[dtype], f"dE rel err {relative_error(dE, rdE):.2e}"
    assert relative_error(dC, rdC) < TOL[dtype], f"dC rel err {relative_error(dC, rdC):.2e}"
    if bias is not None:
        b64 = bias.double().requires_grad_(True)
        from helpers.spec import reference_loss

        (reference_loss(E.double(), C.double(), x, bias=b64, **opts) * go.double()).backward()
        assert relative_error(db, b64.grad) < TOL[dtype], f"db rel err {relative_error(db, b64.grad):.2e}"


@pytest.mark.parametrize("chunks", ["one", "several"])
def test_logits_deep_in_the_soft_caps_saturation_keep_their_gradient(chunks):
    """fp32, every pre-cap logit 11-13 caps (a bias of ~12 under a cap of 1): tanh rounds to 1, so
    1 - t^2 was 0 and every gradient 0, while the cap's slope is ~1e-10 (``slope_from_gap``)."""
    E, C, x, bias = inputs(torch.float32, scale=0.1, bias=True)
    bias = 12.0 + bias / 8  # the logits 11-13
    go = torch.tensor(1.7)
    budget = budget_for(torch.float32, N if chunks == "one" else ROWS, bias=True)
    loss, dE, dC, db, stats = run(E, C, x, bias, go, memory_budget=budget, configs=CONFIGS[chunks], softcap=1.0)
    assert stats["schedule"] == "forward_grads", stats["why"]
    _, rdE, rdC = reference_loss_and_grads(E, C, x, go, bias=bias, softcap=1.0)
    assert rdE.abs().max() > 1e-12
    assert relative_error(dE, rdE) < 1e-4 and relative_error(dC, rdC) < 1e-4


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_fp16_within_the_gate_bound(softcap):
    """fp16 logits held in 16 bits, several chunks, dC accumulated in fp32: each quantity within
    max(floor, 2 x naive's error), the gate's bound on a GPU."""
    E, C, x, _ = inputs(torch.float16, ignore=range(0, N, 7))
    go = torch.tensor(1.0)
    loss, dE, dC, _, stats = run(E, C, x, None, go, memory_budget=budget_for(torch.float16, ROWS),
                                 configs=CONFIGS["several"], softcap=softcap)
    assert stats["schedule"] == "forward_grads" and stats["chunks"] == 3
    assert stats["dC_accumulator"] == "fp32"
    nE, nC = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
    naive = naive_loss(nE, nC, x, softcap=softcap)
    naive.backward()
    rloss, rdE, rdC = reference_loss_and_grads(E, C, x, go, softcap=softcap)
    for name, ours, theirs, ref in (("loss", loss, naive.detach(), rloss), ("dE", dE, nE.grad, rdE),
                                    ("dC", dC, nC.grad, rdC)):
        bound = gate_bound("float16", name, relative_error(theirs, ref))
        assert relative_error(ours, ref) <= bound, (name, relative_error(ours, ref), bound)


@pytest.mark.parametrize("configs", ["one", "several"])
def test_fp16_gradients_meet_the_loss_scale_before_fp16_does(configs):
    """fp16 training scales the loss (GradScaler) so that small gradients survive fp16; the scale arrives as
    the upstream gradient. Rounded to fp16 in the forward, dE and dC erred 1.6e-2 against float64 with E and C
    of ~1e-4 and a scale of 2^16, where "min" erred 2.2e-4 (on an H100 as a T4, notebook 03's fp16
    fine-tuning drifted 0.0475 from exact). Held in fp32 until the backward, within 1.5x of "min"."""
    E, C, x, _ = inputs(torch.float16, scale=1e-4)
    C = (C.float() * 1e-4).half()
    e, c = E.double().requires_grad_(), C.double().requires_grad_()
    reference_loss(e, c, x).backward()
    errors = {}
    for budget in ("min", 2**30):
        _, dE, dC, _, stats = run(E, C, x, None, torch.tensor(2.0**16), memory_budget=budget, configs=CONFIGS[configs])
        assert dE.dtype == dC.dtype == torch.float16
        errors[stats["schedule"]] = (relative_error(dE.double() / 2**16, e.grad), relative_error(dC.double() / 2**16, c.grad))
    (min_dE, min_dC), (ours_dE, ours_dC) = errors["recompute"], errors["forward_grads"]
    assert ours_dE <= 1.5 * min_dE and ours_dC <= 1.5 * min_dC, errors


def test_dC_in_its_dtype_is_held_to_its_chunk_cap_and_never_fp16s():
    """Below dC's fp32 accumulator the budget runs bf16's dC accumulated in itself for at most
    ``dC_in_dtype_chunks`` chunks; with a cap below the 3 chunks, nothing fits, and the error says so.
    fp16 holds its gradients in fp32 (the loss scale), so the same budget fits it no forward_grads."""
    need = (True, True, False)  # the CPU's plans (16-bit products upcast), where recompute needs more than this
    budget = forward_grads_extra_bytes(N, V, D, 2, ROWS, 2, need=need, fp32_dC=False)
    s = choose_schedule(N, V, D, torch.bfloat16, budget, CONFIGS["dC_in_dtype"], need=need)
    assert s.name == "forward_grads" and not s.fp32_dC and s.rows == ROWS, s.why
    with pytest.raises(MemoryBudgetError, match="fits no schedule"):
        choose_schedule(N, V, D, torch.bfloat16, budget, CONFIGS["dC_in_dtype"].tuned(dC_in_dtype_chunks=2), need=need)
    with pytest.raises(MemoryBudgetError, match="fits no schedule"):
        choose_schedule(N, V, D, torch.float16, budget, CONFIGS["dC_in_dtype"], need=need)
    s = choose_schedule(N, V, D, torch.float16, 10 * budget, CONFIGS["dC_in_dtype"], need=need)
    assert s.name == "forward_grads" and s.fp32_dC, s.why


def test_the_gemma_head_at_one_gib_accumulates_dC_in_bf16():
    """The Gemma-2-2B head (N 8,192, bf16, the Hopper tier): dC's fp32 accumulator alone (2.36 GB) passes
    1 GiB, so the budget runs dC accumulated in bf16, in the fewest chunks that fit (4 of 2,048 rows)."""
    hopper = tier("hopper-227k")
    s = choose_schedule(8192, 256000, 2304, torch.bfloat16, 2**30, hopper, need=(True, True, False),
                        device=torch.device("cuda"))
    assert s.name == "forward_grads" and not s.fp32_dC and s.rows == 2048, s.why
    assert s.predicted_extra_bytes <= 2**30 and "accumulated in bfloat16" in s.why


def test_all_ignored_mean_is_nan_with_zero_gradients():
    E, C, x, _ = inputs(torch.float32, ignore=range(N))
    loss, dE, dC, _, stats = run(E, C, x, None, torch.tensor(1.0), memory_budget=2**30, configs=FREE)
    assert stats["schedule"] == "forward_grads" and torch.isnan(loss) and not dE.any() and not dC.any()


@pytest.mark.parametrize("why, options", [
    ("reduction 'none'", dict(reduction="none")),
    ("return_lse", dict(return_lse=True)),
    ("reduction 'none'", dict(weight=torch.rand(V) + 0.5)),
])
def test_calls_it_cannot_serve_run_recompute_and_say_why(why, options):
    E, C, x, _ = inputs(torch.float32)
    E.requires_grad_(True)
    stats = {}
    out = linear_cross_entropy(E, C, x, memory_budget=2**30, stats=stats, **options)
    loss = out[0] if isinstance(out, tuple) else out
    loss.sum().backward()
    assert stats["schedule"] == "recompute" and why in stats["why"], stats["why"]
    with torch.no_grad():
        stats = {}
        linear_cross_entropy(E, C, x, memory_budget=2**30, stats=stats)
        assert stats["schedule"] == "recompute" and "no gradient" in stats["why"]


def test_min_and_auto_on_the_cpu_run_recompute():
    E, C, x, _ = inputs(torch.float32)
    for budget in ("min", "auto"):
        stats = {}
        linear_cross_entropy(E.requires_grad_(True), C, x, memory_budget=budget, stats=stats).backward()
        assert stats["schedule"] == "recompute" and stats["predicted_peak_bytes"] > 0, stats


@pytest.mark.parametrize("bad", ["max", -1, float("nan"), True, None, "1GiB"])
def test_a_bad_budget_is_named(bad):
    E, C, x, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match="memory_budget"):
        linear_cross_entropy(E, C, x, memory_budget=bad)


def test_a_budget_that_fits_no_schedule_says_so_with_the_numbers():
    E, C, x, _ = inputs(torch.float32)
    with pytest.raises(MemoryBudgetError, match=r"fits no schedule at N=37.*recompute needs .* forward_grads at least"):
        linear_cross_entropy(E.requires_grad_(True), C, x, memory_budget=100)


def test_the_gradients_are_handed_over_once():
    E, C, x, _ = inputs(torch.float32)
    E.requires_grad_(True)
    loss = linear_cross_entropy(E, C, x, memory_budget=2**30, configs=FREE)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="handed over"):
        loss.backward()


def test_the_chooser_takes_the_fastest_that_fits_and_the_most_rows():
    """At the Qwen3 head (N 16,384, bf16, the Hopper tier): "min" recompute; 1 GiB gives
    forward_grads, chunks as large as fit; a budget below forward_grads' least gives recompute."""
    hopper = tier("hopper-227k")
    need = (True, True, False)
    Nq, Vq, Dq = 16384, 151936, 1024
    s = choose_schedule(Nq, Vq, Dq, torch.bfloat16, 2**30, hopper, need=need, device=torch.device("cuda"))
    assert s.name == "forward_grads" and s.predicted_extra_bytes <= 2**30
    assert not s.fp32_dC and -(-Nq // s.rows) == 5, s.why  # dC in bf16 leaves room for larger chunks
    assert forward_grads_extra_bytes(Nq, Vq, Dq, 2, s.rows + hopper.host.row_multiple, 2, need=need,
                                     fp32_dC=False) > 2**30
    assert s.predicted_peak_bytes == (Nq + Vq) * Dq * 2 + s.predicted_extra_bytes
    small = recompute_extra_bytes(Nq, Vq, Dq, 2, hopper, need=need)
    s = choose_schedule(Nq, Vq, Dq, torch.bfloat16, small, hopper, need=need, device=torch.device("cuda"))
    assert s.name == "recompute" and "at least" in s.why
    assert choose_schedule(Nq, Vq, Dq, torch.bfloat16, "min", hopper, need=need).name == "recompute"


def test_the_default_budget_is_the_tiers():
    """memory_budget="default" (the loss's default): each tier's ``default_budget``, "min" on every shipped tier
    but the T4's and always on the CPU. The T4's is 1 GiB (measured so: its Triton's 16-bit products as fp32
    FMAs): it runs forward_grads at the Qwen3 head and 16,384 fp16 tokens, all three products in cuBLAS,
    and says why."""
    need, cuda = (True, True, False), torch.device("cuda")
    Nq, Vq, Dq = 16384, 151936, 1024
    for name in ("ampere-99k", "ampere-163k", "hopper-227k"):
        s = choose_schedule(Nq, Vq, Dq, torch.float16, "default", tier(name), need=need, device=cuda)
        assert s.name == "recompute" and s.budget_bytes is None, (name, s.why)
    turing = tier("turing-64k")
    assert turing.host.default_budget == 2**30
    s = choose_schedule(Nq, Vq, Dq, torch.float16, "default", turing, need=need, device=cuda)
    assert s.name == "forward_grads" and s.budget_bytes == 2**30 and "turing-64k tier's default budget" in s.why
    assert choose_schedule(Nq, Vq, Dq, torch.float16, "default", turing, need=need).name == "recompute"  # CPU
    # The time model knows why: the recompute design's four products against three, its logits from cuBLAS
    # (``HostTuning.logits_in_cublas_bytes``); with our Triton products there, at a T4's fp32 rate, over 5x.
    least = choose_schedule(Nq, Vq, Dq, torch.float16, "min", turing, need=need, device=cuda).predicted_ms
    assert 1.1 * s.predicted_ms < least < 1.5 * s.predicted_ms
    assert (choose_schedule(Nq, Vq, Dq, torch.float16, "min", turing.tuned(logits_in_cublas_bytes=0), need=need,
                            device=cuda).predicted_ms > 5 * s.predicted_ms)


@pytest.mark.parametrize("free_gib, raised", [(12, True), (2, False)])
def test_a_default_too_small_for_the_head_is_raised_within_its_ceiling(monkeypatch, free_gib, raised):
    """At the Gemma-2-2B head in fp16 the T4's 1 GiB fits no forward_grads (its dC held in fp32 alone is
    4 V D = 2.4 GB); the default is raised to its least need plus 1 GiB, within 4 GiB and half of what is
    free (measured as a pretend T4 at 8,192 tokens: "min" 915 ms, 4 GiB 50.9 ms). With too little free, or
    on a tier without a ceiling, it stays the recompute design."""
    import helpers.cce.schedules as schedules

    seen = []

    def free(device, lb):  # half of what a card with free_gib GiB free would leave beyond LB
        seen.append(lb)
        return int(0.5 * (free_gib * 2**30 - lb))

    monkeypatch.setattr(schedules, "auto_budget_bytes", free)
    need, cuda = (True, True, False), torch.device("cuda")
    turing = tier("turing-64k")
    s = choose_schedule(8192, 256000, 2304, torch.float16, "default", turing, need=need, device=cuda)
    assert seen, "what is free was not asked"
    if raised:
        assert s.name == "forward_grads" and 2**30 < s.budget_bytes <= 2**32, s.why
        assert s.predicted_extra_bytes <= s.budget_bytes and "raised to" in s.why, s.why
    else:
        assert s.name == "recompute" and "raised" not in s.why, s.why
    # Where the default fits, nothing is raised and nothing asked; a tier without a ceiling never raises.
    seen.clear()
    s = choose_schedule(16384, 151936, 1024, torch.float16, "default", turing, need=need, device=cuda)
    assert s.name == "forward_grads" and s.budget_bytes == 2**30 and not seen
    s = choose_schedule(8192, 256000, 2304, torch.float16, "default", turing.tuned(default_budget_max=0), need=need,
                        device=cuda)
    assert s.name == "recompute" and not seen
    # A prediction for a card that is not this process's (helpers.compare's formulas) leaves what is free out.
    s = choose_schedule(8192, 256000, 2304, torch.float16, "default", turing, need=need, device=cuda, ask_free=False)
    assert s.name == "forward_grads" and "raised to" in s.why and not seen


def test_a_default_budget_that_fits_no_schedule_runs_min():
    """A number the caller gives that fits nothing raises; the tier's default falls back to "min" instead."""
    turing = tier("turing-64k").tuned(default_budget=100)
    need, cuda = (True, True, False), torch.device("cuda")
    with pytest.raises(MemoryBudgetError):
        choose_schedule(4096, 151936, 1024, torch.float16, 100, turing, need=need, device=cuda)
    s = choose_schedule(4096, 151936, 1024, torch.float16, "default", turing, need=need, device=cuda)
    assert s.name == "recompute" and s.budget_bytes is None and "fits no schedule" in s.why, s.why


def test_the_default_runs_min_on_the_cpu_and_is_named_in_stats():
    E, C, x, _ = inputs(torch.float32)
    stats = {}
    linear_cross_entropy(E.requires_grad_(True), C, x, stats=stats, configs=tier("turing-64k")).backward()
    assert stats["schedule"] == "recompute" and stats["why"].startswith("memory_budget='min'"), stats


def test_auto_takes_half_of_what_the_allocators_cap_leaves(monkeypatch):
    """"auto" on a GPU capped to a 16 GB card's memory (``set_per_process_memory_fraction``, as notebook
    05 caps an H200): half of what the cap leaves, not of what the driver has free. Uncapped, half of
    the driver's free memory and the allocator's cached blocks."""
    import types

    import helpers.cce.device as device_module
    from helpers.cce.schedules import AUTO_SHARE, auto_budget_bytes

    GB = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (128 * GB, 140 * GB))  # 12 GB ours
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * GB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 * GB)
    monkeypatch.setattr(device_module, "device_info", lambda device: types.SimpleNamespace(total_memory_bytes=None))
    lb = GB
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 16 / 140, raising=False)
    assert auto_budget_bytes(torch.device("cuda"), lb) == int(AUTO_SHARE * (16 * GB - 10 * GB - lb))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    assert auto_budget_bytes(torch.device("cuda"), lb) == int(AUTO_SHARE * (130 * GB - lb))


def test_a_budget_below_the_recompute_plan_runs_it_with_fewer_rows_per_accumulator():
    """At the Qwen3 head (16k tokens, bf16, the Hopper tier's plan, arithmetic only) 40 MiB is less
    than the recompute plan's 64 MiB and than any forward_grads chunk: the recompute design runs with
    8,192 rows per dE accumulator (1.111 LB predicted; 1.117 measured on an H200). Below its fewest
    rows the error names that need too."""
    hopper = tier("hopper-227k")
    schedule = choose_schedule(16_384, 151_936, 1_024, torch.bfloat16, 40 * 2**20, hopper,
                               need=(True, True, False), device=torch.device("cuda"))
    assert schedule.name == "recompute" and schedule.gemm_chunks[0] == 8_192, schedule
    assert schedule.predicted_extra_bytes <= 40 * 2**20 and "rows per dE accumulator" in schedule.why
    assert schedule.as_stats()["gemm_chunks"] == list(schedule.gemm_chunks)
    with pytest.raises(MemoryBudgetError, match=r"with its fewest rows per dE accumulator"):
        choose_schedule(16_384, 151_936, 1_024, torch.bfloat16, 2**20, hopper, need=(True, True, False),
                        device=torch.device("cuda"))


def test_a_budget_below_the_recompute_plan_first_drops_its_G_buffer():
    """At the Qwen3 head with 1,024 tokens (bf16, the Hopper tier's plan, arithmetic only) the default
    plan ends its G chunks in a buffer (5 chunks, ~24 MiB above LB); a 10 MiB budget runs the same
    rows without it (9 narrower chunks in place, ~4 MiB: dE's accumulator), not fewer rows."""
    hopper = tier("hopper-227k")
    need = (True, True, False)
    default = recompute_extra_bytes(1_024, 151_936, 1_024, 2, hopper, need=need)
    bare = recompute_extra_bytes(1_024, 151_936, 1_024, 2, hopper.tuned(g_buffer_lb_share=0.0), need=need)
    assert bare < 10 * 2**20 < default
    schedule = choose_schedule(1_024, 151_936, 1_024, torch.bfloat16, 10 * 2**20, hopper, need=need,
                               device=torch.device("cuda"))
    assert schedule.name == "recompute" and schedule.gemm_chunks is None and not schedule.g_buffer, schedule
    assert schedule.predicted_extra_bytes == bare and schedule.tuning() == {"g_buffer_lb_share": 0.0}
    assert "without its G buffer" in schedule.why and schedule.as_stats()["g_buffer"] is False


def test_fewer_rows_per_accumulator_run_and_keep_the_gradients():
    """On the CPU: reduction "none" (forward_grads cannot serve it), fp16, 512 rows (the default plan
    takes them all into one fp32 dE accumulator), and a budget that only fewer rows per accumulator
    fit: the backward runs that plan (stats say so) and its gradients are within the gate's bound of
    float64, as "min"'s are."""
    n, v = 512, 131
    E, C, x = regime_inputs(n, v, D, torch.float16, "cpu", regime="uniform", seed=1)
    need = (True, True, False)
    bare = FREE.tuned(g_buffer_lb_share=0.0)  # a tight budget drops the G buffer first
    default = recompute_extra_bytes(n, v, D, 2, bare, upcast=True, need=need)
    chunks, budget = recompute_rows(n, v, D, torch.float16, bare, default - 1, upcast=True, need=need)
    assert chunks[0] < n and budget < default
    go = torch.randn(n, generator=torch.Generator().manual_seed(3))
    results = {}
    for name, memory_budget in (("min", "min"), ("tight", budget)):
        E_, C_ = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
        stats = {}
        loss = linear_cross_entropy(E_, C_, x, reduction="none", memory_budget=memory_budget, configs=FREE,
                                    stats=stats)
        loss.backward(go)
        results[name] = (loss.detach(), E_.grad, C_.grad, stats)
    stats = results["tight"][3]
    assert stats["schedule"] == "recompute" and stats["gemm_chunks"] == list(chunks), stats
    assert results["min"][3]["gemm_chunks"] is None
    reference = reference_loss_and_grads(E, C, x, go, reduction="none")
    for i, q in enumerate(("loss", "dE", "dC")):
        bound = gate_bound("float16", q, relative_error(results["min"][i], reference[i]))
        assert relative_error(results["tight"][i], reference[i]) <= bound, q
