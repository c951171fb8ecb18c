"""torch.compile of a model that calls our loss: one graph, no host reads, the eager numbers.

Under ``torch.compiler.is_compiling()`` the public functions call the ``cce::`` custom ops
(``helpers.cce.ops``), so ``torch.compile(fullgraph=True)`` traces a tiny model (Linear -> our loss)
without a graph break; a host read (``.item()``, ``bool(tensor)``) in the traced Python would break the
graph and fail here. Compiled with the "aot_eager" backend (AOTAutograd traces the forward and the
backward through the ops' fake implementations, then runs them eagerly), the loss and the gradients
equal the eager call's exactly (the same kernels run). "inductor" works too, but its C++ compile of
the model's Linear takes ~15 s on a CPU, so one test runs it, marked slow.

Host reads of the eager path are counted with a dispatch mode: every read of a tensor's value on the
host (``item``, ``bool``, ``int``, ``float``) is ``aten._local_scalar_dense``, so on a CPU this proves
what on a GPU would be a sync. CPU only, fp32, under the Triton interpreter.
"""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import helpers.cce.api as api_module  # noqa: E402
import helpers.cce.backward.gemm as gemm_module  # noqa: E402
from helpers.cce import linear_cross_entropy, linear_cross_entropy_outputs  # noqa: E402
from helpers.cce import ops  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the Triton interpreter)")

N, V, D, H = 13, 37, 16, 8  # odd sizes: partial tiles everywhere


class Model(torch.nn.Module):
    """A body (one Linear) and a head's weight, the loss of the two: what a training step compiles."""

    def __init__(self, bias=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Linear(H, D)
        self.head = torch.nn.Parameter(torch.randn(V, D) / D**0.5)
        self.head_bias = torch.nn.Parameter(0.1 * torch.randn(V)) if bias else None

    def forward(self, inputs, x, **options):
        return linear_cross_entropy(self.body(inputs), self.head, x, bias=self.head_bias, **options)


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (N,), generator=g)
    x[[2, 9]] = -100
    return torch.randn(N, H, generator=g), x


def gradients(model, fn, *args, **kwargs):
    """(output, {name: grad}) of fn's scalar (or summed) output."""
    model.zero_grad(set_to_none=True)
    out = fn(*args, **kwargs)
    value = out[0] if isinstance(out, tuple) else out
    (value.sum() + (out[1].sum() * 0.1 if isinstance(out, tuple) else 0)).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equal(got, want):
    (out_got, g_got), (out_want, g_want) = got, want
    for a, b in zip(out_got if isinstance(out_got, tuple) else (out_got,),
                    out_want if isinstance(out_want, tuple) else (out_want,)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert g_got.keys() == g_want.keys()
    for name in g_want:
        torch.testing.assert_close(g_got[name], g_want[name], rtol=1e-6, atol=1e-7)


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value on the host, and the ops whose output shape depends on data."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("options", [
    dict(),
    dict(bias=True, reduction="none", softcap=3.0, return_lse=True),
    dict(reduction="sum", z_loss=1e-3, label_smoothing=0.1, temperature=1.5, backward_impl="atomic"),
], ids=["mean", "bias-none-lse", "sum-options-atomic"])
def test_compiled_loss_matches_eager(options):
    options = dict(options)
    model = Model(bias=options.pop("bias", False))
    inputs, x = batch()
    want = gradients(model, model, inputs, x, **options)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_equal(gradients(model, compiled, inputs, x, **options), want)


def test_compiled_loss_with_a_symbolic_vocabulary_matches_eager():
    """Under ``dynamic=True`` with C an input (not a parameter, whose shape dynamo keeps static): the
    filter's "auto" threshold, which falls with V, is resolved from C's shape in the traced call too."""
    E = torch.randn(N, H, requires_grad=True)
    C = torch.randn(V, H, requires_grad=True)
    _, x = batch()

    def fn(E, C, x):
        return linear_cross_entropy(E, C, x)

    want = fn(E, C, x)
    want_grads = torch.autograd.grad(want, (E, C))
    got = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)(E, C, x)
    got_grads = torch.autograd.grad(got, (E, C))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_soft_cap_and_an_ignore_index_that_change_between_compiled_calls():
    """torch.compile traces a float that changes between calls as a symbolic float (and may an int): the
    options' checks must trace them (``math.isfinite`` on the soft cap broke ``fullgraph=True``)."""
    E = torch.randn(N, H, requires_grad=True)
    C = torch.randn(V, H)
    _, x = batch()
    compiled = torch.compile(lambda E, x, softcap, ignore: linear_cross_entropy(E, C, x, softcap=softcap,
                                                                                 ignore_index=ignore),
                             fullgraph=True, backend="aot_eager")
    for softcap, ignore in ((2.0, -100), (3.0, -1), (4.5, 0)):
        xi = torch.where(x == -100, ignore, x)  # the batch's ignored tokens, as this call marks them
        torch.testing.assert_close(compiled(E, xi, softcap, ignore),
                                   linear_cross_entropy(E, C, xi, softcap=softcap, ignore_index=ignore),
                                   rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("z_loss", [0.0, 0.01])
def test_compiled_loss_with_class_weights_and_shift(z_loss):
    """With a z-loss too: it is added from the returned lse, unweighted (``helpers.cce.class_weights``)."""
    model = Model()
    inputs, x = batch()
    weight = torch.rand(V) + 0.5

    def fn(inputs, x):
        return linear_cross_entropy(model.body(inputs), model.head, x.view(1, N), weight=weight, shift=True,
                                    z_loss=z_loss)

    want = gradients(model, fn, inputs.view(1, N, H), x)
    got = gradients(model, torch.compile(fn, fullgraph=True, backend="aot_eager"), inputs.view(1, N, H), x)
    assert_equal(got, want)


def test_compiled_outputs_match_eager():
    model = Model(bias=True)
    inputs, x = batch()

    def fn(inputs, x):
        out = linear_cross_entropy_outputs(model.body(inputs), model.head, x, bias=model.head_bias, softcap=4.0,
                                           temperature=0.7)
        return out.logprob, out.entropy, out.correct

    def objective(inputs, x):  # a GRPO-like mix of both differentiable outputs
        logprob, entropy, correct = fn(inputs, x)
        return (logprob * 0.3).sum() - 0.01 * entropy.sum(), correct

    want = gradients(model, objective, inputs, x)
    got = gradients(model, torch.compile(objective, fullgraph=True, backend="aot_eager"), inputs, x)
    assert_equal(got, want)


def test_explain_finds_one_graph_and_no_break():
    model = Model()
    explanation = torch._dynamo.explain(model)(*batch())
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    ops_called = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
    assert "cce.linear_cross_entropy.default" in ops_called


def test_what_a_compiled_call_refuses_names_the_argument():
    model = Model()
    inputs, x = batch()
    for options, word in ((dict(stats={}), "stats"), (dict(backward_impl="sparse"), "sparse"),
                          (dict(memory_budget=1e9), "memory_budget"), (dict(temperature=-1.0), "temperature")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=word):
            torch.compile(model, fullgraph=True, backend="aot_eager")(inputs, x, **options)


def test_eager_call_reads_the_host_once_for_the_targets_check_and_once_for_dCs_scale():
    """Eager forward + backward with stats=None: the targets' range flag (documented in
    ``helpers.cce.ops.loss_forward``) and, in the "gemm" backward, dC's product's alpha (read late:
    ``helpers.cce.backward.gemm``); none where a CUDA graph is capturing (the next test)."""
    model = Model()
    inputs, x = batch()
    for options, count in ((dict(), 2), (dict(reduction="none"), 2), (dict(backward_impl="atomic"), 1)):
        with HostReads() as reads:
            gradients(model, model, inputs, x, **options)
        assert reads.count == count, options
    with pytest.raises(ValueError, match="outside"):
        model(inputs, torch.full_like(x, V))


def test_eager_call_reads_nothing_where_host_reads_are_not_allowed(monkeypatch):
    model = Model()
    inputs, x = batch()
    want = gradients(model, model, inputs, x)
    for module in (api_module, gemm_module):  # as under torch.cuda.graph capture
        monkeypatch.setattr(module, "no_host_sync", lambda E: True)
    with HostReads() as reads:
        got = gradients(model, model, inputs, x)
    assert reads.count == 0
    assert_equal(got, want)
    with pytest.raises(ValueError, match="stats"):
        model(inputs, x, stats={})


def op_inputs():
    g = torch.Generator().manual_seed(0)
    E = torch.randn(N, D, generator=g, requires_grad=True)
    C = torch.randn(V, D, generator=g, requires_grad=True)
    bias = torch.randn(V, generator=g, requires_grad=True)
    x = torch.randint(0, V, (N,), generator=g)
    x[3] = -100
    return E, C, x, bias


# The ops' options, in their schemas' order: (ignore_index, reduction, softcap, z_loss, label_smoothing,
# temperature, filter_eps, sort_vocab, accumulation, full_c, full_e, configs, backward_impl, return_lse)
# and (ignore_index, softcap, temperature, filter_eps, configs, backward_impl).
LOSS_OPTIONS = (-100, "mean", None, 0.0, 0.0, 1.0, None, False, "fp32", False, False, None, "gemm", True)
OUTPUTS_OPTIONS = (-100, 2.0, 1.3, None, None, "gemm")


def test_the_ops_read_nothing_on_the_host():
    """What a compiled graph runs (its Python traced without a graph break: the tests above) reads
    nothing on the host at run time either: the ops' forwards and backwards, called as the graph calls them."""
    E, C, x, bias = (t.detach() for t in op_inputs())
    with HostReads() as reads:
        loss, lse, n_kept, r = ops.linear_cross_entropy_op(E, C, x, bias, *LOSS_OPTIONS)
        ops.linear_cross_entropy_backward_op(E, C, x, bias, lse, r, n_kept, torch.ones(()), torch.rand(N),
                                             *LOSS_OPTIONS, True, True, True)
        _, entropy, lse, _, r = ops.linear_cross_entropy_outputs_op(E, C, x, bias, *OUTPUTS_OPTIONS)
        ops.linear_cross_entropy_outputs_backward_op(E, C, x, bias, lse, entropy, r, torch.rand(N), torch.rand(N),
                                                     *OUTPUTS_OPTIONS, True, True, True)
    assert reads.count == 0


def test_opcheck():
    """torch.library.opcheck on each op: its schema, its fake implementation against the real one,
    its autograd registration and AOTAutograd's dynamic-shape trace. The backward ops get no
    ``test_autograd_registration`` (they are not differentiated: autograd never sees them)."""
    E, C, x, bias = op_inputs()
    loss_options, outputs_options = LOSS_OPTIONS, OUTPUTS_OPTIONS
    torch.library.opcheck(ops.linear_cross_entropy_op, (E, C, x, bias, *loss_options))
    loss, lse, n_kept, r = ops.linear_cross_entropy_op(E.detach(), C.detach(), x, bias.detach(), *loss_options)
    plain = tuple(t.detach() for t in (E, C, x, bias))
    backward_args = (*plain, lse, r, n_kept, torch.ones(()), torch.rand(N), *loss_options, True, True, True)
    not_autograd = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.linear_cross_entropy_backward_op, backward_args, test_utils=not_autograd)
    torch.library.opcheck(ops.linear_cross_entropy_outputs_op, (E, C, x, bias, *outputs_options))
    _, entropy, lse, _, r_out = ops.linear_cross_entropy_outputs_op(*plain, *outputs_options)
    outputs_backward_args = (*plain, lse, entropy, r_out, torch.rand(N), torch.rand(N), *outputs_options, True, True, True)
    torch.library.opcheck(ops.linear_cross_entropy_outputs_backward_op, outputs_backward_args, test_utils=not_autograd)


@pytest.mark.slow
def test_inductor_compiles_the_loss():
    model = Model()
    inputs, x = batch()
    want = gradients(model, model, inputs, x)
    got = gradients(model, torch.compile(model, fullgraph=True, backend="inductor"), inputs, x)
    out_got, g_got = got
    torch.testing.assert_close(out_got, want[0], rtol=1e-5, atol=1e-6)  # inductor's Linear sums in its own order
    for name in want[1]:
        torch.testing.assert_close(g_got[name], want[1][name], rtol=1e-4, atol=1e-5)
