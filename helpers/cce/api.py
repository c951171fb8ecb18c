"""Our Cut Cross-Entropy (Wijmans et al., arXiv 2411.09009): the loss of a linear head without
the (N, V) logits in global memory, as an autograd function and the public call.

The memory arithmetic. A language model's head computes logits z = E C^T from E (N, D) and
C (V, D). At the Gemma-2-2B head (N = 8,192, V = 256,000, D = 2,304) the fp32 logits are
N * V * 4 = 8.4 GB, and autograd keeps them plus their gradient: the naive path peaks at 24 GB
for a loss whose inputs are 1.2 GB. The gradients dE and dC alone are 1.22 GB (1,161 MiB) in
bf16: the lower bound (LB) of any method. CCE stays near LB by never writing a logit: every kernel
rebuilds the (BLOCK_N, BLOCK_V) logit tiles it needs from E and C in on-chip memory.

The math, in the paper's notation (x: targets, S = softmax(z), lse: log-sum-exp per row):

    loss_i = lse_i - z_{i, x_i}                                  (cross-entropy)
    z_{i, x_i} = E_i . C_{x_i}                                   Algorithm 1, indexed dot
    lse_i = log sum_v exp(E_i . C_v)                             Algorithm 2, online over V blocks
    G = dloss/dz = S - 1[v = x],  dE = G C,  dC = G^T E          Algorithms 3-4, tiles recomputed

plus the options: Gemma-2's soft cap z = s tanh(z / s), PaLM's z-loss (+ zl * lse_i^2, Liger's
``lse_square_scale``), torch's label smoothing (loss_i = lse_i - (1 - ls) z_{i, x_i} -
(ls / V) sum_v z_{i, v}) and ``ignore_index``, reduced exactly as ``F.cross_entropy`` does on fp32
logits (``helpers.spec`` is the specification).

Where each part lives: ``forward`` (Algorithms 1-2), ``backward`` (Algorithms 3-4, three
implementations, one module each), ``options`` (what a call may ask, and where it runs), ``kernels/`` (the Triton
kernels and their launch configurations, by shared memory per block).

Gradient filter (paper section 4.2): a tile whose |G| sums to less than eps in every row skips
its products; eps is per 256 vocabulary columns (a tile of BLOCK_V columns is held to
eps * BLOCK_V / 256), so narrower tiles on smaller GPUs drop about what 256-column ones drop
(``helpers.cce.options.tile_eps``). The paper bounds each entry; bounding the row mass also holds
on a flat softmax, where every entry is tiny and their sum is not (``helpers/cce/kernels/atomic_gradients.py``). eps
defaults from the dtype and the vocabulary ("auto"): 2^-12 for bf16 as in the paper (2^-5 of bf16's
machine epsilon), the same 2^-5 of fp16's (2^-15), lower past 8,192 classes so that a row drops at
most 2^-7 (bf16) or 2^-10 (fp16) of its |G| mass over the whole vocabulary (2^-17 bf16 at 262,144:
at 2^-12 a Gemma-3-1B head's dE reached 1.6x the naive path's error on an H200); off for fp32; off
with label smoothing, whose uniform -ls/V term sits below eps in every tile. ``full_c`` / ``full_e``
(the paper's CCE-Kahan-FullC/FullE) keep the filter for one gradient only. In the "gemm" backward the filter zeroes tiles of G but the
cuBLAS products still multiply them, so it saves no time there (docs/PERFORMANCE.md).

Vocabulary sort (paper section 4.3): ``sort_vocab=True`` orders the vocabulary by average logit
(``helpers.cce.shared.vocabulary_order``), so large softmax entries share tiles and more tiles
pass the filter. "auto" (the default) sorts for the "sparse" backward, whose bits it tightens
(unsorted they over-mark ~3x), and not for the others, where it only pays when the filter has
something to skip and costs "gemm" a gather of C's rows.

The "sparse" backward makes the filter save time: the forward also writes one activity bit per
(row, vocabulary tile) (``helpers.cce.activity``), and the backward rebuilds and multiplies only the
marked pairs, per row (``helpers/cce/backward/sparse.py``). Its "auto" eps bounds what a row loses:
B / T for T tiles per row, B = 2^-7 (bf16), 2^-10 (fp16). It computes what "gemm" computes (a bias
and db, per-row upstream gradients, a gradient into the returned lse, only the gradients asked
for), with each row's G filtered on its own. When the bits mark more than the tier's share of the
pairs (a dense softmax), or the options need every pair (label smoothing, FullC/FullE, no filter),
it runs "gemm" as ``backward_impl="gemm"`` would (that backward's eps, unsorted) and
``stats["fallback"]`` says why. With ``return_lse`` its forward marks tiles at a lower threshold
(eps / 2, eps / 3 with z-loss), since a gradient into the lse adds to G's softmax term.

The default backward, "auto", runs "sparse" where its bits pay and "gemm" elsewhere, without paying
for bits on every call to find out: it remembers, per problem (device, dtype, head, N to a power of
two, tier, options), what the last sparse backward decided, and makes bits again to look after
``HostTuning.auto_probe_calls`` calls of "gemm" (``helpers.cce.auto``).

What it does not do: vocabulary parallelism (C sharded across GPUs), and the paper's lock-free
bf16 atomics (fp32 scratch instead: ~0.06-0.2 LB, for the naive path's accuracy).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from helpers.cce.class_weights import check_weight, weighted_reduction, z_loss_term
from helpers.cce.forward_de import dc_plan, forward_de_reason, loss_forward_de
from helpers.cce.forward_grads import ForwardGradsFunction, plan_schedule
from helpers.cce.kernels.configs import CCEConfigs
from helpers.cce.options import CCEPlan, check_bias_gradient, check_loss_terms, plan_call
from helpers.cce.shared import no_host_sync, shift_targets
from helpers.cce.ops import (
    linear_cross_entropy_op,
    loss_backward,
    loss_forward,
    schema_filter_eps,
    traceable_backward,
)
from helpers.cce.schedules import check_memory_budget, resolve_memory_budget
from helpers.spec import validate_inputs


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(loss, lse) of CE(E C^T + b, x) with the CCE kernels, E (N, D) and x (N,), by a ``CCEPlan``
    (``helpers.cce.options.plan_call``); backward recomputes the logits (it saves the lse and r) and
    computes only the gradients the plan says are wanted. The host functions it runs, and the custom
    ops that ``torch.compile`` traces instead: ``helpers.cce.ops``. ``check_targets``: the targets'
    range check (``ops.loss_forward`` says what it costs)."""

    @staticmethod
    def forward(ctx, E, C, x, bias, plan: CCEPlan, stats=None, check_targets=True):
        # dE made here where the tier and the call allow it (``helpers.cce.forward_de``), else the shipped forward.
        why = forward_de_reason(E, C, bias, plan)
        if stats is not None:
            stats["forward_de"] = why or "made dE"
        if why is None:
            loss, lse, r, n_kept, ctx.forward_dE = loss_forward_de(E, C, x, plan, check_targets=check_targets)
            activity = None
        else:
            loss, lse, r, n_kept, activity = loss_forward(E, C, x, bias, plan, check_targets=check_targets)
            ctx.forward_dE = None
        ctx.save_for_backward(E, C, x, lse, r, n_kept, bias)
        ctx.plan, ctx.stats, ctx.activity = plan, stats, activity
        ctx.set_materialize_grads(False)  # an output nobody uses gets None, not a tensor of zeros
        ctx.mark_non_differentiable(n_kept)
        return loss, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_lse):
        E, C, x, lse, r, n_kept, bias = ctx.saved_tensors
        dE = ctx.forward_dE
        if dE is None or grad_loss is None:
            dE, dC, db = loss_backward(E, C, x, lse, r, n_kept, bias, grad_loss, grad_lse, ctx.plan, ctx.stats,
                                       ctx.activity)
            return dE, dC, None, db, None, None, None
        # The forward's dE, scaled in place by the loss's upstream gradient (one value: a mean's or a sum's); a
        # second backward (retain_graph) finds it spent and recomputes as the shipped path does.
        ctx.forward_dE = None
        dE.mul_(grad_loss)
        _, dC, db = loss_backward(E, C, x, lse, r, n_kept, bias, grad_loss, grad_lse, dc_plan(ctx.plan, E, C),
                                  ctx.stats, ctx.activity)
        return dE, dC, None, db, None, None, None


def linear_cross_entropy(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    shift: bool = False,
    softcap: float | None = None,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    return_lse: bool = False,
    filter_eps: float | str | None = "auto",
    sort_vocab: bool | str = "auto",
    accumulation: str = "fp32",
    full_c: bool = False,
    full_e: bool = False,
    configs: CCEConfigs | str | None = None,
    backward_impl: str = "auto",
    stats: dict | None = None,
    temperature: float = 1.0,
    weight: torch.Tensor | None = None,
    memory_budget: str | float = "default",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the logits E C^T (+ bias) against x, without materialising the logits.

    E (..., D) hidden states, C (V, D) the classifier (an lm_head's weight), x integer targets of
    E's leading shape (..., ); fp32, fp16 or bf16 (E, C and bias alike). Returns an fp32 loss: a
    scalar for "mean"/"sum", E's leading shape for "none" (0 at ignored rows); exactly
    ``F.cross_entropy(softcap(E C^T + bias).float(), x, ...)`` up to rounding, NaN for a mean over
    zero kept tokens (with zero gradients), as torch gives. Gradients flow to whichever of E, C
    and bias require them; the others are not computed.

    bias: (V,) added to every row's logits, its gradient computed by the "gemm" and "sparse" backwards.
    shift: a causal LM's shift, done on the targets: position t is scored against x[..., t + 1] and
        the last position of each sequence (the last index of x's last dimension) is ignored. No
        copy of E is made (E is flattened as a view when its leading dimensions are contiguous).
    return_lse: also return each row's log-sum-exp (fp32, E's leading shape), differentiable: a
        z-loss the caller computes from it (e.g. ``1e-4 * (lse ** 2).mean()``) backpropagates.
    z_loss: adds z_loss * lse^2 per kept token. label_smoothing: torch's definition, in [0, 1].
    filter_eps: "auto" (for "gemm" and "atomic" per 256 columns: min(2^-12, 2^-7 x 256 / V) bf16,
        min(2^-15, 2^-10 x 256 / V) fp16; for "sparse" per row, below; off for fp32 and with label
        smoothing), a number (0 = off; per tile, as given, for every backward) or None (off). "auto"
        follows the backward that runs, also under ``backward_impl="auto"`` and in the sparse
        backward's hand-over to "gemm". A row's tile is dropped when its |G| mass there (before the
        soft cap's derivative) is below the threshold.
    sort_vocab: order the vocabulary by average logit for the filter: "auto" (for "sparse" only),
        True or False.
    accumulation: "fp32" (fp32 scratch, rounded once per row chunk) or "kahan" (also compensates
        dC's folds across row chunks). With one row chunk (N * D * 4 <= max(64 MiB, LB / 16): all
        N up to 16,384 at the Qwen3 head, 8,192+ at Gemma's) "fp32" keeps bf16 dE and dC within
        1.5x of the naive bf16 path's error; past it dC is rounded once per chunk and "kahan"
        brings it back for a V * D buffer in the input dtype (docs/PERFORMANCE.md has the numbers).
        full_c / full_e: filter only dE / only dC.
    configs: a ``CCEConfigs`` or tier name from ``helpers.cce.kernels.configs``; None picks by the
        device's shared memory per block. The tier carries the kernels' tiles and the host's knobs
        (``HostTuning``: chunk widths, budgets); ``tier.tuned(...)`` changes knobs for one call.
    backward_impl: "auto" (the default: "sparse" where the last calls of this problem saw its bits
        pay, "gemm" elsewhere; below), "gemm" (G per vocabulary chunk in scratch, its two products
        in cuBLAS), "atomic" (fp32 atomics in one kernel, slower; no bias gradient) or "sparse" (the
        forward marks the (row, tile) pairs that may carry gradient, the backward computes only
        those, deterministically; "auto" filter eps = B / T per tile, B = 2^-7 for bf16, 2^-10 for
        fp16: at most B of a row's |G| mass dropped; "gemm" when more than the tier's
        ``dense_fallback`` of the pairs are marked); ``helpers.cce.backward``. fp32 "gemm" products
        follow torch's fp32 matmul setting (default: no TF32).
        "auto" decides at the call's entry, from a per-process record per problem (device, dtype,
        V, D, N rounded up to a power of two, tier, options): with nothing recorded it probes (runs
        "sparse": the forward makes bits, the backward decides as above, and its decision is
        recorded); after a "sparse" decision it runs "sparse" again (each backward re-decides);
        after a "gemm" decision it runs "gemm" with no bits for ``HostTuning.auto_probe_calls``
        calls (32), then probes again. Where "sparse" cannot skip anything (fp32 "auto", the filter
        off, label smoothing, FullC/FullE, too few pairs, no gradient wanted) it is "gemm" with no
        probe. Consecutive calls may thus run different backwards with different filters (both
        within the accuracy gate); for the same backward on every call pass "gemm" or "sparse".
        ``helpers.cce.auto`` has the measurements behind it.
    stats: a dict the backward fills with what it did: "backward" (the one that ran: "gemm",
        "sparse" or "atomic"), "forward" (the kernel that made the lse: "gluon" on Hopper, "triton",
        or "triton with bits"), "auto" (why "auto" chose it: "probe: ...", "remembered: ...", or the
        reason "sparse" cannot run), "tiles" (logit tiles rebuilt), "skipped" (tiles whose gradient
        the filter dropped), "launches"; see ``cce_backward``. Counting costs one host sync per
        backward.
    temperature: tau > 0; the logits are softcap(E C^T + bias) / tau before everything else (the
        lse, the z-loss, label smoothing, the returned lse); "sparse" runs "gemm" when tau != 1.
    weight: (V,) class weights, torch's ``weight=``: row i's loss is scaled by weight[x_i] and "mean"
        divides by the kept targets' weights; with label smoothing the smoothing term is weighted per
        class, as torch does; a z-loss stays unweighted and a mean divides it by the kept count, as
        Liger does (``helpers.cce.class_weights``; weight with label smoothing not under
        torch.compile). Per-token log-probabilities, entropies and accuracy:
        ``helpers.cce.outputs.linear_cross_entropy_outputs``.
    memory_budget: "default" (the tier's ``HostTuning.default_budget``: 1 GiB on a T4, raised where that
        fits no three-product schedule up to ``HostTuning.default_budget_max``, 4 GiB, and half of what is
        free; "min" on every other tier, on the CPU and under torch.compile. On a T4 Triton compiles its
        16-bit products as fp32 FMAs, so cuBLAS makes the logits there (``helpers.cce.cublas_logits``), and
        the three-product schedule is the faster: on an H100 standing in for a T4, the Qwen3 head at 16,384
        tokens, 31.8 ms at 1.41 GB against "min"'s 107 ms at 0.44 GB, 48 ms of it GPU work), "min" (the
        recompute design above, within ~1.1-1.2 LB at LLM heads; up to ``HostTuning.g_buffer_max_bytes``
        more on a small head whose G chunks in place would all be host-bound,
        ``helpers.cce.backward.gemm.gemm_plan``), a number of bytes the call may hold beyond its inputs and the gradients it returns (dE, dC), or "auto"
        (``helpers.cce.schedules.AUTO_SHARE`` of the device's free memory; "min" on the CPU). The
        call runs the schedule predicted fastest among those whose predicted memory fits
        (``helpers.cce.schedules``): "recompute" or "forward_grads" (the gradients made in the
        forward from chunks of logit rows: three products instead of four; a "mean" or "sum" loss
        without ``return_lse`` or class weights, ``helpers.cce.forward_grads``). ``stats`` gets
        "schedule", "predicted_peak_bytes", "predicted_ms" and "why". A number that fits no
        schedule raises ``helpers.cce.schedules.MemoryBudgetError`` with the numbers.

    Host syncs. An eager call with ``stats=None`` reads the device twice: the targets' range flag
    (a bad target raises a ``ValueError``), copied right after the forward's first launch, which
    counts them, and read once the rest is queued, so the host waits for that launch only
    (``helpers.cce.ops.loss_forward``), and the
    "gemm" backward's scale of dC's product, read once its first chunk is queued; class weights
    add one read of their values; "sparse" and "auto"'s probes read the bits' counts, and a
    memory budget's "forward_grads" schedule reads its count and flag once. Under ``torch.compile`` the
    call is the ``cce::linear_cross_entropy`` custom op (one graph, no break), and under compile or
    CUDA graph capture (``torch.cuda.graph``) nothing is read: the targets and the weights' values
    are not checked, "auto" runs "gemm", and ``stats``, "sparse" or a memory budget raise
    (``helpers.cce.ops`` has the list).
    """
    validate_inputs(E, C, x, ignore_index=ignore_index, reduction=reduction, softcap=softcap, bias=bias,
                    leading_dims=True, check_targets=False)  # x's range: the forward checks it
    if not isinstance(shift, bool) or not isinstance(return_lse, bool):
        raise ValueError(f"shift and return_lse must be True or False, got {shift!r} and {return_lse!r}")
    if stats is not None and not isinstance(stats, dict):
        raise ValueError(f"stats must be a dict (filled by the backward) or None, got {type(stats).__name__}")
    memory_budget = check_memory_budget(memory_budget)
    quiet = no_host_sync(E)  # traced by torch.compile or captured by a CUDA graph: no host reads
    check_loss_terms(z_loss, label_smoothing)  # before class weights take the z-loss out of the kernels
    if weight is not None:
        check_weight(weight, C, read_values=not quiet)
    # Class weights (``helpers.cce.class_weights``): the kernels give unweighted rows, or weighted ones
    # with label smoothing (they sum the weighted logits), and no z-loss, which is added from the lse.
    smoothing_weight = weight is not None and label_smoothing > 0
    kernel_z_loss = 0.0 if weight is not None else z_loss
    lse_wanted = return_lse or (weight is not None and bool(z_loss))
    if quiet:
        backward_impl = traceable_backward(backward_impl)
        if stats is not None:
            raise ValueError("stats cannot be filled under torch.compile or CUDA graph capture (the backward counts "
                             "on the host, a device sync); call without stats there")
        if memory_budget not in ("default", "min"):
            raise ValueError(f"memory_budget={memory_budget!r} is not supported under torch.compile or CUDA graph "
                             "capture (its schedule reads the device on the host); only 'min' (which 'default' "
                             "means there)")
        memory_budget = "min"
    lead = x.shape
    x = shift_targets(x, shift, ignore_index)
    E_rows, x_rows = E.reshape(-1, E.shape[-1]), x.reshape(-1)
    grad = torch.is_grad_enabled()
    wants_db = bias is not None and bias.requires_grad
    if torch.compiler.is_compiling():  # the custom op: no plan object can cross into a graph (``helpers.cce.ops``)
        if not (configs is None or isinstance(configs, str)):
            raise ValueError("configs must be a tier's name or None under torch.compile (a CCEConfigs object cannot "
                             f"pass through the custom op's schema), got {type(configs).__name__}")
        check_bias_gradient(backward_impl, grad and wants_db)
        if smoothing_weight:
            raise ValueError("weight with label_smoothing is not supported under torch.compile (the custom op's "
                             "schema carries no class weights); call it eagerly, or use one or the other")
        loss, lse, _, _ = linear_cross_entropy_op(
            E_rows, C, x_rows, bias, ignore_index, "none" if weight is not None else reduction, softcap, kernel_z_loss,
            label_smoothing, temperature, schema_filter_eps(filter_eps, E.dtype, C.shape[0], label_smoothing),
            False if isinstance(sort_vocab, str) and sort_vocab == "auto" else sort_vocab, accumulation, full_c,
            full_e, configs, backward_impl, lse_wanted)
    else:
        plan = plan_call(
            E_rows, C,
            backward_impl=backward_impl,
            configs=configs,
            return_lse=lse_wanted,
            need=(grad and E.requires_grad, grad and C.requires_grad, grad and wants_db),
            wants_db=wants_db,
            filter_eps=filter_eps,
            ignore_index=ignore_index,
            reduction="none" if weight is not None else reduction,  # weighted after the kernels
            softcap=softcap,
            sort_vocab=sort_vocab,
            accumulation=accumulation,
            full_c=full_c,
            full_e=full_e,
            z_loss=kernel_z_loss,
            label_smoothing=label_smoothing,
            temperature=temperature,
        )
        if smoothing_weight:
            plan = replace(plan, class_weight=weight.to(torch.float32).contiguous())
        schedule = None
        # "min" without stats: no model to run. The budget goes on as given: a tier's default that fits no
        # schedule runs "min" where a caller's number raises (``choose_schedule``).
        if resolve_memory_budget(memory_budget, plan.configs, E.device) != "min" or stats is not None:
            schedule = plan_schedule(E_rows, C, bias, plan, memory_budget, return_lse=lse_wanted)
            if stats is not None:
                stats.update(schedule.as_stats())
        if schedule is not None and schedule.tuning():  # recompute under a tight budget (``Schedule.tuning``)
            # (dE made in the forward holds ~1.1 LB, not the budget's: off there)
            plan = replace(plan, configs=plan.configs.tuned(**schedule.tuning(), forward_de=False))
        if schedule is not None and schedule.name == "forward_grads":
            # A "mean" or a "sum" (class weights make the plan's reduction "none": recompute).
            return ForwardGradsFunction.apply(E_rows, C, x_rows, bias, plan, schedule, stats)
        loss, lse = LinearCrossEntropyFunction.apply(E_rows, C, x_rows, bias, plan, stats, not quiet)
    if weight is not None:
        loss = weighted_reduction(loss, x_rows, weight, ignore_index, reduction, weighted=smoothing_weight)
        if z_loss:
            loss = loss + z_loss_term(lse, x_rows, z_loss, ignore_index, reduction)
    if reduction == "none":
        loss = loss.reshape(lead)
    return (loss, lse.reshape(lead)) if return_lse else loss


class LinearCrossEntropy(torch.nn.Module):
    """``linear_cross_entropy`` as a module: the options at construction, the tensors at call.

        loss_fn = LinearCrossEntropy(shift=True, softcap=30.0)
        loss = loss_fn(hidden_states, model.lm_head.weight, labels)
    """

    def __init__(self, **options):
        super().__init__()
        probe = dict(options)
        for name in ("E", "C", "x"):
            if name in probe:
                raise ValueError(f"{name} is given at call time, not to LinearCrossEntropy(...)")
        self.options = probe

    def forward(self, E: torch.Tensor, C: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None):
        return linear_cross_entropy(E, C, x, bias=bias, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
