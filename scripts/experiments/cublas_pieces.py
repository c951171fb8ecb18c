"""The recompute design on cuBLAS's logits (a T4's "min") against the size of its logit pieces.

    python scripts/experiments/cublas_pieces.py [--out $OUT/cublas_pieces.jsonl] [--tiny]

Why: on the Turing tier "min" takes its two logit products from cuBLAS in fp32, at most
``HostTuning.logits_in_cublas_bytes`` (16 MiB) a piece (``helpers.cce.cublas_logits``). Its first form
(fp16 logits where G lives) took 11.7 / 44.4 ms at the Qwen3 head, 4k / 16k tokens, on an H100 as a T4;
the shipped fp32 form took 29.6 / 103.8 ms (predicted within ~10%). At 16k tokens a 16 MiB piece is
256 columns: ~600 pieces a pass, each a cuBLAS product, a Triton kernel and the forward's merge of its
lse. This tells whether the pieces' count (the host) or their bytes (the device) make the time.

Per head (Qwen3 at 4,096 and 16,384 tokens, Gemma-2-2B at 8,192; fp16, a flat softmax, the Turing tier's
configurations on this GPU, ``memory_budget="min"``) and piece size (16, 64, 256 MiB, bytes alone; "shipped":
the tier's, with the floor ``chunk_columns`` puts under the bytes since): the forward and
forward+backward medians (``call_times_ms``), the step's host time and GPU busy time back to back
(``host_and_device_time``), its peak above the inputs (``peak_memory``), the pieces a pass, and for the
shipped size at 16k the kernels' GPU time by name (torch.profiler): the products' rate says whether
cuBLAS ran its 16-bit tensor-core form. ``--tiny``: a small head on the CPU under the interpreter.
"""

from __future__ import annotations

import statistics

import torch
from _common import Checker, finish, script_setup

from helpers.cce import linear_cross_entropy
from helpers.cce.cublas_logits import chunk_columns
from helpers.cce.kernels.configs import MiB, tier
from helpers.compare.heads import GEMMA2, QWEN3
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import call_times_ms, host_and_device_time, peak_memory


def kernel_times(step, calls: int = 3) -> list:
    """The step's kernels by GPU time a call (ms), largest first, the first eight."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 1e3 / calls, e.count / calls) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    return [[name[:90], round(ms, 3), round(count, 1)] for name, ms, count in rows[:8]]


def case(N, V, D, piece_bytes, device, dtype, repeats, warmup, profile_kernels):
    """piece_bytes None: the tier's pieces as they ship (its bytes, and the host's floor of ``chunk_columns``);
    else pieces of those bytes alone."""
    t4 = tier("turing-64k")
    configs = t4 if piece_bytes is None else t4.tuned(logits_in_cublas_bytes=piece_bytes, g_chunk_host_us=0.0)
    E, C, x = make_inputs(N, V, D, dtype, device, regime="uniform", seed=0)
    E, C = E.requires_grad_(), C.requires_grad_()

    def forward():
        with torch.no_grad():
            linear_cross_entropy(E, C, x, configs=configs, memory_budget="min")

    def step():
        E.grad = C.grad = None
        linear_cross_entropy(E, C, x, configs=configs, memory_budget="min").backward()

    stats: dict = {}
    linear_cross_entropy(E, C, x, configs=configs, memory_budget="min", stats=stats).backward()
    record = dict(N=N, V=V, D=D, piece_mib=configs.host.logits_in_cublas_bytes / MiB, floor=piece_bytes is None,
                  dtype=str(dtype).replace("torch.", ""),
                  columns_a_piece=chunk_columns(N, V, D, dtype, configs.for_dtype(dtype)[0].BLOCK_V, configs.host),
                  why=str(stats.get("why", ""))[:160])
    record["pieces_a_pass"] = -(-V // record["columns_a_piece"])
    record["forward_ms"] = statistics.median(call_times_ms(forward, warmup=warmup, repeats=repeats, device=device))
    record["step_ms"] = statistics.median(call_times_ms(step, warmup=warmup, repeats=repeats, device=device))
    timing = host_and_device_time(step, calls=repeats, warmup=warmup, device=device)
    record.update(step_host_ms=timing.host_ms, step_device_ms=timing.device_ms)
    E.grad = C.grad = None
    _, peak = peak_memory(step, device=device)
    lb = (N + V) * D * dtype.itemsize
    record.update(peak_mb=peak / 1e6, peak_lb=peak / lb)
    if profile_kernels and device == "cuda":
        record["kernels_ms_a_call"] = kernel_times(step)
    record["status"] = "ok"
    return record


def main():
    args, cuda, device, scale = script_setup(
        __doc__, "cublas_pieces.jsonl", budget_s=300,
        add_arguments=lambda p: p.add_argument("--pieces", nargs="*", default=["16", "64", "256", "shipped"],
                                               help="piece sizes in MiB, and/or 'shipped' (the tier's own)"))
    dtype = torch.float16  # 16-bit: the path under test (fp32 inputs take no pieces)
    repeats, warmup = (10, 2) if cuda else (1, 1)
    c = Checker(args.budget_s, device, args.out)
    heads = [("qwen3", 4_096, QWEN3), ("qwen3", 16_384, QWEN3), ("gemma2-2b", 8_192, GEMMA2)]
    for name, n, head in heads:
        for size in args.pieces:
            # --tiny: pieces of 64 KiB... 1 MiB at 64 tokens, V 600, D 32 (1 to 4 pieces a pass).
            piece = None if size == "shipped" else int(size) * MiB // (1 if cuda else 256)
            N, V, D = (n, head.V, head.D) if cuda else (scale(n, 32), 600, 32)
            c.run(f"{name}-{n}/{size}" + ("" if piece is None else "MiB"), case, N, V, D, piece, device, dtype,
                  repeats, warmup, profile_kernels=(n == 16_384 and size == "16"), required=size in ("16", "shipped"))
    finish(c, args.out, cuda)


if __name__ == "__main__":
    main()
