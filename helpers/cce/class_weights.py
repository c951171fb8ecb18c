"""Class weights with torch's ``F.cross_entropy(weight=...)`` semantics, on top of the per-row loss.

A class weight w (V,) makes row i count w_{x_i}:

    "none": w_{x_i} loss_i (0 at ignored rows),  "sum": sum_i w_{x_i} loss_i,
    "mean": sum_i w_{x_i} loss_i / sum_{i kept} w_{x_i}

(torch's weighted mean divides by the kept targets' weights, not by their count). It needs nothing of
the logits: the kernels compute the unweighted rows ("none"), and the weighting is N-sized arithmetic
that autograd differentiates, so each row's upstream gradient reaches the backward scaled by w_{x_i}
(``helpers.cce.backward.rows.RowGradient``'s per-row w). Like torch: NaN for a mean over no kept token
(gradients 0), NaN for a mean whose kept targets all weigh 0.

Not supported with a weight (each raises): label smoothing (torch weights its smoothing term per class,
sum_c w_c (lse - z_c), a weighted logit sum per row that the kernels do not make) and the z-loss (torch
has none, so its weighting would be ours to invent).
"""

from __future__ import annotations

import torch


def check_weight(weight, C: torch.Tensor, *, label_smoothing: float, z_loss: float, read_values: bool = True) -> None:
    """Raise a ``TypeError``/``ValueError`` naming ``weight`` unless it is a finite, non-negative
    floating-point (V,) tensor on C's device and the options allow it. Checking the values reads one
    flag of the weight (a device sync on a GPU); ``read_values=False`` (torch.compile, CUDA graph
    capture) skips that check: a negative or non-finite weight then gives that loss, unreported."""
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
    if read_values and bool(((weight < 0) | ~torch.isfinite(weight)).any()):
        raise ValueError("weight must hold finite weights >= 0")
    if label_smoothing:
        raise ValueError("weight with label_smoothing is not supported (torch weights the smoothing term per "
                         "class, which the kernels do not compute); use one or the other")
    if z_loss:
        raise ValueError("weight with z_loss is not supported (torch defines no weighted z-loss); "
                         "use one or the other")


def weighted_reduction(loss_rows: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, ignore_index: int,
                       reduction: str) -> torch.Tensor:
    """The per-row losses (N,) (0 at ignored rows) weighted by their targets' class weights and
    reduced as torch does (module doc), differentiable through ``loss_rows``."""
    kept = x != ignore_index
    w_rows = torch.where(kept, weight.to(torch.float32)[torch.where(kept, x, 0)], 0.0)
    weighted = loss_rows * w_rows
    if reduction == "none":
        return weighted
    if reduction == "sum":
        return weighted.sum()
    # All ignored: NaN with zero gradients, as torch (divide by 1, then replace the value).
    any_kept = kept.any()
    loss = weighted.sum() / torch.where(any_kept, w_rows.sum(), 1.0)
    return torch.where(any_kept, loss, float("nan"))
