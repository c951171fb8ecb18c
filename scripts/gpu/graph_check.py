"""GPU check that our loss runs without host syncs: captured whole in a CUDA graph, and compiled.

    python scripts/gpu/graph_check.py [--out results.jsonl] [--budget-s 300] [--tiny]

At N = 1,024 tokens the Qwen3 head's loss (V = 151,936, D = 1,024, bf16) is short enough on an H200
(a few ms forward and backward) that the host's Python (planning, launches, the targets' range check,
which waits for the forward) is a visible share of a call. A CUDA graph replays the kernels with no
Python and no host read at all, if the call has none to capture: ``helpers.cce.ops`` says what a call
under capture or ``torch.compile`` skips. Cases, each written to the results file as it ends:

1. ``eager``: forward + backward (``torch.autograd.grad`` of the mean loss to E and C), timed;
2. ``graph``: the same call captured in one ``torch.cuda.graph`` (after warm-up on a side stream, as
   CUDA graphs require), replayed; its loss, dE and dC against the eager call's (relative L2 error,
   at most 1e-3: the same kernels, where the eager "auto" backward may pick another chunking), timed;
3. ``compile``: ``torch.compile(mode="reduce-overhead")`` of a function that returns the loss, with
   the backward through the compiled graph (``cce::`` custom ops in CUDA graph trees), timed and
   compared as 2. Under ``--tiny`` (a CPU) the graph case is skipped and the compile case uses the
   "aot_eager" backend, which checks the code paths only.
4. ``loop_pointers``: whether a training loop hands the loss the same addresses every step, which the
   loss's graphs (``helpers.cce.graphs``: keyed by C's, dE's and dC's addresses, so that eager callers
   need not capture anything) need to be replayed rather than captured again: a small model (an
   embedding, one hidden layer, the head C) trained with AdamW, ``zero_grad()`` each step, new targets
   each step; per step the addresses of the loss's E and x, of C and of C.grad after the backward (dC,
   which autograd keeps), and the steps from the third on whose addresses all equal the step before's.
   Predicted on a GPU: all of them (the caching allocator hands back the blocks the last step freed).
5. ``graphed_calls``: the loss with its CUDA graphs on (``helpers.cce.graphs``, every size:
   ``HostTuning.graphs_below_us`` raised), called as case 1: the first call eager, the second captured
   (forward and backward), the rest replayed. Against case 1: the host's time per call (predicted: under
   0.5 ms against eager's ~2; what is left is autograd's engine, the input copies and the targets'
   check), the GPU time (predicted: eager's, within 5%), the loss and gradients (within 1e-3: the
   captured backward scales dC through its operand), the peak (predicted: eager's plus E's two copies
   and the forward's graph-held outputs, a few MB), and the graphs' counts (predicted: 2 graphs). Measured
   (docs/measurements/h200-2026-12-05): 84 MB in the pool, the G buffer of each backward graph and a 32 MiB
   cuBLAS workspace; a graphed backward now runs without the G buffer (``helpers.cce.graphs.graphed_plan``),
   predicted ~5 MB above eager's peak and the workspace. It records the private pools' blocks.
6. ``graphed_loop/1`` and ``/2``: case 4's training loop (an embedding, a hidden layer, the head C, AdamW)
   run twice from one seed, eager and with the graphs, with 1 and 2 backward calls per optimizer step
   (the second keeps C.grad alive between them, so dC's block alternates): the runs' losses and final C
   within 1e-2 of each other, and the graphs' counts (predicted: 2 graphs and 3 graphs: one forward's,
   one or two backward's; replays from each key's third call on).

Times per call: ``host_ms`` from ``time.perf_counter`` around a batch of calls with one synchronize
at its end (the wall time a training loop sees), ``launch_ms`` the same before that synchronize (the
host's own time: where Python is the bound, close to host_ms) and ``device_ms`` from CUDA events
around the batch.
"""

from __future__ import annotations

import os
import time

import torch
from _common import Checker, script_setup

from helpers.cce import linear_cross_entropy
from helpers.cce.graphs import GRAPHS
from helpers.cce.options import resolve_configs
from helpers.compare.heads import QWEN3
from helpers.compare.measure import peak_memory
from helpers.compare.results_file import ResultsWriter, run_meta
from helpers.spec import relative_error

CALLS = 50  # per timed batch


def make_inputs(N, V, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = (torch.randn(N, D, generator=g) / D**0.25).to(dtype).to(device).requires_grad_(True)
    C = (torch.randn(V, D, generator=g) / D**0.25).to(dtype).to(device).requires_grad_(True)
    x = torch.randint(0, V, (N,), generator=g).to(device)
    return E, C, x


def step(E, C, x):
    """The call every case runs: the mean loss and its gradients to E and C."""
    loss = linear_cross_entropy(E, C, x)
    dE, dC = torch.autograd.grad(loss, (E, C))
    return loss, dE, dC


def timed(run, cuda: bool, calls: int) -> dict:
    """host_ms, launch_ms and device_ms per call of ``run`` (module doc), over one batch of ``calls``."""
    run()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    launched = time.perf_counter() - t0
    if cuda:
        end.record()
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return dict(host_ms=round(1e3 * total / calls, 3), launch_ms=round(1e3 * launched / calls, 3),
                device_ms=round(start.elapsed_time(end) / calls, 3) if cuda else None)


def compared(got, want) -> dict:
    """Relative L2 errors of (loss, dE, dC) against the eager call's; status FAIL past 1e-3."""
    errors = {f"{name}_err": relative_error(g.detach(), w.detach()) for name, g, w in zip(("loss", "dE", "dC"), got, want)}
    worst = max(errors.values())
    return dict(errors, status="ok" if worst <= 1e-3 else "FAIL")


def check_eager(E, C, x, cuda, calls, reference):
    reference.extend(t.detach().clone() for t in step(E, C, x))
    return dict(case="eager", **timed(lambda: step(E, C, x), cuda, calls), status="ok")


def check_graph(E, C, x, calls, reference):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels and settle the caches outside the capture
        for _ in range(3):
            step(E, C, x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(E, C, x)
    graph.replay()
    torch.cuda.synchronize()
    return dict(case="graph", **compared(outputs, reference), **timed(graph.replay, True, calls))


def check_compile(E, C, x, cuda, calls, reference):
    backend, mode = ("inductor", "reduce-overhead") if cuda else ("aot_eager", None)
    loss_fn = torch.compile(lambda E, C, x: linear_cross_entropy(E, C, x), backend=backend, mode=mode,
                            fullgraph=True)

    def run():
        loss = loss_fn(E, C, x)
        return (loss, *torch.autograd.grad(loss, (E, C)))

    for _ in range(3):  # compile, record the CUDA graph trees, settle
        outputs = run()
    record = dict(case=f"compile/{backend}/{mode or 'default'}", **compared(outputs, reference))
    return dict(record, **timed(run, cuda, calls))


def small_lm(N, V, D, dtype, device):
    """Cases 4 and 6's model, the same from every call: an embedding, one hidden layer and the head C,
    trained with AdamW. (C, the optimizer, batch), batch() -> (E, x): the hidden states of N new ids
    and N new targets."""
    torch.manual_seed(2)
    g = torch.Generator().manual_seed(1)
    embed = torch.nn.Embedding(V, D).to(device=device, dtype=dtype)
    hidden = torch.nn.Linear(D, D).to(device=device, dtype=dtype)
    C = torch.nn.Parameter((torch.randn(V, D, generator=g) / D**0.25).to(dtype).to(device))
    opt = torch.optim.AdamW([*embed.parameters(), *hidden.parameters(), C], lr=1e-3)

    def batch():
        ids = torch.randint(0, V, (N,), generator=g).to(device)
        x = torch.randint(0, V, (N,), generator=g).to(device)
        return torch.nn.functional.gelu(hidden(embed(ids))), x

    return C, opt, batch


def check_loop_pointers(N, V, D, dtype, device, steps: int = 10) -> dict:
    """Case 4 (module doc): the addresses a training loop hands the loss, step by step."""
    C, opt, batch = small_lm(N, V, D, dtype, device)
    seen = []
    for _ in range(steps):
        E, x = batch()
        linear_cross_entropy(E, C, x).backward()
        seen.append((E.data_ptr(), x.data_ptr(), C.data_ptr(), C.grad.data_ptr()))
        opt.step()
        opt.zero_grad()
    stable = [seen[i] == seen[i - 1] for i in range(2, steps)]
    return dict(case="loop_pointers", steps=steps, stable_steps=sum(stable), of=len(stable),
                changed=[i for i, same in zip(range(2, steps), stable) if not same],
                status="ok", note="addresses mean little on a CPU (no caching allocator)" if device == "cpu" else "")


def graphed_configs(device):
    """The device's tier with the loss's graphs on for every size (``HostTuning.graphs_below_us``)."""
    return resolve_configs(None, device).tuned(graphs_below_us=1e12)


def private_pools() -> dict:
    """What the graphs' private pools hold, from the allocator's snapshot (segments outside the default pool):
    the reserved MB, and the largest live blocks' MB (a cuBLAS workspace, dE's accumulator, a G buffer...)."""
    segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    active = sorted((b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"),
                    reverse=True)
    return dict(pool_segments_mb=round(sum(s["total_size"] for s in segments) / 2**20, 2),
                pool_active_mb=[round(b / 2**20, 2) for b in active[:12]], pool_active_blocks=len(active),
                cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def check_graphed_calls(E, C, x, calls, reference) -> dict:
    """Case 5 (module doc): the loss with ``helpers.cce.graphs`` on, called as case 1 calls it."""
    configs = graphed_configs(E.device)
    GRAPHS.clear()
    torch.cuda.empty_cache()  # the last case's pools: their segments go back, so that this case's are alone

    def run():
        loss = linear_cross_entropy(E, C, x, configs=configs)
        return (loss, *torch.autograd.grad(loss, (E, C)))

    for _ in range(3):  # eager (first sight), captured, replayed
        got = run()
    torch.cuda.synchronize()
    record = dict(case="graphed_calls", **compared(got, reference), **timed(run, True, calls))
    _, eager_peak = peak_memory(lambda: step(E, C, x))
    _, graphed_peak = peak_memory(run)
    # A forward's graph and a backward's if the timed calls found their dE and dC blocks again; each
    # replay's input copies and pool are in the graphed peak (``peak_memory``).
    return dict(record, eager_peak_mb=round(eager_peak / 2**20, 1), graphed_peak_mb=round(graphed_peak / 2**20, 1),
                **{f"graphs_{k}": v for k, v in GRAPHS.summary().items()}, **private_pools())


def check_graphed_loop(N, V, D, dtype, device, steps: int, micro_batches: int) -> dict:
    """Case 6 (module doc): case 4's training loop twice from one seed, eager and with the loss's graphs,
    ``micro_batches`` calls per optimizer step (gradient accumulation keeps C.grad alive)."""
    def train(configs):
        C, opt, batch = small_lm(N, V, D, dtype, device)
        losses = []
        for _ in range(steps):
            for _ in range(micro_batches):
                E, x = batch()
                loss = linear_cross_entropy(E, C, x, configs=configs) / micro_batches
                loss.backward()
                losses.append(float(loss))
            opt.step()
            opt.zero_grad()
        return torch.tensor(losses), C.detach()

    GRAPHS.clear()
    eager_losses, eager_C = train(resolve_configs(None, device))
    graphed_losses, graphed_C = train(graphed_configs(device))
    summary = GRAPHS.summary()
    C_err = relative_error(graphed_C, eager_C)
    loss_err = relative_error(graphed_losses, eager_losses)
    # The captured path scales dC through its operand (``helpers.cce.backward.gemm``): its bits differ from
    # eager's, so the two runs drift apart by rounding; within 1e-2 after these few steps.
    worst = max(C_err, loss_err)
    return dict(case=f"graphed_loop/{micro_batches}", steps=steps, micro_batches=micro_batches,
                C_err=C_err, loss_err=loss_err, **{f"graphs_{k}": v for k, v in summary.items()}, **private_pools(),
                status="ok" if worst <= 1e-2 else "FAIL")


def main():
    args, cuda, device, scale = script_setup(__doc__, "graph_check.jsonl", 300.0)
    N, V, D = scale(1024, 37), scale(QWEN3.V, 301), scale(QWEN3.D, 24)
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter cannot do bf16
    calls = CALLS if cuda else 2
    E, C, x = make_inputs(N, V, D, dtype, device)
    c = Checker(args.budget_s, device)
    writer = ResultsWriter(args.out, run_meta(device, N=N, V=V, D=D, dtype=str(dtype))) if args.out else None

    def run(name, fn, *fn_args, required=False):
        before = len(c.records)
        c.run(name, fn, *fn_args, required=required)
        for record in c.records[before:]:
            if writer:
                writer.append(record)

    reference = []
    run("eager", check_eager, E, C, x, cuda, calls, reference, required=True)
    if cuda:
        run("graph", check_graph, E, C, x, calls, reference, required=True)
    else:
        c.records.append(dict(case="graph", status="skipped (CUDA graphs need a GPU)"))
        if writer:
            writer.append(c.records[-1])
    run("compile", check_compile, E, C, x, cuda, calls, reference)
    run("loop_pointers", check_loop_pointers, N, V, D, dtype, device, 10 if cuda else 4)  # the CPU: the code path
    if cuda:
        run("graphed_calls", check_graphed_calls, E, C, x, calls, reference)
        for micro_batches in (1, 2):
            run(f"graphed_loop/{micro_batches}", check_graphed_loop, N, V, D, dtype, device, 10, micro_batches)
    else:
        for name in ("graphed_calls", "graphed_loop"):
            c.records.append(dict(case=name, status="skipped (CUDA graphs need a GPU)"))
            if writer:
                writer.append(c.records[-1])

    total = time.time() - c.t0
    print(f"{len(c.records)} records, {c.failed} failed, {total:.0f} s")
    if writer:
        writer.update_meta(seconds=round(total, 1), failed=c.failed)
        print(f"wrote {args.out}")
    raise SystemExit(1 if c.failed else 0)


if __name__ == "__main__":
    main()
