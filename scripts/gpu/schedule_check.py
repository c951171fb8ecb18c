"""The three-product schedule ("forward_grads", ``memory_budget``) on a GPU: gradients against float64
over several row chunks, and predicted against measured peak memory.

    python scripts/gpu/schedule_check.py [--out $OUT/schedule_check.jsonl] [--tiny]

1. Accuracy over several chunks (rows fixed small with ``HostTuning.forward_grads_rows``), bf16 and
   fp16, with the soft cap, and with the z-loss and label smoothing: dE's and dC's error against
   float64 beside the naive path's (logits in the dtype, then fp32), and the gate's rule (within
   max(floor, 2x naive's)) — the CPU tests cover fp32 and fp16 at tiny shapes, not bf16. Also with
   bf16's dC accumulated in its own dtype (a budget below its fp32 accumulator) over the most chunks
   allowed (``HostTuning.dC_in_dtype_chunks``, 16): the rounding that grows with the chunks (fp16 holds
   its gradients in fp32 until the backward, so never).
2. Peak memory of forward+backward above the inputs under budgets of 256 MiB, 1 GiB and 4 GiB at the
   Qwen3 head (N = 16,384 and 65,536) and the Gemma-2-2B head (N = 8,192), and 40 MiB at 16,384 (below
   the recompute plan's own need: fewer rows per dE accumulator), bf16: the schedule chosen,
   the predicted peak (``stats``) against the measured one; the target is within 5%, and the budget
   never exceeded. And fp16 at the Qwen3 head, 16,384 tokens, under 1 and 4 GiB: its gradients held in
   fp32 through the forward, a formula of its own.

``--tiny``: small shapes on a CPU under the interpreter (fp32 and fp16), to check the script.
"""

from __future__ import annotations

import torch
from _common import Checker, finish, script_setup

from helpers.cce import linear_cross_entropy
from helpers.cce.options import resolve_configs
from helpers.cce.schedules import forward_grads_extra_bytes
from helpers.compare.heads import GEMMA2, QWEN3
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import peak_memory
from helpers.compare.units import lower_bound_bytes
from helpers.spec import reference_loss_and_grads, relative_error

GATE_FLOOR = 2e-2  # the gate's floor on a relative error (helpers.compare.verdicts.GATE_FLOOR's order)


def accuracy(dtype, options: dict, device, tiny: bool, fp32_dC: bool = True) -> dict:
    N, V, D = (48, 301, 24) if tiny else (1000, 3001, 256)
    rows = 16 if tiny else 256
    configs = resolve_configs(None, torch.device(device))
    budget = 2**30
    if not fp32_dC:  # the most chunks dC may be accumulated over in its dtype, and a budget without fp32's
        N = rows * configs.host.dC_in_dtype_chunks
        budget = forward_grads_extra_bytes(N, V, D, dtype.itemsize, rows, dtype.itemsize, fp32_dC=False)
    # At these sizes the time model rightly prefers recompute (launches and traffic dominate): priced free, the
    # three products win, so the schedule under test runs; with fp32's dC accumulator unless the case is its dtype's.
    configs = configs.tuned(forward_grads_rows=rows, launch_us=0.0, bandwidth_gbs=1e12,
                            **({"dC_in_dtype_chunks": 0} if fp32_dC else {}))
    E, C, x = make_inputs(N, V, D, dtype, device, regime="uniform", seed=0)
    E.requires_grad_(True)
    C.requires_grad_(True)
    stats = {}
    loss = linear_cross_entropy(E, C, x, memory_budget=budget, configs=configs, stats=stats, **options)
    dE, dC = torch.autograd.grad(loss, (E, C))
    _, ref_dE, ref_dC = reference_loss_and_grads(E.detach(), C.detach(), x, **options)
    # The naive path: logits in the dtype, then fp32 (what the gate measures against).
    E2, C2 = E.detach().clone().requires_grad_(True), C.detach().clone().requires_grad_(True)
    z = E2 @ C2.T
    if options.get("softcap"):
        z = options["softcap"] * torch.tanh(z.float() / options["softcap"])
    z = z.float()
    naive = torch.nn.functional.cross_entropy(z, x, label_smoothing=options.get("label_smoothing", 0.0))
    if options.get("z_loss"):
        naive = naive + options["z_loss"] * (torch.logsumexp(z, dim=-1) ** 2).mean()
    n_dE, n_dC = torch.autograd.grad(naive, (E2, C2))
    errs = {"dE": relative_error(dE, ref_dE), "dC": relative_error(dC, ref_dC),
            "naive_dE": relative_error(n_dE, ref_dE), "naive_dC": relative_error(n_dC, ref_dC)}
    ok = all(errs[k] <= max(GATE_FLOOR, 2 * errs[f"naive_{k}"]) for k in ("dE", "dC"))
    ran = stats.get("schedule") == "forward_grads" and stats.get("dC_accumulator") == ("fp32" if fp32_dC else "dtype")
    return {"dtype": str(dtype).removeprefix("torch."), "options": options, "schedule": stats.get("schedule"),
            "chunks": stats.get("chunks"), "dC_accumulator": stats.get("dC_accumulator"), "why": stats.get("why"),
            **{k: float(v) for k, v in errs.items()},
            # On a CPU the time model may pick the recompute schedule at these sizes: the script's check.
            "status": "ok" if ok and (ran or not torch.device(device).type == "cuda") else "FAIL"}


def peaks(name, N, V, D, budget, device, dtype=None) -> dict:
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float16)
    E, C, x = make_inputs(N, V, D, dtype, device, regime="uniform", seed=N)
    E.requires_grad_(True)
    C.requires_grad_(True)
    stats = {}

    def step():
        loss = linear_cross_entropy(E, C, x, memory_budget=budget, stats=stats)
        torch.autograd.grad(loss, (E, C))

    step()
    _, peak = peak_memory(step, device=device)  # above the inputs: dE, dC and the scratch
    lb = lower_bound_bytes(N, V, D, dtype)
    predicted = stats.get("predicted_peak_bytes")
    rec = {"case": f"peak/{name}/budget={budget}", "dtype": str(dtype).removeprefix("torch."), "N": N, "V": V, "D": D,
           "budget": budget,
           "schedule": stats.get("schedule"), "rows": stats.get("rows"), "gemm_chunks": stats.get("gemm_chunks"),
           "why": stats.get("why"),
           "peak_bytes": int(peak), "lower_bound_bytes": int(lb), "predicted_peak_bytes": predicted,
           "extra_bytes": int(peak - lb)}
    rec["predicted_over_measured"] = round(predicted / peak, 4) if predicted else None
    within = predicted is not None and abs(predicted / peak - 1) <= 0.05
    # On a CPU the peak counts the interpreter's and the fp32 products' copies: recorded, not judged.
    rec["status"] = "ok" if torch.device(device).type != "cuda" or (within and peak - lb <= budget) else "FAIL"
    return rec


def main():
    def add_arguments(parser):
        parser.add_argument("--peaks-only", action="store_true", help="only section 2, the peaks under budgets")

    args, cuda, device, _ = script_setup(__doc__, "schedule_check.jsonl", budget_s=420, add_arguments=add_arguments)
    check = Checker(args.budget_s, device)
    dtypes = (torch.bfloat16, torch.float16) if cuda else (torch.float16,)
    for dtype in dtypes if not args.peaks_only else ():
        for options in ({}, {"softcap": 4.0}, {"z_loss": 1e-3, "label_smoothing": 0.1})[: 3 if cuda else 1]:
            check.run(f"accuracy/{str(dtype).removeprefix('torch.')}/{options}", accuracy, dtype, options, device,
                      args.tiny, required=True)
        if dtype != torch.float16:  # fp16 holds its gradients in fp32 (helpers.cce.forward_grads): never in its dtype
            check.run(f"accuracy/{str(dtype).removeprefix('torch.')}/dC_in_dtype", accuracy, dtype, {"softcap": 4.0},
                      device, args.tiny, False, required=True)
    cases = ([("qwen3-16k", 16_384, QWEN3.V, QWEN3.D), ("qwen3-65k", 65_536, QWEN3.V, QWEN3.D),
              ("gemma2-8k", 8_192, GEMMA2.V, GEMMA2.D)] if not args.tiny else [("tiny", 256, 1031, 40)])
    budgets = (2**28, 2**30, 2**32) if not args.tiny else (2**22,)
    for name, N, V, D in cases:
        for budget in budgets:
            check.run(f"peak/{name}/{budget}", peaks, name, N, V, D, budget, device)
    # Below the recompute plan's own need (64 MiB at 16k tokens): fewer rows per dE accumulator. (At the
    # tiny shape forward_grads fits such a budget: the case would repeat the one above.)
    if not args.tiny:
        check.run("peak/qwen3-16k/tight", peaks, "qwen3-16k", 16_384, QWEN3.V, QWEN3.D, 40 * 2**20, device)
    # fp16 (a T4's dtype): the three-product schedule holds its gradients in fp32 until the backward, a memory
    # formula of its own (helpers.cce.schedules).
    if cuda:
        for budget in (2**30, 2**32):
            check.run(f"peak/qwen3-16k-fp16/{budget}", peaks, "qwen3-16k-fp16", 16_384, QWEN3.V, QWEN3.D, budget,
                      device, torch.float16)
    finish(check, args.out, cuda)


if __name__ == "__main__":
    main()
