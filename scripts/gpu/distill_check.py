"""Distillation without logits (``helpers.cce.linear_kl_div``) on a GPU: accuracy against float64, then
time and peak memory beside Liger-Kernel's fused linear JSD and the naive fp32-logits path.

    python scripts/gpu/distill_check.py [--out $OUT/distill_check.jsonl] [--tiny] [--pretend t4]

1. Accuracy on a small shape (N = 1,000, V = 3,001, D_s = 256, D_t = 512; the uniform regime of
   ``helpers.compare.inputs`` for each head), bf16 and fp16, every kind with a temperature, and one case
   with the soft cap, both biases, ignored tokens and per-token upstream gradients: the loss and dE_s,
   dC_s (db_s) against ``helpers.spec.reference_kl_div`` in float64, beside the naive path's error
   (both heads' logits in the dtype, then fp32, the spec's formula: ``divergence_of_logits``) and, where
   installed, Liger's. Pass: loss relative error <= 1e-4; each gradient within max(2e-2, 2x the naive
   path's) (``scripts/gpu/schedule_check.py``'s rule).
2. Time (median forward+backward, ``helpers.compare.measure.latency``) and peak memory above the inputs
   (``peak_memory``) at N = 16,384 tokens, a Qwen3-0.6B student head (V = 151,936, D_s = 1,024) and a
   teacher of D_t = 2,048 (Qwen3-1.7B's width), bf16, every 7th token ignored, temperature 1:
     - "jsd": ours kind="jsd", beta = 0.5, against ``LigerFusedLinearJSD(jsd_beta=0.5)``;
     - "forward": ours kind="forward" (KL(p || q)) against Liger's jsd_beta = 0 (its forward KL);
     - the naive path of each where it fits (its OOM is recorded).
   Like for like: the same divergence, the same tokens ignored (Liger through its ``shift_labels``),
   both reduced as a mean over the kept tokens of each token's sum over V, the gradients of E_s and
   C_s only (the teacher a constant in all three), each loss checked against the others' value.
   What differs: Liger computes the gradients inside its forward (its backward only scales them) and
   holds fp32 chunks of logits; ours recomputes the logits in the backward (module doc of
   ``helpers.cce.distill``: more FLOP, O(N) memory in the forward).

``--compile-only`` (no GPU needed; run with TRITON_INTERPRET=0): both kernels compiled for each tier's
GPU (``triton.compile`` with its target) at the tiles ``linear_kl_div`` gives them (``pair_config``),
their shared memory against the tier's budget, one JSON line. On a CPU this is the only check that the
kernels compile at all: the interpreter runs what the compiler refuses (a global that is no constexpr).

``--pretend <card>`` (``helpers.cce.device``): as that card sees it (a T4: fp16 only, 15 GiB, the
Turing tier's tiles; its speed stays this GPU's). ``--tiny``: small shapes on a CPU under the
interpreter, fp16, to check the script; Liger (CUDA only) is recorded as unavailable there.
"""

from __future__ import annotations

import json
import sys

import torch
from _common import Checker, finish, script_setup

from helpers.cce import linear_kl_div
from helpers.cce.device import CARDS, device_info, pretend
from helpers.cce.options import why_unavailable
from helpers.compare.heads import QWEN3
from helpers.compare.measure import is_out_of_memory, latency, peak_memory, release_memory
from helpers.lab.distill import LIGER_BETA, heads, liger_kl_div, liger_reason, naive_kl_div, student_grads
from helpers.spec import reference_kl_div, relative_error

GATE_FLOOR = 2e-2  # the gate's floor on a relative error (helpers.compare.verdicts.GATE_FLOOR's order)
TEACHER_D = 2_048  # Qwen3-1.7B's hidden size: a teacher of the student's vocabulary


def accuracy(dtype, kind, everything: bool, device, tiny: bool) -> dict:
    N, V, D_s, D_t = (48, 301, 24, 40) if tiny else (1000, 3001, 256, 512)
    name = f"accuracy/{str(dtype).removeprefix('torch.')}/{kind}/{'everything' if everything else 'tempered'}"
    reason = why_unavailable(device, dtype)
    if reason:
        return dict(case=name, status="skipped", reason=reason)
    E_s, C_s, E_t, C_t, x = heads(N, V, D_s, D_t, dtype, device)
    options = dict(kind=kind, temperature=0.7)
    bias_s = bias_t = grad_output = None
    if everything:
        g = torch.Generator(device=device).manual_seed(3)
        bias_s = (0.5 * torch.randn(V, device=device, generator=g)).to(dtype)
        bias_t = (0.5 * torch.randn(V, device=device, generator=g)).to(dtype)
        options.update(softcap=8.0, reduction="none")
        grad_output = torch.randn(N, device=device, generator=g)
    biases = dict(bias_t=bias_t)
    ref, ref_grads = student_grads(
        lambda E, C, *b: reference_kl_div(E, C, E_t.double(), C_t.double(), mask=x != -100, bias_s=b[0] if b else None,
                                          bias_t=bias_t.double() if bias_t is not None else None, **options),
        E_s.double(), C_s.double(), None if bias_s is None else bias_s.double(),
        None if grad_output is None else grad_output.double())
    loss, grads = student_grads(lambda E, C, *b: linear_kl_div(E, C, E_t, C_t, x=x, bias_s=b[0] if b else None,
                                                               **biases, **options),
                                E_s, C_s, bias_s, grad_output)
    _, naive_grads = student_grads(lambda E, C, *b: naive_kl_div(E, C, E_t, C_t, x, bias_s=b[0] if b else None,
                                                               **biases, **options),
                                   E_s, C_s, bias_s, grad_output)
    rec = dict(case=name, N=N, V=V, D_s=D_s, D_t=D_t, options={k: v for k, v in options.items()},
               loss_err=relative_error(loss, ref))
    names = ("dE_s", "dC_s", "db_s")
    for label, got, want in zip(names, grads, ref_grads):
        rec[f"{label}_err"] = relative_error(got, want)
    for label, got, want in zip(names, naive_grads, ref_grads):
        rec[f"naive_{label}_err"] = relative_error(got, want)
    if not everything and liger_reason(device, dtype) is None:  # Liger has no bias, cap or per-token upstream
        try:
            liger, liger_grads = student_grads(lambda E, C: liger_kl_div(E, C, E_t, C_t, x, kind=kind, temperature=0.7),
                                               E_s, C_s)
            rec["liger_loss_err"] = relative_error(liger, ref)
            for label, got, want in zip(names, liger_grads, ref_grads):
                rec[f"liger_{label}_err"] = relative_error(got, want)
        except Exception as error:  # a peer's failure is a finding, recorded
            rec["liger_error"] = f"{type(error).__name__}: {error}"
    ok = rec["loss_err"] <= 1e-4 and all(rec[f"{n}_err"] <= max(GATE_FLOOR, 2 * rec[f"naive_{n}_err"])
                                         for n in names[:len(grads)])
    rec["status"] = "ok" if ok else "FAIL"
    return rec


def speed(kind, N, V, D_s, D_t, dtype, device) -> list[dict]:
    """Ours, Liger's and the naive path at one shape: loss, peak above the inputs, median time."""
    E_s, C_s, E_t, C_t, x = heads(N, V, D_s, D_t, dtype, device, seed=N)
    E_s.requires_grad_(True)
    C_s.requires_grad_(True)
    methods = {
        "ours": lambda: linear_kl_div(E_s, C_s, E_t, C_t, kind=kind, x=x),
        "liger": lambda: liger_kl_div(E_s, C_s, E_t, C_t, x, kind=kind),
        "naive": lambda: naive_kl_div(E_s, C_s, E_t, C_t, x, kind=kind),
    }
    cuda = torch.device(device).type == "cuda"
    records, losses = [], {}
    for method, loss_fn in methods.items():
        rec = dict(case=f"speed/{kind}/{method}", kind=kind, method=method, N=N, V=V, D_s=D_s, D_t=D_t,
                   dtype=str(dtype).removeprefix("torch."),
                   compared=f"liger jsd_beta={LIGER_BETA[kind]}" if method == "liger" else None)
        reason = liger_reason(device, dtype) if method == "liger" else None
        if reason:
            records.append(dict(rec, status="skipped", reason=reason))
            continue

        def step():
            loss = loss_fn()
            torch.autograd.grad(loss, (E_s, C_s))
            return loss.detach()

        try:
            loss, peak = peak_memory(step, device=device)
            timing = latency(step, warmup=1, repeats=5 if cuda else 1, device=device)
        except Exception as error:
            release_memory(device)
            if not is_out_of_memory(error) and method == "ours":
                raise
            # A peer's failure, or the naive path's OOM: a finding, recorded.
            records.append(dict(rec, status="oom" if is_out_of_memory(error) else "peer_error",
                                error=f"{type(error).__name__}: {str(error)[:300]}"))
            continue
        losses[method] = float(loss)
        records.append(dict(rec, loss=float(loss), peak_bytes=int(peak), median_ms=timing.median_ms,
                            p10_ms=timing.p10_ms, p90_ms=timing.p90_ms, status="ok"))
        release_memory(device)
    # The three compute one number: ours against each other's (bf16 inputs, fp32 arithmetic everywhere).
    for rec in records:
        if rec["method"] != "ours" and rec["method"] in losses and "ours" in losses:
            rec["loss_rel_diff_vs_ours"] = abs(losses[rec["method"]] - losses["ours"]) / max(abs(losses["ours"]), 1e-30)
            if rec["loss_rel_diff_vs_ours"] > 1e-2:
                rec["status"] = "FAIL"
    return records


def compile_only() -> None:
    """Compile the two kernels for every tier's GPU (``--compile-only``); print one JSON object."""
    import triton

    from helpers.cce.distill import pair_config
    from helpers.cce.kernels.configs import TIERS
    from helpers.cce.kernels.divergence import (JSD, REVERSE_KL, divergence_forward_kernel,
                                                divergence_gradient_chunk_kernel)

    unit = {"stride_Esd", "stride_Csd", "stride_Etd", "stride_Ctd", "stride_Gv"}  # contiguous: 1
    aligned = {"stride_Esn", "stride_Csv", "stride_Etn", "stride_Ctv", "stride_Gn", "D_s", "D_t", "stride_out"}
    results, failed = [], 0
    for tier in TIERS:
        for size, dtype in ((2, "fp16"), (4, "fp32")):
            for fn, table, variants in ((divergence_forward_kernel, tier.forward,
                                         (dict(KIND=REVERSE_KL.value, SECOND_PASS=False, SPLIT_MAJOR=True),
                                          dict(KIND=JSD.value, SECOND_PASS=True, SPLIT_MAJOR=True))),
                                        (divergence_gradient_chunk_kernel, tier.backward_gemm,
                                         (dict(KIND=REVERSE_KL.value), dict(KIND=JSD.value)))):
                cfg = pair_config(table[size])
                for flags in variants:
                    constexprs = dict(cfg.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D"), **flags, HAS_SOFTCAP=True,
                                      HAS_BIAS_S=True, HAS_BIAS_T=True,
                                      DOT_PRECISION="ieee" if size == 4 else "tf32")
                    if fn is divergence_gradient_chunk_kernel:
                        constexprs["GROUP_N"] = cfg.GROUP_N
                    signature, attrs = {}, {}
                    for i, param in enumerate(fn.params):
                        name = param.name
                        if param.is_constexpr or name in unit:
                            signature[name] = "constexpr"
                            constexprs.setdefault(name, 1)
                            continue
                        signature[name] = (("*" + (dtype if name[0] in "ECbG" else "fp32")) if name.endswith("_ptr")
                                           else "fp32" if name in ("softcap", "inv_temperature", "beta") else "i32")
                        if name.endswith("_ptr") or name in aligned:
                            attrs[(i,)] = [["tt.divisibility", 16]]
                    major, minor = tier.target_capability
                    compiled = triton.compile(
                        triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                        target=triton.backends.compiler.GPUTarget("cuda", 10 * major + minor, 32),
                        options=cfg.launch)
                    shared = compiled.metadata.shared
                    failed += shared > tier.shared_memory_bytes
                    results.append(dict(tier=tier.name, dtype=dtype, kernel=fn.fn.__name__, flags=flags,
                                        shared=shared, budget=tier.shared_memory_bytes))
    print(json.dumps({"status": "FAIL" if failed else "ok", "compiled": results}))
    sys.exit(1 if failed else 0)


def main():
    if "--compile-only" in sys.argv:
        compile_only()

    def arguments(parser):
        parser.add_argument("--pretend", choices=list(CARDS), metavar="CARD",
                            help=f"run as this card sees it ({', '.join(CARDS)})")

    args, cuda, device, _ = script_setup(__doc__, "distill_check.jsonl", budget_s=480, add_arguments=arguments)
    if args.pretend:
        card = pretend(args.pretend)
        print(f"pretending to be {card.a_label}", flush=True)
    check = Checker(args.budget_s, device)
    bf16 = cuda and device_info(device).has_bf16_matmul
    # The CPU's interpreter: fp16 (real fp32 arithmetic, 16-bit operands); the fp32 path is the tests'.
    dtypes = ((torch.bfloat16,) if bf16 else ()) + (torch.float16,) if cuda else (torch.float16,)
    for dtype in dtypes:
        for kind in ("forward", "reverse", "jsd"):
            for everything in (False, True):
                name = f"accuracy/{dtype}/{kind}/{everything}"
                check.run(name, accuracy, dtype, kind, everything, device, args.tiny, required=True)
    dtype = torch.bfloat16 if bf16 else torch.float16 if cuda else torch.float32
    N, V, D_s, D_t = (32, 257, 16, 24) if args.tiny else (16_384, QWEN3.V, QWEN3.D, TEACHER_D)
    for kind in ("jsd", "forward"):
        check.run(f"speed/{kind}", speed, kind, N, V, D_s, D_t, dtype, device)
    finish(check, args.out, cuda)


if __name__ == "__main__":
    main()
