"""Gradients at real shapes, where they are summed over many chunks: every method against float64 at
the Qwen3 and Gemma-2-2B heads, and ours with fewer rows per dE accumulator.

    python scripts/gpu/accumulation_check.py [--out $OUT/accumulation_check.jsonl] [--tiny]

The gate (notebook 01, ``python -m helpers gate``) judges every method at 2,048 tokens of the Qwen3
head or fewer, on uniform targets. A method that sums a gradient over chunks of rows in 16 bits
(Liger's dC: ``addmm`` into a bf16 dC, once per chunk of rows, about V / D = 149 chunks at the Qwen3
head whatever N; ours under a budget, at most ``HostTuning.dC_in_dtype_chunks``) rounds once per
chunk, and the error that costs grows with how many chunks add comparable amounts to one row of dC:
few with uniform targets over 151,936 tokens at 2,048 rows (each token is the target of at most a
row or two), many with frequent tokens at 65,536 rows. So:

1. ``accuracy/<head>/<N>/<regime>``: loss, dE and dC of each method against the float64 reference
   (chunked closed form, ``helpers.spec.reference_loss_and_grads``), with the gate's rule
   (``helpers.compare.verdicts.gate_bound``: within max(floor, 2x naive's error)), bf16, at 16,384
   and 65,536 tokens of the Qwen3 head and 8,192 of the Gemma head, uniform and realistic targets
   (``helpers.compare.inputs``). Methods: naive, Liger, Apple CCE, ours (each budget's schedule
   and dC accumulator recorded), and ours with dC accumulated in bf16 over as many chunks as
   Liger's (``dC_in_dtype_chunks`` raised, a budget near Liger's peak).
2. ``rows/<N>/<rows>``: ours' recompute design with ``rows`` rows per dE accumulator
   (``HostTuning.gemm_chunks``) at the Qwen3 head: time, peak and the plan's predicted peak, and
   dE/dC against float64 (the design's bound in docs/PERFORMANCE.md: fewer rows reach 1.1 LB at
   more launches).

``--tiny``: small shapes on a CPU under the interpreter, to check the script.
"""

from __future__ import annotations

# _common first: on a CPU it sets TRITON_INTERPRET before triton is imported (triton's own
# helpers, tl.sum among them, are made interpreted or not when triton is imported).
from _common import Checker, finish, script_setup
import torch
import triton

from helpers.cce import linear_cross_entropy
from helpers.cce.backward.gemm import gemm_chunks
from helpers.cce.options import resolve_configs
from helpers.compare.heads import GEMMA2, QWEN3
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import latency, peak_memory, release_memory
from helpers.compare.methods import MethodUnavailable, get_method
from helpers.compare.units import lower_bound_bytes
from helpers.compare.verdicts import GATE_FLOOR, SLACK
from helpers.spec import reference_loss_and_grads, relative_error

PEERS = ("naive", "liger", "apple_cce")
# Ours' budgets: "min" (the recompute design), 512 MiB (at 16k: dC accumulated in bf16, 10 chunks),
# 1 GiB (dC in fp32 where it fits).
BUDGETS = ("min", 2**29, 2**30)
LIGER_CHUNKS = 128  # Liger's chunk count at the Qwen3 head: 2^ceil(log2(N / 149)) rows a chunk


def _grads(loss_fn, E, C, x):
    E = E.detach().clone().requires_grad_(True)
    C = C.detach().clone().requires_grad_(True)
    loss = loss_fn(E, C, x)
    dE, dC = torch.autograd.grad(loss, (E, C))
    return loss.detach(), dE, dC


def _errors(got, ref) -> dict:
    return {q: relative_error(g, r) for q, g, r in zip(("loss", "dE", "dC"), got, ref)}


def accuracy(head: str, N: int, V: int, D: int, regime: str, device: str, tiny: bool) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    floors = GATE_FLOOR[str(dtype).removeprefix("torch.")]
    E, C, x = make_inputs(N, V, D, dtype, device, regime=regime, seed=N + len(regime))
    ref = reference_loss_and_grads(E, C, x, chunk_rows=256 if tiny else 2048)
    targets = torch.bincount(x, minlength=V)
    common = {"head": head, "N": N, "V": V, "D": D, "regime": regime, "dtype": str(dtype).removeprefix("torch."),
              "most_frequent_target_count": int(targets.max()), "distinct_targets": int((targets > 0).sum())}
    runs = []
    for name in PEERS:
        method = get_method(name)
        try:
            runs.append((name, {}, _grads(method, E, C, x)))
        except MethodUnavailable as why:
            runs.append((name, {"status": "unavailable", "why": str(why)}, None))
        release_memory(device)
    configs = resolve_configs(None, torch.device(device))
    # About Liger's peak beyond the inputs and LB: one chunk of its rows' 16-bit logits (and 1/8 more).
    liger_rows = triton.next_power_of_2(triton.cdiv(N, triton.cdiv(V, D)))
    liger_like = 16 * N + liger_rows * V * dtype.itemsize * 9 // 8
    variants = [(f"ours/budget={b}", dict(memory_budget=b), configs) for b in (BUDGETS if not tiny else ("min",))]
    if dtype != torch.float16:  # fp16 holds its gradients in fp32 (helpers.cce.forward_grads): dC never in fp16
        variants.append((f"ours/dC_in_dtype_{LIGER_CHUNKS}", dict(memory_budget=liger_like),
                         configs.tuned(dC_in_dtype_chunks=LIGER_CHUNKS, **({"row_multiple": 1} if tiny else {}))))
    for name, options, cfg in variants:
        stats = {}

        def loss_fn(E_, C_, x_, options=options, cfg=cfg, stats=stats):
            return linear_cross_entropy(E_, C_, x_, configs=cfg, stats=stats, **options)

        try:
            got = _grads(loss_fn, E, C, x)
        except Exception as error:  # noqa: BLE001  (a budget no schedule fits: recorded, not fatal)
            runs.append((name, {"status": "error", "why": f"{type(error).__name__}: {error}"[:300]}, None))
            continue
        runs.append((name, {k: stats.get(k) for k in ("schedule", "rows", "dC_accumulator", "why")}, got))
        release_memory(device)
    naive = _errors(next(got for name, _, got in runs if name == "naive"), ref)
    records = []
    for name, extra, got in runs:
        rec = {**common, "case": f"accuracy/{head}/{N}/{regime}/{name}", "method": name, **extra}
        if got is not None:
            errors = _errors(got, ref)
            bounds = {q: max(floors[q], SLACK * naive[q]) for q in ("loss", "dE", "dC")}
            rec.update({f"err_{q}": errors[q] for q in errors}, **{f"bound_{q}": bounds[q] for q in bounds})
            rec["gate"] = "pass" if all(errors[q] <= bounds[q] for q in errors) else "fail"
            rec["status"] = "ok"  # a method over the bound is a finding, recorded in "gate", not a failed check
        records.append(rec)
    del ref
    release_memory(device)
    return records


def rows_per_accumulator(N: int, V: int, D: int, rows: int, device: str, tiny: bool) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    E, C, x = make_inputs(N, V, D, dtype, device, regime="uniform", seed=N)
    configs = resolve_configs(None, torch.device(device))
    _, v_default = gemm_chunks(N, V, D, dtype, configs.backward_gemm_for(dtype).BLOCK_V)
    configs = configs.tuned(gemm_chunks=(min(rows, N), v_default))
    E.requires_grad_(True)
    C.requires_grad_(True)
    stats = {}

    def step():
        loss = linear_cross_entropy(E, C, x, configs=configs, stats=stats)
        return torch.autograd.grad(loss, (E, C))

    step()
    _, peak = peak_memory(step, device=device)
    timing = latency(step, warmup=0 if tiny else 1, repeats=1 if tiny else 7, device=device)
    dE, dC = step()
    _, ref_dE, ref_dC = reference_loss_and_grads(E.detach(), C.detach(), x, chunk_rows=256 if tiny else 2048)
    lb = lower_bound_bytes(N, V, D, dtype)
    predicted = stats.get("predicted_peak_bytes")
    return {"case": f"rows/{N}/{rows}", "N": N, "rows": rows, "ms": round(timing.median_ms, 3),
            "p10_ms": round(timing.p10_ms, 3), "p90_ms": round(timing.p90_ms, 3), "peak_bytes": int(peak),
            "peak_over_lb": round(peak / lb, 4), "predicted_peak_bytes": predicted,
            "predicted_over_measured": round(predicted / peak, 4) if predicted else None,
            "err_dE": relative_error(dE, ref_dE), "err_dC": relative_error(dC, ref_dC),
            "status": "ok"}


def main():
    args, cuda, device, scale = script_setup(__doc__, "accumulation_check.jsonl", budget_s=480)
    check = Checker(args.budget_s, device, args.out)
    if args.tiny:
        heads = [("tiny", 64, 521, 16, ("realistic",))]
    else:
        heads = [("qwen3", 16_384, QWEN3.V, QWEN3.D, ("uniform", "realistic")),
                 ("qwen3", 65_536, QWEN3.V, QWEN3.D, ("realistic",)),
                 ("gemma2", 8_192, GEMMA2.V, GEMMA2.D, ("realistic",))]
    for head, N, V, D, regimes in heads:
        for regime in regimes:
            check.run(f"accuracy/{head}/{N}/{regime}", accuracy, head, N, V, D, regime, device, args.tiny,
                      required=head != "gemma2")
    shapes = [(16_384, (16_384, 8_192, 6_144, 4_096)), (65_536, (16_384, 8_192))] if not args.tiny else \
        [(64, (32,))]
    for N, rows_list in shapes:
        V, D = (QWEN3.V, QWEN3.D) if not args.tiny else (521, 16)
        for rows in rows_list:
            check.run(f"rows/{N}/{rows}", rows_per_accumulator, N, V, D, rows, device, args.tiny)
    finish(check, args.out, cuda)


if __name__ == "__main__":
    main()
