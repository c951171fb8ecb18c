"""GPU check of our loss on Liger's own correctness grid, and the float64 gate for its combined options.

    python scripts/gpu/liger_parity.py [--out results.jsonl] [--budget-s 300] [--tiny]

Liger-Kernel's published test of its fused linear cross-entropy (``test_fused_linear_cross_entropy.py``,
``test_correctness``) passes "non-default values once to ensure all params work along": class weights
(``ce_weight``, uniform in [0, 1)), label smoothing 0.1, ``ignore_index`` 42, a z-loss of 1e-4 and a soft
cap of 30, on two shapes, for mean, sum and none, bf16 and fp32, with a bias and without. Its reference is
torch on fp32 logits of the head computed in the inputs' dtype: ``F.cross_entropy(weight=,
label_smoothing=)`` plus an unweighted z-loss (zl lse^2 at kept rows, a mean dividing by their count).
Sections:

1. ``liger``: that grid, our loss against that reference with Liger's own tolerances (atol, rtol) on the
   loss and every gradient (E, C, bias), and Liger 0.8.5's loss on the same inputs where it is installed
   (so a failure is ours, not the grid's). Our inputs are made as the test makes them (the head's weight
   and bias uniform in [0, 1), E normal, a random share of the targets ignored), from our own seed. Then
   its ``test_correctness_functional``'s inputs (normal, class weights of both signs: torch and Liger
   take negative weights) with the combined options, a mean, on its two odd shapes. Each case records
   the share of the tolerance used: the largest |ours - reference| / (atol + rtol |reference|) over every
   element, passing at <= 1. The reference is itself rounded (16-bit logits), so each case also gives
   ours' and the reference's relative errors against float64 (the same formula on the inputs upcast);
   past the tolerance a case passes only where ours is at least as close to float64 as the reference on
   the loss and every gradient, and its status says so.
2. ``gate``: the combined options at an LLM head (Qwen3-0.6B: V 151,936, D 1,024; N 4,096 tokens) in
   bf16, our "gemm" and "atomic" backwards and the default "auto", against float64 (autograd through
   ``helpers.spec.reference_loss``), judged as ``cce_check.py`` judges: the loss within 1e-4, each
   gradient within 1.5x the naive bf16 path's error.
3. ``speed``: what the options cost, at the Qwen3 head with N 16,384 bf16 tokens: forward and backward
   (median ms, ``triton.testing.do_bench``) and peak memory beyond the inputs, ours with label smoothing
   alone, ours and Liger with class weights too (the combined options).

``--tiny``: fp32 and the small shape only, under the interpreter; Liger is not run (its kernels need a GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import Checker, finish, script_setup

from helpers.cce import linear_cross_entropy
from helpers.compare.heads import QWEN3
from helpers.compare.inputs import make_inputs as regime_inputs
from helpers.spec import reference_loss, relative_error

# Liger's grid (its test's parameters): shapes (B, T, H, V); (reduction, dtype, atol, rtol); bias; options.
SHAPES = [(8, 128, 1024, 4096), (4, 47, 31, 123)]
TOLERANCES = [("mean", torch.bfloat16, 5e-3, 5e-2), ("mean", torch.float32, 1e-5, 5e-4),
              ("sum", torch.bfloat16, 5.0, 50.0), ("sum", torch.float32, 1e-3, 5e-2),
              ("none", torch.bfloat16, 5.0, 50.0), ("none", torch.float32, 1e-3, 5e-2)]
OPTION_SETS = {
    "defaults": dict(weight=False, label_smoothing=0.0, ignore_index=-100, z_loss=0.0, softcap=None),
    "combined": dict(weight=True, label_smoothing=0.1, ignore_index=42, z_loss=1e-4, softcap=30.0),
}
# Its ``test_correctness_functional``: normal inputs and class weights (negative ones among them), the
# combined options, a mean, on two odd shapes (it compares Liger's two entry points; we compare with torch).
FUNCTIONAL_SHAPES = [(2, 2, 8, 8), (9, 7, 41, 41)]
FUNCTIONAL = dict(weight="signed", label_smoothing=0.1, ignore_index=-100, z_loss=1e-4, softcap=30.0)


def liger_inputs(BT, H, V, dtype, bias, options, device, seed):
    """As Liger's tests make them: the head uniform in [0, 1) and some targets ignored, or (signed
    weights: its functional test) the head, bias and class weights normal and every target kept."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    signed = options["weight"] == "signed"
    C = (torch.randn if signed else torch.rand)(V, H, generator=g).to(dtype).to(device)
    b = (torch.randn if signed else torch.rand)(V, generator=g).to(dtype).to(device) if bias else None
    E = torch.randn(BT, H, generator=g).to(dtype).to(device)
    x = torch.randint(0, V, (BT,), generator=g)
    if not signed:
        ignored = torch.randperm(BT, generator=g)[: int(torch.randint(1, max(2, BT // 2), (1,), generator=g))]
        x[ignored] = options["ignore_index"]
    w = None
    if options["weight"]:
        w = (torch.randn if signed else torch.rand)(V, generator=g).to(device)
    return E, C, b, x.to(device), w


def torch_reference(E, C, b, x, w, reduction, options):
    """Liger's reference: fp32 logits of the head in the inputs' dtype (float64 for float64 inputs),
    capped, torch's weighted and smoothed cross-entropy plus an unweighted z-loss."""
    z = F.linear(E, C, b)
    z = z if z.dtype == torch.float64 else z.float()  # float64 inputs: the exact loss
    if options["softcap"]:
        z = options["softcap"] * torch.tanh(z / options["softcap"])
    loss = F.cross_entropy(z, x, weight=w, ignore_index=options["ignore_index"], reduction=reduction,
                           label_smoothing=options["label_smoothing"])
    kept = x != options["ignore_index"]
    square = torch.where(kept, options["z_loss"] * torch.logsumexp(z, dim=-1) ** 2, 0.0)
    return loss + {"none": square, "sum": square.sum(), "mean": square.sum() / kept.sum()}[reduction]


def ours(E, C, b, x, w, reduction, options):
    return linear_cross_entropy(E, C, x, bias=b, weight=w, reduction=reduction, softcap=options["softcap"],
                                z_loss=options["z_loss"], label_smoothing=options["label_smoothing"],
                                ignore_index=options["ignore_index"])


def liger(E, C, b, x, w, reduction, options):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(E, C, x, bias=b, ce_weight=w, ignore_index=options["ignore_index"],
                                           lse_square_scale=options["z_loss"],
                                           label_smoothing=options["label_smoothing"], reduction=reduction,
                                           softcap=options["softcap"])
    return out.loss if hasattr(out, "loss") else out[0] if isinstance(out, tuple) else out


def run_one(fn, E, C, b, x, w, reduction, options):
    """(loss, dE, dC, db) of ``fn`` with an upstream gradient of ones, as Liger's test backpropagates."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (E, C, b)]
    loss = fn(*leaves, x, w, reduction, options)
    loss.backward(torch.ones_like(loss))
    return [loss.detach()] + [t.grad if t is not None else None for t in leaves]


def close(got, ref, atol, rtol):
    """The largest |got - ref| / (atol + rtol |ref|) over the tensors' elements: allclose holds at <= 1."""
    worst = 0.0
    for a, r in zip(got, ref):
        if r is not None and r.numel():
            worst = max(worst, float(((a.float() - r.float()).abs() / (atol + rtol * r.float().abs())).max()))
    return worst


def check_liger_grid(shape, reduction, dtype, atol, rtol, bias, option_name, device, seed, run_liger):
    B, T, H, V = shape
    options = FUNCTIONAL if option_name == "functional" else OPTION_SETS[option_name]
    E, C, b, x, w = liger_inputs(B * T, H, V, dtype, bias, options, device, seed)
    ref = run_one(torch_reference, E, C, b, x, w, reduction, options)
    record = dict(B=B, T=T, H=H, V=V, dtype=str(dtype).removeprefix("torch."), reduction=reduction, bias=bias,
                  options=option_name, atol=atol, rtol=rtol)
    got = run_one(ours, E, C, b, x, w, reduction, options)
    used = close(got, ref, atol, rtol)
    record["ours_tolerance_used"] = used
    if run_liger:
        record["liger_tolerance_used"] = close(run_one(liger, E, C, b, x, w, reduction, options), ref, atol, rtol)
    # The reference is itself rounded (its logits in the inputs' dtype): each one's error against float64.
    exact = run_one(torch_reference, *(t.double() if t is not None else None for t in (E, C, b)), x,
                    w.double() if w is not None else None, reduction, options)
    record["ours_f64_err"] = [relative_error(a, r) for a, r in zip(got, exact) if r is not None]
    record["reference_f64_err"] = [relative_error(a, r) for a, r in zip(ref, exact) if r is not None]
    closer = all(o <= r for o, r in zip(record["ours_f64_err"], record["reference_f64_err"]))
    record["status"] = "ok" if used <= 1 else "ok (closer to float64 than the reference)" if closer else "FAIL"
    return record


def check_gate(N, V, D, dtype, backward_impl, device):
    """The combined options at an LLM head against float64; the naive path in the dtype as the bar."""
    E, C, x = regime_inputs(N, V, D, dtype, device, regime="realistic", seed=0)
    x[::7] = 42
    w = torch.rand(V, generator=torch.Generator(device="cpu").manual_seed(1)).to(device) + 0.25
    options = dict(weight=w, label_smoothing=0.1, ignore_index=42, z_loss=1e-4, softcap=30.0)
    E64, C64 = (t.detach().double().requires_grad_(True) for t in (E, C))
    rloss = reference_loss(E64, C64, x, **options)
    rloss.backward()
    En, Cn = (t.detach().clone().requires_grad_(True) for t in (E, C))
    z = (En @ Cn.T).float()
    z = 30.0 * torch.tanh(z / 30.0)
    kept = x != 42
    nloss = F.cross_entropy(z, x, weight=w, ignore_index=42, label_smoothing=0.1) + \
        (torch.where(kept, 1e-4 * torch.logsumexp(z, dim=-1) ** 2, 0.0)).sum() / kept.sum()
    nloss.backward()
    del z
    Eo, Co = (t.detach().clone().requires_grad_(True) for t in (E, C))
    stats = {}
    loss = linear_cross_entropy(Eo, Co, x, backward_impl=backward_impl, stats=stats, **options)
    loss.backward()
    record = dict(N=N, V=V, D=D, dtype=str(dtype).removeprefix("torch."), backward=stats.get("backward"),
                  forward=stats.get("forward"), g_kernels=stats.get("g_kernels"),
                  loss_err=relative_error(loss, rloss), dE_err=relative_error(Eo.grad, E64.grad),
                  dC_err=relative_error(Co.grad, C64.grad), naive_dE_err=relative_error(En.grad, E64.grad),
                  naive_dC_err=relative_error(Cn.grad, C64.grad))
    record["dE_ratio"] = record["dE_err"] / max(record["naive_dE_err"], 1e-30)
    record["dC_ratio"] = record["dC_err"] / max(record["naive_dC_err"], 1e-30)
    low = dtype != torch.float32
    ok = record["loss_err"] <= 1e-4 and (not low or max(record["dE_ratio"], record["dC_ratio"]) <= 1.5) and \
        (low or max(record["dE_err"], record["dC_err"]) <= 1e-4)
    record["status"] = "ok" if ok else "FAIL"
    return record


def time_options(N, V, D, dtype, method, weighted, device, cuda):
    """(ms, peak MiB beyond the inputs: the gradients included) of one forward and backward with the
    combined options."""
    import triton

    E, C, x = regime_inputs(N, V, D, dtype, device, regime="realistic", seed=0)
    E.requires_grad_(True)
    C.requires_grad_(True)
    w = torch.rand(V, generator=torch.Generator(device="cpu").manual_seed(1)).to(device) + 0.25 if weighted else None
    options = dict(weight=w is not None, label_smoothing=0.1, ignore_index=-100, z_loss=1e-4, softcap=30.0)
    fn = ours if method == "ours" else liger

    def step():
        fn(E, C, None, x, w, "mean", options).backward()

    step()
    if not cuda:
        return dict(method=method, weighted=weighted, N=N, V=V, D=D, status="ok")
    E.grad = C.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = triton.testing.do_bench(step, grad_to_none=[E, C], warmup=10, rep=100, return_mode="median")
    return dict(method=method, weighted=weighted, N=N, V=V, D=D, ms=ms, peak_MiB=peak, status="ok")


def main():
    args, cuda, device, scale = script_setup(__doc__, "liger_parity.jsonl", 300.0)
    c = Checker(args.budget_s, device, args.out)
    run_liger = False
    if cuda:
        try:
            import liger_kernel  # noqa: F401
            run_liger = True
        except ImportError:
            print("liger-kernel is not installed: ours alone on its grid", flush=True)
    shapes = SHAPES if cuda else SHAPES[1:]
    seed = 0
    for shape in shapes:
        for reduction, dtype, atol, rtol in TOLERANCES:
            if dtype != torch.float32 and not cuda:
                continue  # the interpreter's bf16 is not the GPU's
            for bias in (True, False):
                for option_name in OPTION_SETS:
                    seed += 1
                    name = f"liger/{'x'.join(map(str, shape))}/{reduction}/{str(dtype)[6:]}/bias={bias}/{option_name}"
                    c.run(name, check_liger_grid, shape, reduction, dtype, atol, rtol, bias, option_name, device,
                          seed, run_liger, required=True)
    for shape in FUNCTIONAL_SHAPES:
        for reduction, dtype, atol, rtol in TOLERANCES[:2]:  # a mean, bf16 and fp32
            if dtype != torch.float32 and not cuda:
                continue
            for bias in (True, False):
                seed += 1
                name = f"liger/{'x'.join(map(str, shape))}/{reduction}/{str(dtype)[6:]}/bias={bias}/functional"
                c.run(name, check_liger_grid, shape, reduction, dtype, atol, rtol, bias, "functional", device,
                      seed, run_liger, required=True)
    N, V, D = scale(4096, 37), scale(QWEN3.V, 257), scale(QWEN3.D, 24)
    dtype = torch.bfloat16 if cuda else torch.float32
    for backward_impl in ("auto", "gemm", "atomic"):
        c.run(f"gate/{backward_impl}", check_gate, N, V, D, dtype, backward_impl, device)
    N = scale(16384, 37)
    for method, weighted in (("ours", False), ("ours", True)) + ((("liger", True),) if run_liger else ()):
        c.run(f"speed/{method}/{'weights' if weighted else 'no weights'}", time_options, N, V, D, dtype, method,
              weighted, device, cuda)
    finish(c, args.out, cuda)


if __name__ == "__main__":
    main()
