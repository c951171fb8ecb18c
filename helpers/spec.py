"""The specification every method must meet, and the float64 reference it is gated against.

Every loss method in this package computes

    loss_i = lse_i - z_{i, x_i},     z = cap(E @ C^T)  (N, V),  lse_i = log sum_v exp(z_{i, v})

over the tokens i whose target x_i is not ``ignore_index``, where ``cap`` is Gemma-2's soft cap
``s * tanh(z / s)`` when ``softcap=s`` is given and the identity otherwise; with the options our
loss adds (``helpers.cce``), torch's label smoothing ``ls`` and PaLM's z-loss ``zl``,

    loss_i = lse_i - (1 - ls) z_{i, x_i} - (ls / V) sum_v z_{i, v} + zl * lse_i^2;

with a temperature tau the logits are cap(E @ C^T + b) / tau before all of this, and class weights
``weight`` are torch's (row i counts w_{x_i}); the loss is then reduced exactly as
``torch.nn.functional.cross_entropy`` does on fp32 logits:

- ``"none"``: a length-N vector, 0 at ignored tokens;
- ``"sum"``: the sum over kept tokens (0 when every token is ignored);
- ``"mean"``: the sum divided by the number of kept tokens (NaN when every token is ignored, as
  torch gives; the gradients are then 0, again as torch gives).

The per-token outputs (``helpers.cce.outputs``) are specified by ``reference_outputs``: each token's
log-probability of its target, its softmax's entropy H_i = lse_i - sum_v p_{i, v} z_{i, v}, and whether
its target is among the row's largest logits.

This module holds that specification in two forms: ``validate_inputs`` (what a caller may pass,
with errors that name the argument) and ``reference_loss`` (the computation, in float64 by
default), and the one measure of disagreement, ``relative_error``. Nothing here is fast; it is the
yardstick. ``reference_loss_and_grads(..., chunk_rows=n)`` computes the same numbers n rows of
logits at a time from the closed-form gradient, for inputs whose float64 logits would not fit.
"""

from __future__ import annotations

import math

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
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be None or a positive number, got {softcap!r}")
    if E.numel() == 0 or C.shape[0] == 0 or E.shape[-1] == 0:
        raise ValueError(f"E and C must be non-empty, got E {tuple(E.shape)} and C {tuple(C.shape)}")
    if check_targets:
        raise_for_targets(x, C.shape[0], ignore_index)


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
    (``F.cross_entropy(weight=...)``: row i counts w_{x_i}; "mean" divides by the kept rows' weights).

    Differentiable: autograd through it gives the reference dE and dC (in ``dtype``; pass leaf
    tensors already upcast when you want their ``.grad``).
    """
    z = reference_logits(E, C, softcap, dtype, bias, temperature)
    x = x.long()
    if weight is not None:
        weight = weight.to(dtype)
        if z_loss:
            raise ValueError("the specification defines no z-loss with class weights")
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
        t = None
        if softcap is not None:
            t = torch.tanh(z / softcap)
            z = softcap * t
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
        if t is not None:
            G.mul_(1 - t * t)
        G.mul_(g[n0:n1, None])
        dE[n0:n1] = G @ C64
        dC.addmm_(G.T, En)
        del G, z, t
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
    "reference_loss",
    "reference_loss_and_grads",
    "reference_outputs",
    "relative_error",
]
