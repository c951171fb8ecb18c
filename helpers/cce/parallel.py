"""Vocabulary-parallel Cut Cross-Entropy on ``torch.distributed``: C split by rows across the ranks
of a process group, the loss exchanging per-row statistics only, never logits.

Why. Megatron, TransformerEngine and torchtitan shard the lm_head by vocabulary rows: rank r holds
C_r = C[s_r : s_r + V_r] (and b_r), and every rank holds the same E (N, D) and targets x. A
vocabulary-parallel loss must then combine the ranks' logits without gathering them: at the Qwen3
head (V = 151,936) on 8 ranks with N = 131,072 tokens each rank's logit slice is
N * V / 8 * 2 = 5.0 GB in bf16, its gradient as much again. Here each rank runs our forward on its
slice (no logits in memory, ``helpers.cce.forward.cce_forward_rows``) and the ranks exchange, per
row, a few fp32 numbers: one ``all_gather`` of (k, N) with k = 3 (lse_r, the target logit if rank r
owns the target, the slice's lse without the target's column: r = 1 - p(target) to fp32's relative
precision, ``helpers.cce.forward.nontarget_mass``), 4 with label smoothing (+ the slice's logit sum),
6 for the per-token outputs (+ entropy_r, max_r, the target from the max's tile): k * N * 4 bytes a
rank, 1.5 MiB at N = 131,072, k = 3. The backward sends dE once (an ``all_reduce`` of N * D in E's dtype,
256 MiB at the Qwen3 head in bf16), or leaves it to the caller (``dE_reduction="none"``).

The math. With the global lse_i = log sum_r exp(lse_{r, i}) (``torch.logsumexp`` over the gathered
(R, N)) and the target logit z_{i, x_i} from the one rank whose slice holds x_i:

    loss_i = lse_i - (1 - ls) z_{i, x_i} - (ls / V) sum_r sum_{v in r} z_{i, v} + zl lse_i^2
    G_{i, v} = w_i (a_i S_{i, v} - b_i [v = x_i] - c_i / V),  S = exp(z - lse) with the GLOBAL lse

so rank r's backward is our backward on its slice (``helpers.cce.backward``) given the global lse:
[v = x_i] only where x_i is in the slice (its kernels treat a target outside [0, V_r) as "no column
here"), and the smoothing term c_i / V with the global V, not V_r (c scaled by V_r / V, since the
kernels divide by their own C's rows). dC_r and db_r are whole on rank r; dE = sum_r G_r C_r is a
sum over ranks. The per-token outputs merge as ``helpers.cce.forward.merge_row_stats`` merges the
vocabulary splits of one device: the entropy H = sum_r w_r (H_r + lse - lse_r), w_r = exp(lse_r - lse),
the max over ranks, the target is correct when its logit reaches the global max.

Every rank computes the same loss (the same gathered statistics, merged in the same order: the same
bits) and must call backward on it: the backward's ``all_reduce`` is collective.

Refused, with a message: the "sparse" backward (its activity bits bound G with the slice's own lse,
which is not the global one); a process group of one holding a slice of a larger vocabulary; slices
that overlap, leave a gap, pass ``vocab_size``, or differ in D; ranks that disagree on the targets,
N, the options or whether dE is wanted (a checksum of x and of the options is exchanged with the layout, so every rank
raises the same error instead of one rank hanging in a collective). A rank whose own arguments are refused
(a dtype, a shape, a type: ``validate_inputs`` and the rest, run before any collective) raises its error
after the same exchange, and every other rank raises that it refused. Class weights are a replicated
(V,) vector (not sharded): each row's weight is read by every rank.

Reference: ``helpers.spec.reference_loss`` / ``reference_outputs`` on the whole C, and our single-device
loss; ``tests/cce/test_parallel.py`` compares the three on 2, 3 and 4 CPU processes (gloo), and
``scripts/gpu/vocab_parallel.py`` on GPUs (NCCL).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from helpers.cce.backward.atomic import backward_atomic
from helpers.cce.backward.gemm import backward_gemm
from helpers.cce.backward.rows import RowGradient
from helpers.cce.class_weights import check_weight, weighted_reduction
from helpers.cce.forward import cce_forward_rows, log_target_prob, merge_row_stats, nontarget_mass
from helpers.cce.kernels.configs import CCEConfigs
from helpers.cce.options import CCEPlan, plan_call
from helpers.cce.outputs import TokenOutputs
from helpers.cce.shared import shift_targets, vocabulary_order
from helpers.spec import check_ignore_index, raise_for_targets, targets_out_of_range, validate_inputs

DE_REDUCTIONS = ("all_reduce", "none")
# The local targets: a rank's own target columns in [0, V_r); every other row (ignored, or its target
# on another rank) is NO_TARGET, which the local kernels read as ignore_index (Algorithm 1 gives 0)
# and the backward's as "no column here". The global kept mask travels separately (``RowGradient``).
NO_TARGET = -1


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's C rows sit in the vocabulary, checked against every other rank's."""

    group: object  # the torch.distributed process group (None: the default group)
    rank: int
    world: int
    vocab_start: int  # s_r: C_local's row 0 is vocabulary row s_r
    V_local: int  # V_r = C_local.shape[0]
    vocab_size: int  # V, the whole vocabulary

    def local_targets(self, x: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_local, owned), each (N,): x - s_r where this rank holds the target, else NO_TARGET."""
        owned = (x >= self.vocab_start) & (x < self.vocab_start + self.V_local) & (x != ignore_index)
        return torch.where(owned, x - self.vocab_start, NO_TARGET), owned


def local_refusal(check: Callable[[], object]) -> tuple[object, Exception | None]:
    """(what ``check()`` returned, None), or (None, the error it raised): a rank's own argument checks,
    whose outcome ``shard_layout`` exchanges, so that a refusal on one rank is raised on every rank
    instead of leaving the others waiting in a collective."""
    try:
        return check(), None
    except Exception as error:  # whatever a check raises: the other ranks must hear of it
        return None, error


def shard_layout(E, C_local, x, *, vocab_start: int, vocab_size: int, group, ignore_index: int,
                 options: dict, refused: Exception | None = None) -> ShardLayout:
    """Exchange (one ``all_gather`` of 10 integers a rank) and check the ranks' layout: their slices
    must tile [0, vocab_size) with one D, the same N, targets and options; a ``ValueError`` otherwise,
    raised alike on every rank. ``refused``: this rank's own argument checks' error (``local_refusal``):
    raised here after the exchange, and every other rank raises that a rank refused its inputs. Reads the
    gathered integers on the host (one device sync)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_cross_entropy needs torch.distributed initialised "
                           "(dist.init_process_group); for one device use helpers.linear_cross_entropy")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # The exchange's device follows the group's backend on every rank (not E's, which a refused rank may
    # not have): CUDA under NCCL alone, else the CPU (gloo, or a group with both).
    backend = str(dist.get_backend(group))
    exchange = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend and "gloo" not in backend
                else torch.device("cpu"))
    if refused is not None:
        meta = torch.zeros(10, dtype=torch.int64, device=exchange)
        meta[9] = 1
        _gather_meta(meta, group, world)
        raise refused
    device = E.device
    x_flat = x.reshape(-1)
    integer = x.dtype in (torch.int32, torch.int64)
    meta = torch.tensor([
        vocab_start,
        C_local.shape[0] if C_local.dim() == 2 else -1,
        vocab_size,
        C_local.shape[-1] if C_local.dim() == 2 else -1,
        E.shape[-1] if E.dim() >= 1 else -1,
        x_flat.numel(),
        # Whether dE is wanted joins the options: the backward's all_reduce of dE is collective.
        0, zlib.crc32(repr(sorted({**options, "dE_wanted": torch.is_grad_enabled() and E.requires_grad}.items()))
                      .encode()), 0, 0,
    ], dtype=torch.int64, device=device)
    if integer and x_flat.numel():
        # A weighted sum of the targets: ranks fed different batches disagree here.
        position = torch.arange(x_flat.numel(), device=device) % 8191 + 1
        meta[6] = (x_flat.long() * position).sum()
        meta[8] = targets_out_of_range(x_flat, vocab_size, ignore_index).long()
    rows = _gather_meta(meta.to(exchange), group, world)
    refusing = [r for r, row in enumerate(rows) if row[9]]
    if refusing:
        raise ValueError(f"rank(s) {refusing} refused their inputs (the error raised there says why): every rank "
                         "stops here, none runs the loss")
    check_layout(rows, rank)
    if rows[rank][8]:
        raise_for_targets(x_flat, vocab_size, ignore_index, True)
    return ShardLayout(group, rank, world, vocab_start, rows[rank][1], vocab_size)


def _gather_meta(meta: torch.Tensor, group, world: int) -> list[list[int]]:
    if world == 1:
        return [meta.tolist()]
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    return [t.tolist() for t in gathered]


def check_layout(rows: list[list[int]], rank: int) -> None:
    """The layout's checks on every rank's (vocab_start, V_r, vocab_size, D of C_r, D of E, N,
    checksum of x, checksum of the options, targets out of range), in ``shard_layout``'s order."""
    world = len(rows)
    starts, sizes, vocab, d_C, d_E, n_rows, x_sum, opt_sum = (list(c) for c in zip(*[r[:8] for r in rows]))
    V = vocab[rank]
    spans = ", ".join(f"rank {r} holds [{s}, {s + n})" for r, (s, n) in enumerate(zip(starts, sizes)))
    if len(set(vocab)) > 1:
        raise ValueError(f"the ranks disagree on vocab_size: {vocab} (rank by rank)")
    if world == 1 and (starts[0] != 0 or sizes[0] != V):
        raise ValueError(
            f"the process group has one rank, but C_local holds rows [{starts[0]}, {starts[0] + sizes[0]}) of a "
            f"vocabulary of {V}: a sharded head needs the group of all the ranks that hold its slices "
            "(group=...), and an unsharded one helpers.linear_cross_entropy")
    if len(set(d_C)) > 1 or any(a != b for a, b in zip(d_C, d_E)):
        raise ValueError(f"the shards have different D: C_local's D is {d_C}, E's D is {d_E} (rank by rank); "
                         "every rank needs the same E (N, D) and a (V_r, D) slice of C")
    if len(set(n_rows)) > 1 or len(set(x_sum)) > 1:
        raise ValueError(f"the ranks hold different targets (rows {n_rows}, rank by rank, or the same count with "
                         "different values): a vocabulary-parallel loss needs the same E and x on every rank")
    if len(set(opt_sum)) > 1:
        raise ValueError("the ranks were called with different loss options; every rank must pass the same")
    for r, (s, n) in enumerate(zip(starts, sizes)):
        if n < 1 or s < 0 or s + n > V:
            raise ValueError(f"rank {r}'s C_local does not match the declared vocabulary range: {n} rows from "
                             f"vocab_start={s}, but the vocabulary is [0, {V}) and each rank needs at least one row "
                             f"({spans})")
    end = 0
    for s, n in sorted(zip(starts, sizes)):
        if s != end:
            what = f"rows [{end}, {s}) are held by no rank" if s > end else f"rows [{s}, {end}) are held twice"
            raise ValueError(f"the C slices do not tile the vocabulary [0, {V}): {what} ({spans})")
        end = s + n
    if end != V:
        raise ValueError(f"the C slices do not tile the vocabulary [0, {V}): rows [{end}, {V}) are held by no rank "
                         f"({spans})")


def _all_gather_rows(stats: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """(R, k, N): every rank's (k, N) per-row statistics, in rank order."""
    if layout.world == 1:
        return stats[None]
    gathered = [torch.empty_like(stats) for _ in range(layout.world)]
    dist.all_gather(gathered, stats.contiguous(), group=layout.group)
    return torch.stack(gathered)


def _local_options(plan: CCEPlan):
    """The options the local kernels take: NO_TARGET is their ignore_index (module constant)."""
    return replace(plan.options, ignore_index=NO_TARGET)


def _slice_backward(E, C_local, x_local, lse, up: RowGradient, plan: CCEPlan, bias, stats):
    """(dE partial, dC_r, db_r) of this rank's slice given the global lse and row coefficients."""
    o = _local_options(plan)
    configs = plan.configs
    order = vocabulary_order(E, C_local) if o.sort_vocab else None
    if plan.backward_impl == "atomic":
        dE, dC = backward_atomic(E, C_local, x_local, lse, up, order, o, configs.for_dtype(E.dtype)[1], None, None,
                                 stats, bias, plan.need[:2])
        return dE, dC, None
    return backward_gemm(E, C_local, x_local, lse, up, order, o, configs.backward_gemm_for(E.dtype), None, None,
                         stats, bias, plan.need, host=configs.host)


def _reduce_dE(dE, layout: ShardLayout, dE_reduction: str):
    if dE is not None and dE_reduction == "all_reduce" and layout.world > 1:
        dist.all_reduce(dE, group=layout.group)
    return dE


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """(loss, lse) of CE(E C^T + b, x) with C split by rows across ``layout``'s ranks (module doc)."""

    @staticmethod
    def forward(ctx, E, C_local, x, bias_local, plan: CCEPlan, layout: ShardLayout, dE_reduction: str,
                stats=None):
        o = plan.options
        x_local, owned = layout.local_targets(x, o.ignore_index)
        # 1. This slice's statistics: lse_r, z_{i, x_i} where the target is here, sum_{v in r} z_v.
        local = cce_forward_rows(E, C_local, x_local, _local_options(plan), plan.configs, bias=bias_local)
        # The slice's non-target lse: its whole lse where the target is elsewhere (x_local matches nothing).
        rows = [local.lse, torch.where(owned, local.target_logit, 0.0), local.lse_nontarget]
        if o.label_smoothing > 0:
            rows.append(local.logit_sum)
        # 2. [Exchange] every rank's statistics, (R, k, N); merged alike on every rank.
        gathered = _all_gather_rows(torch.stack(rows), layout)
        lse = torch.logsumexp(gathered[:, 0], dim=0)  # lse = log sum_r exp(lse_r)
        target_logit = gathered[:, 1].sum(dim=0)  # one rank's value, zeros elsewhere
        r = nontarget_mass(gathered[:, 2], lse, target_logit)  # 1 - p(target), as the backward takes it
        # 3. The loss of each row, as ``cce_forward`` combines one device's statistics.
        loss_rows = -log_target_prob(target_logit, lse, r) + o.label_smoothing * target_logit
        if o.label_smoothing > 0:
            loss_rows = loss_rows - (o.label_smoothing / layout.vocab_size) * gathered[:, 3].sum(dim=0)
        if o.z_loss:
            loss_rows = loss_rows + o.z_loss * lse * lse
        kept = x != o.ignore_index
        loss_rows = torch.where(kept, loss_rows, 0.0)
        n_kept = kept.sum()
        if o.reduction == "none":
            loss = loss_rows
        elif o.reduction == "sum":
            loss = loss_rows.sum()
        else:
            loss = loss_rows.sum() / n_kept  # NaN when every token is ignored, as torch
        # The backward's rows (``RowGradient.of``): r and the lse's rounding, 0 here (the ranks' lse merged in fp32).
        rows_back = torch.cat([r, torch.zeros_like(r)])
        ctx.save_for_backward(E, C_local, x_local, kept, lse, rows_back, n_kept, bias_local)
        ctx.plan, ctx.layout, ctx.dE_reduction, ctx.stats = plan, layout, dE_reduction, stats
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(n_kept)
        return loss, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_lse):
        E, C_local, x_local, kept, lse, r, n_kept, bias_local = ctx.saved_tensors
        plan, layout = ctx.plan, ctx.layout
        none = (None,) * 8
        if not any(plan.need) or (grad_loss is None and grad_lse is None):
            return none
        o = plan.options
        # As the one-GPU loss's backward (``helpers.cce.ops.loss_backward``): grad_loss itself, a mean divided in the
        # row kernel; the rows kept by the global targets (``kept``, a mask: kept where it is not 0).
        up = RowGradient.of(grad_loss, grad_lse, kept, 0, lse, r, o, n_kept if o.reduction == "mean" else None)
        if o.label_smoothing > 0:
            # The kernels divide c by their own C's rows (V_r); the smoothing spreads over all V.
            scale = torch.tensor([1.0, 1.0, layout.V_local / layout.vocab_size], device=E.device)
            up = replace(up, coef=up.coef * scale[:, None])
        dE, dC, db = _slice_backward(E, C_local, x_local, lse, up, plan, bias_local, ctx.stats)
        return _reduce_dE(dE, layout, ctx.dE_reduction), dC, None, db, None, None, None, None


def _scored_targets(E, C_local, x, bias_local, stats, *, ignore_index, shift, softcap, reduction, dE_reduction,
                    backward_impl, vocab_start, vocab_size):
    """Both entry points' own argument checks (run under ``local_refusal``), and the targets as scored:
    shifted before the layout checks their range, so that a first column the shift drops may hold anything,
    as for ``linear_cross_entropy``."""
    _check_common(dE_reduction, backward_impl, shift, vocab_start, vocab_size)
    check_ignore_index(ignore_index, x)  # before the shift writes it into x
    scored = shift_targets(x, shift, ignore_index)
    validate_inputs(E, C_local, scored, ignore_index=ignore_index, reduction=reduction, softcap=softcap,
                    bias=bias_local, leading_dims=True, check_targets=False)  # x's range: shard_layout's
    if stats is not None and not isinstance(stats, dict):
        raise ValueError(f"stats must be a dict (filled by the backward) or None, got {type(stats).__name__}")
    return scored


def _check_common(dE_reduction, backward_impl, shift, vocab_start, vocab_size):
    for name, value in (("vocab_start", vocab_start), ("vocab_size", vocab_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 < vocab_size < 2**62 or not 0 <= vocab_start < vocab_size:
        raise ValueError(f"vocab_size must be in [1, 2^62) and vocab_start in [0, vocab_size), got vocab_start="
                         f"{vocab_start} and vocab_size={vocab_size}")
    if dE_reduction not in DE_REDUCTIONS:
        raise ValueError(f"dE_reduction must be one of {DE_REDUCTIONS}, got {dE_reduction!r}")
    if backward_impl == "sparse":
        raise ValueError('backward_impl="sparse" is not supported by the vocabulary-parallel loss: its activity bits '
                         "bound G with each slice's own lse, not the global one; use \"gemm\" or \"atomic\"")
    if backward_impl not in ("gemm", "atomic"):  # "auto" would pick per rank, and may pick "sparse"
        raise ValueError(f'backward_impl must be "gemm" or "atomic" for the vocabulary-parallel loss, got {backward_impl!r}')
    if not isinstance(shift, bool):
        raise ValueError(f"shift must be True or False, got {shift!r}")


def _need(E, C_local, bias_local):
    grad = torch.is_grad_enabled()
    return (grad and E.requires_grad, grad and C_local.requires_grad,
            grad and bias_local is not None and bias_local.requires_grad)


def vocab_parallel_cross_entropy(
    E: torch.Tensor,
    C_local: torch.Tensor,
    x: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    bias_local: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    shift: bool = False,
    softcap: float | None = None,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    return_lse: bool = False,
    filter_eps: float | str | None = "auto",
    sort_vocab: bool = False,
    accumulation: str = "fp32",
    full_c: bool = False,
    full_e: bool = False,
    configs: CCEConfigs | str | None = None,
    backward_impl: str = "gemm",
    stats: dict | None = None,
    temperature: float = 1.0,
    weight: torch.Tensor | None = None,
    dE_reduction: str = "all_reduce",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``linear_cross_entropy(E, C, x, ...)`` with C split by rows across the ranks of ``group``:
    this rank holds C_local = C[vocab_start : vocab_start + V_r] (V_r = C_local.shape[0]) and
    bias_local = bias[vocab_start : vocab_start + V_r]; every rank passes the same E (..., D), x and
    options. Returns what ``linear_cross_entropy`` returns, the same on every rank (module doc).

    vocab_size: V, the whole vocabulary; the slices of the group's ranks must tile [0, V) (checked,
        with D, N, x and the options, by one small ``all_gather``: ``shard_layout``).
    group: the process group over the slices' ranks (None: the default group).
    dE_reduction: "all_reduce" (E's gradient is the whole dE = sum_r G_r C_r on every rank) or
        "none" (E's gradient is this rank's partial sum G_r C_r: for a tensor-parallel head whose
        layer all-reduces its input's gradient itself, e.g. Megatron's copy-to-tensor-parallel
        region, which would otherwise count it twice). dC_local and db_local are this rank's whole.
    weight: (V,) class weights, the whole vocabulary's on every rank (not sharded).
    backward_impl: "gemm" or "atomic"; "sparse" is refused (module doc). Everything else: as
        ``linear_cross_entropy``. Every rank must call backward: it is collective.
    """
    def checks():
        scored = _scored_targets(E, C_local, x, bias_local, stats, ignore_index=ignore_index, shift=shift,
                                 softcap=softcap, reduction=reduction, dE_reduction=dE_reduction,
                                 backward_impl=backward_impl, vocab_start=vocab_start, vocab_size=vocab_size)
        if not isinstance(return_lse, bool):
            raise ValueError(f"return_lse must be True or False, got {return_lse!r}")
        if weight is not None:
            # check_weight reads V and the device from its C: the whole vocabulary's, as no rank holds it.
            check_weight(weight, C_local.new_empty(vocab_size, 0))
            if label_smoothing or z_loss:
                raise ValueError("weight with label_smoothing or z_loss is not supported by the vocabulary-parallel "
                                 "loss (each rank would need the weighted logit sums of every shard); use one or the other")
        return scored

    scored, refused = local_refusal(checks)
    options = {} if refused else dict(
        ignore_index=ignore_index, reduction=reduction, shift=shift, softcap=softcap, z_loss=z_loss,
        label_smoothing=label_smoothing, return_lse=return_lse, filter_eps=filter_eps, sort_vocab=sort_vocab,
        accumulation=accumulation, full_c=full_c, full_e=full_e, backward_impl=backward_impl, temperature=temperature,
        dE_reduction=dE_reduction, configs=str(configs), weight=None if weight is None else tuple(weight.shape),
        bias=bias_local is not None, dtype=str(E.dtype))
    x = scored
    layout = shard_layout(E, C_local, x, vocab_start=vocab_start, vocab_size=vocab_size, group=group,
                          ignore_index=ignore_index, options=options, refused=refused)
    lead = x.shape
    E_rows = E.reshape(-1, E.shape[-1])
    plan = plan_call(
        E_rows, C_local, backward_impl=backward_impl, configs=configs, return_lse=return_lse,
        need=_need(E, C_local, bias_local), wants_db=bias_local is not None and bias_local.requires_grad,
        filter_eps=filter_eps, vocabulary=vocab_size, ignore_index=ignore_index,
        reduction="none" if weight is not None else reduction,
        softcap=softcap, sort_vocab=sort_vocab, accumulation=accumulation, full_c=full_c, full_e=full_e,
        z_loss=z_loss, label_smoothing=label_smoothing, temperature=temperature,
    )
    x = x.reshape(-1)
    loss, lse = VocabParallelCrossEntropyFunction.apply(E_rows, C_local, x, bias_local, plan,
                                                        layout, dE_reduction, stats)
    if weight is not None:
        loss = weighted_reduction(loss, x, weight, ignore_index, reduction)
    if reduction == "none":
        loss = loss.reshape(lead)
    return (loss, lse.reshape(lead)) if return_lse else loss


class VocabParallelOutputsFunction(torch.autograd.Function):
    """(logprob, entropy, correct) with C split by rows across ``layout``'s ranks (module doc)."""

    @staticmethod
    def forward(ctx, E, C_local, x, bias_local, plan: CCEPlan, layout: ShardLayout, dE_reduction: str,
                stats=None):
        o = plan.options
        x_local, owned = layout.local_targets(x, o.ignore_index)
        local = cce_forward_rows(E, C_local, x_local, _local_options(plan), plan.configs, bias=bias_local,
                                 outputs=True)
        rows = [local.lse, local.entropy, local.row_max, torch.where(owned, local.target_logit, 0.0),
                local.target_in_tile,  # 0 off this slice (x_local = NO_TARGET matches no tile)
                local.lse_nontarget]  # the slice's whole lse off this slice
        gathered = _all_gather_rows(torch.stack(rows), layout)
        lse, entropy, row_max = merge_row_stats(gathered[:, 0], gathered[:, 1], gathered[:, 2])
        target_logit, target_in_tile = gathered[:, 3].sum(dim=0), gathered[:, 4].sum(dim=0)
        r = nontarget_mass(gathered[:, 5], lse, target_logit)
        kept = x != o.ignore_index
        logprob = torch.where(kept, log_target_prob(target_logit, lse, r), 0.0)
        entropy = torch.where(kept, entropy, 0.0)
        correct = kept & (target_in_tile >= row_max)  # ties: the target among the maxima
        ctx.save_for_backward(E, C_local, x_local, kept, lse, entropy, r, bias_local)
        ctx.plan, ctx.layout, ctx.dE_reduction, ctx.stats = plan, layout, dE_reduction, stats
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(correct)
        return logprob, entropy, correct

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprob, grad_entropy, _grad_correct):
        E, C_local, x_local, kept, lse, entropy, r, bias_local = ctx.saved_tensors
        plan = ctx.plan
        if not any(plan.need) or (grad_logprob is None and grad_entropy is None):
            return (None,) * 8
        up = RowGradient.of_outputs(grad_logprob, grad_entropy, kept, entropy, r)
        dE, dC, db = _slice_backward(E, C_local, x_local, lse, up, plan, bias_local, ctx.stats)
        return _reduce_dE(dE, ctx.layout, ctx.dE_reduction), dC, None, db, None, None, None, None


def vocab_parallel_outputs(
    E: torch.Tensor,
    C_local: torch.Tensor,
    x: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    bias_local: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    softcap: float | None = None,
    temperature: float = 1.0,
    filter_eps: float | str | None = "auto",
    configs: CCEConfigs | str | None = None,
    backward_impl: str = "gemm",
    stats: dict | None = None,
    dE_reduction: str = "all_reduce",
) -> TokenOutputs:
    """``linear_cross_entropy_outputs`` (per-token logprob, entropy, correct) with C split by rows
    across the ranks of ``group``; the sharding arguments and ``dE_reduction`` as
    ``vocab_parallel_cross_entropy``'s, the rest as ``linear_cross_entropy_outputs``'s."""
    scored, refused = local_refusal(lambda: _scored_targets(
        E, C_local, x, bias_local, stats, ignore_index=ignore_index, shift=shift, softcap=softcap, reduction="none",
        dE_reduction=dE_reduction, backward_impl=backward_impl, vocab_start=vocab_start, vocab_size=vocab_size))
    options = {} if refused else dict(
        ignore_index=ignore_index, shift=shift, softcap=softcap, temperature=temperature, filter_eps=filter_eps,
        configs=str(configs), backward_impl=backward_impl, dE_reduction=dE_reduction, bias=bias_local is not None,
        dtype=str(E.dtype), outputs=True)
    x = scored
    layout = shard_layout(E, C_local, x, vocab_start=vocab_start, vocab_size=vocab_size, group=group,
                          ignore_index=ignore_index, options=options, refused=refused)
    lead = x.shape
    E_rows = E.reshape(-1, E.shape[-1])
    plan = plan_call(
        E_rows, C_local, backward_impl=backward_impl, configs=configs, return_lse=False,
        need=_need(E, C_local, bias_local), wants_db=bias_local is not None and bias_local.requires_grad,
        filter_eps=filter_eps, vocabulary=vocab_size, ignore_index=ignore_index, softcap=softcap,
        temperature=temperature,
    )
    x = x.reshape(-1)
    logprob, entropy, correct = VocabParallelOutputsFunction.apply(E_rows, C_local, x,
                                                                   bias_local, plan, layout, dE_reduction, stats)
    return TokenOutputs(logprob.reshape(lead), entropy.reshape(lead), correct.reshape(lead))
