"""The forward pass: Algorithm 1 (the indexed dot) and Algorithm 2 (the online log-sum-exp).

``indexed_dot_kernel`` on a grid of N / BLOCK_N programs gives z_{i, x_i}; ``lse_forward_kernel``
on a (N / BLOCK_N, SPLITS) grid gives each row's log-sum-exp over one split of the vocabulary, the
splits merged with a logsumexp here (SPLITS fills the GPU when N alone would not; its buffer is
SPLITS * N * 4 bytes). What the backward needs from the forward is the lse: N * 4 bytes.
"""

from __future__ import annotations

import torch
import triton

from helpers.cce.device import device_info
from helpers.cce.kernels.configs import CCEConfigs
from helpers.cce.kernels.indexed_dot import indexed_dot_kernel
from helpers.cce.kernels.lse_forward import lse_forward_kernel
from helpers.cce.options import CCEOptions, dot_precision, resolve_configs


def cce_forward(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    options: CCEOptions = CCEOptions(),
    configs: CCEConfigs | str | None = None,
    v_splits: int | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row (N,) fp32, 0 at ignored rows; lse (N,) fp32), from Algorithms 1 and 2.

    ``v_splits``: vocabulary splits of the LSE grid; None picks enough to fill the device.
    ``bias``: the head's bias (V,), added to every row's logits; None for none.
    """
    N, D = E.shape
    V = C.shape[0]
    o = options
    fwd, _, dot_cfg = resolve_configs(configs, E.device).for_dtype(E.dtype)
    softcap = o.softcap if o.softcap is not None else 1.0

    # Algorithm 1: z_{i, x_i}, (N,).
    target_logit = torch.empty(N, dtype=torch.float32, device=E.device)
    indexed_dot_kernel[(triton.cdiv(N, dot_cfg.BLOCK_N),)](
        E, C, x, target_logit, bias if bias is not None else target_logit,
        N, D,
        E.stride(0), E.stride(1), C.stride(0), C.stride(1), x.stride(0),
        o.ignore_index, softcap,
        HAS_SOFTCAP=o.softcap is not None,
        HAS_BIAS=bias is not None,
        **dot_cfg.tiles("BLOCK_N", "BLOCK_D"), **dot_cfg.launch,
    )

    # Algorithm 2: lse over vocabulary splits, (SPLITS, N), then merged.
    n_blocks = triton.cdiv(N, fwd.BLOCK_N)
    v_blocks = triton.cdiv(V, fwd.BLOCK_V)
    if v_splits is None:
        programs_wanted = 4 * _multiprocessors(E.device)
        v_splits = triton.cdiv(programs_wanted, n_blocks)
    blocks_per_split = triton.cdiv(v_blocks, max(1, min(v_splits, v_blocks)))
    v_splits = triton.cdiv(v_blocks, blocks_per_split)
    lse_split = torch.empty(v_splits, N, dtype=torch.float32, device=E.device)
    smoothing = o.label_smoothing > 0
    logit_sum_split = torch.empty_like(lse_split) if smoothing else lse_split
    lse_forward_kernel[(n_blocks, v_splits)](
        E, C, bias if bias is not None else lse_split, lse_split, logit_sum_split,
        N, V, D, blocks_per_split,
        E.stride(0), E.stride(1), C.stride(0), C.stride(1),
        softcap,
        HAS_SOFTCAP=o.softcap is not None,
        HAS_BIAS=bias is not None,
        SUM_LOGITS=smoothing,
        DOT_PRECISION=dot_precision(E.dtype),
        **fwd.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D"), **fwd.launch,
    )
    lse = torch.logsumexp(lse_split, dim=0) if v_splits > 1 else lse_split[0]

    loss = lse - (1.0 - o.label_smoothing) * target_logit
    if smoothing:
        loss = loss - (o.label_smoothing / V) * logit_sum_split.sum(dim=0)
    if o.z_loss:
        loss = loss + o.z_loss * lse * lse
    return torch.where(x != o.ignore_index, loss, 0.0), lse


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return device_info(device).multiprocessors
    return 1  # the interpreter runs programs one by one: a couple of splits just exercise the merge
