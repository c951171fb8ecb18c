"""One GRPO step through a Qwen3-0.6B-shaped policy head on a GPU: ours against the naive path and
Liger-Kernel's fused GRPO loss (``rl.liger_grpo_loss``: the same objective without the entropy bonus,
which it lacks; its gate and its step run without it), as TRL calls it ("liger") and with two non-default
settings ("liger_tuned": 4 sequences a chunk, TF32 for its fp32 products; ``rl.PATHS``). Before each Liger
case, in the gate and the steps, the compiler's cache is reset (``rl.fresh_compile``), so that each shape
compiles once, statically, in the warm-ups; a peer that fails the gate's call is recorded, not the gate's
failure.

    python scripts/gpu/rl_step.py [--out $OUT/rl_step.jsonl] [--tiny]

1. The gate, first: on an irregular shape (8 completions of 129 tokens, V = 5,003, D = 136) in
   bf16 and fp16, ours (``helpers.lab.rl.grpo_loss``: ``linear_cross_entropy_outputs`` and the
   clipped objective) against the same GRPO loss in float64 on the full logits
   (``rl.check_against_float64``): the per-token log-probabilities and entropies, dE and dC, each
   within max(the dtype's floor, 2x the naive path's error). Nothing is timed unless it passes.
2. One step (the loss with ``rl.STEP_OPTIONS``: temperature 0.7, clip 0.2/0.28, a k3 KL and an
   entropy bonus; then dE and dC) at the Qwen3-0.6B head (V = 151,936, D = 1,024), bf16, at 4,096,
   16,384 and 65,536 tokens (completions of 1,024): time (median of 5 after 2 warm-ups) and peak
   memory above the inputs, ours and the naive path (logits in bf16, then fp32 log-softmax, gather
   and the entropy from the softmax, as TRL writes it). An out-of-memory step is recorded
   (status "oom"), not failed: it is the naive path's finding. Beside ours' peak, the loss's memory
   formula (``helpers.compare.theory``); beside naive's, its bytes per logit.

Each record is appended to the results file as it is measured (JSON Lines,
``helpers.compare.results_file``). ``--tiny``: small shapes on a CPU under the interpreter (fp32 and
fp16), to check the script.
"""

from __future__ import annotations

import torch
from _common import Checker, finish, script_setup

from helpers.compare.heads import QWEN3
from helpers.compare.measure import measure, release_memory
from helpers.compare.theory import predicted_peak_bytes
from helpers.compare.units import dtype_name
from helpers.lab import rl


def gate(dtype, device, tiny: bool) -> dict:
    B, T, V, D = (5, 7, 257, 24) if tiny else (8, 129, 5003, 136)
    check = rl.check_against_float64(rl.step_inputs(B, T, V, D, dtype, device))
    return {"B": B, "T": T, "V": V, "D": D, "dtype": check["dtype"], "options": rl.STEP_OPTIONS,
            **{f"{path}_{q}": e for path, errors in check["errors"].items() for q, e in errors.items()},
            **{f"bound_{path}_{q}": b for path, bounds in check["bounds"].items() for q, b in bounds.items()},
            **{f"{path}_within": within for path, within in check["within"].items()},
            **{f"{path}_failed": error for path, error in check["failed"].items()},
            "status": "ok" if check["ok"] else "FAIL"}


def step(path: str, B: int, T: int, V: int, D: int, dtype, device, cuda: bool, warmup: int, repeats: int) -> dict:
    inputs = rl.step_inputs(B, T, V, D, dtype, device)
    m = measure(rl.head_step(path, inputs), warmup=warmup, repeats=repeats, device=device)
    N = B * T
    record = {"case": f"step/{path}/N={N}", "path": path, "N": N, "B": B, "T": T, "V": V, "D": D,
              "dtype": dtype_name(dtype),
              "options": {**rl.STEP_OPTIONS, **rl.PATH_OPTIONS.get(path, {}), **getattr(rl.PATHS[path], "keywords", {})},
              "status": m.status, "error": m.error,
              "peak_bytes": m.peak_bytes, **(m.latency.as_dict() if m.latency else {})}
    if path == "ours":
        capability = torch.cuda.get_device_capability() if cuda else None
        record["predicted_peak_bytes"] = predicted_peak_bytes("ours", N, V, D, dtype, capability)
        if m.status != "ok":
            record["status"] = "FAIL"  # ours must fit where a 16-bit head and its gradients do
    elif m.peak_bytes:
        record["bytes_per_logit"] = round(m.peak_bytes / (N * V), 2)
    del inputs
    release_memory(device)
    return record


def main():
    args, cuda, device, _ = script_setup(__doc__, "rl_step.jsonl", budget_s=480)
    check = Checker(args.budget_s, device, out=args.out)
    gate_dtypes = (torch.bfloat16, torch.float16) if cuda else (torch.float32, torch.float16)
    gates = [check.run(f"gate/{dtype_name(d)}", gate, d, device, args.tiny, required=True) for d in gate_dtypes]
    if not all(g and g["status"] == "ok" for g in gates):
        print("ours failed the gate: nothing is timed", flush=True)
        finish(check, args.out, cuda)
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = [(2, 32, 509, 32)] if args.tiny else [(B, 1024, QWEN3.V, QWEN3.D) for B in (4, 16, 64)]
    warmup, repeats = (0, 1) if args.tiny else (2, 5)
    for B, T, V, D in shapes:
        for path in (p for p in rl.PATHS if rl.path_reason(p) is None):
            check.run(f"step/{path}/N={B * T}", step, path, B, T, V, D, dtype, device, cuda, warmup, repeats,
                      required=B * T == 16_384)
    finish(check, args.out, cuda)


if __name__ == "__main__":
    main()
