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
4. ``loop_pointers``: whether a training loop hands the loss the same addresses every step, which a
   CUDA graph captured inside the loss (keyed by its tensors' addresses, so that eager callers need not
   capture anything) would need to be replayed rather than captured again: a small model (an
   embedding, one hidden layer, the head C) trained with AdamW, ``zero_grad()`` each step, new targets
   each step; per step the addresses of the loss's E and x, of C and of C.grad after the backward (dC,
   which autograd keeps), and the steps from the third on whose addresses all equal the step before's.
   Predicted on a GPU: all of them (the caching allocator hands back the blocks the last step freed).
5. ``graphed_backward`` (GPU only): a prototype of that graph, here and not in the package. The loss's
   backward (the "gemm" path: the row weights, the G chunks, the products) is captured the first time its
   plan's options and its tensors' addresses, shapes and strides are seen, and replayed after; the
   forward stays eager. Its outputs live in the graph's memory, so each call hands back copies (dC's
   copy is GPU time and memory the real thing would not spend: it would take dE and dC from the caller's
   allocator). Against case 1's eager call: the host's time per call (predicted: ~1/3 of eager's, the
   forward's share) and the gradients (within 1e-3: under capture dC's scale goes through its operand).

Times per call: ``host_ms`` from ``time.perf_counter`` around a batch of calls with one synchronize
at its end (the wall time a training loop sees), ``launch_ms`` the same before that synchronize (the
host's own time: where Python is the bound, close to host_ms) and ``device_ms`` from CUDA events
around the batch.
"""

from __future__ import annotations

import time

import torch
from _common import Checker, script_setup

from helpers.cce import linear_cross_entropy
from helpers.compare.heads import QWEN3
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


def check_loop_pointers(N, V, D, dtype, device, steps: int = 10) -> dict:
    """Case 4 (module doc): the addresses a training loop hands the loss, step by step."""
    g = torch.Generator().manual_seed(1)
    embed = torch.nn.Embedding(V, D).to(device=device, dtype=dtype)
    hidden = torch.nn.Linear(D, D).to(device=device, dtype=dtype)
    C = torch.nn.Parameter((torch.randn(V, D, generator=g) / D**0.25).to(dtype).to(device))
    opt = torch.optim.AdamW([*embed.parameters(), *hidden.parameters(), C], lr=1e-3)
    seen = []
    for _ in range(steps):
        ids = torch.randint(0, V, (N,), generator=g).to(device)
        x = torch.randint(0, V, (N,), generator=g).to(device)
        E = torch.nn.functional.gelu(hidden(embed(ids)))
        linear_cross_entropy(E, C, x).backward()
        seen.append((E.data_ptr(), x.data_ptr(), C.data_ptr(), C.grad.data_ptr()))
        opt.step()
        opt.zero_grad()
    stable = [seen[i] == seen[i - 1] for i in range(2, steps)]
    return dict(case="loop_pointers", steps=steps, stable_steps=sum(stable), of=len(stable),
                changed=[i for i, same in zip(range(2, steps), stable) if not same],
                status="ok", note="addresses mean little on a CPU (no caching allocator)" if device == "cpu" else "")


def check_graphed_backward(E, C, x, calls, reference) -> dict:
    """Case 5 (module doc): the backward replayed from CUDA graphs keyed by what it reads."""
    from helpers.cce import api

    original = api.loss_backward
    graphs = {}

    def tensor_key(t):
        return None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def graphed(E, C, x, lse, r, n_kept, bias, grad_loss, grad_lse, plan, stats=None, activity=None):
        args = (E, C, x, lse, r, n_kept, bias, grad_loss, grad_lse, plan, stats, activity)
        if stats is not None or activity is not None or plan.backward_impl != "gemm":
            return original(*args)  # counts read on the host, or the sparse backward's bits
        key = (plan.options, id(plan.configs), plan.need, plan.return_lse,
               *map(tensor_key, (E, C, x, lse, r, n_kept, bias, grad_loss, grad_lse)))
        if key not in graphs:
            if len(graphs) >= 8:  # addresses that keep changing: each capture would hold its own memory
                return original(*args)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # kernels compiled and caches settled outside the capture
                original(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = original(*args)
            graphs[key] = (graph, outputs)
        graph, outputs = graphs[key]
        graph.replay()
        return tuple(None if t is None else t.clone() for t in outputs)

    api.loss_backward = graphed
    try:
        for _ in range(3):
            got = step(E, C, x)
        torch.cuda.synchronize()
        record = dict(case="graphed_backward", **compared(got, reference))
        record.update(timed(lambda: step(E, C, x), True, calls))
        # One graph if the timed calls found their addresses again (``grad_loss``, autograd's ones, is new
        # each call: its block from the caching allocator); up to 8, then eager, if they did not.
        return dict(record, graphs=len(graphs))
    finally:
        api.loss_backward = original


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
        run("graphed_backward", check_graphed_backward, E, C, x, calls, reference)
    else:
        c.records.append(dict(case="graphed_backward", status="skipped (CUDA graphs need a GPU)"))
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
