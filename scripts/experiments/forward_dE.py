"""dE made in the forward: does the recompute design keep its time and come under 1.1 LB at every N?

    python scripts/experiments/forward_dE.py [--out $OUT/forward_dE.jsonl] [--tiny] [--cases NAME ...]

Why. The recompute design ("gemm") holds dE's fp32 accumulator (rows x D x 4 bytes: 64 MiB at the Qwen3
head, 16,384 rows) while dE and dC both exist: its peak is 1.13-1.20 LB from 16,384 tokens (LB = dE + dC,
docs/PERFORMANCE.md, "Against the targets"). Made in the forward instead, the accumulator lives while dC
does not exist yet. The forward walks the vocabulary once: per chunk its logits z, P = exp(z - m) written
in the dtype (m a per-row reference known before the walk, the target's logit; the target's own column
left out), the row sums S and the largest logit from the same tiles in fp32, and A += P C_c in cuBLAS
(fp32 output); at the end lse = m + log S and dE = (A - (1 - p_target) S C_x) / S per row, scaled by the
upstream gradient in the backward (by 1 for a mean's loss.backward(): no second rounding). The backward
then makes G and dC alone. Still four N x V x D products; what moves is G's chunk pass: the forward's
fused lse kernel (logits, no write) becomes a pass that writes P, as the backward's G pass writes G.

What this script measures, before anything is built: the same arithmetic from the kernels we ship.

- "shipped": ``cce_forward`` then ``cce_backward`` for dE and dC ("gemm", the tier's plan).
- "split": ``cce_backward`` for dE alone, its G chunks in a buffer as wide as the backward's widest (the
  forward has LB's room: dC is not made yet), then ``cce_backward`` for dC alone with dE held. The first
  is the forward's P pass to within its reference (G given the lse, where P is given m: the same tile
  arithmetic, the same bytes written) and its row sums (an epilogue of the same tiles, left out here, as
  are the forward's O(N) launches, the target's logit and the loss: ``fwd_ms`` bounds them); the
  second is the new backward. The forward's lse kernel is not run.

Per case: each one's ms (``latency``'s median; the two alternated ``--rounds`` times in one process, since
hosts and clocks drift between calls), its peak above the inputs over LB, the plans' launches, and the
split's dE and dC against the shipped path's (their chunks differ, so fp32's sums differ in order: the
share of elements that differ and the largest difference over the largest element). At 16,384 tokens
both against float64 too (``helpers.spec.reference_loss_and_grads``).

Variants of the dC-only pass (``helpers.cce.forward_de.dc_pass_configs`` with their rows): 16,384 rows a row
chunk (dC folded across them, as the shipped plan folds from 16,384 tokens) and all N rows in one (dC written
once per chunk; G only in dC's rows not yet written, whose room for a chunk is (V - v0) D / (N + D) columns,
and the buffer), each with a G buffer of what 1.1 LB leaves beside dE and dC (at least one tile's columns:
64 MiB at 131,072 tokens, past the 53 MiB left, a predicted 1.12 LB there).

Predicted (written before the run, from the plans on a CPU and the shipped passes' rates, docs/PERFORMANCE.md):
- Qwen3 16k: the P pass in 19 chunks of 8,192 columns (shipped's backward: 55, 21 of them 1,024 wide in dE's
  rows), the dC pass 55. split / shipped 0.92-1.03 (the shipped lse kernel's ~7.4 ms traded for a second G pass
  at ~7.0 plus its products' passes over the accumulator).
- Gemma-2-2B 8k: 16 and 19 chunks against 24; split / shipped 1.00-1.03 (its G pass, 13.5 ms, is 0.6 ms
  slower than its lse pass).
- Qwen3 65k and 131k: the P pass 76 and 152 chunks; the dC pass with all rows in one chunk 242 and 384, from
  ~2,300 and ~1,200 columns down to the buffer's (thin products, K = N: cuBLAS's split-K or not), with 16,384
  rows 502 and 884 (host-bound). split (all rows) / shipped 0.75-0.95: the shipped backward's 305 and 408
  chunks are narrow too (its later row chunks' G in dE's own rows, 1,024 columns).
- Qwen3 4k: 5 and 15 chunks against 21: within +-5% (few chunks; its forward is a small share).
- Peaks over LB: split 1.05-1.10 at every N (1.12 at 131k with all rows in one chunk), shipped 1.05 / 1.20 /
  1.06 / 1.16 / 1.13 at 4k / 16k / Gemma / 65k / 131k (the memory model, ``predicted_peak_bytes``).
- Bits: dE's and dC's differ from shipped's only in fp32's order of sums (chunks of other widths): a few
  percent of elements by one bf16 step; the errors against float64 at 16k within 2% of shipped's.

Section "built" (``--sections``): the design as built (``helpers.cce.forward_de``, the tier with ``forward_de``)
against the shipped path, each a training step of the loss (``built_case``); results in
docs/measurements/h100-2026-12-07 and the predictions in scripts/gpu/pending.sh (items 25 and 26).

Section "precision" (``--sections``): the design's own arithmetic, not the stand-in's, emulated in torch
(fp32 logits from bf16 operands, a chunk of the vocabulary at a time) against float64 on the uniform,
realistic and trained softmaxes: dE as shipped (G = softmax - onehot with the target column -r, rounded to
bf16, its products summed in fp32) and as designed (P = exp(z - z_x) with the target column left out,
rounded to bf16, A = sum P C in fp32, S' = sum P in fp32 from the unrounded exponentials, then
dE = (A - S' C_x) / (1 + S'), rounded once), and the largest margin z_max - z_x (P overflows fp32 past
~88: where a fallback is needed). Predicted: the designed dE's error within 1.2x the shipped's on every
softmax (the same roundings: G's entries and P's are both rounded once to bf16, relative 2^-9; the target's
column is exact in both), margins far below 88 on all three.

``--tiny``: a small head on the CPU under the Triton interpreter, to check the script.
"""

from __future__ import annotations

import statistics

import torch
from _common import Checker, finish, script_setup

from helpers.cce import linear_cross_entropy
from helpers.cce.backward import cce_backward
from helpers.cce.backward.gemm import gemm_plan
from helpers.cce.forward import cce_forward
from helpers.cce.forward_de import dc_pass_configs, p_pass_configs
from helpers.cce.options import CCEOptions, resolve_configs
from helpers.cce.schedules import lower_bound_bytes
from helpers.compare.heads import GEMMA2, QWEN3
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import host_and_device_time, latency, peak_memory
from helpers.spec import reference_loss_and_grads, relative_error

CASES = {  # name: (N, V, D), in the order they run (the first is required; the others wait on the time budget)
    "qwen3-16k": (16_384, QWEN3.V, QWEN3.D),
    "gemma2-8k": (8_192, GEMMA2.V, GEMMA2.D),
    "qwen3-65k": (65_536, QWEN3.V, QWEN3.D),
    "qwen3-131k": (131_072, QWEN3.V, QWEN3.D),
    "qwen3-4k": (4_096, QWEN3.V, QWEN3.D),
}
STAND_IN_SLACK = 16  # bytes a row the stand-in left outside its buffers (helpers.cce.forward_de.SLACK since: 64)


def _plan(configs, N, V, D, dtype, need) -> dict:
    g_cfg = configs.backward_gemm_for(dtype)
    plan = gemm_plan(N, V, D, dtype, g_cfg.BLOCK_V, need_dE=need[0], need_dC=need[1], host=configs.host,
                     tensor_cores=g_cfg.tensor_cores)
    places = {}
    for _, _, chunks in plan.row_chunks:
        for _, _, place in chunks:
            places[place] = places.get(place, 0) + 1
    return {"row_chunks": len(plan.row_chunks), "g_chunks": places,
            "g_buffer_mib": round(plan.buffer_elements * dtype.itemsize / 2**20, 1)}


def one_case(name: str, N: int, V: int, D: int, device: str, rounds: int, tiny: bool) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    E, C, x = make_inputs(N, V, D, dtype, device, regime="uniform", seed=N)
    o = CCEOptions()
    configs = resolve_configs(None, torch.device(device))
    fwd_configs = p_pass_configs(configs, N, V, D, dtype, slack=STAND_IN_SLACK, row_sums=False)
    bwd = {f"bwd_rows{rows}": dc_pass_configs(configs, N, V, D, dtype, rows=rows, slack=STAND_IN_SLACK)
           for rows in sorted({min(N, 16_384 if not tiny else 32), N})}
    # A mean's upstream gradient as autograd hands it: one value for every row (``RowGradient.uniform``). A
    # full (N,) tensor of equal values is not uniform to the backward, whose dC operand is then w_rel E, a copy
    # of a row chunk (rows x D in the dtype): the first run's peaks carried it (docs/measurements/h100-2026-12-07).
    grad_rows = torch.full((1,), 1.0 / N, device=device).expand(N)
    _, lse, r = cce_forward(E, C, x, o, configs)  # the split's G pass is given the lse (module doc)

    def shipped():
        _, lse_, r_ = cce_forward(E, C, x, o, configs)
        return cce_backward(E, C, x, lse_, r_, grad_rows, o, configs, backward_impl="gemm")[:2]

    def fwd_pass():
        return cce_backward(E, C, x, lse, r, grad_rows, o, fwd_configs, backward_impl="gemm",
                            need=(True, False, False))[0]

    def bwd_pass(bwd_configs):
        return cce_backward(E, C, x, lse, r, grad_rows, o, bwd_configs, backward_impl="gemm",
                            need=(False, True, False))[1]

    def split(bwd_configs):
        dE = fwd_pass()
        return dE, bwd_pass(bwd_configs)

    lb = lower_bound_bytes(N, V, D, dtype.itemsize)
    record = dict(case=f"forward_dE/{name}", N=N, V=V, D=D, dtype=str(dtype), lb_bytes=lb,
                  shipped_plan=_plan(configs, N, V, D, dtype, (True, True)),
                  fwd_pass_plan=_plan(fwd_configs, N, V, D, dtype, (True, False)))
    for label, bwd_configs in bwd.items():
        record[f"{label}_plan"] = _plan(bwd_configs, N, V, D, dtype, (False, True))
    want = shipped()  # warm (compiles), then the bits of each against the shipped path's
    if N == 16_384 or tiny:
        _, ref_dE, ref_dC = reference_loss_and_grads(E, C, x, chunk_rows=256 if tiny else 2048)
        record.update(shipped_err_dE=relative_error(want[0], ref_dE), shipped_err_dC=relative_error(want[1], ref_dC))
    for label, bwd_configs in bwd.items():
        got = split(bwd_configs)
        for which, a, b in (("dE", want[0], got[0]), ("dC", want[1], got[1])):
            record[f"{label}_{which}_differ_share"] = (a != b).float().mean().item()
            record[f"{label}_{which}_max_diff"] = ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
        if N == 16_384 or tiny:
            record.update({f"{label}_err_dE": relative_error(got[0], ref_dE),
                           f"{label}_err_dC": relative_error(got[1], ref_dC)})
        del got
    if N == 16_384 or tiny:
        del ref_dE, ref_dC
    del want
    runs = {"shipped": shipped, "fwd_pass": fwd_pass, **{label: (lambda c=c: bwd_pass(c)) for label, c in bwd.items()}}
    peaks = {"shipped": shipped, **{f"split_{label}": (lambda c=c: split(c)) for label, c in bwd.items()}}
    for label, fn in peaks.items():
        _, peak = peak_memory(fn, device=device)
        record[f"{label}_peak_over_lb"] = round(peak / lb, 4)
    times = {label: [] for label in runs}
    for _ in range(rounds):
        for label, fn in runs.items():
            t = latency(fn, warmup=0 if tiny else 1, repeats=1 if tiny else 5, device=device)
            times[label].append(round(t.median_ms, 3))
    record.update({f"{label}_ms": ms for label, ms in times.items()})
    median = {label: statistics.median(ms) for label, ms in times.items()}
    for label in bwd:
        record[f"split_{label}_over_shipped"] = round((median["fwd_pass"] + median[label]) / median["shipped"], 4)
    record["status"] = "ok"
    return [record]


def built_case(name: str, N: int, V: int, D: int, device: str, rounds: int, tiny: bool) -> list[dict]:
    """The built path (``helpers.cce.forward_de``, the tier with ``forward_de``) against the shipped one, each a
    training step of the loss (forward, then backward into E and C as leaves; "gemm"): time alternated, peak
    above the inputs over LB, the loss and both gradients against float64 at 16,384 tokens (and --tiny), and
    the stats' word that the forward made dE (a step that fell back is an error, not a measurement)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    scale = 0.3 if tiny else 1.0  # fp16 on the CPU: a softmax within its range (S' < 2^15)
    E0, C, x = make_inputs(N, V, D, dtype, device, regime="uniform", seed=N)
    E0 = (scale * E0.float()).to(dtype)
    shipped = resolve_configs(None, torch.device(device))
    variants = {"shipped": shipped, "built": shipped.tuned(forward_de=True)}
    if device == "cuda" and shipped.host.g_pingpong:  # the P pass's G kernel: Gluon (the tier's) or Triton
        variants["built_triton_g"] = shipped.tuned(forward_de=True, g_pingpong=False)
    E = E0.clone().requires_grad_()
    Cg = C.clone().requires_grad_()
    said = {}

    def step(configs, label):
        E.grad, Cg.grad = None, None
        stats = {}
        loss = linear_cross_entropy(E, Cg, x, configs=configs, backward_impl="gemm", stats=stats)
        loss.backward()
        said[label] = stats.get("forward_de")
        return loss.detach()

    lb = lower_bound_bytes(N, V, D, dtype.itemsize)
    record = dict(case=f"built/{name}", N=N, V=V, D=D, dtype=str(dtype), lb_bytes=lb)
    ref = reference_loss_and_grads(E0, C, x, chunk_rows=256 if tiny else 2048) if N == 16_384 or tiny else None
    for label, configs in variants.items():
        loss = step(configs, label)  # warm (compiles)
        if label != "shipped" and said[label] != "made dE":
            raise RuntimeError(f"{label}: the forward did not make dE ({said[label]})")
        if ref is not None:
            record.update({f"{label}_loss_err": abs(loss.double().item() - ref[0].item()) / abs(ref[0].item()),
                           f"{label}_err_dE": relative_error(E.grad, ref[1]),
                           f"{label}_err_dC": relative_error(Cg.grad, ref[2])})
        E.grad, Cg.grad = None, None
        _, peak = peak_memory(lambda c=configs, lab=label: step(c, lab), device=device)
        record[f"{label}_peak_over_lb"] = round(peak / lb, 4)
    del ref
    times = {label: [] for label in variants}
    for _ in range(rounds):
        for label, configs in variants.items():
            t = latency(lambda c=configs, lab=label: step(c, lab), warmup=0 if tiny else 1, repeats=1 if tiny else 5,
                        device=device)
            times[label].append(round(t.median_ms, 3))
    record.update({f"{label}_ms": ms for label, ms in times.items()})
    # Where the time goes: the step's host time (the launches queued, no wait but the step's own reads) and the
    # GPU's busy time, back to back (``host_and_device_time``): a step whose host time passes its GPU time is the
    # host's.
    for label, configs in variants.items():
        hd = host_and_device_time(lambda c=configs, lab=label: step(c, lab), calls=1 if tiny else 5, warmup=0,
                                  device=device)
        record.update({f"{label}_host_ms": round(hd.host_ms, 3), f"{label}_gpu_busy_ms": round(hd.device_ms, 3)})
    median = {label: statistics.median(ms) for label, ms in times.items()}
    for label in variants:
        if label != "shipped":
            record[f"{label}_over_shipped"] = round(median[label] / median["shipped"], 4)
    record["status"] = "ok"
    return [record]


def precision_case(regime: str, N: int, V: int, D: int, device: str, step: int) -> dict:
    E, C, x = make_inputs(N, V, D, torch.bfloat16, device, regime=regime, seed=N + V)
    Ef, Cf, E64, C64 = E.float(), C.float(), E.double(), C.double()
    rows = torch.arange(N, device=device)
    z_x = (Ef * Cf[x]).sum(1)  # the target's logit, fp32 (the indexed dot)
    lse64 = torch.full((N,), -float("inf"), dtype=torch.float64, device=device)
    z_max = torch.full((N,), -float("inf"), device=device)
    for v0 in range(0, V, step):
        z64 = E64 @ C64[v0:v0 + step].T
        lse64 = torch.logaddexp(lse64, torch.logsumexp(z64, dim=1))
        z_max = torch.maximum(z_max, z64.max(1).values.float())
    p_x64 = torch.exp((E64 * C64[x]).sum(1) - lse64)
    lse, r = lse64.float(), (1.0 - p_x64).float()  # the shipped forward's lse and 1 - p(target), to fp32
    ref = torch.zeros(N, D, dtype=torch.float64, device=device)
    shipped = torch.zeros(N, D, device=device)
    A = torch.zeros(N, D, device=device)
    S_other = torch.zeros(N, device=device)
    for v0 in range(0, V, step):
        v1 = min(V, v0 + step)
        z64 = E64 @ C64[v0:v1].T
        here = (x >= v0) & (x < v1)
        G64 = torch.exp(z64 - lse64[:, None])
        G64[rows[here], x[here] - v0] -= 1.0
        ref += G64 @ C64[v0:v1]
        z = Ef @ Cf[v0:v1].T  # fp32 logits of bf16 operands
        G = torch.exp(z - lse[:, None])
        G[rows[here], x[here] - v0] = -r[here]
        shipped += G.to(torch.bfloat16).float() @ Cf[v0:v1]
        P = torch.exp(z - z_x[:, None])
        P[rows[here], x[here] - v0] = 0.0
        S_other += P.sum(1)
        A += P.to(torch.bfloat16).float() @ Cf[v0:v1]
    designed = ((A - S_other[:, None] * Cf[x]) / (1.0 + S_other)[:, None]).to(torch.bfloat16)
    margin = (z_max - z_x).max().item()
    return {"case": f"precision/{regime}/{N}x{V}x{D}", "regime": regime, "N": N, "V": V, "D": D,
            "shipped_err_dE": relative_error(shipped.to(torch.bfloat16), ref),
            "designed_err_dE": relative_error(designed, ref),
            "designed_over_shipped": relative_error(designed, ref) / relative_error(shipped.to(torch.bfloat16), ref),
            "margin_max": round(margin, 3), "p_target_median": p_x64.median().item(), "status": "ok"}


def main():
    def add_arguments(parser):
        parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=None)
        parser.add_argument("--rounds", type=int, default=3, help="shipped and split alternated this many times")
        parser.add_argument("--precision-shape", type=int, nargs=3, default=[2_048, QWEN3.V, QWEN3.D],
                            metavar=("N", "V", "D"), help="the precision section's head (default: the Qwen3 head)")
        parser.add_argument("--sections", nargs="+", choices=("time", "precision", "built"),
                            default=["time", "precision"])

    args, cuda, device, _ = script_setup(__doc__, "forward_dE.jsonl", budget_s=420, add_arguments=add_arguments)
    check = Checker(args.budget_s, device, args.out)
    cases = {"tiny": (64, 521, 16)} if args.tiny else {k: CASES[k] for k in (args.cases or CASES)}
    if "time" in args.sections:
        for name, (N, V, D) in cases.items():
            check.run(f"forward_dE/{name}", one_case, name, N, V, D, device, 1 if args.tiny else args.rounds,
                      args.tiny, required=name in ("qwen3-16k", "tiny"))
    if "built" in args.sections:
        for name, (N, V, D) in cases.items():
            check.run(f"built/{name}", built_case, name, N, V, D, device, 1 if args.tiny else args.rounds,
                      args.tiny, required=name in ("qwen3-16k", "tiny"))
    if "precision" in args.sections:
        N, V, D, step = (48, 700, 32, 256) if args.tiny else (args.precision_shape + [8_192])[:4]
        for regime in ("uniform", "realistic", "trained"):
            check.run(f"precision/{regime}", precision_case, regime, N, V, D, device, step, required=True)
    finish(check, args.out, cuda)


if __name__ == "__main__":
    main()
