"""Vocabulary-parallel CCE on several GPUs (``helpers.cce.parallel``): time and peak memory per rank
against our single-GPU loss, at the Qwen3 head.

    torchrun --standalone --nproc_per_node=2 scripts/gpu/vocab_parallel.py [--out results.jsonl]
        [--sizes 16384 32768 65536 131072] [--budget-s 480]
    python scripts/gpu/vocab_parallel.py --tiny [--out results.jsonl]   # CPU: 2 gloo processes

Each rank holds C[s_r : s_r + V_r] of the Qwen3 head (V = 151,936, D = 1,024; V_r = V / ranks, the
first V mod ranks one row more) and the same E (N, D) and x, in bf16 (fp32 under ``--tiny``, where
the Triton interpreter computes bf16 wrongly); NCCL on GPUs, gloo on the CPU.

1. ``check`` (required): at the first size, the vocabulary-parallel loss, dE and dC_r against our
   single-GPU loss on the whole C on the same rank (a label-smoothed, soft-capped case with ignored
   targets, so that every exchanged statistic is used). Pass: loss relative error <= 1e-5; gradients
   <= 2e-2 in bf16 (the two differ by bf16 roundings in different places: dE summed across ranks in
   bf16, tiles cut at other columns), <= 1e-5 in fp32.
2. ``time N=...`` for each N per rank: forward + backward (dE all-reduced, dC_r), median of 7 calls
   after 2 warm-ups and the peak above the inputs (``helpers.compare.measure.measure``: fixed call
   counts, so every rank runs the same collectives), then the single-GPU loss (whole C, same N) on
   the same rank. One record per rank and size: ``vp_ms``, ``vp_peak_mb``, ``single_ms``,
   ``single_peak_mb``, ``speedup`` (single / vp). Expect vp_ms near single_ms / ranks plus the
   exchange (2 x N floats per rank gathered, N x D bf16 all-reduced), and vp_peak near single_peak
   minus the (V - V_r) x D of dC this rank does not hold.

Apple's vocab-parallel mode (``cut_cross_entropy``'s ``VocabParallelOptions``) is not timed here: the
package is not among our peers on these machines. The skip rule for the time budget is taken on rank
0 and broadcast, so that no rank starts a case the others skip. Rank 0 writes every rank's records.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import Checker, finish, script_setup

from helpers.cce import linear_cross_entropy
from helpers.cce.parallel import vocab_parallel_cross_entropy
from helpers.compare.heads import QWEN3
from helpers.compare.measure import measure
from helpers.spec import relative_error

SIZES = [16_384, 32_768, 65_536, 131_072]
CHECK_OPTIONS = dict(label_smoothing=0.1, softcap=30.0)


def add_arguments(parser):
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="tokens N per rank")
    parser.add_argument("--world", type=int, default=2, help="processes of --tiny (torchrun sets its own)")


def shard(V: int, world: int, rank: int) -> tuple[int, int]:
    """(vocab_start, V_r): V / world rows each, the first V mod world ranks one more."""
    sizes = [V // world + (r < V % world) for r in range(world)]
    return sum(sizes[:rank]), sizes[rank]


def inputs(N, V, D, dtype, device, seed=0):
    """The same E, C, x on every rank (one seed); a tenth of the targets ignored."""
    g = torch.Generator(device=device).manual_seed(seed)
    E = (torch.randn(N, D, generator=g, device=device) / D**0.25).to(dtype).requires_grad_()
    C = (torch.randn(V, D, generator=g, device=device) / D**0.25).to(dtype)
    x = torch.randint(0, V, (N,), generator=g, device=device)
    x[torch.rand(N, generator=g, device=device) < 0.1] = -100
    return E, C, x


def check(N, V, D, dtype, device, rank, world):
    start, size = shard(V, world, rank)
    E, C, x = inputs(N, V, D, dtype, device)
    C_r = C[start:start + size].clone().requires_grad_()
    C = C.requires_grad_()
    loss = vocab_parallel_cross_entropy(E, C_r, x, vocab_start=start, vocab_size=V, **CHECK_OPTIONS)
    dE, dC_r = torch.autograd.grad(loss, (E, C_r))
    single = linear_cross_entropy(E, C, x, **CHECK_OPTIONS)
    dE_1, dC_1 = torch.autograd.grad(single, (E, C))
    errors = dict(loss_err=relative_error(loss, single), dE_err=relative_error(dE, dE_1),
                  dC_err=relative_error(dC_r, dC_1[start:start + size]))
    grad_tol = 1e-5 if dtype == torch.float32 else 2e-2
    ok = errors["loss_err"] <= 1e-5 and errors["dE_err"] <= grad_tol and errors["dC_err"] <= grad_tol
    return dict(status="ok" if ok else "FAIL", rank=rank, N=N, **errors)


def time_size(N, V, D, dtype, device, rank, world, calls):
    start, size = shard(V, world, rank)
    E, C, x = inputs(N, V, D, dtype, device)
    C_r = C[start:start + size].clone().requires_grad_()

    def vp_step():
        loss = vocab_parallel_cross_entropy(E, C_r, x, vocab_start=start, vocab_size=V)
        torch.autograd.grad(loss, (E, C_r))
        return loss.detach()

    vp = measure(vp_step, device=device, **calls)
    C = C.requires_grad_()

    def single_step():
        loss = linear_cross_entropy(E, C, x)
        torch.autograd.grad(loss, (E, C))
        return loss.detach()

    single = measure(single_step, device=device, **calls)
    record = dict(rank=rank, world=world, N=N, V=V, V_r=size, D=D, dtype=str(dtype).replace("torch.", ""))
    for name, m in (("vp", vp), ("single", single)):
        record[f"{name}_status"] = m.status
        if m.status == "ok":
            record[f"{name}_ms"] = round(m.latency.median_ms, 3)
            record[f"{name}_peak_mb"] = round(m.peak_bytes / 2**20, 1)
    if vp.status == "ok" and single.status == "ok":
        record["speedup"] = round(single.latency.median_ms / vp.latency.median_ms, 2)
    return record


def run(rank, world, args, cuda):
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300),
                            **({"device_id": device} if cuda else {}))
    c = Checker(args.budget_s, device.type)
    scale = (lambda n, lo: max(lo, n // 256)) if args.tiny else (lambda n, lo: n)
    V, D = scale(QWEN3.V, 97), scale(QWEN3.D, 16)  # --tiny: 593 (odd) x 16
    dtype = torch.bfloat16 if cuda else torch.float32
    # --tiny: the two smallest sizes, one timed call each (the interpreter's times mean nothing).
    sizes = [scale(n, 32) for n in args.sizes][:2 if args.tiny else None]
    calls = dict(warmup=0, repeats=1) if args.tiny else dict(warmup=2, repeats=7)
    c.run("check", check, min(sizes[0], 4096), V, D, dtype, device, rank, world, required=True)
    for N in sizes:
        # One skip decision for all ranks: rank 0's clock.
        go = [time.time() - c.t0 <= c.budget_s]
        dist.broadcast_object_list(go, src=0)
        if not go[0]:
            c.records.append(dict(case=f"time N={N}", rank=rank, status="skipped (time budget)"))
            continue
        c.run(f"time N={N}", time_size, N, V, D, dtype, device, rank, world, calls, required=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, (c.records, c.failed))
    dist.destroy_process_group()
    if rank == 0:
        c.records = [record for records, _ in everyone for record in records]
        c.failed = sum(failed for _, failed in everyone)
        finish(c, args.out, cuda)
    finish(c, None, cuda)


def _spawned(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(rank, world, args, False)


def main():
    args, cuda, _, _ = script_setup(__doc__, "vocab_parallel.jsonl", 480, add_arguments)
    if "RANK" in os.environ:  # torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, cuda)
    elif args.tiny:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(args.world, port, args), nprocs=args.world)
    else:
        sys.exit("launch with torchrun --nproc_per_node=<GPUs> (or --tiny for the CPU check)")


if __name__ == "__main__":
    main()
