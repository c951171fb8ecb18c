"""The vocabulary-parallel loss on several processes: start them, check the loss, time it.

``helpers.cce.parallel.vocab_parallel_cross_entropy`` runs inside a process group: rank r holds
C_r = C[s_r : s_r + V_r] and the same E (N, D) and x as every other rank. This module is what
notebook 07 and ``scripts/gpu/vocab_parallel.py`` share:

- ``shard`` (where rank r's rows sit), ``inputs`` (the same E, C, x on every rank, from one seed);
- ``check``: one rank's loss, dE and dC_r against our single-device loss on the whole C and against
  float64 (``helpers.spec.reference_loss_and_grads``), for one of ``CHECK_CASES``;
- ``time_size``: one rank's forward + backward against the single-device loss, time and peak
  (``helpers.compare.measure.measure``: fixed call counts, so every rank runs the same collectives);
- ``memory_per_rank``: the bytes a rank holds and exchanges, from the shapes;
- ``launch(worker, world, ...)``: ``world`` processes, NCCL with one GPU each where this machine has
  ``world`` GPUs, else gloo: sharing this machine's GPUs where it has any (the kernels compiled for
  them, the collectives through the host), on the CPU otherwise (the Triton kernels under the
  interpreter); each rank appends
  its records to its own results file as they come (a run that dies keeps what it measured), and
  ``launch`` returns every rank's records to the caller. The workers below (``check_worker``,
  ``timing_worker``) are what a notebook launches: a worker must be importable, because spawned
  processes cannot unpickle a function defined in a notebook.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers.cce import linear_cross_entropy
from helpers.cce.parallel import vocab_parallel_cross_entropy
from helpers.compare.measure import apply_memory_cap, measure
from helpers.compare.results_file import ResultsWriter, read_results, run_meta
from helpers.compare import units
from helpers.spec import reference_loss_and_grads, relative_error

# The checks: every exchanged statistic used (the smoothing term's logit sum, the capped logits, the
# owned target logit, the kept mask); a rank that owns no target; dE left to the caller to reduce.
CHECK_CASES = {
    "smoothed, capped, ignored": dict(options=dict(label_smoothing=0.1, softcap=3.0)),
    "targets on rank 0 only": dict(options=dict(label_smoothing=0.1), targets="rank 0"),
    "dE left partial": dict(options=dict(softcap=3.0), dE_reduction="none"),
}
# ours against the single-device loss, and the floor of ours against float64 (the gate: ours within
# max(floor, 2 x the single-device loss's error)). fp32 is real fp32; fp16 rounds the products'
# inputs and G to 11 bits; in bf16 the two sum dE in bf16 in different places (across ranks, tiles
# cut at other columns).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
IGNORE_INDEX = -100


def shard(V: int, world: int, rank: int) -> tuple[int, int]:
    """(vocab_start, V_r): V / world rows each, the first V mod world ranks one more."""
    sizes = [V // world + (r < V % world) for r in range(world)]
    return sum(sizes[:rank]), sizes[rank]


def inputs(N, V, D, dtype, device, seed=0):
    """The same E (N, D), C (V, D), x (N,) on every rank (one seed); a tenth of the targets ignored."""
    g = torch.Generator(device=device).manual_seed(seed)
    E = (torch.randn(N, D, generator=g, device=device) / D**0.25).to(dtype).requires_grad_()
    C = (torch.randn(V, D, generator=g, device=device) / D**0.25).to(dtype)
    x = torch.randint(0, V, (N,), generator=g, device=device)
    x[torch.rand(N, generator=g, device=device) < 0.1] = IGNORE_INDEX
    return E, C, x


def check(N, V, D, dtype, device, rank, world, case="smoothed, capped, ignored", row_shift=0):
    """One rank's loss, dE and dC_r against the single-device loss (whole C, same rank) and float64.

    ``row_shift``: this rank holds C's rows shifted by that many (a sharding bug, for showing that
    the check fails). Returns a record: the errors, the gate's bounds and ``status`` "ok" or "FAIL".
    """
    spec = CHECK_CASES[case]
    options = spec["options"]
    start, size = shard(V, world, rank)
    E, C, x = inputs(N, V, D, dtype, device)
    if spec.get("targets") == "rank 0":  # every target in rank 0's slice: the other ranks own none
        x = torch.where(x == IGNORE_INDEX, x, x % shard(V, world, 0)[1])
    held = torch.roll(C, -row_shift, dims=0) if row_shift else C
    C_r = held[start:start + size].clone().requires_grad_()
    reduction = spec.get("dE_reduction", "all_reduce")
    loss = vocab_parallel_cross_entropy(E, C_r, x, vocab_start=start, vocab_size=V, dE_reduction=reduction,
                                        **options)
    dE, dC_r = torch.autograd.grad(loss, (E, C_r))
    if reduction == "none":  # each rank holds G_r C_r: the caller's all_reduce makes dE
        dist.all_reduce(dE)
    C_whole = C.clone().requires_grad_()
    single = linear_cross_entropy(E, C_whole, x, **options)
    dE_1, dC_1 = torch.autograd.grad(single, (E, C_whole))
    chunk_rows = 256 if device.type == "cuda" else None  # float64 logits a chunk of rows at a time
    loss_64, dE_64, dC_64 = reference_loss_and_grads(E.detach(), C, x, chunk_rows=chunk_rows, **options)
    rows = slice(start, start + size)
    pairs = {"loss": (loss, single, loss_64), "dE": (dE, dE_1, dE_64),
             "dC_r": (dC_r, dC_1[rows], dC_64[rows])}
    tolerance = TOLERANCE[dtype]
    record = dict(case=case, rank=rank, world=world, N=N, V=V, V_r=size, D=D, dtype=units.dtype_name(dtype),
                  owned=int(((x >= start) & (x < start + size)).sum()), tolerance=tolerance)
    ok = True
    for name, (ours, single_device, float64) in pairs.items():
        against_single = relative_error(ours, single_device)
        against_64, single_64 = relative_error(ours, float64), relative_error(single_device, float64)
        bound = max(tolerance, 2 * single_64)
        record.update({f"{name}_vs_single": against_single, f"{name}_vs_float64": against_64,
                       f"{name}_single_vs_float64": single_64, f"{name}_bound": bound})
        ok &= against_single <= tolerance and against_64 <= bound
    record["status"] = "ok" if ok else "FAIL"
    return record


def time_size(N, V, D, dtype, device, rank, world, calls):
    """One rank's forward + backward (dE all-reduced, dC_r), then the single-device loss on the whole
    C at the same N on the same rank: median time and peak above the inputs of each."""
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
    record = dict(case=f"time N={N}", rank=rank, world=world, N=N, V=V, V_r=size, D=D, dtype=units.dtype_name(dtype))
    for name, m in (("vp", vp), ("single", single)):
        record[f"{name}_status"] = m.status
        if m.status == "ok":
            record[f"{name}_ms"] = round(m.latency.median_ms, 3)
            record[f"{name}_peak_mb"] = round(m.peak_bytes / 2**20, 3)
        else:
            record[f"{name}_error"] = m.error
    if vp.status == "ok" and single.status == "ok":
        record["speedup"] = round(single.latency.median_ms / vp.latency.median_ms, 2)
    return record


def memory_per_rank(N: int, V: int, D: int, world: int, element_bytes: int) -> dict[str, int]:
    """What one of ``world`` ranks holds and exchanges, in bytes (the widest rank, V_r = ceil(V / world)),
    beside one device holding the whole head: the inputs and gradients, the logit slice the loss never
    builds, and the traffic (``helpers.cce.parallel``'s module doc counts it)."""
    V_r = -(-V // world)
    return {
        "C_r and dC_r (each)": V_r * D * element_bytes,
        "C and dC on one device (each)": V * D * element_bytes,
        "E and dE (each, on every rank)": N * D * element_bytes,
        "the rank's logit slice, never built (N x V_r)": N * V_r * element_bytes,
        "all_gather of lse_r and the owned target logit (fp32, sent)": 2 * N * 4,
        "the same, received from all ranks": world * 2 * N * 4,
        "all_reduce of dE": N * D * element_bytes,
    }


# ---------------------------------------------------------------------------------------------
# Starting the ranks
# ---------------------------------------------------------------------------------------------


def backend_for(world: int) -> str:
    """"nccl" where this machine has ``world`` GPUs (one each), else "gloo" (ranks sharing its GPUs,
    or CPU processes where it has none: ``start_rank``)."""
    if dist.is_nccl_available() and torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "nccl"
    return "gloo"


def start_rank(rank: int, world: int, backend: str, init_method: str = "env://",
               timeout_s: float = 300) -> torch.device:
    """Join the process group and return this rank's device. NCCL: GPU ``LOCAL_RANK`` or ``rank``.
    gloo: GPU ``rank`` mod the GPUs this machine has (NCCL refuses two ranks on one GPU; gloo takes
    CUDA tensors and exchanges them through the host), or the CPU where it has none. A GPU's allocator
    is capped at 90% of the card, or of the pretend card's memory, as every notebook caps its GPU,
    shared equally by the ranks on it."""
    if backend == "nccl":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}")
        torch.cuda.set_device(device)
        apply_memory_cap(0.9, device=device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), device_id=device)
        return device
    device = torch.device("cpu")
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        device = torch.device(f"cuda:{rank % gpus}")
        torch.cuda.set_device(device)
        sharing = len(range(rank % gpus, world, gpus))  # the ranks on this GPU
        apply_memory_cap(0.9 / sharing, device=device)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return device


def rank_results(folder: str | Path, rank: int) -> Path:
    """Rank ``rank``'s results file (JSON Lines, ``helpers.compare.results_file``) in ``folder``."""
    return Path(folder) / f"rank{rank}.jsonl"


def launch(worker, world: int, *args, folder: str | Path | None = None, backend: str | None = None,
           timeout_s: float = 300) -> list[dict]:
    """Run ``worker(rank, world, device, results, *args)`` on ``world`` processes and return every
    rank's records, rank 0's first.

    ``backend``: "nccl" (one GPU a rank) or "gloo" (ranks sharing this machine's GPUs, or CPU
    processes running the Triton kernels under the interpreter where it has none:
    ``start_rank``); default ``backend_for(world)``. ``results`` is a
    ``ResultsWriter`` on the rank's results file (``rank_results(folder, rank)``; in a temporary
    folder when ``folder`` is None), started with a meta record: the worker appends each record to
    it as it comes (``results.append(record)``). A rank that raises adds a record of status "error";
    the others are then stopped (``mp.spawn``) and ``launch`` raises, naming the error, with what
    was measured left in ``folder``. The ranks meet through a file in a temporary folder: no port to
    collide with another run's.
    """
    backend = backend or backend_for(world)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(folder) if folder is not None else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        rendezvous = Path(scratch) / "rendezvous"
        for rank in range(world):
            rank_results(folder, rank).unlink(missing_ok=True)
        try:
            mp.spawn(_entry, args=(world, backend, f"file://{rendezvous}", str(folder), timeout_s, worker, args),
                     nprocs=world)
        except Exception as error:
            errors = [r["error"] for r in _read_all(folder, world) if r.get("status") == "error"]
            raise RuntimeError(f"a rank failed ({'; '.join(errors) or error}); records so far in {folder}") \
                from error
        return _read_all(folder, world)


def _entry(rank, world, backend, init_method, folder, timeout_s, worker, args):
    device = start_rank(rank, world, backend, init_method, timeout_s)
    results = ResultsWriter(rank_results(folder, rank), run_meta(device, rank=rank, world=world, backend=backend))
    try:
        worker(rank, world, device, results, *args)
    except Exception as error:
        results.append(dict(rank=rank, status="error", error=f"{type(error).__name__}: {error}"))
        traceback.print_exc()
        stop_rank(finished=False)
        raise
    stop_rank(finished=True)


def stop_rank(finished: bool = True) -> None:
    """Leave the process group. A rank that ``finished`` first waits at a barrier for every other
    rank to finish too: one that tore gloo down while a peer's last send to it was in flight died
    with SIGABRT ("terminate called without an active exception"). Before that, a garbage
    collection frees what reference cycles still hold (an FSDP2 model's hooks hold its state,
    collective work and tensors among it) while the group and the interpreter are alive: freed at
    the interpreter's exit instead, gloo's work objects can take the GIL during finalization, which
    also aborts (a suspicion, not reproduced: the rare abort in an FSDP test). A failing rank leaves
    at once (the launcher then stops the others)."""
    if finished:
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def _read_all(folder: Path, world: int) -> list[dict]:
    records = []
    for rank in range(world):
        path = rank_results(folder, rank)
        if path.exists():
            records += read_results(path)[1]
    return records


# ---------------------------------------------------------------------------------------------
# What notebook 07 launches
# ---------------------------------------------------------------------------------------------


def check_worker(rank, world, device, results, shapes, dtype_name, cases=tuple(CHECK_CASES), row_shift=0):
    """``check`` of every case on every (N, V, D) of ``shapes``, one record each, written as it comes."""
    dtype = getattr(torch, dtype_name)
    for N, V, D in shapes:
        for case in cases:
            started = time.perf_counter()
            record = check(N, V, D, dtype, device, rank, world, case, row_shift)
            results.append({**record, "seconds": round(time.perf_counter() - started, 2)})


def timing_worker(rank, world, device, results, sizes, V, D, dtype_name, calls, budget_s=None):
    """``time_size`` at each N of ``sizes``; past ``budget_s`` seconds (rank 0's clock, broadcast so
    that no rank starts a size the others skip) the rest are recorded as skipped."""
    dtype = getattr(torch, dtype_name)
    started = time.perf_counter()
    for N in sizes:
        go = [budget_s is None or time.perf_counter() - started <= budget_s]
        dist.broadcast_object_list(go, src=0)
        if not go[0]:
            results.append(dict(case=f"time N={N}", rank=rank, world=world, N=N, status="skipped (time budget)"))
            continue
        record = time_size(N, V, D, dtype, device, rank, world, calls)
        # "ok": the size ran (not skipped); each path's own outcome, an out-of-memory among them, is in
        # its "vp_status" / "single_status".
        results.append({**record, "status": "ok"})
        if device.type == "cuda":
            torch.cuda.empty_cache()


__all__ = ["CHECK_CASES", "TOLERANCE", "shard", "inputs", "check", "time_size", "memory_per_rank", "backend_for",
           "start_rank", "rank_results", "launch", "check_worker", "timing_worker"]
