"""Per-token outputs of one pass over the logits, for RL and evaluation: each token's log-probability
of its target, the entropy of its softmax (both differentiable) and whether the target is the argmax.

Why. A policy-gradient trainer (GRPO, PPO) needs log p(x_i) under a temperature and an entropy bonus,
per token; the naive path forms the (N, V) logits, their softmax and its gradient. Here the forward
walks the logits once, tile by tile (``lse_forward_kernel`` with ROW_STATS: one more running sum for
the entropy, rescaled like the sum-exp), and the backward rebuilds them as the loss's does, with one
more row coefficient in G (``gradient_tile``'s ENTROPY). Memory: the N-sized outputs, and the loss's
backward (no N x V buffer beyond its G chunks).

The math, for z = cap(E C^T + b) / tau (the soft cap first, then the temperature, as RL samplers do)
and S = softmax(z):

    logprob_i = z_{i, x_i} - lse_i,                       d/dz_v = [v = x_i] - S_v
    H_i = lse_i - sum_v S_v z_v = -sum_v S_v log S_v,      d/dz_v = -S_v (z_v - lse_i + H_i)
    correct_i = z_{i, x_i} = max_v z_{i, v}                (not differentiable)

times 1 / tau (and the soft cap's 1 - (z_cap / s)^2) on the way to E C^T. Ties: a token counts as
correct when its target is among the row's largest logits (torch.argmax would pick the lowest index;
ties of real logits are rare, and this rule does not depend on the vocabulary's order). The
comparison is made on the tempered logits, in fp32, the target's logit taken from the same tile
product as the maximum. Reference: ``helpers.spec.reference_outputs``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from helpers.cce.kernels.configs import CCEConfigs
from helpers.cce.shared import no_host_sync, shift_targets
from helpers.cce.ops import (
    linear_cross_entropy_outputs_op,
    outputs_backward,
    outputs_forward,
    schema_filter_eps,
    traceable_backward,
)
from helpers.cce.options import CCEPlan, check_bias_gradient, plan_call
from helpers.spec import validate_inputs


class TokenOutputs(NamedTuple):
    """Per-token outputs, each of x's shape: ``logprob`` (fp32, differentiable; 0 at ignored tokens),
    ``entropy`` (fp32, differentiable; 0 at ignored tokens), ``correct`` (bool; False at ignored)."""

    logprob: torch.Tensor
    entropy: torch.Tensor
    correct: torch.Tensor


class LinearOutputsFunction(torch.autograd.Function):
    """(logprob, entropy, correct) of E (N, D), C (V, D), x (N,) by a ``CCEPlan``; the backward
    recomputes the logits (it saves the lse, the entropy and r only). Its host functions, and the custom
    ops ``torch.compile`` traces instead: ``helpers.cce.ops``."""

    @staticmethod
    def forward(ctx, E, C, x, bias, plan: CCEPlan, stats=None, check_targets=True):
        logprob, entropy, lse, correct, r = outputs_forward(E, C, x, bias, plan, check_targets=check_targets)
        ctx.save_for_backward(E, C, x, lse, entropy, r, bias)
        ctx.plan, ctx.stats = plan, stats
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(correct)
        return logprob, entropy, correct

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprob, grad_entropy, _grad_correct):
        E, C, x, lse, entropy, r, bias = ctx.saved_tensors
        dE, dC, db = outputs_backward(E, C, x, lse, entropy, r, bias, grad_logprob, grad_entropy, ctx.plan, ctx.stats)
        return dE, dC, None, db, None, None, None


def linear_cross_entropy_outputs(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    softcap: float | None = None,
    temperature: float = 1.0,
    filter_eps: float | str | None = "auto",
    configs: CCEConfigs | str | None = None,
    backward_impl: str = "gemm",
    stats: dict | None = None,
) -> TokenOutputs:
    """Each token's log-probability of its target, its softmax's entropy and whether its target is
    the argmax, under the logits z = softcap(E C^T + bias) / temperature, in one pass and without
    the (N, V) logits (module doc for the math and the tie rule).

    E (..., D), C (V, D), x integer targets of E's leading shape, bias (V,) or None: as
    ``linear_cross_entropy``. Returns ``TokenOutputs(logprob, entropy, correct)``, each of x's shape.
    ``logprob`` and ``entropy`` are differentiable (to E, C and bias): e.g. a GRPO step's
    ``-(ratio * advantage) - beta * entropy``, masked and reduced as the trainer likes; -logprob is
    ``linear_cross_entropy(..., reduction="none")``. Ignored tokens (``ignore_index``, and the last
    position with ``shift``) get logprob 0, entropy 0 and correct False, and no gradient.

    temperature: tau > 0, dividing the soft-capped logits. softcap, shift, filter_eps, configs,
    stats: as ``linear_cross_entropy`` (no z-loss or label smoothing: these are not a loss).
    backward_impl: "gemm" (the default) or "atomic" (no bias gradient); "sparse" runs "gemm" (its
    activity bits do not cover the entropy's term: ``stats["fallback"]`` says so).
    Host syncs, ``torch.compile`` and CUDA graph capture: as ``linear_cross_entropy`` (the targets'
    range after the forward's kernels, dC's scale in the backward; none under compile or capture, where the custom op
    ``cce::linear_cross_entropy_outputs`` runs and stats are refused).
    """
    validate_inputs(E, C, x, ignore_index=ignore_index, softcap=softcap, bias=bias, leading_dims=True,
                    check_targets=False)
    if not isinstance(shift, bool):
        raise ValueError(f"shift must be True or False, got {shift!r}")
    if stats is not None and not isinstance(stats, dict):
        raise ValueError(f"stats must be a dict (filled by the backward) or None, got {type(stats).__name__}")
    if backward_impl == "sparse":
        backward_impl = "gemm"
        if stats is not None:
            stats["fallback"] = "the sparse backward's activity bits do not cover the entropy's gradient"
    quiet = no_host_sync(E)  # traced by torch.compile or captured by a CUDA graph: no host reads
    if quiet and stats is not None:
        raise ValueError("stats cannot be filled under torch.compile or CUDA graph capture (the backward counts "
                         "on the host, a device sync); call without stats there")
    backward_impl = traceable_backward(backward_impl) if quiet else backward_impl
    lead = x.shape
    x = shift_targets(x, shift, ignore_index)
    E_rows, x_rows = E.reshape(-1, E.shape[-1]), x.reshape(-1)
    grad = torch.is_grad_enabled()
    wants_db = bias is not None and bias.requires_grad
    if torch.compiler.is_compiling():  # the custom op (``helpers.cce.ops``)
        if not (configs is None or isinstance(configs, str)):
            raise ValueError("configs must be a tier's name or None under torch.compile (a CCEConfigs object cannot "
                             f"pass through the custom op's schema), got {type(configs).__name__}")
        check_bias_gradient(backward_impl, grad and wants_db)
        logprob, entropy, _, correct, _ = linear_cross_entropy_outputs_op(
            E_rows, C, x_rows, bias, ignore_index, softcap, temperature, schema_filter_eps(filter_eps, E.dtype, C.shape[0]),
            configs, backward_impl)
    else:
        plan = plan_call(
            E_rows, C,
            backward_impl=backward_impl,
            configs=configs,
            return_lse=False,
            need=(grad and E.requires_grad, grad and C.requires_grad, grad and wants_db),
            wants_db=wants_db,
            filter_eps=filter_eps,
            ignore_index=ignore_index,
            softcap=softcap,
            temperature=temperature,
        )
        logprob, entropy, correct = LinearOutputsFunction.apply(E_rows, C, x_rows, bias, plan, stats, not quiet)
    return TokenOutputs(logprob.reshape(lead), entropy.reshape(lead), correct.reshape(lead))
