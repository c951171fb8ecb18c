"""Class weights with torch's ``F.cross_entropy(weight=...)`` semantics, on top of the per-row loss.

A class weight w (V,) makes row i count t_i = w_{x_i} (0 at ignored rows):

    "none": t_i loss_i,  "sum": sum_i t_i loss_i,  "mean": sum_i t_i loss_i / sum_i t_i

(torch's weighted mean divides by the kept targets' weights, not by their count). It needs nothing of
the logits: the kernels compute the unweighted rows ("none"), and the weighting is N-sized arithmetic
that autograd differentiates, so each row's upstream gradient reaches the backward scaled by t_i
(``helpers.cce.backward.rows.RowGradient``'s per-row w). Like torch: NaN for a mean over no kept token
(gradients 0), NaN for a mean whose kept targets all weigh 0.

With label smoothing eps torch weights the smoothing term by class too, so a row is no longer t_i times
the unweighted one (V classes, W = sum_c w_c, z the row's logits, lse their log-sum-exp):

    loss_i = (1 - eps) t_i (lse_i - z_{i, x_i}) + (eps / V) sum_c w_c (lse_i - z_{i, c})
           = (1 - eps) t_i (lse_i - z_{i, x_i}) + (eps / V) (W lse_i - sum_c w_c z_{i, c})

and "mean" still divides by sum_i t_i. The kernels then sum w_c z_{i, c} in the forward (as they sum
the logits for unweighted smoothing) and form G's smoothing term as c_i w_v / V
(``helpers/cce/kernels/gradient_tile.py``); ``smoothed_rows`` assembles the row and
``RowGradient.of_class_weights`` its coefficients. The Gluon kernels do not take class weights: such a
call runs the Triton ones, the "gemm" backward's G kernel one program per tile (``backward_gemm``: its
persistent walk gave a wrong G with them on an H200). Measured against Liger's own test grid and float64
on an H200: ``scripts/gpu/liger_parity.py``.

With the z-loss, the z-loss is not weighted (torch defines none; Liger's kernel and its tests add
zl lse_i^2 per kept row, divided by the kept count for a mean, to the weighted cross-entropy):
``z_loss_term``, from the lse the kernels return, which backpropagates through it.
"""

from __future__ import annotations

import torch


def check_weight(weight, C: torch.Tensor, *, read_values: bool = True) -> None:
    """Raise a ``TypeError``/``ValueError`` naming ``weight`` unless it is a finite floating-point (V,)
    tensor on C's device that does not require grad where grad is enabled (as torch). Negative weights are taken, as torch and Liger take
    them (a class that pushes its logit down); a weighted mean whose kept weights sum to 0 is then inf or
    NaN, as torch's. Checking the values reads one flag of the weight (a device sync on a GPU);
    ``read_values=False`` (torch.compile, CUDA graph capture) skips that check: a negative or non-finite
    weight then gives that loss, unreported."""
    V = C.shape[0]
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be None or a torch.Tensor of shape (V,) = ({V},), got {type(weight).__name__}")
    if tuple(weight.shape) != (V,):
        raise ValueError(f"weight must have shape (V,) = ({V},), one weight per class (row of C), "
                         f"got {tuple(weight.shape)}")
    if not weight.dtype.is_floating_point:
        raise TypeError(f"weight must be a floating-point tensor, got {weight.dtype}")
    if weight.device != C.device:
        raise ValueError(f"weight must be on C's device ({C.device}), got {weight.device}")
    if weight.requires_grad and torch.is_grad_enabled():  # as torch's cross_entropy: no gradient reaches them
        raise ValueError("weight must not require grad (the loss is not differentiated with respect to the "
                         "class weights, as in torch's cross_entropy): pass weight.detach()")
    if read_values and not bool(torch.isfinite(weight).all()):
        raise ValueError("weight must hold finite weights (no NaN or inf)")


def target_weights(x: torch.Tensor, weight: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """t_i = weight[x_i] at kept rows, 0 at ignored ones, (N,) fp32. A target outside [0, V) reads class
    0's weight instead of indexing out of bounds (a device assert on a GPU): the forward runs this before
    the targets' range is checked, and reports such a target right after (``helpers.cce.ops``)."""
    kept = x != ignore_index
    index = torch.where(kept, x, 0).clamp(0, weight.shape[0] - 1)
    return torch.where(kept, weight.to(torch.float32)[index], 0.0)


def smoothed_rows(plain: torch.Tensor, lse: torch.Tensor, weighted_sum: torch.Tensor, x: torch.Tensor,
                  weight: torch.Tensor, label_smoothing: float, ignore_index: int) -> torch.Tensor:
    """Each row's loss under class weights with label smoothing (module doc), already weighted, (N,)
    fp32 and 0 at ignored rows: from the kernels' ``plain`` rows lse_i - z_{i, x_i}, the lse and
    ``weighted_sum`` = sum_c w_c z_{i, c}."""
    eps, V = label_smoothing, weight.shape[0]
    t = target_weights(x, weight, ignore_index)
    total = weight.to(torch.float32).sum()
    rows = (1.0 - eps) * t * plain + (eps / V) * (total * lse - weighted_sum)
    return torch.where(x != ignore_index, rows, 0.0)


def z_loss_term(lse: torch.Tensor, x: torch.Tensor, z_loss: float, ignore_index: int,
                reduction: str) -> torch.Tensor:
    """zl lse_i^2 at kept rows, unweighted, reduced by the kept count for a mean (module doc);
    differentiable through ``lse``."""
    kept = x != ignore_index
    rows = torch.where(kept, z_loss * lse * lse, 0.0)
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / kept.sum().clamp(min=1)  # no kept row: the weighted mean is NaN already


def weighted_reduction(loss_rows: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, ignore_index: int,
                       reduction: str, *, weighted: bool = False) -> torch.Tensor:
    """The per-row losses (N,) (0 at ignored rows) weighted by their targets' class weights and
    reduced as torch does (module doc), differentiable through ``loss_rows``; ``weighted``: the rows
    already carry their weights (``smoothed_rows``), only the reduction is left."""
    kept = x != ignore_index
    w_rows = target_weights(x, weight, ignore_index)
    rows = loss_rows if weighted else loss_rows * w_rows
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    # All ignored: NaN with zero gradients, as torch (divide by 1, then replace the value).
    any_kept = kept.any()
    loss = rows.sum() / torch.where(any_kept, w_rows.sum(), 1.0)
    return torch.where(any_kept, loss, float("nan"))
