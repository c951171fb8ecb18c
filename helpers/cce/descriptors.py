"""Tensor descriptors: how the kernels read E and C (and write G) through Hopper's copy engine (TMA).

A kernel whose launch configuration asks for it (``LaunchConfig.tma``, the Hopper tier) receives
``triton.tools.tensor_descriptor.TensorDescriptor`` objects instead of pointers for its dense
operands: the copy engine moves each (rows, BLOCK_D) block into shared memory without address
arithmetic in the warps (a pointer-fed 128 x 256 logit tile spends ~70 more registers a thread on
addresses), and fills whatever lies beyond the tensor's bounds with zeros (the D tail, the last
row block, the last vocabulary tile). A tensor the copy engine cannot read (a last stride other
than 1, a base or row stride not a multiple of 16 bytes) is passed as itself and read with
pointer loads, to the same result: the kernels compile both ways (``E_DESC``, ``G_DESC``).
A gathered C (the sorted vocabulary) is always a pointer: Hopper's TMA reads boxes, not lists of rows.
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def tma_ready(t: torch.Tensor) -> bool:
    """Whether the copy engine can read ``t`` (2-D): unit last stride, 16-byte aligned base and
    row stride, and no empty dimension."""
    return (t.dim() == 2 and t.shape[0] > 0 and t.shape[1] > 0 and t.stride(1) == 1
            and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0)


def block_descriptor(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor | None:
    """A descriptor of ``t`` in (rows, cols) blocks, or None where ``tma_ready`` says no."""
    return TensorDescriptor.from_tensor(t, [rows, cols]) if tma_ready(t) else None


def operand_descriptors(E: torch.Tensor, C: torch.Tensor, cfg, gathered: bool):
    """(E's argument, C's argument, whether they are descriptors) for a kernel with ``cfg``'s tiles
    (E in (BLOCK_N, BLOCK_D) blocks, C in (BLOCK_V, BLOCK_D)): descriptors when ``cfg.tma`` and
    the copy engine can read both, the tensors themselves otherwise (and for ``cfg`` None). C
    stays a pointer when ``gathered`` (its rows read in the sorted order)."""
    if cfg is None or not cfg.tma:
        return E, C, False
    E_desc = block_descriptor(E, cfg.BLOCK_N, cfg.BLOCK_D)
    C_desc = C if gathered else block_descriptor(C, cfg.BLOCK_V, cfg.BLOCK_D)
    if E_desc is None or C_desc is None:
        return E, C, False
    return E_desc, C_desc, True
