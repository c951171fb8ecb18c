"""GPU check and timing of backward version 2 (``backward_impl="gemm"``) against version 1.

    python bench/gpu_backward_v2.py [--out $OUT/backward_v2.json] [--budget-s 180] [--tiny]

On a CUDA machine (written for the lent H200: torch 2.11, triton 3.6; ~3 minutes) it does, in order
(the bf16 accuracy at both heads and the Gemma timings are required; the rest runs as time allows):

1. accuracy against float64 (``gpu_cce_check.chunked_reference``, imported, not copied) at the
   Qwen3 head (N=2,048, V=151,936, D=1,024) and the Gemma-2-2B head (N=8,192, V=256,000,
   D=2,304), bf16 / fp16 / fp32: loss, dE and dC relative L2 errors, and the naive path's in the
   same dtype. Pass rules as gpu_cce_check: loss <= 1e-4 (1e-5 fp32); exact gradients <= 1.5x the
   naive path's error (<= 1e-5 in fp32); gradients under the filter <= 0.1 (reported). Options:
   the default, filter off, and at Qwen3 bf16 the sort, FullC, FullE, v1 for comparison, and (step
   3) the option-heavy spec (reduction="none", ignored rows, soft cap, z-loss, label smoothing:
   v2's g_rel E operand).
2. time and memory, v1 ("atomic") against v2 ("gemm"), bf16: forward+backward median
   (``helpers.measure.latency``, CUDA events), backward alone (``cce_backward``; for v2 also with
   4x wider G chunks), peak memory above the inputs incl. dE and dC (``helpers.measure.
   peak_memory``) against LB, v2's skipped tiles and product mode, and v1-v2 gradient agreement;
   at Gemma uniform and realistic (``helpers.data.make_inputs``) and Qwen3 N = 1,024 / 16,384 /
   131,072 (uniform). At Gemma uniform, a torch.profiler breakdown of one v2 backward by kernel.
3. the rest of step 1's matrix: the option-heavy spec, fp32 and fp16 at both heads.

Each case runs in try/except; cases that would start after ``--budget-s`` are skipped. Prints a
compact table; writes JSON (default $OUT/backward_v2.json). ``--tiny`` shrinks every shape so the
script can be checked on a CPU under the Triton interpreter (fp32/fp16 only there).
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from gpu_cce_check import (  # noqa: E402
    DTYPES,
    SPECS,
    Checker,
    chunked_reference,
    finish,
    judge,
    loss_options,
    make_inputs,
    naive,
    ours,
    rel_err,
    script_setup,
    upstream,
)

from helpers.cce import (  # noqa: E402
    cce_backward,
    cce_forward,
    gemm_chunks,
    linear_cross_entropy,
    resolve_options,
    why_unavailable,
)
from helpers.data import make_inputs as make_regime_inputs  # noqa: E402
from helpers.kernels.configs import select_configs  # noqa: E402
from helpers.measure import latency, peak_memory, release_memory  # noqa: E402

# name -> options of ours (v2 unless backward_impl says otherwise); "exact" says which gradients
# must match the naive path's accuracy (the others pass under the filter).
VARIANTS = {
    "gemm/filter_off": dict(backward_impl="gemm", filter_eps=None),
    "gemm/default": dict(backward_impl="gemm"),
    "gemm/sort": dict(backward_impl="gemm", sort_vocab=True),
    "gemm/full_c": dict(backward_impl="gemm", full_c=True),
    "gemm/full_e": dict(backward_impl="gemm", full_e=True),
    "atomic/filter_off": dict(backward_impl="atomic", filter_eps=None),
}


def check_accuracy(shape_name, N, V, D, dtype_name, spec_name, variant_names, device, chunk):
    """One float64 reference and one naive run per (shape, dtype, spec); each variant against them."""
    dtype = DTYPES[dtype_name]
    reason = why_unavailable(device, dtype)
    if reason:
        return [dict(case=f"acc/{shape_name}/{dtype_name}", status="skipped", reason=reason)]
    opts = loss_options(SPECS[spec_name])
    E, C, x = make_inputs(N, V, D, dtype, SPECS[spec_name], device)
    go = upstream(opts.get("reduction", "mean"), N, device)
    rloss, rdE, rdC = chunked_reference(E, C, x, go, chunk=chunk, **opts)
    nE, nC = naive(E, C, x, go, **opts)
    naive_dE, naive_dC = rel_err(nE, rdE), rel_err(nC, rdC)
    del nE, nC
    records = []
    for variant in variant_names:
        options = dict(opts, **VARIANTS[variant])
        if options.get("full_c") or options.get("full_e"):
            options.setdefault("filter_eps", 2.0**-12)  # "auto" is off in fp32 / with smoothing
        impl = options.pop("backward_impl")
        resolved = resolve_options(dtype, **options)
        loss, dE, dC = ours(E, C, x, go, backward_impl=impl, **options)
        rec = dict(case=f"acc/{shape_name}/{dtype_name}/{spec_name}/{variant}", N=N, V=V, D=D,
                   filter_eps=resolved.filter_eps,
                   loss_err=rel_err(loss.reshape(-1, 1).double(), rloss.reshape(-1, 1)),
                   dE_err=rel_err(dE, rdE), dC_err=rel_err(dC, rdC),
                   naive_dE_err=naive_dE, naive_dC_err=naive_dC)
        rec["dE_ratio"] = rec["dE_err"] / max(naive_dE, 1e-30)
        rec["dC_ratio"] = rec["dC_err"] / max(naive_dC, 1e-30)
        judge(rec, dtype, resolved)
        records.append(rec)
        del loss, dE, dC
    return records


def time_case(name, N, V, D, regime, device, repeats):
    """v1 and v2 at one shape, bf16 (fp16 on the CPU): fwd+bwd, bwd alone, peak memory."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    E, C, x = make_regime_inputs(N, V, D, dtype, device, regime=regime, seed=N)
    lb = (N + V) * D * dtype.itemsize
    rec = dict(case=f"time/{name}/{regime}", N=N, V=V, D=D, regime=regime,
               lb_mb=round(lb / 1e6, 1), status="ok")
    grads = {}
    for impl in ("atomic", "gemm"):
        E_ = E.detach().clone().requires_grad_(True)
        C_ = C.detach().clone().requires_grad_(True)

        def step():
            E_.grad = C_.grad = None
            linear_cross_entropy(E_, C_, x, backward_impl=impl).backward()

        step()  # compile, warm up
        E_.grad = C_.grad = None
        _, peak = peak_memory(step, device=device)  # dE and dC are allocated inside: counted
        grads[impl] = (E_.grad, C_.grad)
        rec[f"{impl}_peak_mb"] = round(peak / 1e6, 1)
        rec[f"{impl}_peak_over_lb"] = round(peak / lb, 3)
        rec[f"{impl}_fwd_bwd_ms"] = round(latency(step, warmup=1, repeats=repeats, device=device).median_ms, 2)
        del E_, C_
    rec["dE_v1_v2_rel_diff"] = rel_err(grads["gemm"][0], grads["atomic"][0])
    rec["dC_v1_v2_rel_diff"] = rel_err(grads["gemm"][1], grads["atomic"][1])
    del grads
    release_memory(device)

    # Backward alone, through the host function (the chunk sizes are arguments there).
    options = resolve_options(dtype)
    _, lse = cce_forward(E, C, x, options)
    grad_rows = torch.full((), 1.0 / N, device=device).expand(N)  # a mean's: one scalar, stride 0
    cfg = select_configs(torch.device(device)).backward_gemm_for(dtype)
    n_chunk, v_chunk = gemm_chunks(N, V, D, dtype, cfg.BLOCK_V)
    rec.update(gemm_n_chunk=n_chunk, gemm_v_chunk=v_chunk)
    for label, impl, kw in (("atomic", "atomic", {}), ("gemm", "gemm", {}),
                            ("gemm_wide", "gemm", dict(v_chunk=4 * v_chunk))):
        stats = {}
        cce_backward(E, C, x, lse, grad_rows, options, stats=stats, backward_impl=impl, **kw)
        rec[f"{label}_bwd_ms"] = round(latency(
            lambda: cce_backward(E, C, x, lse, grad_rows, options, backward_impl=impl, **kw),
            warmup=1, repeats=repeats, device=device).median_ms, 2)
        if impl == "gemm" and not kw:
            rec.update(gemm_products=stats.get("products"), gemm_launches=stats["launches"],
                       gemm_skipped=round(stats["skipped"] / max(1, stats["tiles"]), 3))
    return rec


def profile_gemm_backward(N, V, D, device):
    """Where one v2 backward spends its GPU time, by kernel name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    dtype = torch.bfloat16
    E, C, x = make_regime_inputs(N, V, D, dtype, device, seed=N)
    options = resolve_options(dtype)
    _, lse = cce_forward(E, C, x, options)
    grad_rows = torch.full((), 1.0 / N, device=device).expand(N)
    cce_backward(E, C, x, lse, grad_rows, options, backward_impl="gemm")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cce_backward(E, C, x, lse, grad_rows, options, backward_impl="gemm")
        torch.cuda.synchronize()
    totals = {}
    for event in prof.key_averages():
        ms = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0)) / 1e3
        if ms > 0:
            totals[event.key[:60]] = totals.get(event.key[:60], 0.0) + ms
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:8]
    return dict(case="profile/gemma2/gemm_bwd", status="ok", total_ms=round(sum(totals.values()), 2),
                kernels={k: round(v, 2) for k, v in top})


def main():
    args, cuda, device, scale = script_setup(__doc__, "backward_v2.json", 180.0)
    qwen = (scale(2048, 37), scale(151_936, 301), scale(1024, 24))
    gemma = (scale(8192, 40), scale(256_000, 500), scale(2304, 36))
    chunk = 64 if args.tiny else 2048
    low = ["fp16"] if args.tiny else ["bf16", "fp16"]
    repeats = 2 if args.tiny else 5
    c = Checker(args.budget_s, device)

    # 1. Accuracy against float64 at the two heads in bf16 (required: v2 is not timed blind).
    c.run("acc/qwen3", check_accuracy, "qwen3", *qwen, low[0], "mean",
          ["gemm/filter_off", "gemm/default", "gemm/sort", "gemm/full_c", "gemm/full_e",
           "atomic/filter_off"], device, chunk, required=True)
    c.run("acc/gemma2", check_accuracy, "gemma2", *gemma, low[0], "mean",
          ["gemm/filter_off", "gemm/default"], device, chunk, required=True)
    # 2. Time and memory, v1 against v2 (Gemma required), and where v2's backward time goes.
    timing = [("gemma2", *gemma, "uniform"), ("gemma2", *gemma, "realistic")]
    for n in (1024, 16_384, 131_072):
        timing.append((f"qwen3-N{n}", scale(n, 64), qwen[1], qwen[2], "uniform"))
    for name, N, V, D, regime in timing:
        c.run(f"time/{name}/{regime}", time_case, name, N, V, D, regime, device, repeats,
              required=name == "gemma2")
    if cuda:
        c.run("profile", profile_gemm_backward, *gemma, device)
    # 3. The rest of the accuracy matrix, as time allows.
    c.run("acc/qwen3/everything", check_accuracy, "qwen3", *qwen, low[0], "everything",
          ["gemm/filter_off", "gemm/default"], device, chunk)
    for dtype_name in ["fp32", *low[1:]]:
        for shape_name, shape in (("qwen3", qwen), ("gemma2", gemma)):
            c.run(f"acc/{shape_name}/{dtype_name}", check_accuracy, shape_name, *shape, dtype_name,
                  "mean", ["gemm/filter_off"], device, chunk)

    # The tables.
    print("\n" + "=" * 100)
    print(f"{'accuracy case':52s} {'status':6s} {'loss':>8s} {'dE':>8s} {'dC':>8s} {'dE/nv':>6s} {'dC/nv':>6s}")
    for r in c.records:
        if r["case"].startswith("acc/"):
            def f(key, fmt):
                width = int(fmt.split(".")[0])
                return format(r[key], fmt) if isinstance(r.get(key), (int, float)) else "-".rjust(width)
            print(f"{r['case'][:52]:52s} {r.get('status', '?')[:6]:6s} {f('loss_err', '8.1e')} "
                  f"{f('dE_err', '8.1e')} {f('dC_err', '8.1e')} {f('dE_ratio', '6.2f')} {f('dC_ratio', '6.2f')}")
            if r.get("problems") or r.get("error"):
                print(f"    -> {r.get('problems') or r.get('error')}")
    print(f"\n{'timing case (bf16)':30s} {'v1 ms':>8s} {'v2 ms':>8s} {'v1 bwd':>8s} {'v2 bwd':>8s} "
          f"{'v2 wide':>8s} {'v1 /LB':>7s} {'v2 /LB':>7s} {'LB MB':>8s} {'skip':>5s} {'dE v1-v2':>9s} products")
    for r in c.records:
        if r["case"].startswith("time/") and r.get("status") == "ok":
            print(f"{r['case'][5:35]:30s} {r['atomic_fwd_bwd_ms']:8.1f} {r['gemm_fwd_bwd_ms']:8.1f} "
                  f"{r['atomic_bwd_ms']:8.1f} {r['gemm_bwd_ms']:8.1f} {r['gemm_wide_bwd_ms']:8.1f} "
                  f"{r['atomic_peak_over_lb']:7.3f} {r['gemm_peak_over_lb']:7.3f} {r['lb_mb']:8.0f} "
                  f"{r['gemm_skipped']:5.2f} {r['dE_v1_v2_rel_diff']:9.1e} {r['gemm_products']}")
        elif r["case"].startswith("time/"):
            print(f"{r['case'][5:35]:30s} {r.get('status')}: {r.get('error', r.get('reason', ''))[:60]}")
    finish(c, args.out, cuda)


if __name__ == "__main__":
    main()
