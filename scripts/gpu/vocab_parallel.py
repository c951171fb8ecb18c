"""Vocabulary-parallel CCE on several GPUs (``helpers.cce.parallel``): time and peak memory per rank
against our single-GPU loss, at the Qwen3 head.

    torchrun --standalone --nproc_per_node=2 scripts/gpu/vocab_parallel.py [--out results.jsonl]
        [--sizes 16384 32768 65536 131072] [--budget-s 480]
    python scripts/gpu/vocab_parallel.py --tiny [--world 2] [--out results.jsonl]   # CPU: gloo processes

Each rank holds C[s_r : s_r + V_r] of the Qwen3 head (V = 151,936, D = 1,024; V_r = V / ranks, the
first V mod ranks one row more) and the same E (N, D) and x, in bf16 (fp32 under ``--tiny``, where
the Triton interpreter computes bf16 wrongly); NCCL on GPUs, gloo on the CPU. The pieces are
``helpers.lab.parallel``'s, which notebook 07 runs too: ``launch`` starts the ``--tiny`` processes,
``check_worker`` and ``timing_worker`` are what every rank runs.

1. ``check`` (required): every case of ``CHECK_CASES`` (label smoothing and the soft cap with ignored
   targets; every target on rank 0, so the other ranks own none; dE left partial and reduced by the
   caller) at an irregular shape (1,031 x 5,003 x 136: V odd, no world size divides it) and at the
   Qwen3 head with 4,096 tokens (--tiny: 37 x 593 x 16): the loss, dE and dC_r against our
   single-GPU loss on the whole C on the same rank and against float64 (rows of logits a chunk at a
   time). Pass: against single-GPU within ``TOLERANCE`` (2e-2 in bf16: the two sum dE in bf16 in
   different places; 2e-5 in fp32), against float64 within max(that, 2 x the single-GPU loss's error).
2. ``time N=...`` for each N per rank: forward + backward (dE all-reduced, dC_r), median of 7 calls
   after 2 warm-ups and the peak above the inputs (``helpers.compare.measure.measure``: fixed call
   counts, so every rank runs the same collectives), then the single-GPU loss (whole C, same N) on
   the same rank. One record per rank and size: ``vp_ms``, ``vp_peak_mb``, ``single_ms``,
   ``single_peak_mb``, ``speedup`` (single / vp). Expect vp_ms near single_ms / ranks plus the
   exchange (2 x N floats per rank gathered, N x D bf16 all-reduced), and vp_peak near single_peak
   minus the (V - V_r) x D of dC this rank does not hold.

Apple's vocab-parallel mode (``cut_cross_entropy``'s ``VocabParallelOptions``) is not timed here: it is in
Apple's GitHub code only, not in the released wheel we run (25.1.1 has no vocabulary-parallel
mode). The skip rule for the time budget is taken on rank 0 and broadcast, so that no rank starts a
size the others skip. Each rank appends its records to its
own file as they come (``<out stem>.ranks/rank<r>.jsonl``: a run that dies keeps what it measured);
at the end every rank's records go into ``--out``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
from _common import script_setup

from helpers.compare.heads import QWEN3
from helpers.compare.results_file import ResultsWriter, read_results, run_meta
from helpers.lab.parallel import check_worker, launch, rank_results, start_rank, stop_rank, timing_worker

SIZES = [16_384, 32_768, 65_536, 131_072]
CHECK_SHAPES = [(1031, 5003, 136), (4096, QWEN3.V, QWEN3.D)]


def add_arguments(parser):
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="tokens N per rank")
    parser.add_argument("--world", type=int, default=2, help="processes of --tiny (torchrun sets its own)")


def measure_rank(rank, world, device, results, args):
    """What every rank runs: the checks, then the timings (``helpers.lab.parallel``'s workers)."""
    scale = (lambda n, lo: max(lo, n // 256)) if args.tiny else (lambda n, lo: n)
    V, D = scale(QWEN3.V, 97), scale(QWEN3.D, 16)  # --tiny: 593 (odd) x 16
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    shapes = [(37, V, D)] if args.tiny else CHECK_SHAPES
    check_worker(rank, world, device, results, shapes, dtype)
    # --tiny: the two smallest sizes, one timed call each (the interpreter's times mean nothing).
    sizes = [scale(n, 32) for n in args.sizes][:2 if args.tiny else None]
    calls = dict(warmup=0, repeats=1) if args.tiny else dict(warmup=2, repeats=7)
    timing_worker(rank, world, device, results, sizes, V, D, dtype, calls, budget_s=args.budget_s)


def write_all(out, records, cuda, seconds):
    """Every rank's records in one results file; the meta record counts the failed checks."""
    failed = sum(r.get("status") in ("FAIL", "error") for r in records)
    if out:
        writer = ResultsWriter(out, run_meta("cuda" if cuda else "cpu", seconds=round(seconds, 1), failed=failed))
        for record in records:
            writer.append(record)
        print(f"wrote {out}")
    for r in records:
        print({k: f"{v:.2e}" if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    print(f"{len(records)} records, {failed} failed, {seconds:.0f} s")
    return failed


def main():
    args, cuda, _, _ = script_setup(__doc__, "vocab_parallel.jsonl", 480, add_arguments)
    started = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.out).with_suffix(".ranks") if args.out else Path(scratch)
        if "RANK" in os.environ:  # torchrun: this process is one rank
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            device = start_rank(rank, world, "nccl" if cuda else "gloo")
            folder.mkdir(parents=True, exist_ok=True)
            path = rank_results(folder, rank)
            measure_rank(rank, world, device, ResultsWriter(path, run_meta(device, rank=rank, world=world)), args)
            everyone = [None] * world
            dist.all_gather_object(everyone, read_results(path)[1])
            stop_rank()
            if rank != 0:
                return
            records = [record for rank_records in everyone for record in rank_records]
        elif args.tiny:
            records = launch(measure_rank, args.world, args, folder=folder, backend="gloo")
        else:
            sys.exit("launch with torchrun --nproc_per_node=<GPUs> (or --tiny for the CPU check)")
    sys.exit(1 if write_all(args.out, records, cuda, time.time() - started) else 0)


if __name__ == "__main__":
    main()
