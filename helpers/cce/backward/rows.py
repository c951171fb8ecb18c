"""What the three backwards share: each row's gradient, and the fold of dC's fp32 rows into dC.

Each row's gradient. Row i's loss carries an upstream gradient g_i (1/N_kept for a mean, the
caller's vector for "none", 0 at ignored rows) and, when the caller backpropagates through the
returned lse, h_i. The gradient with respect to the row's logits is then

    g_i [S (1 + 2 zl lse_i) - (1 - ls) [v = x_i] - ls / V] + h_i S = w_i (a_i S - b_i [v = x_i] - c_i / V)

with w_i = max(|g_i|, |h_i|) and a, b, c the coefficients that remain (each of size about 1). The
kernels take the target column's value whole, t_i = a_i S_{i, x_i} - b_i = (a_i - b_i) - a_i r_i, from
r_i = 1 - S_{i, x_i}, the row's non-target mass the forward sums (``helpers.cce.kernels.gradient_tile``:
at S_x near 1, a S_x - b formed in a kernel is a difference of rounded numbers). So ``coef`` holds
a, t, c (and the entropy's d). The
kernels form the bracket, G, unscaled by w: in fp16, w = 1/N times a softmax entry of ~1e-6 falls
below fp16's smallest subnormal (6e-8) and rounds to zero, whatever a trainer's loss scale does
later. So dE's products take G and the rows are scaled by w afterwards in fp32, and dC's products
take w_rel E (w_rel = w / max w, exact for a mean or a sum) with max w applied to the fp32 result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from helpers.cce.class_weights import target_weights
from helpers.cce.kernels.row_weights import ONE_PROGRAM_ROWS, row_scale_kernel, row_weights_kernel
from helpers.cce.options import CCEOptions

ROW_BLOCK = 1024  # rows per program of the row-weight kernels


@dataclass(frozen=True)
class RowGradient:
    """The upstream gradient of every row, as the kernels take it (module doc)."""

    w: torch.Tensor  # (N,) fp32 >= 0, applied to the products' fp32 results
    w_rel: torch.Tensor  # (N,) fp32, w / w_scale
    w_scale: torch.Tensor  # (1,) fp32, max w
    uniform: bool  # every row has the same w: a mean or a sum, no gradient through the lse
    coef: torch.Tensor  # (3, N) fp32: a, t, c of each row (module doc); (4, N) with the entropy's d (``of_outputs``)

    @classmethod
    def of(cls, grad_rows: torch.Tensor | None, grad_lse: torch.Tensor | None, labels: torch.Tensor, ignore: int,
           lse: torch.Tensor, nontarget: torch.Tensor, o: CCEOptions, divisor: torch.Tensor | None = None
           ) -> RowGradient:
        """grad_rows: the loss's upstream gradient per row, (N,), or one value for every row (a scalar, or
        an expanded one: a mean or a sum), any float dtype, or None (no gradient into the loss);
        labels, ignore: a row is kept where labels != ignore (x and ignore_index; or a kept mask and 0);
        divisor: None, or a mean's n_kept (an int64 scalar): its rows get grad_rows / max(n_kept, 1);
        grad_lse: (N,) the gradient flowing into the returned lse, or None; nontarget: (2N,) fp32, each
        row's r = 1 - S_x and its lse's rounding lo from the forward (``cce_forward``'s r). One launch up to
        ``ONE_PROGRAM_ROWS`` rows, two past it (``helpers.cce.kernels.row_weights``: with few tokens the
        host's launches bound the backward, so the kept mask and the mean's division are made there too)."""
        N = lse.shape[0]
        device = lse.device
        if nontarget.shape != (2 * N,) or not nontarget.is_contiguous():
            raise ValueError(f"nontarget must be cce_forward's r, contiguous ({2 * N},), got {tuple(nontarget.shape)}")
        # w, w_rel, coef's three rows and w_scale in one allocation, each 16-byte aligned as an allocation of
        # its own is (the kernels specialise on their pointers' alignment).
        n = -(-N // 4) * 4
        rows = torch.empty(5 * n + 1, dtype=torch.float32, device=device)
        w, w_rel, w_scale = rows[:N], rows[n:n + N], rows[5 * n:]
        coef = rows[2 * n:5 * n].view(3, n)[:, :N]
        one_program = N <= ONE_PROGRAM_ROWS  # one launch (``row_weights``' doc)
        blocks = 1 if one_program else triton.cdiv(N, ROW_BLOCK)
        block_max = w_scale if one_program else torch.empty(blocks, dtype=torch.float32, device=device)
        uniform = grad_lse is None and (grad_rows is None or grad_rows.numel() == 1 or grad_rows.stride(0) == 0)
        g = grad_rows.expand(N) if grad_rows is not None else lse
        row_weights_kernel[(blocks,)](
            g, grad_lse if grad_lse is not None else lse, labels, divisor if divisor is not None else labels, lse,
            nontarget, w, coef, block_max, w_rel, w_scale,
            N, g.stride(0), grad_lse.stride(0) if grad_lse is not None else 0, labels.stride(0), ignore,
            coef.stride(0), float(o.z_loss), float(o.label_smoothing), HAS_G=grad_rows is not None,
            HAS_H=grad_lse is not None, DIVIDE=divisor is not None, BLOCK=ROW_BLOCK, ONE_PROGRAM=one_program)
        if not one_program:
            row_scale_kernel[(blocks,)](w, block_max, w_rel, w_scale, N, blocks, BLOCK=ROW_BLOCK, MAX_BLOCK=1024)
        return cls(w, w_rel, w_scale, uniform, coef)

    @classmethod
    def of_outputs(cls, grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                   kept: torch.Tensor, entropy: torch.Tensor, nontarget: torch.Tensor) -> RowGradient:
        """The rows of the per-token outputs (``helpers.cce.outputs``): upstream gradients g into
        logprob = z_x - lse and e into the entropy H = lse - sum_v S_v z_v, each (N,) or None. With
        dlogprob/dz_v = [v = x] - S_v and dH/dz_v = -S_v (z_v - lse + H),

            G = g [v = x] - (g + e H) S - e S (z - lse) = w (a S - b [v = x] + d S (z - lse)),

        a = -(g + e H) / w, b = -g / w, c = 0, d = -e / w, w = max(|g|, |e|): coef (4, N), whose fourth
        row the kernels read with ENTROPY (``gradient_tile``). Its second row is the target column's
        a S_x - b + d S_x log S_x with S_x = 1 - r, log S_x = log1p(-r) (module doc), a - b = -e H / w."""
        zeros = torch.zeros_like(entropy)
        g = torch.where(kept, grad_logprob.to(torch.float32), 0.0) if grad_logprob is not None else zeros
        e = torch.where(kept, grad_entropy.to(torch.float32), 0.0) if grad_entropy is not None else zeros
        w = torch.maximum(g.abs(), e.abs())
        safe = torch.where(w > 0, w, 1.0)
        a, d = -(g + e * entropy) / safe, -e / safe
        r = nontarget.to(torch.float32)
        s_log_s = torch.where(r < 1.0, (1.0 - r) * torch.log1p(-r.clamp(max=1.0)), 0.0)  # 0 log 0 = 0
        t = -(e * entropy) / safe - a * r + d * s_log_s
        coef = torch.stack([a, t, zeros, d])
        w_scale = w.amax().reshape(1)
        w_rel = torch.where(w_scale > 0, w / w_scale, 0.0)
        return cls(w, w_rel, w_scale, False, coef)

    @classmethod
    def of_class_weights(cls, grad_rows: torch.Tensor, grad_lse: torch.Tensor | None, x: torch.Tensor,
                         ignore_index: int, weight: torch.Tensor, label_smoothing: float,
                         nontarget: torch.Tensor) -> RowGradient:
        """The rows of a loss with class weights w and label smoothing eps (``helpers.cce.class_weights``:
        row i's loss is already weighted, t_i = w_{x_i}, W = sum_c w_c; no z-loss in it): with g_i its
        upstream gradient and h_i the gradient into the lse,

            G = g [alpha S - beta [v = x] - eps w_v / V] + h S,  alpha = (1 - eps) t + eps W / V,  beta = (1 - eps) t,

        so a = (g alpha + h) / w, b = g beta / w (the kernels take t = (g eps W / V + h) / w - a r, module
        doc, and a exp(-lo), ``row_weights``), c = g eps / w, the kernels multiplying c / V by w_v
        (CLASS_WEIGHTS). w = max(|g| k, |h|) with k = max(|alpha|, |beta|, eps max|w_v| / V) keeps
        |a| <= 2, |b| <= 1 and each |c w_v| / V <= 1, negative weights included: G's entries stay of
        size ~1 in fp16 whatever the weights' scale, which w carries instead."""
        N = x.shape[0]
        kept = x != ignore_index
        eps, V = label_smoothing, weight.shape[0]
        g = (torch.where(kept, grad_rows.to(torch.float32).expand(N), 0.0) if grad_rows is not None else
             torch.zeros(N, dtype=torch.float32, device=x.device))
        h = grad_lse.to(torch.float32) if grad_lse is not None else torch.zeros_like(g)
        t = target_weights(x, weight, ignore_index)
        weight = weight.to(torch.float32)
        alpha, beta = (1.0 - eps) * t + (eps / V) * weight.sum(), (1.0 - eps) * t
        k = torch.maximum(torch.maximum(alpha.abs(), beta.abs()), (eps / V) * weight.abs().amax())
        w = torch.maximum(g.abs() * k, h.abs())
        safe = torch.where(w > 0, w, 1.0)
        a = (g * alpha + h) / safe
        r, lo = nontarget.to(torch.float32).view(2, -1)  # cce_forward's r: 1 - S_x and the lse's rounding
        t = (g * ((eps / V) * weight.sum()) + h) / safe - a * r
        coef = torch.stack([a * torch.exp(-lo), t, g * eps / safe])  # the softmax is S exp(-lo) (``row_weights``)
        w_scale = w.amax().reshape(1)
        w_rel = torch.where(w_scale > 0, w / w_scale, 0.0)
        return cls(w, w_rel, w_scale, False, coef)

    @classmethod
    def of_upstream(cls, grad_rows: torch.Tensor, kept: torch.Tensor) -> RowGradient:
        """The rows of a loss whose kernel forms the whole bracket itself (``helpers.cce.distill``'s
        divergences): w = |g| and one coefficient, coef (1, N) = sign(g), 0 at rows not kept."""
        g = torch.where(kept, grad_rows.to(torch.float32), 0.0)
        w = g.abs()
        w_scale = w.amax().reshape(1)
        w_rel = torch.where(w_scale > 0, w / w_scale, 0.0)
        uniform = grad_rows.numel() == 1 or grad_rows.stride(0) == 0
        return cls(w, w_rel, w_scale, uniform, torch.sign(g)[None])


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
