"""GPU check of our Cut Cross-Entropy (``helpers.cce``): accuracy against float64, memory, time.

    python bench/gpu_cce_check.py [--out results.json] [--budget-s 330] [--tiny]

On a CUDA machine (written for an H200: torch 2.11, triton 3.6) it checks, in order of priority:

1. the float64 reference used here (a chunked formula on the GPU) against ``helpers.reference``;
2. bf16 at the Qwen3 head (N=2,048, V=151,936, D=1,024) and the Gemma-2-2B head (N=8,192,
   V=256,000, D=2,304): dE and dC relative L2 errors against float64 must be at most 1.5x the
   naive bf16 path's (``(E @ C.T).float()`` then ``F.cross_entropy``), for the exact variants;
3. the big case N=131,072 x V=151,936 (N*V > 2^31: 64-bit offsets), bf16, against float64
   computed 4,096 rows at a time;
4. peak memory above the inputs and median forward+backward time (``triton.testing.do_bench``) at
   the Gemma shape, with the configuration picked for this GPU and with the Turing (64 KB) one;
5. fp32 / fp16 and the full option matrix (reductions, ignore, softcap, z-loss, label smoothing,
   filter, sort, Kahan, FullC, FullE) on an odd shape and the Qwen3 head.

Pass rules. Loss: relative error <= 1e-5 (fp32) or 1e-4 (fp16/bf16, whose inputs are exact in
fp32). Gradients, "exact" variants (filter off; FullC's dC; FullE's dE): <= 1.5x the naive path's
error in fp16/bf16, <= 1e-5 in fp32. Gradients under the filter drop entries below eps by design:
on these random (non-sparse) inputs that error is reported and only bounded (<= 0.1).
Each case runs in try/except; the exit status is 1 if any case failed. Cases that would start
after ``--budget-s`` seconds are recorded as skipped. ``--tiny`` shrinks every shape so the script
itself can be checked on a CPU under the Triton interpreter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from helpers.cce import linear_cross_entropy, resolve_options, why_unavailable  # noqa: E402
from helpers.kernels.configs import select_configs  # noqa: E402
from helpers.reference import reference_loss_and_grads  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Specs: the options that change the mathematical loss (so the reference). Variants: the options
# that change only our arithmetic (filter, sort, accumulation), checked against the same reference.
SPECS = {
    "mean": dict(),
    "sum_ignore": dict(reduction="sum", ignore_fraction=0.1),
    "none": dict(reduction="none"),
    "softcap": dict(softcap=30.0),
    "zloss_smooth": dict(z_loss=1e-4, label_smoothing=0.1),
    "everything": dict(reduction="none", ignore_fraction=0.1, softcap=30.0, z_loss=1e-4,
                       label_smoothing=0.1),
    "all_ignored": dict(ignore_fraction=1.0),
}
VARIANTS = {
    "default": dict(),
    "filter_off": dict(filter_eps=None),
    "sort": dict(sort_vocab=True),
    "kahan": dict(accumulation="kahan", filter_eps=None),
    "full_c": dict(full_c=True),
    "full_e": dict(full_e=True),
}


class Checker:
    def __init__(self, budget_s: float, device: str):
        self.t0 = time.time()
        self.budget_s = budget_s
        self.device = device
        self.records: list[dict] = []
        self.failed = 0

    def run(self, name: str, fn, *args, required=False, **kwargs):
        """Run one case; record its result or its error; never raise."""
        if not required and time.time() - self.t0 > self.budget_s:
            self.records.append(dict(case=name, status="skipped (time budget)"))
            print(f"[skip] {name}: past the {self.budget_s:.0f} s budget", flush=True)
            return None
        start = time.time()
        try:
            out = fn(*args, **kwargs)
        except Exception as error:  # a failing case must not stop the others
            self.failed += 1
            self.records.append(dict(case=name, status="error", error=f"{type(error).__name__}: {error}"))
            print(f"[ERROR] {name}: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc()
            return None
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        for record in out if isinstance(out, list) else [out]:
            record.setdefault("case", name)
            record["seconds"] = round(time.time() - start, 2)
            if record.get("status") == "FAIL":
                self.failed += 1
            self.records.append(record)
            print(f"[{record.get('status', 'ok')}] {record['case']}: "
                  + ", ".join(f"{k}={_fmt(v)}" for k, v in record.items()
                              if k not in ("case", "status")), flush=True)
        return out


def _fmt(v):
    return f"{v:.2e}" if isinstance(v, float) else str(v)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error, computed in float64 in row chunks (a 1 GB dE stays 1 GB)."""
    num = den = 0.0
    for i in range(0, got.shape[0], 8192):
        r = ref[i:i + 8192].double()
        num += (got[i:i + 8192].double() - r).pow(2).sum().item()
        den += r.pow(2).sum().item()
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def make_inputs(N, V, D, dtype, spec, device, seed=0):
    """ANCHORS.md's inputs: E ~ N(0, 1), C ~ N(0, 1) * 2/sqrt(D), uniform targets."""
    g = torch.Generator(device=device).manual_seed(seed)
    E = torch.randn(N, D, device=device, generator=g).to(dtype)
    C = (torch.randn(V, D, device=device, generator=g) * (2.0 / math.sqrt(D))).to(dtype)
    x = torch.randint(0, V, (N,), device=device, generator=g)
    fraction = spec.get("ignore_fraction", 0.0)
    if fraction:
        drop = torch.rand(N, device=device, generator=g) < fraction if fraction < 1 else torch.ones_like(x, dtype=torch.bool)
        x = torch.where(drop, -100, x)
    return E, C, x


def upstream(reduction, N, device, seed=1):
    if reduction == "none":
        return torch.randn(N, device=device, generator=torch.Generator(device=device).manual_seed(seed))
    return torch.tensor(1.7, device=device)


def loss_options(spec):
    return {k: v for k, v in spec.items() if k != "ignore_fraction"}


def chunked_reference(E, C, x, grad_output, *, reduction="mean", softcap=None, z_loss=0.0,
                      label_smoothing=0.0, ignore_index=-100, chunk=4096, dtype=torch.float64):
    """(loss, dE, dC) in ``dtype``, from the explicit formulas, ``chunk`` rows of logits at a time.

    Per kept row: loss_i = lse_i - (1 - ls) z_{i, x_i} - ls * mean_v z_{i, v} + zl * lse_i^2
    (torch's label smoothing plus PaLM's z-loss, checked against helpers.reference first);
    G = S (1 + 2 zl lse) - (1 - ls) [v = x] - ls / V, times 1 - (z / softcap)^2 under the cap.
    """
    N, D = E.shape
    V = C.shape[0]
    kept = x != ignore_index
    n_kept = kept.sum()
    go = grad_output.to(dtype)
    if reduction == "none":
        g = go
    elif reduction == "sum":
        g = go.expand(N)
    else:
        g = (go / n_kept.clamp(min=1)).expand(N)
    g = torch.where(kept, g, 0.0)
    C64 = C.to(dtype)
    loss_rows = torch.zeros(N, dtype=dtype, device=E.device)
    dE = torch.empty(N, D, dtype=dtype, device=E.device)
    dC = torch.zeros(V, D, dtype=dtype, device=E.device)
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        En = E[n0:n1].to(dtype)
        z = En @ C64.T  # (chunk, V)
        t = None
        if softcap is not None:
            t = torch.tanh(z / softcap)
            z = softcap * t
        lse = torch.logsumexp(z, dim=1)
        k = kept[n0:n1]
        xt = torch.where(k, x[n0:n1], 0)
        rows = lse - (1 - label_smoothing) * z.gather(1, xt[:, None])[:, 0]
        if label_smoothing:
            rows = rows - label_smoothing * z.mean(dim=1)
        rows = rows + z_loss * lse * lse
        loss_rows[n0:n1] = torch.where(k, rows, 0.0)
        G = z.sub_(lse[:, None]).exp_()  # S, in place of z
        if z_loss:
            G.mul_((1 + 2 * z_loss * lse)[:, None])
        G[torch.arange(n1 - n0, device=E.device), xt] -= (1 - label_smoothing) * k.to(dtype)
        if label_smoothing:
            G.sub_(label_smoothing / V)
        if t is not None:
            G.mul_(1 - t * t)
            del t
        G.mul_(g[n0:n1, None])
        dE[n0:n1] = G @ C64
        dC.addmm_(G.T, En)
        del G, z
    if reduction == "none":
        loss = loss_rows
    elif reduction == "sum":
        loss = loss_rows.sum()
    else:
        loss = loss_rows.sum() / n_kept
    return loss, dE, dC


def naive(E, C, x, grad_output, *, reduction="mean", softcap=None, z_loss=0.0, label_smoothing=0.0,
          ignore_index=-100):
    """The naive path in E's dtype: logits (E @ C.T) in that dtype, upcast, F.cross_entropy."""
    E_ = E.detach().clone().requires_grad_(True)
    C_ = C.detach().clone().requires_grad_(True)
    z = (E_ @ C_.T).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, x, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss:
        kept = x != ignore_index
        sq = torch.where(kept, torch.logsumexp(z, dim=1) ** 2, 0.0) * z_loss
        loss = loss + {"none": sq, "sum": sq.sum(), "mean": sq.sum() / kept.sum()}[reduction]
    loss.backward(grad_output.expand_as(loss))
    return E_.grad, C_.grad


def ours(E, C, x, grad_output, **options):
    E_ = E.detach().clone().requires_grad_(True)
    C_ = C.detach().clone().requires_grad_(True)
    loss = linear_cross_entropy(E_, C_, x, **options)
    loss.backward(grad_output.expand_as(loss))
    return loss.detach(), E_.grad, C_.grad


def check_reference_formula(device):
    """The chunked formula against helpers.reference (autograd through F.cross_entropy)."""
    records = []
    for spec_name in ("mean", "sum_ignore", "none", "softcap"):
        spec = SPECS[spec_name]
        opts = loss_options(spec)
        E, C, x = make_inputs(67, 1031, 40, torch.float32, spec, device)
        go = upstream(opts.get("reduction", "mean"), 67, device)
        got = chunked_reference(E, C, x, go, chunk=16, **opts)
        ref = reference_loss_and_grads(E, C, x, go, **opts)
        errs = [rel_err(a.reshape(-1, 1) if a.dim() < 2 else a, b.reshape(-1, 1) if b.dim() < 2 else b)
                for a, b in zip(got, ref)]
        records.append(dict(case=f"reference-formula/{spec_name}", loss_err=errs[0], dE_err=errs[1],
                            dC_err=errs[2], status="ok" if max(errs) < 1e-10 else "FAIL"))
    return records


def check_shape(shape_name, N, V, D, dtype_name, spec_name, variant_names, device, chunk):
    """One reference (and one naive run) per spec; every variant of ours against them."""
    dtype = DTYPES[dtype_name]
    reason = why_unavailable(device, dtype)
    if reason:
        return [dict(case=f"{shape_name}/{dtype_name}/{spec_name}", status="skipped", reason=reason)]
    spec = SPECS[spec_name]
    opts = loss_options(spec)
    E, C, x = make_inputs(N, V, D, dtype, spec, device)
    go = upstream(opts.get("reduction", "mean"), N, device)
    rloss, rdE, rdC = chunked_reference(E, C, x, go, chunk=chunk, **opts)
    nE, nC = naive(E, C, x, go, **opts)
    naive_dE, naive_dC = rel_err(nE, rdE), rel_err(nC, rdC)
    del nE, nC
    records = []
    for variant in variant_names:
        options = dict(opts, **VARIANTS[variant])
        if variant in ("full_c", "full_e") and dtype == torch.float32:
            options["filter_eps"] = 2.0**-12  # "auto" is off in fp32: give FullC/FullE a filter
        resolved = resolve_options(dtype, **options)
        loss, dE, dC = ours(E, C, x, go, **options)
        rec = dict(case=f"{shape_name}/{dtype_name}/{spec_name}/{variant}", N=N, V=V, D=D,
                   filter_eps=resolved.filter_eps)
        all_ignored = spec_name == "all_ignored"
        if all_ignored:
            ok = bool(torch.isnan(loss).item()) and not dE.any().item() and not dC.any().item()
            rec.update(status="ok" if ok else "FAIL", loss=float(loss))
            records.append(rec)
            continue
        rec["loss_err"] = rel_err(loss.reshape(-1, 1).double(), rloss.reshape(-1, 1))
        rec["dE_err"], rec["dC_err"] = rel_err(dE, rdE), rel_err(dC, rdC)
        rec["naive_dE_err"], rec["naive_dC_err"] = naive_dE, naive_dC
        rec["dE_ratio"] = rec["dE_err"] / max(naive_dE, 1e-30)
        rec["dC_ratio"] = rec["dC_err"] / max(naive_dC, 1e-30)
        judge(rec, dtype, resolved)
        records.append(rec)
        del loss, dE, dC
    return records


def check_big(N, V, D, device, chunk, dtype_name="bf16"):
    """N * V > 2^31 in bf16: loss and gradients against float64 computed ``chunk`` rows at a time.

    The naive path cannot run here (its logits alone are 120 GB), so its errors are estimated:
    dE's from the naive path on the first ``chunk`` rows (dE is row-local), dC's as the error of
    rounding the float64 dC to bf16 (a lower bound on any bf16 dC's error). N spans 8 row chunks
    of fp32 scratch by default, so dC is rounded 8 times: "kahan" must be within 1.5x, the plain
    fp32 accumulation within 3x (reported).
    """
    dtype = DTYPES[dtype_name]
    E, C, x = make_inputs(N, V, D, dtype, {}, device)
    go = torch.tensor(1.7, device=device)
    rloss, rdE, rdC = chunked_reference(E, C, x, go, chunk=chunk)
    nE, _ = naive(E[:chunk], C, x[:chunk], go * chunk / N)  # the mean's 1/N, rows 0..chunk
    naive_dE = rel_err(nE, rdE[:chunk])
    naive_dC = rel_err(rdC.to(dtype), rdC)
    del nE
    records = []
    for variant, limit in (("kahan", 1.5), ("filter_off", 3.0)):
        loss, dE, dC = ours(E, C, x, go, **VARIANTS[variant])
        rec = dict(case=f"big/{dtype_name}/mean/{variant}", N=N, V=V, D=D,
                   N_times_V_over_2_31=round(N * V / 2**31, 2),
                   loss_err=rel_err(loss.reshape(1, 1).double(), rloss.reshape(1, 1)),
                   dE_err=rel_err(dE, rdE), dC_err=rel_err(dC, rdC),
                   naive_dE_err=naive_dE, naive_dC_err=naive_dC)
        rec["dE_ratio"] = rec["dE_err"] / naive_dE
        rec["dC_ratio"] = rec["dC_err"] / naive_dC
        problems = [p for p, bad in (
            ("loss err > 1e-4", not rec["loss_err"] <= 1e-4),
            (f"dE ratio > {limit}", not rec["dE_ratio"] <= limit),
            (f"dC ratio > {limit}", not rec["dC_ratio"] <= limit)) if bad]
        rec["status"] = "FAIL" if problems else "ok"
        if problems:
            rec["problems"] = "; ".join(problems)
        records.append(rec)
        del loss, dE, dC
    return records


def measure(shape_name, N, V, D, dtype_name, device, configs=None, **options):
    """Peak memory above the inputs and median fwd+bwd ms (do_bench), vs the lower bound."""
    dtype = DTYPES[dtype_name]
    E, C, x = make_inputs(N, V, D, dtype, {}, device)
    E.requires_grad_(True)
    C.requires_grad_(True)

    def step():
        linear_cross_entropy(E, C, x, configs=configs, **options).backward()

    step()  # compile, warm up
    E.grad = C.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    E.grad = C.grad = None
    ms = triton.testing.do_bench(step, grad_to_none=[E, C], warmup=50, rep=400, return_mode="median")
    lb = (N + V) * D * dtype.itemsize
    name = configs if isinstance(configs, str) else select_configs(torch.device(device)).name
    return dict(case=f"bench/{shape_name}/{dtype_name}/{name}/{options or 'default'}",
                peak_mb=round(peak / 1e6, 1), lb_mb=round(lb / 1e6, 1),
                peak_over_lb=round(peak / lb, 3), fwd_bwd_ms=round(ms, 2), status="ok")


def script_setup(doc: str, out_name: str, budget_s: float, add_arguments=None):
    """The GPU scripts' shared start: --out (default $OUT/out_name), --budget-s, --tiny and any
    ``add_arguments(parser)`` adds; exits without CUDA unless --tiny; on CUDA turns TF32 off (fp32
    references and naive paths in real fp32) and prints the device, versions and configuration tier.
    Returns (args, cuda, device, scale), ``scale(n, lo)`` shrinking a size for --tiny."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    default_out = os.path.join(os.environ["OUT"], out_name) if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out, help=f"JSON results path (default $OUT/{out_name})")
    parser.add_argument("--budget-s", type=float, default=budget_s,
                        help="optional cases that would start after this many seconds are skipped")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check of this script)")
    if add_arguments:
        add_arguments(parser)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
              f"configs {select_configs(torch.device('cuda')).name}", flush=True)
    elif not args.tiny:
        sys.exit("no CUDA device: run with --tiny to check the script on a CPU")
    scale = (lambda n, lo: max(lo, n // 256)) if args.tiny else (lambda n, lo: n)
    return args, cuda, "cuda" if cuda else "cpu", scale


def main():
    args, cuda, device, scale = script_setup(__doc__, "cce_check.json", 330.0)
    qwen = (scale(2048, 37), scale(151_936, 301), scale(1024, 24))
    gemma = (scale(8192, 40), scale(256_000, 500), scale(2304, 36))
    big = (scale(131_072, 512), scale(151_936, 301), scale(1024, 24))
    odd = (scale(1031, 37), scale(32_011, 301), scale(520, 24))
    chunk = 64 if args.tiny else 4096
    low = ["fp16"] if args.tiny else ["bf16", "fp16"]  # the interpreter cannot do bf16
    c = Checker(args.budget_s, device)

    # 1. The reference itself.
    c.run("reference-formula", check_reference_formula, device, required=True)
    # 2. bf16 accuracy against the naive path at the two heads (required).
    c.run("qwen3/mean", check_shape, "qwen3", *qwen, low[0], "mean",
          ["filter_off", "default", "kahan", "full_c", "full_e", "sort"], device, chunk, required=True)
    c.run("gemma2/mean", check_shape, "gemma2", *gemma, low[0], "mean",
          ["filter_off", "default", "full_c"], device, 2048 if not args.tiny else chunk, required=True)
    # 3. N * V > 2^31 (required).
    c.run("big", check_big, *big, device, chunk, low[0], required=True)
    # 4. Memory and time at the Gemma head (required), with this GPU's and the Turing configs.
    if cuda:
        for configs in (None, "turing-64k"):
            for options in ({}, {"filter_eps": None}):
                c.run("bench", measure, "gemma2", *gemma, "bf16", device, configs=configs,
                      required=True, **options)
    # 5. The rest, as time allows.
    c.run("gemma2/softcap", check_shape, "gemma2", *gemma, low[0], "softcap", ["filter_off"],
          device, 2048 if not args.tiny else chunk)
    c.run("qwen3/everything", check_shape, "qwen3", *qwen, low[0], "everything",
          ["filter_off", "default"], device, chunk)
    for dtype_name in ["fp32"] + low[1:]:
        c.run(f"qwen3/{dtype_name}", check_shape, "qwen3", *qwen, dtype_name, "mean",
              ["filter_off", "default"], device, chunk)
    for dtype_name in ["fp32", *low]:
        for spec_name in SPECS:
            variants = list(VARIANTS) if spec_name == "mean" else ["default"]
            c.run(f"odd/{dtype_name}/{spec_name}", check_shape, "odd", *odd, dtype_name, spec_name,
                  variants, device, chunk)
    for dtype_name in ["fp32", *low[1:]]:
        c.run(f"gemma2/{dtype_name}", check_shape, "gemma2", *gemma, dtype_name, "mean", ["default"],
              device, 2048 if not args.tiny else chunk)

    # The table.
    print("\n" + "=" * 110)
    print(f"{'case':58s} {'status':7s} {'loss':>8s} {'dE':>8s} {'dC':>8s} {'dE/nv':>6s} {'dC/nv':>6s}"
          f" {'MB':>8s} {'/LB':>6s} {'ms':>7s}")
    for r in c.records:
        def f(key, fmt):
            width = int(fmt.split(".")[0])
            return format(r[key], fmt) if isinstance(r.get(key), (int, float)) else "-".rjust(width)
        print(f"{r['case'][:58]:58s} {r.get('status', '?')[:7]:7s} {f('loss_err', '8.1e')} "
              f"{f('dE_err', '8.1e')} {f('dC_err', '8.1e')} {f('dE_ratio', '6.2f')} {f('dC_ratio', '6.2f')}"
              f" {f('peak_mb', '8.0f')} {f('peak_over_lb', '6.3f')} {f('fwd_bwd_ms', '7.2f')}")
        if r.get("problems") or r.get("error"):
            print(f"    -> {r.get('problems') or r.get('error')}")
    finish(c, args.out, cuda)


def judge(rec: dict, dtype: torch.dtype, resolved) -> None:
    """The pass rules, set on ``rec`` as status (and problems): loss <= 1e-4 (1e-5 fp32); an exact
    gradient <= 1e-5 in fp32, else <= 1.5x the naive path's error; a filtered one <= 0.1."""
    filtered = resolved.filter_eps is not None
    loss_tol = 1e-5 if dtype == torch.float32 else 1e-4
    problems = []
    if not rec["loss_err"] <= loss_tol:
        problems.append(f"loss err > {loss_tol}")
    for grad, exact in (("dE", not filtered or resolved.full_e), ("dC", not filtered or resolved.full_c)):
        err, ratio = rec[f"{grad}_err"], rec[f"{grad}_ratio"]
        if not exact:
            if not err <= 0.1:
                problems.append(f"{grad} (filtered) err > 0.1")
        elif dtype == torch.float32:
            if not err <= 1e-5:
                problems.append(f"{grad} err > 1e-5")
        elif not ratio <= 1.5:
            problems.append(f"{grad} {ratio:.2f}x the naive path's error > 1.5x")
    rec["status"] = "FAIL" if problems else "ok"
    if problems:
        rec["problems"] = "; ".join(problems)


def finish(c, out: str | None, cuda: bool) -> None:
    """Print the count line, write the records as JSON to ``out``, exit 1 if any case failed."""
    total = time.time() - c.t0
    print(f"{len(c.records)} records, {c.failed} failed, {total:.0f} s")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        meta = dict(torch=torch.__version__, triton=triton.__version__, seconds=round(total, 1),
                    device=torch.cuda.get_device_name(0) if cuda else "cpu", failed=c.failed)
        with open(out, "w") as fh:
            json.dump(dict(meta=meta, records=c.records), fh, indent=1, default=str)
        print(f"wrote {out}")
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    main()
