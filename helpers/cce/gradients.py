"""What both backward implementations share: the upstream gradient, the vocabulary order, and the
fold of dC's fp32 rows into dC.

The upstream gradient. Each row i of the loss carries g_i (1/N_kept for a mean, the caller's
vector for "none", 0 at ignored rows). It is kept out of G = dloss_i/dz_{i,v}: in fp16, g = 1/N
times a softmax entry of ~1e-6 falls below fp16's smallest subnormal (6e-8) and rounds to zero,
whatever a trainer's loss scale does later. So dE's products take G unscaled and the rows are
scaled afterwards in fp32, and dC's products take g_rel = g / max|g| (|g_rel| <= 1, exact for a
mean or a sum) with g_scale = max|g| applied to the fp32 result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MiB = 1024 * 1024


@dataclass(frozen=True)
class UpstreamGradient:
    """g (N,) fp32 per row (0 at ignored rows) = g_rel * g_scale, |g_rel| <= 1; ``uniform`` when
    every row has the same g (a mean or a sum hands each row an expanded scalar)."""

    g: torch.Tensor
    g_rel: torch.Tensor
    g_scale: torch.Tensor  # (1,) fp32: max |g|
    uniform: bool

    @classmethod
    def of(cls, grad_rows: torch.Tensor, kept: torch.Tensor) -> UpstreamGradient:
        g = torch.where(kept, grad_rows.to(torch.float32), 0.0)
        g_scale = g.abs().amax().reshape(1)
        g_rel = torch.where(g_scale > 0, g / g_scale, 0.0)
        return cls(g, g_rel, g_scale, uniform=grad_rows.numel() == 1 or grad_rows.stride(0) == 0)


def vocabulary_order(E: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """(V,) int64, C's rows by average logit, largest first (paper section 4.3): the average of
    E_i . C_v over i is C_v . mean_i E_i, one (V, D) @ (D,) product, no logits. The sort ignores
    the soft cap, which is monotone."""
    E_mean = E.mean(dim=0, dtype=torch.float32).to(E.dtype)
    return torch.argsort(torch.mv(C, E_mean).float(), descending=True)


def fold_dC(dC, dC_rows, where, first, compensation):
    """dC[where] (+)= dC_rows (fp32), rounded to dC's dtype; ``compensation`` (Kahan) carries what
    each rounding lost to the next fold. dC_rows is used as scratch."""
    if not first:
        dC_rows += dC[where]
        if compensation is not None:
            dC_rows += compensation[where]
    rounded = dC_rows.to(dC.dtype)
    dC[where] = rounded
    if compensation is not None:
        compensation[where] = dC_rows.sub_(rounded).to(dC.dtype)
