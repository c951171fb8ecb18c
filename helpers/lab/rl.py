"""An RL step without the logits: a GRPO/PPO-style clipped policy-gradient loss from our per-token
outputs, its reference on full logits, group-normalised advantages, and a tiny policy that GRPO
trains on the CPU (notebook 06, tests/lab/test_rl.py).

Why. A policy-gradient trainer needs, per completion token, log pi(x_t) under the sampling
temperature (for the importance ratio against the sampling policy, and for the KL to a reference
policy) and, for an entropy bonus, the entropy of pi(. | context); both differentiable. The naive
path forms the (N, V) logits, their log-softmax and softmax, and keeps them for the backward:
several fp32 N x V tensors (notebook 06 counts them). ``linear_cross_entropy_outputs`` gives both
per token without them; the objective below is O(N) arithmetic on top.

The objective, per completion token t of sequence i (TRL's GRPOTrainer, DAPO's two clip ranges,
verl's entropy bonus), with A_i the sequence's advantage:

    r = exp(logp - logp_old)                                  importance ratio (logp_old detached)
    pg = -min(r A_i, clip(r, 1 - eps_low, 1 + eps_high) A_i)  clipped surrogate
    kl = exp(logp_ref - logp) - (logp_ref - logp) - 1         k3 estimator of KL(pi || pi_ref), >= 0
    l_t = pg + kl_coef * kl - entropy_coef * H                what is minimised

then aggregated over the completion mask (``AGGREGATIONS``):

- "token": sum of l_t over every kept token of the batch / their number. TRL's ``loss_type="bnpo"``
  (and "dapo" on one process), verl's "token-mean", DeepSpeed-Chat's masked mean.
- "sequence": each sequence's mean over its kept tokens, then the mean over sequences. TRL's
  ``loss_type="grpo"`` (the GRPO paper's 1/|o_i|), verl's "seq-mean-token-mean".
- "constant": sum of l_t over kept tokens / (B * max_tokens), max_tokens the padded completion
  length by default. TRL's ``loss_type="dr_grpo"`` (Dr. GRPO; TRL divides by its
  ``max_completion_length``: pass that as max_tokens), verl's "seq-mean-token-sum-norm".

Not here: TRL's "dapo" across processes (its normaliser is the token count of the global batch,
which needs a collective), GSPO's sequence-level ratio, PPO's value loss and dual clip. TRL calls
the KL coefficient ``beta``; verl calls the entropy coefficient ``entropy_coeff``. With
``old_logprob=None`` (one gradient step per generation, TRL's default) the ratio is 1 and only its
gradient, A * d logp, acts.
"""

from __future__ import annotations

import contextlib
import copy
import math
import functools
from typing import NamedTuple

import torch
from torch import nn

from helpers.cce import linear_cross_entropy_outputs
from helpers.cce.shared import no_host_sync
from helpers.spec import reference_logits

AGGREGATIONS = ("token", "sequence", "constant")
ADVANTAGE_SCALES = ("std", "none")


class PolicyLoss(NamedTuple):
    """``loss``: the scalar to minimise (differentiable). Per token, each of x's shape (B, T) and
    detached: ``logprob`` (0 at masked tokens; before the first update, the sampling policy's: the
    ``old_logprob`` of the iterations after it), ``entropy``,
    ``ratio`` (1 at masked tokens), ``clipped`` (bool: the clipped term was the smaller, so the token
    gives no gradient through the ratio) and ``kl`` (the k3 estimate, 0 without a reference)."""

    loss: torch.Tensor
    logprob: torch.Tensor
    entropy: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor

    def metrics(self, mask: torch.Tensor) -> dict[str, float]:
        """Means over the kept tokens, as a trainer logs them (a host sync: once a step)."""
        kept = mask.bool()
        count = max(1, int(kept.sum()))
        means = {name: float(getattr(self, name)[kept].float().sum()) / count
                 for name in ("entropy", "ratio", "clipped", "kl")}
        return {"loss": float(self.loss.detach()), **means}


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: str = "std", eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, divided by the group's standard
    deviation (``scale="std"``, TRL's default, Bessel-corrected as torch.std is, plus ``eps``) or not
    (``scale="none"``: Dr. GRPO, TRL's ``scale_rewards=False``). rewards (B,), the ``group_size``
    completions of each prompt consecutive (TRL's layout); returns (B,) float32. A group whose
    rewards are all equal gets advantages 0: it carries no signal."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor (B,), one per completion, got "
                         f"{tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__}")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2 (completions per prompt), got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards must hold whole groups: {rewards.numel()} rewards is not a multiple of "
                         f"group_size={group_size}")
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if scale == "std" and not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < math.inf):
        raise ValueError(f"eps must be a finite number > 0 (added to each group's standard deviation, so that a "
                         f"group of equal rewards gets advantages 0, not NaN), got {eps!r}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "std":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


# ---------------------------------------------------------------------------------------------
# The objective, from per-token log-probabilities and entropies
# ---------------------------------------------------------------------------------------------


def _check_objective_inputs(x, advantages, mask, old_logprob, ref_logprob, eps_low, eps_high, kl_coef,
                            entropy_coef, aggregation, max_tokens, x_name="x", what="the completion tokens"):
    """Raise naming the argument and what was expected; ``x`` (named ``x_name``) gives (B, T)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{x_name} must be {what}, (B, T), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    B, T = x.shape
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in ((B,), (B, T)):
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(f"advantages must be (B,) = ({B},), one per sequence, or {x_name}'s shape ({B}, {T}), "
                         f"got {got}")
    for name, t in (("mask", mask), ("old_logprob", old_logprob), ("ref_logprob", ref_logprob)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, T)):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have {x_name}'s shape ({B}, {T}) or be None, got {got}")
    for name, t in (("advantages", advantages), ("old_logprob", old_logprob), ("ref_logprob", ref_logprob)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    for name, t in (("advantages", advantages), ("mask", mask), ("old_logprob", old_logprob),
                    ("ref_logprob", ref_logprob)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on {x_name}'s device ({x.device}), got {t.device}")
    if not (isinstance(eps_low, (int, float)) and 0 <= eps_low < 1):
        raise ValueError(f"eps_low must be in [0, 1) (the ratio's floor is 1 - eps_low), got {eps_low!r}")
    if not (isinstance(eps_high, (int, float)) and eps_high >= 0):
        raise ValueError(f"eps_high must be >= 0 (the ratio's ceiling is 1 + eps_high), got {eps_high!r}")
    for name, v in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef), ("eps_high", eps_high)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0 (a penalty), got {kl_coef!r}")
    if kl_coef and ref_logprob is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprob: the reference policy's per-token log-probabilities")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS} (module doc: TRL's and verl's names), "
                         f"got {aggregation!r}")
    if max_tokens is not None and (aggregation != "constant" or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens is the \"constant\" aggregation's normaliser per sequence, a positive int; "
                         f"got {max_tokens!r} with aggregation={aggregation!r}")


def policy_objective(
    logprob: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logprob: torch.Tensor | None = None,
    ref_logprob: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    aggregation: str = "token",
    max_tokens: int | None = None,
) -> PolicyLoss:
    """The clipped objective (module doc) from per-token ``logprob`` and ``entropy`` (B, T) of the
    current policy, however they were computed: ours (``grpo_loss``) or any other. ``mask`` (B, T)
    (bool, or nonzero) at the completion tokens that count; the other arguments as ``grpo_loss``'s."""
    _check_objective_inputs(logprob, advantages, mask, old_logprob, ref_logprob, eps_low, eps_high, kl_coef,
                            entropy_coef, aggregation, max_tokens, "logprob", "per-token log-probabilities")
    if not logprob.is_floating_point():
        raise TypeError(f"logprob must be a floating-point tensor, got {logprob.dtype}")
    if mask is None:
        raise ValueError(f"mask must be given, (B, T) = {tuple(logprob.shape)}: True at the tokens that count")
    if not isinstance(entropy, torch.Tensor) or entropy.shape != logprob.shape:
        raise ValueError(f"entropy and mask must have logprob's shape {tuple(logprob.shape)}, got "
                         f"{tuple(getattr(entropy, 'shape', ()))} and {tuple(getattr(mask, 'shape', ()))}")
    kept = mask.bool()
    old = logprob.detach() if old_logprob is None else old_logprob.detach().to(logprob.dtype)
    A = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logprob.dtype)
    # Masked tokens get a log-ratio of 0, not whatever logp_old held there: exp of a large one would
    # be inf, and inf * 0 in the backward is NaN even where torch.where drops the value.
    log_ratio = torch.where(kept, logprob - old, 0.0)
    ratio = log_ratio.exp()
    unclipped, clipped = ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logprob)
    if ref_logprob is not None:
        delta = torch.where(kept, ref_logprob.detach().to(logprob.dtype) - logprob, 0.0)
        kl = delta.exp() - delta - 1
        per_token = per_token + kl_coef * kl
    if entropy_coef:
        per_token = per_token - entropy_coef * entropy
    per_token = torch.where(kept, per_token, 0.0)
    B, T = per_token.shape
    if aggregation == "token":
        loss = per_token.sum() / kept.sum().clamp(min=1)
    elif aggregation == "sequence":
        loss = (per_token.sum(dim=1) / kept.sum(dim=1).clamp(min=1)).mean()
    else:
        loss = per_token.sum() / (B * (max_tokens or T))
    return PolicyLoss(loss, logprob.detach(), entropy.detach(), ratio.detach(),
                      kept & (clipped < unclipped), kl.detach())


# ---------------------------------------------------------------------------------------------
# Ours: from hidden states and the head, without the logits
# ---------------------------------------------------------------------------------------------


def grpo_loss(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    old_logprob: torch.Tensor | None = None,
    ref_logprob: torch.Tensor | None = None,
    temperature: float = 1.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    aggregation: str = "token",
    max_tokens: int | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    filter_eps: float | str | None = "auto",
    configs=None,
) -> PolicyLoss:
    """The clipped policy-gradient loss (module doc) of completions x (B, T) whose hidden states
    are E (B, T, D) (the states that predict each x_t: already shifted), under the head C (V, D)
    at ``temperature`` (the sampler's), without the (B T, V) logits.

    advantages: (B,) per sequence (``group_advantages``) or (B, T) per token. mask: (B, T), True
    (or nonzero) at the completion tokens that count (None: all); x may hold anything at the
    others (padding). old_logprob: the sampling policy's per-token log-probabilities (B, T),
    detached (None: on-policy, the ratio is 1). ref_logprob: the reference policy's (B, T), for the
    k3 KL penalty weighted by ``kl_coef``. entropy_coef: the entropy bonus's weight. aggregation,
    max_tokens: ``AGGREGATIONS``. bias, softcap, filter_eps, configs: ``linear_cross_entropy_outputs``'s.
    Gradients flow to E, C (and bias) through logp and H.
    """
    if not isinstance(E, torch.Tensor) or not isinstance(x, torch.Tensor) or E.dim() != 3 or E.shape[:2] != x.shape:
        raise ValueError(f"E must be the hidden states (B, T, D) of the completions x (B, T), got E "
                         f"{tuple(getattr(E, 'shape', ()))} and x {tuple(getattr(x, 'shape', ()))}")
    _check_objective_inputs(x, advantages, mask, old_logprob, ref_logprob, eps_low, eps_high, kl_coef,
                            entropy_coef, aggregation, max_tokens)
    kept = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    ignore_index = -100
    # Masked tokens go to the kernels as ignored targets: no work, logp 0 and no gradient.
    targets = torch.where(kept, x, ignore_index)
    # A kept -100 would pass as one of them (logp 0, ratio 1, no gradient, yet counted in the objective):
    # flagged on the device here, read after the kernels are queued (the loss's own range check, which
    # refuses every other kept id outside [0, V), has waited for the device by then), and not under
    # torch.compile or graph capture, which read nothing on the host.
    kept_ignored = None if no_host_sync(E) else (kept & (x == ignore_index)).any()
    out = linear_cross_entropy_outputs(E, C, targets, bias=bias, ignore_index=ignore_index, softcap=softcap,
                                       temperature=temperature, filter_eps=filter_eps, configs=configs)
    if kept_ignored is not None and kept_ignored.item():
        where = tuple((kept & (x == ignore_index)).nonzero()[0].tolist())
        raise ValueError(f"x must hold token ids in [0, {C.shape[0]}) wherever mask is True (the tokens that count); "
                         f"got {ignore_index} at {where}")
    return policy_objective(out.logprob, out.entropy, advantages, kept, old_logprob=old_logprob,
                            ref_logprob=ref_logprob, eps_low=eps_low, eps_high=eps_high, kl_coef=kl_coef,
                            entropy_coef=entropy_coef, aggregation=aggregation, max_tokens=max_tokens)


# ---------------------------------------------------------------------------------------------
# The same loss on the full logits: the naive path, and the float64 reference
# ---------------------------------------------------------------------------------------------


def logits_grpo_loss(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    old_logprob: torch.Tensor | None = None,
    ref_logprob: torch.Tensor | None = None,
    temperature: float = 1.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    aggregation: str = "token",
    max_tokens: int | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    dtype: torch.dtype | None = None,
) -> PolicyLoss:
    """``grpo_loss`` computed from the full (B, T, V) logits, written as TRL writes it (logits /
    temperature, log-softmax, gather, entropy from the softmax; the per-token loss, then the mask
    and the normaliser), independently of ``policy_objective``.

    ``dtype`` None: the naive path a trainer runs, E C^T in the inputs' dtype, then fp32 (what
    notebook 06 and scripts/gpu/rl_step.py measure ours against). ``dtype=torch.float64``: the
    reference, inputs upcast before the product (``helpers.spec.reference_logits``), which the
    tests hold ours to. Arguments as ``grpo_loss``'s.
    """
    _check_objective_inputs(x, advantages, mask, old_logprob, ref_logprob, eps_low, eps_high, kl_coef,
                            entropy_coef, aggregation, max_tokens)
    completion_mask = (torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool())
    if dtype is None:  # (B, T, V) in the inputs' dtype, then a second copy in fp32
        z = (E @ C.T if bias is None else E @ C.T + bias).float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
    else:
        z = reference_logits(E.reshape(-1, E.shape[-1]), C, softcap, dtype, bias, temperature).view(*x.shape, -1)
    log_p = torch.log_softmax(z, dim=-1)
    per_token_logps = log_p.gather(-1, torch.where(completion_mask, x, 0).long()[..., None])[..., 0]
    entropies = -(log_p.exp() * log_p).sum(dim=-1)
    old = per_token_logps.detach() if old_logprob is None else old_logprob.to(z.dtype)
    log_importance_weights = torch.where(completion_mask, per_token_logps - old, 0.0)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).to(z.dtype)
    per_token_loss1 = coef_1 * adv
    per_token_loss2 = coef_2 * adv
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    per_token_kl = torch.zeros_like(per_token_logps)
    if ref_logprob is not None:
        ref = torch.where(completion_mask, ref_logprob.to(z.dtype), per_token_logps.detach())
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        per_token_loss = per_token_loss + kl_coef * per_token_kl
    per_token_loss = per_token_loss - entropy_coef * entropies
    m = completion_mask.to(z.dtype)
    if aggregation == "sequence":  # TRL "grpo"
        loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif aggregation == "token":  # TRL "bnpo"
        loss = (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    else:  # TRL "dr_grpo"
        loss = (per_token_loss * m).sum() / (per_token_loss.size(0) * (max_tokens or x.shape[1]))
    return PolicyLoss(loss, (per_token_logps * m).detach(), (entropies * m).detach(),
                      torch.where(completion_mask, coef_1, 1.0).detach(),
                      completion_mask & (per_token_loss2 < per_token_loss1), (per_token_kl * m).detach())


# ---------------------------------------------------------------------------------------------
# The fused peer: Liger-Kernel's GRPO loss, on the same objective
# ---------------------------------------------------------------------------------------------

# Our aggregations as Liger-Kernel's (TRL's) loss types.
LIGER_LOSS_TYPES = {"token": "bnpo", "sequence": "grpo", "constant": "dr_grpo"}


def liger_grpo_loss(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    old_logprob: torch.Tensor | None = None,
    ref_logprob: torch.Tensor | None = None,
    temperature: float = 1.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    aggregation: str = "token",
    max_tokens: int | None = None,
    chunk_size: int = 1,
    allow_tf32: bool | None = None,
) -> PolicyLoss:
    """Liger-Kernel's ``LigerFusedLinearGRPOLoss`` on ``grpo_loss``'s objective: the same clip, k3 KL and
    aggregation (``LIGER_LOSS_TYPES``). Its rows go through the head a chunk at a time in PyTorch (the
    loss's arithmetic compiled on a GPU). It has no entropy bonus (entropy_coef must be 0) and per-sequence
    advantages only, and gives no per-token outputs: the PolicyLoss holds the loss, its other fields None.

    chunk_size: sequences a chunk (Liger's and TRL's default, 1). allow_tf32: TF32 for the call's fp32
    matrix products, on or off for the call and restored after it (None: left as the process has it;
    PyTorch's default is off, and so is every timed script's): Liger forms each chunk's dE and dC from fp32
    copies of its operands, and computes the gradients inside the forward, so the setting covers them.
    ``PATHS["liger_tuned"]`` sets both."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (sequences a chunk), got {chunk_size!r}")
    if entropy_coef:
        raise ValueError(f"Liger-Kernel's GRPO loss has no entropy bonus: entropy_coef must be 0, got {entropy_coef}")
    _check_objective_inputs(x, advantages, mask, old_logprob, ref_logprob, eps_low, eps_high, kl_coef,
                            entropy_coef, aggregation, max_tokens)
    if advantages.dim() != 1:
        raise ValueError(f"Liger-Kernel's GRPO loss takes one advantage per sequence, (B,), got {tuple(advantages.shape)}")
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(
        beta=kl_coef, compiled=E.device.type == "cuda", use_ref_model=ref_logprob is not None and kl_coef != 0,
        epsilon_low=eps_low, epsilon_high=eps_high, loss_type=LIGER_LOSS_TYPES[aggregation],
        max_completion_length=max_tokens or x.shape[1], temperature=temperature, chunk_size=chunk_size)
    kept = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    # What a trainer hands it at padding (a valid id, finite log-probabilities): it gathers x at every
    # position and multiplies the masked terms by 0, so an out-of-range id would fail and an inf ratio
    # (a huge stored logp_old there) would make the loss NaN.
    x = torch.where(kept, x, 0)
    old_logprob, ref_logprob = (None if t is None else torch.where(kept, t, 0.0) for t in (old_logprob, ref_logprob))
    with matmul_tf32(allow_tf32):
        loss, _ = loss_fn(E, C, x, kept.int(), advantages, ref_per_token_logps=ref_logprob,
                          old_per_token_logps=old_logprob)
    return PolicyLoss(loss, None, None, None, None, None)


@contextlib.contextmanager
def matmul_tf32(on: bool | None):
    """CUDA's fp32 matrix products with TF32 (True) or without (False) inside the block, restored after it;
    None: untouched. Through ``fp32_precision`` where torch has it (2.9 on: mixing it with the older
    ``allow_tf32`` flag raises), else ``allow_tf32``."""
    if on is None:
        yield
        return
    matmul = torch.backends.cuda.matmul
    name, value = (("fp32_precision", "tf32" if on else "ieee") if hasattr(matmul, "fp32_precision")
                   else ("allow_tf32", bool(on)))
    before = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, before)


def liger_reason() -> str | None:
    """Why Liger-Kernel's GRPO loss cannot run here (None: it can: it is PyTorch, on any device and dtype)."""
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except ImportError as error:
        return f"liger-kernel is not installed ({error})"
    return None


# ---------------------------------------------------------------------------------------------
# One step of a policy head: ours, the naive path or Liger's (notebook 06, scripts/gpu/rl_step.py)
# ---------------------------------------------------------------------------------------------

# "liger" as TRL's GRPOTrainer calls it (its defaults); "liger_tuned" with two non-default settings that cut
# its time without changing its algorithm: 4 sequences a chunk (fewer chunks and fewer passes over its fp32
# dC buffer) and TF32 for its fp32 products (its dE and dC are fp32 matrix products, which without TF32 run
# at a tenth of bf16's rate: most of its time at the Qwen3 head, read from its source).
PATHS = {"ours": grpo_loss, "naive": logits_grpo_loss, "liger": liger_grpo_loss,
         "liger_tuned": functools.partial(liger_grpo_loss, chunk_size=4, allow_tf32=True)}
# What a path cannot do, taken out of the step's options for it: Liger has no entropy bonus.
PATH_OPTIONS = {"liger": dict(entropy_coef=0.0), "liger_tuned": dict(entropy_coef=0.0)}
# Why a path cannot run here, for the paths that may not (None: it can).
PATH_REASONS = {"liger": liger_reason, "liger_tuned": liger_reason}


def path_reason(path: str) -> str | None:
    """Why ``path`` (``PATHS``) cannot run here; None where it can."""
    return PATH_REASONS[path]() if path in PATH_REASONS else None
# A GRPO step as DAPO-style trainers run it: a sampling temperature, the wider upper clip, a small KL
# to the reference and an entropy bonus, so that every term's gradient is in what is measured.
STEP_OPTIONS = dict(temperature=0.7, eps_low=0.2, eps_high=0.28, kl_coef=0.04, entropy_coef=0.001,
                    aggregation="token")


class StepInputs(NamedTuple):
    """A GRPO step's inputs: E (B, T, D) and C (V, D) requiring gradients, x and mask (B, T),
    advantages (B,), old_logprob and ref_logprob (B, T)."""

    E: torch.Tensor
    C: torch.Tensor
    x: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprob: torch.Tensor
    ref_logprob: torch.Tensor


def step_inputs(B: int, T: int, V: int, D: int, dtype: torch.dtype, device, seed: int = 0) -> StepInputs:
    """Random hidden states and head (entries ~ N(0, 1/sqrt(D)): logits of unit scale, a flat
    softmax, as at the start of training), B completions of uniform random tokens and random
    lengths (from half of T to T), advantages from random rewards in groups of up to 8, and the
    sampling and reference policies' log-probabilities: the current ones (ours, no gradient) plus
    noise, so that some ratios leave the clip range."""
    g = torch.Generator().manual_seed(seed)
    E = (torch.randn(B, T, D, generator=g) / D**0.25).to(device, dtype).requires_grad_(True)
    C = (torch.randn(V, D, generator=g) / D**0.25).to(device, dtype).requires_grad_(True)
    x = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint((T + 1) // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    group = next(size for size in (8, 4, 2, B) if B % size == 0)
    advantages = group_advantages(torch.rand(B, generator=g), group)
    noise = torch.randn(2, B, T, generator=g)
    x, mask, advantages, noise = (t.to(device) for t in (x, mask, advantages, noise))
    with torch.no_grad():
        logprob = linear_cross_entropy_outputs(E, C, torch.where(mask, x, -100),
                                               temperature=STEP_OPTIONS["temperature"]).logprob
    return StepInputs(E, C, x, mask, advantages, logprob + 0.3 * noise[0], logprob + 0.2 * noise[1])


def fresh_compile(path: str) -> None:
    """Before a Liger path on a GPU: the compiler's caches dropped (``torch._dynamo.reset``), so that its
    compiled chunk loss compiles once for this shape, statically. Recompiled for a new shape, chunk size or
    TF32 setting with dynamic sizes, it failed inside torch.compile on torch 2.11 ("sources must not be empty
    for symbol s10", two H100 runs at 4,096 tokens after the gate's shape). Drops every compiled function
    of the process, ours included: their next call compiles again."""
    if path.startswith("liger") and torch.cuda.is_available():
        torch._dynamo.reset()


def head_step(path: str, inputs: StepInputs, **options):
    """The step of ``path`` (``PATHS``) as a callable: the GRPO loss of ``inputs`` (``STEP_OPTIONS``,
    less what the path cannot do (``PATH_OPTIONS``), updated by ``options``), then dE and dC (returned,
    not accumulated, so that every call starts from the same memory)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}")
    loss_fn, options = PATHS[path], {**STEP_OPTIONS, **PATH_OPTIONS.get(path, {}), **options}
    fresh_compile(path)

    def step():
        out = loss_fn(inputs.E, inputs.C, inputs.x, inputs.advantages, inputs.mask, old_logprob=inputs.old_logprob,
                      ref_logprob=inputs.ref_logprob, **options)
        return torch.autograd.grad(out.loss, (inputs.E, inputs.C))

    return step


def check_against_float64(inputs: StepInputs, paths=None, **options) -> dict:
    """Each of ``paths`` (default: every path that can run here) against the float64 reference on full
    logits, on ``inputs``: the relative errors of what it gives (the per-token log-probabilities and
    entropies, dE and dC; Liger's loss gives dE and dC), the gate's bound for each
    (``helpers.compare.verdicts.gate_bound``: max(the dtype's floor, 2 x the naive path's error); the
    log-probabilities and entropies take the loss's floor), each path's reference and bounds taken at its
    own options (``PATH_OPTIONS``). Returns {"dtype", "errors": {path: {quantity: error}}, "bounds": {path:
    {quantity: bound}}, "within": {path: bool}, "failed": {path: its error, for a peer that raised (its errors and bounds
    absent)}, "ok": whether ours is within every bound}."""
    from helpers.compare.units import dtype_name
    from helpers.compare.verdicts import gate_bound
    from helpers.spec import relative_error

    paths = [p for p in PATHS if path_reason(p) is None] if paths is None else list(paths)
    quantities = ("logprob", "entropy", "dE", "dC")
    name = dtype_name(inputs.E.dtype)

    def run(fn, opts, dtype=None):
        E = inputs.E.detach().to(dtype or inputs.E.dtype).requires_grad_(True)
        C = inputs.C.detach().to(dtype or inputs.C.dtype).requires_grad_(True)
        out = fn(E, C, inputs.x, inputs.advantages, inputs.mask, old_logprob=inputs.old_logprob,
                 ref_logprob=inputs.ref_logprob, **opts, **({"dtype": dtype} if dtype else {}))
        return dict(zip(quantities, (out.logprob, out.entropy, *torch.autograd.grad(out.loss, (E, C)))))

    errors, bounds, yardsticks, failed = {}, {}, {}, {}
    for path in paths:
        opts = {**STEP_OPTIONS, **PATH_OPTIONS.get(path, {}), **options}
        key = tuple(sorted(opts.items()))
        if key not in yardsticks:  # the float64 reference and the naive path's errors, per set of options
            reference = run(logits_grpo_loss, opts, torch.float64)
            naive = run(PATHS["naive"], opts)
            yardsticks[key] = (reference, {q: relative_error(naive[q], reference[q]) for q in quantities})
        reference, naive_errors = yardsticks[key]
        fresh_compile(path)
        try:
            got = run(PATHS[path], opts)
        except Exception as error:  # a peer's failure is its finding, not the gate's; ours' stops the gate
            if path not in PATH_REASONS:  # the peers: the paths that may not run here
                raise
            failed[path] = f"{type(error).__name__}: {str(error)[:300]}"
            continue
        errors[path] = {q: relative_error(got[q], reference[q]) for q in quantities if got[q] is not None}
        bounds[path] = {q: gate_bound(name, "loss" if q in ("logprob", "entropy") else q, naive_errors[q])
                        for q in errors[path]}
    within = {path: path not in failed and all(errors[path][q] <= bounds[path][q] for q in errors[path])
              for path in paths}
    return {"dtype": name, "errors": errors, "bounds": bounds, "within": within, "failed": failed,
            "ok": within.get("ours", False)}


# ---------------------------------------------------------------------------------------------
# A tiny policy that GRPO trains on a CPU: count up from the prompt
# ---------------------------------------------------------------------------------------------

EOS = 0  # the end-of-sequence token of the toy task


class TinyPolicy(nn.Module):
    """An autoregressive policy small enough for the Triton interpreter. The hidden state at
    position t comes from the previous token and t: h = norm(u + MLP(u)), u = emb[prev] + pos[t]
    (B, T, D); the head is ``head.weight`` (V, D), whose logits the loss never forms."""

    def __init__(self, V: int, D: int, T: int):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.position = nn.Embedding(T, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def hidden(self, previous: torch.Tensor, start: int = 0) -> torch.Tensor:
        """(B, T') previous tokens at positions start.. -> (B, T', D) hidden states."""
        u = self.embed(previous) + self.position.weight[start:start + previous.shape[1]]
        return self.norm(u + self.mlp(u))


@torch.no_grad()
def sample_completions(policy: TinyPolicy, prompts: torch.Tensor, T: int, temperature: float,
                       generator: torch.Generator) -> torch.Tensor:
    """(B, T) tokens sampled one at a time at ``temperature`` after each prompt token (B,). The
    sampler sees B x V logits a step (an inference engine's business); the trainer never does."""
    previous, tokens = prompts, []
    for t in range(T):
        z = policy.hidden(previous[:, None], start=t)[:, 0] @ policy.head.weight.T
        previous = torch.multinomial(torch.softmax(z.float() / temperature, dim=-1), 1, generator=generator)[:, 0]
        tokens.append(previous)
    return torch.stack(tokens, dim=1)


def completion_mask(completions: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: every token up to and including the first EOS (the rest is padding)."""
    ended_before = (completions == EOS).long().cumsum(dim=1) - (completions == EOS).long()
    return ended_before == 0


def count_up_reward(prompts: torch.Tensor, completions: torch.Tensor, mask: torch.Tensor, V: int) -> torch.Tensor:
    """(B,) the fraction of the T positions whose token is the previous one plus 1 (after the
    prompt, for the first), among the kept tokens: 1 for p+1, p+2, ... to the last position.
    Counting wraps from V - 1 to 1 (EOS is never the right token, so stopping early costs)."""
    previous = torch.cat([prompts[:, None], completions[:, :-1]], dim=1)
    wanted = previous % (V - 1) + 1
    return ((completions == wanted) & mask).float().mean(dim=1)


@torch.no_grad()
def token_logprobs(policy: TinyPolicy, previous: torch.Tensor, completions: torch.Tensor, mask: torch.Tensor,
                   temperature: float, configs=None) -> torch.Tensor:
    """(B, T) log-probabilities of the completions under ``policy`` (ours, no gradient): the
    sampling policy's logp_old, or the reference policy's."""
    targets = torch.where(mask, completions, -100)
    return linear_cross_entropy_outputs(policy.hidden(previous), policy.head.weight, targets,
                                        temperature=temperature, configs=configs).logprob


def train_grpo(
    policy: TinyPolicy,
    *,
    steps: int,
    prompts_per_step: int,
    group_size: int,
    T: int,
    lr: float,
    seed: int = 0,
    temperature: float = 1.0,
    iterations: int = 1,
    **loss_options,
) -> dict[str, list[float]]:
    """GRPO on the count-up task: each step samples ``group_size`` completions of T tokens for each
    of ``prompts_per_step`` prompts from ``policy`` (at ``temperature``), scores them
    (``count_up_reward``), normalises the rewards within each group (``group_advantages``) and takes
    ``iterations`` Adam steps on ``grpo_loss`` (TRL's num_iterations: past the first, the ratio
    against the sampling policy's log-probabilities is what the clip acts on). ``loss_options``:
    ``grpo_loss``'s (with ``kl_coef`` the reference is the policy as it starts). Seeded: the same
    arguments give the same curves. Returns per step: "reward" (the sampled completions' mean,
    before the update), "loss", "entropy", "clipped", "kl", "ratio" (means over kept tokens,
    of the last iteration)."""
    V = policy.head.weight.shape[0]
    device = policy.head.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    reference = copy.deepcopy(policy).requires_grad_(False) if loss_options.get("kl_coef") else None
    curves: dict[str, list[float]] = {k: [] for k in ("reward", "loss", "entropy", "clipped", "kl", "ratio")}
    for _ in range(steps):
        prompts = torch.randint(1, V, (prompts_per_step,), generator=generator, device=device)
        prompts = prompts.repeat_interleave(group_size)
        completions = sample_completions(policy, prompts, T, temperature, generator)
        mask = completion_mask(completions)
        rewards = count_up_reward(prompts, completions, mask, V)
        advantages = group_advantages(rewards, group_size)
        previous = torch.cat([prompts[:, None], completions[:, :-1]], dim=1)
        configs = loss_options.get("configs")
        old = token_logprobs(policy, previous, completions, mask, temperature, configs) if iterations > 1 else None
        ref = token_logprobs(reference, previous, completions, mask, temperature, configs) if reference else None
        for _ in range(iterations):
            out = grpo_loss(policy.hidden(previous), policy.head.weight, completions, advantages, mask,
                            old_logprob=old, ref_logprob=ref, temperature=temperature, **loss_options)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            optimizer.step()
        curves["reward"].append(float(rewards.mean()))
        for name, value in out.metrics(mask).items():
            curves[name].append(value)
    return curves
