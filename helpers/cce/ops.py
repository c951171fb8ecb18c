"""The loss and the per-token outputs as host functions (forward, backward) and as ``torch.library``
custom ops over them, so that ``torch.compile(..., fullgraph=True)`` traces a model whose forward
calls ``linear_cross_entropy`` or ``linear_cross_entropy_outputs`` without a graph break.

Two callers, one implementation. Eager calls run the ``torch.autograd.Function``s of ``api`` and
``outputs``, which carry a ``CCEPlan`` (a Python object: the tier, "auto"'s record, the "sparse"
backward's bits) from the forward to the backward. A traced graph can hold only tensors and numbers,
so under ``torch.compiler.is_compiling()`` the public functions call the ops below instead: every
option is an int, float, bool or str of the op's schema, and the op rebuilds the plan from them
(``plan_call``, a few microseconds of Python) in its forward and again in its backward, each a
custom op of its own. Both callers run ``loss_forward`` / ``loss_backward`` (``outputs_forward`` /
``outputs_backward``), so the two paths compute the same numbers.

    cce::linear_cross_entropy(E, C, x, bias, <options>) -> (loss, lse, n_kept, r)
    cce::linear_cross_entropy_backward(E, C, x, bias, lse, r, n_kept, grad_loss, grad_lse, <options>,
                                       need_E, need_C, need_bias) -> (dE, dC, db)
    cce::linear_cross_entropy_outputs(E, C, x, bias, <options>) -> (logprob, entropy, lse, correct, r)
    cce::linear_cross_entropy_outputs_backward(...) -> (dE, dC, db)

A gradient that is not wanted comes back from a backward op as an empty tensor (a schema's outputs
are tensors), and as None from the autograd formula.

What a traced call does not do (the public functions raise, naming the argument, or say here):
- the range check of the targets: it reads a flag on the host, a sync a graph cannot hold. A target
  outside [0, V) that is not ignore_index is then not reported: the kernels read C's row 0 for it
  (no memory is read out of bounds) and its loss is wrong. ``torch._assert_async`` could check on
  the device, but on a GPU a failed device assert ends the process's CUDA context;
- ``backward_impl="auto"``: its per-problem record (``helpers.cce.auto``) is a Python dict that the
  backward updates; a traced call runs "gemm", the choice "auto" makes on a flat softmax.
  "sparse" is refused (its index is sized on the host from the forward's bits);
- ``stats`` (a dict the backward fills on the host) and ``memory_budget`` other than "min" (the
  schedule's model reads the device's free memory and its forward reads a flag);
- ``configs`` other than a tier's name or None (a ``CCEConfigs`` object is not a schema type);
- the class weights' value check (finite, >= 0), which also reads a flag.
"""

from typing import Optional

import torch

from helpers.cce.backward import run_backward
from helpers.cce.backward.atomic import backward_atomic
from helpers.cce.backward.gemm import backward_gemm
from helpers.cce.backward.rows import RowGradient
from helpers.cce.forward import cce_forward, cce_forward_outputs, forward_kernel, reduces_in_kernel
from helpers.cce.graphs import GRAPHS, graphed_plan
from helpers.cce.options import CCEPlan, auto_filter_eps, plan_call
from helpers.cce.shared import read_later
from helpers.spec import raise_for_targets, targets_out_of_range


def traceable_backward(backward_impl: str) -> str:
    """The backward a call without host reads runs: "auto" runs "gemm" (module doc)."""
    if backward_impl == "auto":
        return "gemm"
    if backward_impl == "sparse":
        raise ValueError('backward_impl="sparse" reads its bits\' counts on the host, which torch.compile and CUDA '
                         'graphs cannot hold; pass "gemm" (what "auto" runs there) or "atomic"')
    return backward_impl


# ---------------------------------------------------------------------------------------------
# The host functions, shared by the autograd Functions and the ops
# ---------------------------------------------------------------------------------------------

def loss_forward(E, C, x, bias, plan: CCEPlan, *, check_targets: bool = True):
    """(loss, lse, r, n_kept, activity) of E (N, D), C (V, D), x (N,) by ``plan``: the loss reduced as
    ``plan.options.reduction`` says, the lse (N,) fp32, the rows the backward takes r (2N,) fp32
    (``cce_forward``'s: its target column's 1 - p and the lse's rounding), the kept rows' count (an int64 scalar), the
    "sparse" backward's bits (None without).

    ``check_targets``: raise for a target outside [0, V) that is not ignore_index. It costs one
    host read of a count per call, made by the forward's first launch: the host waits for that
    launch (not the forward's products) once it has queued the rest, so the GPU does not idle.
    Replayed from a CUDA graph where ``helpers.cce.graphs`` says one fits: the check is then launched
    before the replay and read after it is queued."""
    if GRAPHS.applies(E, C, plan):
        V = C.shape[0]
        bad = read_later(targets_out_of_range(x, V, plan.options.ignore_index)) if check_targets else None

        def forward(E, x, C, bias, out=()):
            return _loss_forward(E, C, x, bias, plan, check_targets=False)[:4]

        loss, lse, r, n_kept = GRAPHS.run("forward", forward, plan=plan, copied=dict(E=E, x=x),
                                          held=dict(C=C, bias=bias))
        if check_targets:
            raise_for_targets(x, V, plan.options.ignore_index, bad())
        return loss, lse, r, n_kept, None
    return _loss_forward(E, C, x, bias, plan, check_targets=check_targets)


def _loss_forward(E, C, x, bias, plan: CCEPlan, *, check_targets: bool):
    """``loss_forward`` launched eagerly."""
    options = plan.options
    V = C.shape[0]
    # The kept rows and the targets out of range, counted by the forward's first launch; their copy to
    # the host is queued right after it and read once the rest is queued (a wait for that launch only).
    got, reads = [], []

    def counted(counts):
        got.append(counts)
        if check_targets:
            reads.append(read_later(counts[1]))

    # A "sum" or a "mean" of few rows reduced by the forward's last launch (``reduces_in_kernel``).
    reduced = (torch.empty((), dtype=torch.float32, device=E.device)
               if reduces_in_kernel(x.shape[0], options.reduction, plan.class_weight is not None) else None)
    activity = None
    if plan.emit_activity:  # the "sparse" backward's bits (``CCEPlan.emit_activity``)
        loss_rows, lse, r, activity = cce_forward(E, C, x, options, plan.configs, bias=bias, emit_activity=True,
                                                  return_lse=plan.return_lse, counted=counted, reduced=reduced)
    else:
        loss_rows, lse, r = cce_forward(E, C, x, options, plan.configs, bias=bias, counted=counted,
                                        class_weight=plan.class_weight, reduced=reduced)
    if check_targets:  # the forward's kernels read C's row 0 for a target out of range
        raise_for_targets(x, V, options.ignore_index, reads[0]())
    n_kept = got[0][0]
    if reduced is not None:
        loss = reduced
    elif options.reduction == "none":
        loss = loss_rows
    elif options.reduction == "sum":
        loss = loss_rows.sum()
    else:
        loss = loss_rows.sum() / n_kept  # 0 / 0 = NaN when every token is ignored, as torch
    return loss, lse, r, n_kept, activity


def loss_backward(E, C, x, lse, r, n_kept, bias, grad_loss, grad_lse, plan: CCEPlan, stats=None, activity=None):
    """(dE, dC, db) of ``loss_forward``'s loss and lse, given their upstream gradients (either None);
    None for a gradient ``plan.need`` does not ask for. ``r``: ``loss_forward``'s."""
    if not any(plan.need) or (grad_loss is None and grad_lse is None):
        return None, None, None
    if stats is not None:  # the kernel that made the forward's lse (a bench says which path it timed)
        stats["forward"] = forward_kernel(E, C, bias, plan.options, plan.configs.host, bits=activity is not None)
    # The rows' upstream gradient is grad_loss itself (a scalar for a mean or a sum); a mean's division by
    # the kept rows is made in the row kernel (``RowGradient.of``; with few tokens each launch is host time).
    divisor = n_kept if plan.options.reduction == "mean" else None
    graphed = GRAPHS.applies(E, C, plan, stats, activity)  # few tokens on a GPU: replayed (``helpers.cce.graphs``)
    if graphed:
        plan = graphed_plan(plan)

    def backward(E, C, x, lse, r, grad_loss, grad_lse, divisor, bias, out=None):
        return run_backward(E, C, x, lse, r, grad_loss, plan, stats=stats, grad_lse=grad_lse, bias=bias,
                            activity=activity, divisor=divisor, out=out)

    if graphed:
        need_dE, need_dC, _ = plan.need
        return GRAPHS.run(
            "backward", backward, plan=plan, held=dict(C=C, bias=bias),
            copied=dict(E=E, x=x, lse=lse, r=r, grad_loss=grad_loss, grad_lse=grad_lse, divisor=divisor),
            outputs=((E.shape, E.dtype, E.device) if need_dE else None, (C.shape, E.dtype, E.device) if need_dC else None))
    return backward(E, C, x, lse, r, grad_loss, grad_lse, divisor, bias)


def outputs_forward(E, C, x, bias, plan: CCEPlan, *, check_targets: bool = True):
    """(logprob, entropy, lse, correct, r), each (N,), of ``helpers.cce.outputs`` (r: ``cce_forward_outputs``'s);
    ``check_targets`` as ``loss_forward`` (the read follows the forward's kernels)."""
    o = plan.options
    logprob, entropy, lse, correct, r = cce_forward_outputs(E, C, x, o, plan.configs, bias=bias)
    if check_targets:
        raise_for_targets(x, C.shape[0], o.ignore_index)
    return logprob, entropy, lse, correct, r


def outputs_backward(E, C, x, lse, entropy, r, bias, grad_logprob, grad_entropy, plan: CCEPlan, stats=None):
    """(dE, dC, db) of ``outputs_forward``'s logprob and entropy (either gradient None)."""
    if not any(plan.need) or (grad_logprob is None and grad_entropy is None):
        return None, None, None
    o, configs = plan.options, plan.configs
    up = RowGradient.of_outputs(grad_logprob, grad_entropy, x != o.ignore_index, entropy, r)
    if plan.backward_impl == "atomic":
        dE, dC = backward_atomic(E, C, x, lse, up, None, o, configs.for_dtype(E.dtype)[1], None, None, stats, bias,
                                 plan.need[:2])
        return dE, dC, None
    return backward_gemm(E, C, x, lse, up, None, o, configs.backward_gemm_for(E.dtype), None, None, stats, bias,
                         plan.need, host=configs.host)


# ---------------------------------------------------------------------------------------------
# The custom ops
# ---------------------------------------------------------------------------------------------

def schema_filter_eps(filter_eps, dtype: torch.dtype, vocabulary: int, label_smoothing: float = 0.0):
    """``filter_eps`` as the ops take it, a number or None: "auto" resolved for the dense backwards
    (``auto_filter_eps``, for ``vocabulary`` V classes), the only ones a traced call runs."""
    if isinstance(filter_eps, str) and filter_eps == "auto":
        return auto_filter_eps(dtype, label_smoothing, vocabulary=vocabulary)
    return filter_eps


def _loss_plan(E, C, options: tuple, need=(False, False, False)) -> CCEPlan:
    (ignore_index, reduction, softcap, z_loss, label_smoothing, temperature, filter_eps, sort_vocab, accumulation,
     full_c, full_e, configs, backward_impl, return_lse) = options
    return plan_call(E, C, backward_impl=backward_impl, configs=configs, return_lse=return_lse, need=need,
                     wants_db=need[2], filter_eps=filter_eps, sort_vocab=sort_vocab, ignore_index=ignore_index,
                     reduction=reduction, softcap=softcap, accumulation=accumulation, full_c=full_c, full_e=full_e,
                     z_loss=z_loss, label_smoothing=label_smoothing, temperature=temperature)


@torch.library.custom_op("cce::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    E: torch.Tensor, C: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
    ignore_index: int, reduction: str, softcap: Optional[float], z_loss: float, label_smoothing: float,
    temperature: float, filter_eps: Optional[float], sort_vocab: bool, accumulation: str, full_c: bool,
    full_e: bool, configs: Optional[str], backward_impl: str, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, n_kept, r) of ``linear_cross_entropy`` (E (N, D), x (N,)), targets unchecked."""
    plan = _loss_plan(E, C, (ignore_index, reduction, softcap, z_loss, label_smoothing, temperature, filter_eps,
                             sort_vocab, accumulation, full_c, full_e, configs, backward_impl, return_lse))
    loss, lse, r, n_kept, _ = loss_forward(E, C, x, bias, plan, check_targets=False)
    return loss, lse, n_kept, r


@linear_cross_entropy_op.register_fake
def _(E, C, x, bias, *options):
    plan = _loss_plan(E, C, options)  # the options' errors at trace time, as in an eager call
    N = E.shape[0]
    loss = E.new_empty((N,) if plan.options.reduction == "none" else (), dtype=torch.float32)
    return (loss, E.new_empty((N,), dtype=torch.float32), x.new_empty((), dtype=torch.int64),
            E.new_empty((2 * N,), dtype=torch.float32))


@torch.library.custom_op("cce::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    E: torch.Tensor, C: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], lse: torch.Tensor,
    r: torch.Tensor, n_kept: torch.Tensor, grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor],
    ignore_index: int, reduction: str, softcap: Optional[float], z_loss: float, label_smoothing: float,
    temperature: float, filter_eps: Optional[float], sort_vocab: bool, accumulation: str, full_c: bool,
    full_e: bool, configs: Optional[str], backward_impl: str, return_lse: bool,
    need_E: bool, need_C: bool, need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dE, dC, db) of ``cce::linear_cross_entropy``; empty where not wanted."""
    options = (ignore_index, reduction, softcap, z_loss, label_smoothing, temperature, filter_eps, sort_vocab,
               accumulation, full_c, full_e, configs, backward_impl, return_lse)
    plan = _loss_plan(E, C, options, (need_E, need_C, need_bias))
    grads = loss_backward(E, C, x, lse, r, n_kept, bias, grad_loss, grad_lse if return_lse else None, plan)
    return _filled(grads, E, C, bias)


@linear_cross_entropy_backward_op.register_fake
def _(E, C, x, bias, lse, r, n_kept, grad_loss, grad_lse, *options_and_need):
    return _gradients_like(E, C, bias, options_and_need[-3:])


def _filled(grads, E, C, bias):
    """A backward's (dE, dC, db) with None as an empty tensor (a schema returns tensors)."""
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, (E, C, bias if bias is not None else E)))


def _gradients_like(E, C, bias, need):
    return tuple(t.new_empty(t.shape if wanted else (0,)) if t is not None else E.new_empty(0)
                 for t, wanted in zip((E, C, bias), need))


def _setup_loss(ctx, inputs, output):
    E, C, x, bias, *options = inputs
    _, lse, n_kept, r = output
    ctx.save_for_backward(E, C, x, bias, lse, r, n_kept)
    ctx.options = tuple(options)


def _loss_gradients(ctx, grad_loss, grad_lse, _grad_n_kept, _grad_r):
    E, C, x, bias, lse, r, n_kept = ctx.saved_tensors
    need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
    none = (None,) * (4 + len(ctx.options))
    if not any(need):
        return none
    dE, dC, db = linear_cross_entropy_backward_op(E, C, x, bias, lse, r, n_kept, grad_loss, grad_lse, *ctx.options,
                                                  *need)
    return (dE if need[0] else None, dC if need[1] else None, None, db if need[2] else None) + none[4:]


linear_cross_entropy_op.register_autograd(_loss_gradients, setup_context=_setup_loss)


def _outputs_plan(E, C, options: tuple, need=(False, False, False)) -> CCEPlan:
    ignore_index, softcap, temperature, filter_eps, configs, backward_impl = options
    return plan_call(E, C, backward_impl=backward_impl, configs=configs, return_lse=False, need=need,
                     wants_db=need[2], filter_eps=filter_eps, ignore_index=ignore_index, softcap=softcap,
                     temperature=temperature)


@torch.library.custom_op("cce::linear_cross_entropy_outputs", mutates_args=())
def linear_cross_entropy_outputs_op(
    E: torch.Tensor, C: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor],
    ignore_index: int, softcap: Optional[float], temperature: float, filter_eps: Optional[float],
    configs: Optional[str], backward_impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob, entropy, lse, correct, r) of ``linear_cross_entropy_outputs`` (x (N,)), targets unchecked."""
    plan = _outputs_plan(E, C, (ignore_index, softcap, temperature, filter_eps, configs, backward_impl))
    return outputs_forward(E, C, x, bias, plan, check_targets=False)


@linear_cross_entropy_outputs_op.register_fake
def _(E, C, x, bias, *options):
    _outputs_plan(E, C, options)
    N = E.shape[0]
    rows = tuple(E.new_empty((N,), dtype=torch.float32) for _ in range(3))
    return (*rows, x.new_empty((N,), dtype=torch.bool), E.new_empty((N,), dtype=torch.float32))


@torch.library.custom_op("cce::linear_cross_entropy_outputs_backward", mutates_args=())
def linear_cross_entropy_outputs_backward_op(
    E: torch.Tensor, C: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], lse: torch.Tensor,
    entropy: torch.Tensor, r: torch.Tensor, grad_logprob: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor],
    ignore_index: int, softcap: Optional[float], temperature: float, filter_eps: Optional[float],
    configs: Optional[str], backward_impl: str, need_E: bool, need_C: bool, need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dE, dC, db) of ``cce::linear_cross_entropy_outputs``; empty where not wanted."""
    plan = _outputs_plan(E, C, (ignore_index, softcap, temperature, filter_eps, configs, backward_impl),
                         (need_E, need_C, need_bias))
    return _filled(outputs_backward(E, C, x, lse, entropy, r, bias, grad_logprob, grad_entropy, plan), E, C, bias)


@linear_cross_entropy_outputs_backward_op.register_fake
def _(E, C, x, bias, lse, entropy, r, grad_logprob, grad_entropy, *options_and_need):
    return _gradients_like(E, C, bias, options_and_need[-3:])


def _setup_outputs(ctx, inputs, output):
    E, C, x, bias, *options = inputs
    _, entropy, lse, _, r = output
    ctx.save_for_backward(E, C, x, bias, lse, entropy, r)
    ctx.options = tuple(options)


def _outputs_gradients(ctx, grad_logprob, grad_entropy, _grad_lse, _grad_correct, _grad_r):
    E, C, x, bias, lse, entropy, r = ctx.saved_tensors
    need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
    none = (None,) * (4 + len(ctx.options))
    if not any(need):
        return none
    dE, dC, db = linear_cross_entropy_outputs_backward_op(E, C, x, bias, lse, entropy, r, grad_logprob, grad_entropy,
                                                          *ctx.options, *need)
    return (dE if need[0] else None, dC if need[1] else None, None, db if need[2] else None) + none[4:]


linear_cross_entropy_outputs_op.register_autograd(_outputs_gradients, setup_context=_setup_outputs)
