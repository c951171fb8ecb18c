"""The specification every method must meet, and the float64 reference it is gated against.

Every loss method in this package computes

    loss_i = lse_i - z_{i, x_i},     z = cap(E @ C^T)  (N, V),  lse_i = log sum_v exp(z_{i, v})

over the tokens i whose target x_i is not ``ignore_index``, where ``cap`` is Gemma-2's soft cap
``s * tanh(z / s)`` when ``softcap=s`` is given and the identity otherwise; with the options our
loss adds (``helpers.cce``), torch's label smoothing ``ls`` and PaLM's z-loss ``zl``,

    loss_i = lse_i - (1 - ls) z_{i, x_i} - (ls / V) sum_v z_{i, v} + zl * lse_i^2;

with a temperature tau the logits are cap(E @ C^T + b) / tau before all of this, and class weights
``weight`` are torch's (row i counts w_{x_i}, its smoothing term weights each class: torch's
``F.cross_entropy(weight=, label_smoothing=)``; the z-loss is not weighted, and a mean divides it by
the kept count, as Liger's kernel and its tests do); the loss is then reduced exactly as
``torch.nn.functional.cross_entropy`` does on fp32 logits:

- ``"none"``: a length-N vector, 0 at ignored tokens;
- ``"sum"``: the sum over kept tokens (0 when every token is ignored);
- ``"mean"``: the sum divided by the number of kept tokens (NaN when every token is ignored, as
  torch gives; the gradients are then 0, again as torch gives).

The per-token outputs (``helpers.cce.outputs``) are specified by ``reference_outputs``: each token's
log-probability of its target, its softmax's entropy H_i = lse_i - sum_v p_{i, v} z_{i, v}, and whether
its target is among the row's largest logits. Distillation's divergences of a student head's softmax
from a teacher head's (``helpers.cce.distill``: forward KL, reverse KL, JSD) are specified by
``reference_kl_div`` on both heads' full logits, its inputs by ``validate_distill_inputs``.

This module holds that specification in two forms: ``validate_inputs`` (what a caller may pass,
with errors that name the argument) and ``reference_loss`` (the computation, in float64 by
default), and the one measure of disagreement, ``relative_error``. Nothing here is fast; it is the
yardstick. ``reference_loss_and_grads(..., chunk_rows=n)`` computes the same numbers n rows of
logits at a time from the closed-form gradient, for inputs whose float64 logits would not fit.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum", "none")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def validate_inputs(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES,
    bias: torch.Tensor | None = None,
    leading_dims: bool = False,
    check_targets: bool = True,
) -> None:
    """Raise a ``ValueError``/``TypeError`` naming the argument when the inputs break the contract.

    E: (N, D) embeddings, C: (V, D) classifier, x: (N,) integer targets in [0, V) or ignore_index;
    with ``leading_dims`` E may be (..., D) and x then has E's leading shape (B, T, say). bias: None
    or (V,) in C's dtype. The range check on x (``raise_for_targets``) reads one flag of x (a device
    sync on a GPU): a wrong target must never reach a kernel, where it reads out of bounds instead
    of failing. ``check_targets=False`` leaves it to a caller whose kernels cannot read out of bounds
    and that raises before returning anything (``helpers.cce.linear_cross_entropy``).
    """
    for name, t in (("E", E), ("C", C), ("x", x)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if leading_dims:
        if E.dim() < 1:
            raise ValueError("E must be (..., D) with D the hidden size, got a scalar")
        if tuple(x.shape) != tuple(E.shape[:-1]):
            raise ValueError(
                f"x must have E's leading shape {tuple(E.shape[:-1])} (one target per row of E), "
                f"got {tuple(x.shape)}"
            )
    else:
        if E.dim() != 2:
            raise ValueError(
                f"E must be 2-D (N tokens, D hidden), got shape {tuple(E.shape)}; "
                "flatten batch and sequence first, e.g. E.reshape(-1, E.shape[-1])"
            )
        if x.dim() != 1:
            raise ValueError(
                f"x must be 1-D (N targets), got shape {tuple(x.shape)}; flatten it, e.g. x.reshape(-1)"
            )
        if x.shape[0] != E.shape[0]:
            raise ValueError(
                f"x must hold one target per row of E: x has {x.shape[0]}, E has {E.shape[0]} rows"
            )
    if C.dim() != 2:
        raise ValueError(f"C must be 2-D (V vocabulary, D hidden), got shape {tuple(C.shape)}")
    if E.shape[-1] != C.shape[1]:
        raise ValueError(
            f"E and C must share the hidden size D: E is {tuple(E.shape)}, C is {tuple(C.shape)}"
        )
    if E.device != C.device or x.device != E.device:
        raise ValueError(
            f"E, C and x must be on one device, got E on {E.device}, C on {C.device}, x on {x.device}"
        )
    if E.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"E must be one of {names}, got {E.dtype}")
    if C.dtype != E.dtype:
        raise TypeError(f"C must have E's dtype ({E.dtype}), got {C.dtype}")
    if x.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"x must hold integer class indices (int64 or int32), got {x.dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be None or a torch.Tensor, got {type(bias).__name__}")
        if tuple(bias.shape) != (C.shape[0],):
            raise ValueError(f"bias must be (V,) = ({C.shape[0]},), one per row of C, got {tuple(bias.shape)}")
        if bias.dtype != C.dtype or bias.device != C.device:
            raise TypeError(f"bias must have C's dtype and device ({C.dtype}, {C.device}), "
                            f"got {bias.dtype} on {bias.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_softcap(softcap)
    check_ignore_index(ignore_index, x)
    if E.numel() == 0 or C.shape[0] == 0 or E.shape[-1] == 0:
        raise ValueError(f"E and C must be non-empty, got E {tuple(E.shape)} and C {tuple(C.shape)}")
    if check_targets:
        raise_for_targets(x, C.shape[0], ignore_index)


MIN_SOFTCAP = 1e-30  # far below any cap in use (Gemma-2's 30 and 50), far above where 2.885 / softcap leaves fp32


def check_softcap(softcap) -> None:
    """A ``ValueError`` naming ``softcap`` unless it is None or a finite number > 0 (not a bool). Comparisons
    only: torch.compile traces a soft cap that changes between calls as a symbolic float, which
    ``math.isfinite`` cannot take (NaN fails both comparisons)."""
    if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                    and 0 < softcap < math.inf):
        raise ValueError(f"softcap must be None or a finite positive number, got {softcap!r}")
    if softcap is not None and softcap < MIN_SOFTCAP:  # the kernels scale by 2 log2(e) / softcap in fp32
        raise ValueError(f"softcap must be at least {MIN_SOFTCAP:g} (the kernels scale the logits by 2 log2(e) / "
                         f"softcap in fp32, which overflows below it), got {softcap!r}")


def check_ignore_index(ignore_index, x: torch.Tensor | None = None) -> None:
    """A ``TypeError`` naming ``ignore_index`` unless it is an int (not a bool), as torch takes it; a ``ValueError``
    unless it fits int64, or the targets ``x``'s dtype where they are int32 (no target could equal it)."""
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int (the target value whose rows are skipped, e.g. -100), "
                        f"got {ignore_index!r}")
    if not -2**63 <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64 (a target's dtype), got {ignore_index}")
    if isinstance(x, torch.Tensor) and x.dtype == torch.int32 and not -2**31 <= ignore_index < 2**31:
        raise ValueError(f"ignore_index={ignore_index} does not fit x's dtype (int32), so no target can equal it: "
                         "pass x as int64, or an ignore_index within int32's range")


def targets_out_of_range(x: torch.Tensor, V: int, ignore_index: int) -> torch.Tensor:
    """Whether any target of x lies outside [0, V) and is not ignore_index: a bool tensor on x's
    device, so that a caller can launch work first and read it later (no sync here)."""
    return (((x < 0) | (x >= V)) & (x != ignore_index)).any()


def raise_for_targets(x: torch.Tensor, V: int, ignore_index: int, bad: torch.Tensor | bool | None = None) -> None:
    """Raise the ``ValueError`` naming x's first offending target when ``bad`` (None: computed here,
    ``targets_out_of_range``) says one is out of range. Reading it is one device sync on a GPU."""
    if bad is None:
        bad = targets_out_of_range(x, V, ignore_index)
    if not bool(bad):
        return
    kept = x[x != ignore_index]
    lo, hi = int(kept.min()), int(kept.max())
    raise ValueError(f"x holds target {lo if lo < 0 else hi}, outside [0, V={V}) and not ignore_index={ignore_index}")


def softcap_slope(a: torch.Tensor, softcap: float) -> torch.Tensor:
    """d/da [softcap tanh(a / softcap)] = 1 - tanh^2(a / softcap), as 4q / (1 + q)^2 with q = exp(-2|a| / softcap):
    accurate at every a, where 1 - tanh^2 rounds to 0 once tanh rounds to +-1 (|a| above ~19 caps in float64,
    ~9 in float32) while the slope is ~4 exp(-2|a| / softcap)."""
    q = torch.exp(-2 * a.abs() / softcap)
    return 4 * q / (1 + q) ** 2


def reference_logits(
    E: torch.Tensor, C: torch.Tensor, softcap: float | None = None, dtype=torch.float64,
    bias: torch.Tensor | None = None, temperature: float = 1.0,
) -> torch.Tensor:
    """z = cap(E @ C^T + bias) / temperature in ``dtype``: (N, V). The one place the soft cap's
    formula lives; the temperature divides the capped logits (an RL sampler's order)."""
    z = E.to(dtype) @ C.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if temperature != 1.0:
        z = z / temperature
    return z


def reference_loss(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    temperature: float = 1.0,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss as the specification above defines it, computed in ``dtype`` (float64 by default);
    ``bias`` (V,) is added to every row's logits before the soft cap, ``temperature`` divides the
    capped logits (before the lse and everything after it), ``weight`` (V,) is torch's class weight
    (``F.cross_entropy(weight=...)``: row i counts w_{x_i}; "mean" divides by the kept rows' weights;
    the z-loss stays unweighted, divided by the kept count for a mean: the module doc).

    Differentiable: autograd through it gives the reference dE and dC (in ``dtype``; pass leaf
    tensors already upcast when you want their ``.grad``).
    """
    z = reference_logits(E, C, softcap, dtype, bias, temperature)
    x = x.long()
    if weight is not None:
        weight = weight.to(dtype)
    loss = F.cross_entropy(z, x, weight=weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss:
        kept = x != ignore_index
        square = torch.where(kept, torch.logsumexp(z, dim=1) ** 2, 0.0) * z_loss
        loss = loss + {"none": square, "sum": square.sum(), "mean": square.sum() / kept.sum()}[reduction]
    return loss


def reference_outputs(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob, entropy, correct) per token in ``dtype``, of z = cap(E C^T + bias) / temperature:
    log_softmax(z)[i, x_i], -sum_v p log p of each row, and whether x_i is among the row's largest
    logits (a tie with the maximum counts as correct); 0, 0 and False at ignored tokens.
    Differentiable (the first two), as ``reference_loss`` is."""
    z = reference_logits(E, C, softcap, dtype, bias, temperature)
    kept = x != ignore_index
    target = torch.where(kept, x, 0).long()
    log_p = torch.log_softmax(z, dim=1)
    logprob = torch.where(kept, log_p.gather(1, target[:, None])[:, 0], 0.0)
    entropy = torch.where(kept, -(log_p.exp() * log_p).sum(dim=1), 0.0)
    correct = kept & (z.gather(1, target[:, None])[:, 0] >= z.amax(dim=1))
    return logprob, entropy, correct


# The divergences of ``helpers.cce.distill.linear_kl_div`` (module doc of ``reference_kl_div``).
DIVERGENCES = ("forward", "reverse", "jsd")


def validate_distill_inputs(
    E_s: torch.Tensor,
    C_s: torch.Tensor,
    E_t: torch.Tensor,
    C_t: torch.Tensor,
    *,
    bias_s: torch.Tensor | None = None,
    bias_t: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    x: torch.Tensor | None = None,
    kind: str = "forward",
    beta: float = 0.5,
    reduction: str = "mean",
    softcap: float | None = None,
    ignore_index: int = -100,
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES,
) -> None:
    """Raise a ``ValueError``/``TypeError`` naming the argument when a distillation call's inputs break
    the contract (``reference_kl_div``): a student head E_s (..., D_s), C_s (V, D_s) and a teacher head
    E_t (..., D_t), C_t (V, D_t) with E_s's leading shape and C_s's V, all in one dtype and on one
    device; biases (V,) or None; ``mask`` (bool) and ``x`` (integer targets) None or of E_s's leading
    shape; ``kind`` one of ``DIVERGENCES``, ``beta`` in (0, 1) for "jsd"."""
    tensors = (("E_s", E_s), ("C_s", C_s), ("E_t", E_t), ("C_t", C_t))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, E in (("E_s", E_s), ("E_t", E_t)):
        if E.dim() < 1:
            raise ValueError(f"{name} must be (..., D) with D its head's hidden size, got a scalar")
    for name, C in (("C_s", C_s), ("C_t", C_t)):
        if C.dim() != 2:
            raise ValueError(f"{name} must be 2-D (V vocabulary, D hidden), got shape {tuple(C.shape)}")
    if tuple(E_t.shape[:-1]) != tuple(E_s.shape[:-1]):
        raise ValueError(f"E_t must have E_s's leading shape {tuple(E_s.shape[:-1])} (one teacher row per student "
                         f"token), got {tuple(E_t.shape[:-1])}")
    if C_t.shape[0] != C_s.shape[0]:
        raise ValueError(f"C_t must have C_s's vocabulary V = {C_s.shape[0]} (one row per token of one tokenizer), "
                         f"got V = {C_t.shape[0]}")
    for who, E, C in (("student", E_s, C_s), ("teacher", E_t, C_t)):
        e, c = ("E_s", "C_s") if who == "student" else ("E_t", "C_t")
        if E.shape[-1] != C.shape[1]:
            raise ValueError(f"{e} and {c} must share the {who}'s hidden size: {e} is {tuple(E.shape)}, "
                             f"{c} is {tuple(C.shape)}")
    if any(t.device != E_s.device for _, t in tensors):
        raise ValueError("E_s, C_s, E_t and C_t must be on one device, got "
                         + ", ".join(f"{name} on {t.device}" for name, t in tensors))
    if E_s.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"E_s must be one of {names}, got {E_s.dtype}")
    for name, t in tensors[1:]:
        if t.dtype != E_s.dtype:
            raise TypeError(f"{name} must have E_s's dtype ({E_s.dtype}), got {t.dtype}; cast the teacher's "
                            "hidden states and head to the student's dtype")
    for name, b in (("bias_s", bias_s), ("bias_t", bias_t)):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{name} must be None or a torch.Tensor, got {type(b).__name__}")
        if tuple(b.shape) != (C_s.shape[0],):
            raise ValueError(f"{name} must be (V,) = ({C_s.shape[0]},), one per vocabulary row, got {tuple(b.shape)}")
        if b.dtype != E_s.dtype or b.device != E_s.device:
            raise TypeError(f"{name} must have E_s's dtype and device ({E_s.dtype}, {E_s.device}), "
                            f"got {b.dtype} on {b.device}")
    lead = tuple(E_s.shape[:-1])
    for name, t, ok, what in (("mask", mask, lambda t: t.dtype == torch.bool, "bool (True: the token counts)"),
                              ("x", x, lambda t: t.dtype in (torch.int64, torch.int32), "integer targets")):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be None or a torch.Tensor, got {type(t).__name__}")
        if not ok(t):
            raise TypeError(f"{name} must hold {what}, got {t.dtype}")
        if tuple(t.shape) != lead or t.device != E_s.device:
            raise ValueError(f"{name} must have E_s's leading shape {lead} on {E_s.device}, "
                             f"got {tuple(t.shape)} on {t.device}")
    if kind not in DIVERGENCES:
        raise ValueError(f"kind must be one of {DIVERGENCES}, got {kind!r}")
    if kind == "jsd" and not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and 0 < beta < 1):
        raise ValueError(f"beta must be a number in (0, 1) for kind='jsd' (at 0 or 1 the mixture is one of the two "
                         f"softmaxes and the JSD is 0: use kind='forward' or 'reverse'), got {beta!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_softcap(softcap)
    if x is not None:  # ignore_index is read only against targets
        check_ignore_index(ignore_index, x)
    if E_s.numel() == 0 or C_s.shape[0] == 0 or E_s.shape[-1] == 0 or E_t.shape[-1] == 0:
        raise ValueError(f"E_s, C_s and E_t must be non-empty, got E_s {tuple(E_s.shape)}, C_s {tuple(C_s.shape)} "
                         f"and E_t {tuple(E_t.shape)}")


def reference_kl_div(
    E_s: torch.Tensor,
    C_s: torch.Tensor,
    E_t: torch.Tensor,
    C_t: torch.Tensor,
    *,
    kind: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    softcap: float | None = None,
    bias_s: torch.Tensor | None = None,
    bias_t: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The divergence of a student's softmax q from a teacher's p over one vocabulary, per token, on the
    full logits in ``dtype``: s = cap(E_s C_s^T + b_s) / tau, t = cap(E_t C_t^T + b_t) / tau (one soft
    cap and one temperature for both), q = softmax(s), p = softmax(t), and with
    ``F.kl_div(input, target, log_target=True)`` = target's probabilities times (target - input):

        "forward":  KL(p || q) = sum_v p (log p - log q)   F.kl_div(log q, log p)   (Hinton's distillation)
        "reverse":  KL(q || p) = sum_v q (log q - log p)   F.kl_div(log p, log q)   (mode seeking)
        "jsd":      beta KL(p || M) + (1 - beta) KL(q || M),   M = beta p + (1 - beta) q

    (the JSD as Liger-Kernel's ``LigerFusedLinearJSD`` defines it, beta = 0.5 the symmetric one).
    Each token's divergence is summed over V; ``mask`` (bool, E_s's leading shape) keeps the tokens that
    count. "none": per token, 0 where not kept; "sum": over kept tokens; "mean": their sum over the
    kept tokens' count (torch's ``reduction="batchmean"`` over the kept rows; NaN when none is kept).
    Differentiable in the student's tensors; the teacher's logits are detached (a constant), as in
    ``helpers.cce.distill.linear_kl_div``.
    """
    s = reference_logits(E_s.reshape(-1, E_s.shape[-1]), C_s, softcap, dtype, bias_s, temperature)
    t = reference_logits(E_t.reshape(-1, E_t.shape[-1]), C_t, softcap, dtype, bias_t, temperature)
    rows = divergence_of_logits(s, t, kind=kind, beta=beta, mask=None if mask is None else mask.reshape(-1),
                                reduction=reduction)
    return rows.reshape(E_s.shape[:-1]) if reduction == "none" else rows


def divergence_of_logits(
    s: torch.Tensor,
    t: torch.Tensor,
    *,
    kind: str = "forward",
    beta: float = 0.5,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """``reference_kl_div``'s divergence of softmax(s) from softmax(t), from the student's logits s and
    the teacher's t (N, V), already capped and tempered, in their dtype; t is detached. ``mask`` (N,)."""
    log_q, log_p = torch.log_softmax(s, dim=1), torch.log_softmax(t.detach(), dim=1)
    if kind == "forward":
        rows = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(dim=1)
    elif kind == "reverse":
        rows = F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(dim=1)
    elif kind == "jsd":
        log_M = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
        rows = (beta * F.kl_div(log_M, log_p, log_target=True, reduction="none").sum(dim=1)
                + (1 - beta) * F.kl_div(log_M, log_q, log_target=True, reduction="none").sum(dim=1))
    else:
        raise ValueError(f"kind must be one of {DIVERGENCES}, got {kind!r}")
    kept = torch.ones_like(rows, dtype=torch.bool) if mask is None else mask
    rows = torch.where(kept, rows, 0.0)
    if reduction == "none":
        return rows
    return rows.sum() if reduction == "sum" else rows.sum() / kept.sum()


def reference_loss_and_grads(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    grad_output: torch.Tensor | float = 1.0,
    *,
    chunk_rows: int | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dE, dC) in float64 for the given inputs, which may be of any dtype.

    The inputs are upcast exactly (every fp16/bf16/fp32 value is a float64 value), so the only
    error left in a method's result is its own arithmetic. ``grad_output``: the upstream gradient
    (a scalar, or (N,) for reduction "none"). ``options``: those of ``reference_loss``.
    ``chunk_rows``: compute ``chunk_rows`` rows of logits at a time from the closed form below
    instead of autograd over all N x V logits (tests check the two agree).
    """
    if chunk_rows:
        return _chunked_loss_and_grads(E, C, x, grad_output, chunk_rows, **options)
    E64 = E.detach().to(torch.float64).requires_grad_(True)
    C64 = C.detach().to(torch.float64).requires_grad_(True)
    loss = reference_loss(E64, C64, x, **options)
    go = torch.as_tensor(grad_output, dtype=torch.float64, device=loss.device).expand_as(loss)
    loss.backward(go)
    return loss.detach(), E64.grad, C64.grad


def _chunked_loss_and_grads(E, C, x, grad_output, chunk_rows, *, ignore_index=-100, reduction="mean",
                            softcap=None, z_loss=0.0, label_smoothing=0.0, bias=None, dtype=torch.float64):
    """``reference_loss_and_grads`` row chunk by row chunk, from the gradient's closed form:

        G = S (1 + 2 zl lse) - (1 - ls) [v = x] - ls / V   (times 1 - (z / softcap)^2 under the cap),
        dE = g G C,   dC = G^T (g E),   g: each row's upstream gradient (0 where ignored).
    """
    N, D = E.shape
    V = C.shape[0]
    kept = x != ignore_index
    n_kept = kept.sum()
    go = torch.as_tensor(grad_output, dtype=dtype, device=E.device)
    g = go if reduction == "none" else (go if reduction == "sum" else go / n_kept.clamp(min=1)).expand(N)
    g = torch.where(kept, g, 0.0)
    C64 = C.to(dtype)
    loss_rows = torch.zeros(N, dtype=dtype, device=E.device)
    dE = torch.empty(N, D, dtype=dtype, device=E.device)
    dC = torch.zeros(V, D, dtype=dtype, device=E.device)
    for n0 in range(0, N, chunk_rows):
        n1 = min(N, n0 + chunk_rows)
        En = E[n0:n1].to(dtype)
        z = En @ C64.T  # (rows, V)
        if bias is not None:
            z += bias.to(dtype)
        slope = None
        if softcap is not None:
            slope = softcap_slope(z, softcap)
            z = softcap * torch.tanh(z / softcap)
        lse = torch.logsumexp(z, dim=1)
        k = kept[n0:n1]
        xt = torch.where(k, x[n0:n1], 0).long()
        rows = lse - (1 - label_smoothing) * z.gather(1, xt[:, None])[:, 0] + z_loss * lse * lse
        if label_smoothing:
            rows = rows - label_smoothing * z.mean(dim=1)
        loss_rows[n0:n1] = torch.where(k, rows, 0.0)
        G = z.sub_(lse[:, None]).exp_()  # S, in place of z
        if z_loss:
            G.mul_((1 + 2 * z_loss * lse)[:, None])
        G[torch.arange(n1 - n0, device=E.device), xt] -= (1 - label_smoothing) * k.to(dtype)
        if label_smoothing:
            G.sub_(label_smoothing / V)
        if slope is not None:
            G.mul_(slope)
        G.mul_(g[n0:n1, None])
        dE[n0:n1] = G @ C64
        dC.addmm_(G.T, En)
        del G, z, slope
    loss = {"none": loss_rows, "sum": loss_rows.sum(), "mean": loss_rows.sum() / n_kept}[reduction]
    return loss, dE, dC


def relative_error(a, r, chunk_rows: int = 8192) -> float:
    """||a - r|| / ||r|| in float64 (||a - r|| when r is all zeros): the one measure of how far a
    result is from the reference. inf when NaNs disagree in position or ``a`` holds a stray inf;
    NaNs where ``r`` has them are ignored. Computed ``chunk_rows`` rows at a time, so a gigabyte
    gradient is never copied whole into float64.

    ``a`` and ``r`` may also be matching sequences of tensors (a model's gradients, say): the norm
    is then over all of them together, as if concatenated, without the copy that concatenating
    would cost (a 0.6B model's fp32 gradients are 2.4 GB, twice over: more than a T4 spares)."""
    sequences = isinstance(a, (list, tuple))
    if sequences != isinstance(r, (list, tuple)) or (sequences and len(a) != len(r)):
        raise ValueError("relative_error compares a tensor with a tensor, or two sequences of tensors of one length")
    pairs = list(zip(a, r)) if sequences else [(a, r)]
    diff = scale = 0.0
    for ai, ri in pairs:
        sums = _squared_sums(ai, ri, chunk_rows)
        if sums is None:
            return math.inf
        diff, scale = diff + sums[0], scale + sums[1]
    return math.sqrt(diff / scale) if scale > 0 else math.sqrt(diff)


def _squared_sums(a: torch.Tensor, r: torch.Tensor, chunk_rows: int) -> tuple[float, float] | None:
    """(sum (a - r)^2, sum r^2) in float64, ``chunk_rows`` rows at a time; None where ``relative_error``
    is inf (NaNs in different places, or an inf in ``a``)."""
    if a.shape != r.shape:
        raise ValueError(f"relative_error compares tensors of one shape, got {tuple(a.shape)} and {tuple(r.shape)}")
    a, r = a.detach().reshape(a.shape[0] if a.dim() else 1, -1), r.detach().reshape(r.shape[0] if r.dim() else 1, -1)
    diff = scale = 0.0
    for i in range(0, a.shape[0], chunk_rows):
        ai, ri = a[i:i + chunk_rows].double(), r[i:i + chunk_rows].double()
        nan_a, nan_r = torch.isnan(ai), torch.isnan(ri)
        if not torch.equal(nan_a, nan_r):
            return None
        ai, ri = ai[~nan_r], ri[~nan_r]
        if not torch.isfinite(ai).all():
            return None
        diff += float((ai - ri).pow(2).sum())
        scale += float(ri.pow(2).sum())
    return diff, scale


__all__ = [
    "REDUCTIONS",
    "SUPPORTED_DTYPES",
    "validate_inputs",
    "targets_out_of_range",
    "raise_for_targets",
    "reference_logits",
    "softcap_slope",
    "reference_loss",
    "reference_loss_and_grads",
    "reference_outputs",
    "reference_kl_div",
    "divergence_of_logits",
    "validate_distill_inputs",
    "DIVERGENCES",
    "relative_error",
]
