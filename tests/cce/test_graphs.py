"""The loss's forward and backward replayed from CUDA graphs (``helpers.cce.graphs``), on the CPU.

No CPU captures a CUDA graph, so ``SimulatedGraphs`` (``tests/conftest.py``) keeps a graph's contract
here: capture records the call, replay runs it again on the buffers it was captured with (what a graph's
baked addresses read), and its allocator hands a freed block back as the caching allocator does. What the graphs decide is then checked
where no GPU is: when a key is captured, that every per-call input reaches a replay (a stale one gives a
wrong gradient), what the key holds by address, the calls left eager, and the memory a replay holds.
That real capture works, and what it saves, is ``scripts/gpu/graph_check.py``'s on a GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.cce import linear_cross_entropy  # noqa: E402
from helpers.cce.options import resolve_configs  # noqa: E402
from helpers.compare import measure  # noqa: E402
from helpers.compare.inputs import make_inputs  # noqa: E402
from helpers.spec import reference_loss_and_grads, relative_error  # noqa: E402

# The simulated graphs are the CPU's; on a GPU scripts/gpu/graph_check.py runs the real ones.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (simulated CUDA graphs)")

N, V, D = 45, 300, 24
CPU = torch.device("cpu")
EAGER = resolve_configs(None, CPU)
GRAPHED = EAGER.tuned(graphs_below_us=1e12, graphs_kept=4)


def batch(seed, dtype):
    """(E, C, x) of a new batch: E a new leaf each call, as a model's last layer makes it."""
    E, C, x = make_inputs(N, V, D, torch.float32, "cpu", regime="realistic", seed=seed)
    return E.to(dtype).requires_grad_(True), C.to(dtype), x


UPSTREAM = {
    "mean": lambda loss, lse, g: loss,
    "none, summed": lambda loss, lse, g: loss.sum(),  # an expanded upstream gradient (stride 0)
    "through the lse": lambda loss, lse, g: (loss * g).sum() + (lse * g).sum(),  # new upstream vectors each call
}


def gradients(E, C, x, kind, g, configs):
    """(loss, dE, dC) of one call with ``kind``'s upstream gradient."""
    reduction = "mean" if kind == "mean" else "none"
    loss, lse = linear_cross_entropy(E, C, x, reduction=reduction, return_lse=True, backward_impl="gemm",
                                     configs=configs)
    objective = UPSTREAM[kind](loss, lse, g)
    dE, dC = torch.autograd.grad(objective, (E, C))
    return objective.detach(), dE, dC


# A mean; "none" summed (an expanded upstream gradient), in fp16; a new upstream vector into the loss and
# into the lse each call.
@pytest.mark.parametrize("kind, dtype", [("mean", torch.float32), ("none, summed", torch.float16),
                                         ("through the lse", torch.float32)])
def test_a_repeated_call_is_captured_then_replayed_with_each_calls_inputs(simulated_graphs, dtype, kind):
    """New E, targets and upstream gradients every call, C changed in place (an optimizer step): the second
    call captures its forward and its backward, the later ones replay, and each call's loss is eager's and
    its gradients are its own (eager's, within rounding, and as close to float64 as eager's)."""
    C = batch(0, dtype)[1].requires_grad_(True)
    for call in range(4):
        E, C_new, x = batch(10 + call, dtype)
        with torch.no_grad():
            C.copy_(C_new)
        g = torch.rand(N, generator=torch.Generator().manual_seed(call))
        loss, dE, dC = gradients(E, C, x, kind, g, GRAPHED)
        want_loss, want_dE, want_dC = gradients(E, C, x, kind, g, EAGER)
        assert torch.equal(loss, want_loss), call  # the forward's graph runs the same kernels
        tolerance = 1e-5 if dtype == torch.float32 else 2e-3  # the captured path scales dC through its operand
        assert relative_error(dE, want_dE) <= tolerance and relative_error(dC, want_dC) <= tolerance, call
        if kind == "mean":
            _, ref_dE, ref_dC = reference_loss_and_grads(E.detach(), C.detach(), x)
            assert relative_error(dE, ref_dE) <= 1.5 * relative_error(want_dE, ref_dE) + 1e-6, call
            assert relative_error(dC, ref_dC) <= 1.5 * relative_error(want_dC, ref_dC) + 1e-6, call
        del dE, dC  # their blocks free for the next call, as a training loop leaves them
    for kind in ("forward", "backward"):
        summary = simulated_graphs.summary(kind)
        assert (summary["eager_first_sight"], summary["captured"], summary["replayed"], summary["graphs"]) == (1, 1, 2, 1)


def test_a_kept_gradient_or_a_new_classifier_is_another_key(simulated_graphs):
    """dC's block and C's address are read by address. Gradient accumulation, two backward calls per step:
    the first call's dC becomes C.grad (autograd keeps it), so the second's comes from another block, and
    ``C.grad = None`` frees the first again for the next step: two keys, two graphs, each replayed from
    the third step; C.grad is what eager's two calls sum to. A new C tensor is a key not seen before."""
    C = batch(0, torch.float32)[1].requires_grad_(True)
    for step in range(3):
        C.grad, want = None, torch.zeros_like(C)
        for micro_batch in range(2):
            E, _, x = batch(20 + 2 * step + micro_batch, torch.float32)
            linear_cross_entropy(E, C, x, backward_impl="gemm", configs=GRAPHED).backward()
            want += gradients(E, C, x, "mean", None, EAGER)[2]
        assert relative_error(C.grad, want) <= 1e-5, step
    summary = simulated_graphs.summary("backward")
    assert (summary["graphs"], summary["captured"], summary["replayed"]) == (2, 2, 2), summary
    assert simulated_graphs.summary("forward")["replayed"] == 4  # one key: E and x are copied in
    C2 = C.detach().clone().requires_grad_(True)
    E, _, x = batch(30, torch.float32)
    got = gradients(E, C2, x, "mean", None, GRAPHED)[2]
    assert relative_error(got, gradients(E, C2, x, "mean", None, EAGER)[2]) <= 1e-5
    after = simulated_graphs.summary("backward")
    assert after["replayed"] == 2 and after["eager_first_sight"] == summary["eager_first_sight"] + 1, after


def test_past_the_graphs_kept_and_after_a_failed_capture_calls_run_eagerly(simulated_graphs):
    """Two graphs kept: of two shapes in turn, the first's forward and backward are captured and replayed,
    the second runs eagerly every call. A capture that fails warns once, answers eagerly, and is not
    tried again for its key."""
    C = batch(0, torch.float32)[1].requires_grad_(True)
    one = GRAPHED.tuned(graphs_kept=2)
    for call in range(6):
        rows = (N, N - 7)[call % 2]
        E, _, x = batch(40 + call, torch.float32)
        E, x = E.detach()[:rows].requires_grad_(True), x[:rows]
        got = gradients(E, C, x, "mean", None, one)
        want = gradients(E, C, x, "mean", None, EAGER)
        assert all(relative_error(a, b) <= 1e-5 for a, b in zip(got[1:], want[1:])), call
        del got, want
    for kind in ("forward", "backward"):
        summary = simulated_graphs.summary(kind)
        assert (summary["graphs"], summary["replayed"], summary["eager_full"]) == (1, 1, 2), summary

    simulated_graphs.clear()
    failing = simulated_graphs.backend
    failing.fail, captures = "operation not permitted when stream is capturing", failing.captures
    E, _, x = batch(50, torch.float32)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        for _ in range(3):  # seen, its capture failed, eager
            got = [t.clone() for t in gradients(E, C, x, "mean", None, GRAPHED)]  # its blocks free again
    want = gradients(E, C, x, "mean", None, EAGER)
    assert all(relative_error(a, b) <= 1e-5 for a, b in zip(got[1:], want[1:]))
    for kind in ("forward", "backward"):
        summary = simulated_graphs.summary(kind)
        assert (summary["failed"], summary["eager_failed"], summary["graphs"]) == (1, 1, 0), summary
        assert "not permitted" in summary["failures"][0]
    assert failing.captures == captures


def test_calls_a_graph_does_not_fit_run_eagerly(simulated_graphs):
    """Stats (read on the host), the "atomic" backward, the knob at 0, and products predicted longer than the
    knob: the backward takes no graph, no key is seen."""
    E, C, x = batch(60, torch.float32)
    C.requires_grad_(True)
    for _ in range(2):  # a key seen twice would be captured
        linear_cross_entropy(E, C, x, backward_impl="gemm", configs=GRAPHED, stats={}).sum().backward()
        linear_cross_entropy(E, C, x, backward_impl="atomic", configs=GRAPHED).backward()
        linear_cross_entropy(E, C, x, backward_impl="gemm", configs=EAGER).backward()
        linear_cross_entropy(E, C, x, backward_impl="gemm", configs=GRAPHED.tuned(graphs_below_us=1e-3)).backward()
    summary = simulated_graphs.summary("backward")
    assert summary["calls"] == 0, summary


def test_a_tier_tuned_in_every_call_still_replays(simulated_graphs):
    """The key holds the tier by identity: ``tier.tuned(...)`` written in each call gives the same object for
    the same knobs, so the third call replays (a new object each call would leave every call eager)."""
    C = batch(0, torch.float32)[1].requires_grad_(True)
    for seed in (90, 91, 92):
        E, _, x = batch(seed, torch.float32)
        linear_cross_entropy(E, C, x, backward_impl="gemm", configs=EAGER.tuned(graphs_below_us=1e12)).backward()
        C.grad = None
    for kind in ("forward", "backward"):
        assert simulated_graphs.summary(kind)["replayed"] == 1, simulated_graphs.summary(kind)


def test_a_graphed_backward_runs_without_the_g_buffer(simulated_graphs, monkeypatch):
    """Launches are free under a graph, so its plan drops the G buffer that saves them (8% of LB, held in the
    graph's pool); eager calls keep it. Each call's backward is seen with the tier it runs."""
    from helpers.cce import ops

    shares = []
    run_backward = ops.run_backward

    def spy(*args, **kwargs):
        shares.append(args[6].configs.host.g_buffer_lb_share)  # the plan
        return run_backward(*args, **kwargs)

    monkeypatch.setattr(ops, "run_backward", spy)
    C = batch(0, torch.float32)[1].requires_grad_(True)
    for configs in (GRAPHED, GRAPHED, GRAPHED, EAGER):
        E, _, x = batch(95, torch.float32)
        linear_cross_entropy(E, C, x, backward_impl="gemm", configs=configs).backward()
        C.grad = None
    # First sight, the capture's eager run (its replay runs nothing new), a replay (the simulated graph runs
    # the captured call again), eager.
    assert shares[:2] == [0.0, 0.0] and shares[-1] == EAGER.host.g_buffer_lb_share > 0, shares
    assert set(shares[:-1]) == {0.0} and simulated_graphs.summary("backward")["replayed"] == 1


def test_the_key_holds_the_classifier_and_the_gradients_by_address(simulated_graphs):
    """The backward run through ``run`` directly: the same call replays; C at another address, or dC's
    block still held by the caller, is another key."""
    calls = []

    def backward(E, C, out=None):
        calls.append("run")
        out[0].copy_(E * 2)
        out[1].fill_(float(E.sum()))
        return out[0], out[1], None

    E, C = torch.randn(4, 3), torch.randn(5, 3)
    outputs = (((4, 3), torch.float32, CPU), ((5, 3), torch.float32, CPU))

    def call(E, C):
        return simulated_graphs.run("backward", backward, copied=dict(E=E), held=dict(C=C), outputs=outputs,
                                    plan=plan)

    from helpers.cce.options import plan_call

    plan = plan_call(E, C, backward_impl="gemm", configs=GRAPHED, return_lse=False, need=(True, True, False),
                     wants_db=False)
    for _ in range(3):
        dE, dC = call(E, C)[:2]
        assert torch.equal(dE, E * 2)
        del dE, dC
    assert simulated_graphs.summary()["replayed"] == 1
    E2 = torch.randn(4, 3)
    dE, dC = call(E2, C)[:2]  # a new E is copied in: the graph's answer is E2's
    assert torch.equal(dE, E2 * 2) and simulated_graphs.summary()["replayed"] == 2
    kept = dC  # the caller keeps dC: the next call's dC is another block
    dE, dC = call(E, C)[:2]
    assert dC.data_ptr() != kept.data_ptr() and simulated_graphs.summary()["replayed"] == 2
    del dE, dC, kept
    call(E, C.clone())
    assert simulated_graphs.summary()["replayed"] == 2 and simulated_graphs.summary()["eager_first_sight"] == 3


def test_peak_memory_counts_what_a_replay_holds(simulated_graphs):
    """A replay's pool (here 10 MB, the simulated reservation) and its input copies are added to the
    measured peak; an eager call's peak has neither."""
    simulated_graphs.backend.pool_bytes = 10_000_000
    C = batch(0, torch.float32)[1].requires_grad_(True)

    def step(seed, configs):
        E, _, x = batch(seed, torch.float32)
        return lambda: linear_cross_entropy(E, C, x, backward_impl="gemm", configs=configs).backward()

    for seed in (70, 71):
        step(seed, GRAPHED)()
        C.grad = None
    _, replayed = measure.peak_memory(step(72, GRAPHED), device=CPU)
    C.grad = None
    _, eager = measure.peak_memory(step(72, EAGER), device=CPU)
    assert replayed >= 10_000_000 + N * D * 4 and eager < 1_000_000, (replayed, eager)  # E's copy at least
    assert simulated_graphs.summary("forward")["replayed"] == simulated_graphs.summary("backward")["replayed"] == 1


def test_a_graph_whose_classifier_is_gone_makes_room(simulated_graphs):
    """Room for one forward and one backward: once their C is gone (a gate case's or a benchmark point's own
    C), a new C's keys are captured in their place rather than left eager for good, into a new pool (CUDA
    refuses a capture into a pool whose last graph is gone: an H200's bench gate failed so)."""
    one = GRAPHED.tuned(graphs_kept=2)
    for seed in (0, 1):
        C = batch(seed, torch.float32)[1].requires_grad_(True)
        E, _, x = batch(80 + seed, torch.float32)
        for _ in range(3):
            gradients(E, C, x, "mean", None, one)
        del C
    for kind in ("forward", "backward"):
        summary = simulated_graphs.summary(kind)
        assert (summary["graphs"], summary["captured"], summary["replayed"], summary["eager_full"]) == (1, 2, 2, 0)


def test_a_target_out_of_range_is_refused_on_a_replayed_call(simulated_graphs):
    """The targets' range check stays outside the forward's graph: a call that would replay still raises,
    naming x and the target."""
    C = batch(0, torch.float32)[1].requires_grad_(True)
    E, _, x = batch(90, torch.float32)
    for _ in range(3):
        gradients(E, C, x, "mean", None, GRAPHED)
    assert simulated_graphs.summary("forward")["replayed"] == 1
    x[5] = V + 3
    with pytest.raises(ValueError, match=f"x holds target {V + 3}"):
        linear_cross_entropy(E, C, x, backward_impl="gemm", configs=GRAPHED)


def test_a_bias_gradient_comes_out_of_the_graph_per_call(simulated_graphs):
    """db is the backward graph's own output: each replay's is copied out, so a call's db is its own and
    survives the next call's replay."""
    C = batch(0, torch.float32)[1].requires_grad_(True)
    bias = torch.randn(V, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    kept = []
    for call in range(4):
        E, _, x = batch(100 + call, torch.float32)
        loss = linear_cross_entropy(E, C, x, bias=bias, backward_impl="gemm", configs=GRAPHED)
        db, = torch.autograd.grad(loss, (bias,))
        want, = torch.autograd.grad(linear_cross_entropy(E, C, x, bias=bias, backward_impl="gemm", configs=EAGER),
                                    (bias,))
        assert relative_error(db, want) <= 1e-5, call
        kept.append((db, want))
    assert all(relative_error(db, want) <= 1e-5 for db, want in kept)  # the first replay's db, after the second's
    assert simulated_graphs.summary("backward")["replayed"] == 2
