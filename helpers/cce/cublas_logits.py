"""Logits made by cuBLAS for the recompute design, on a tier whose Triton products are FMAs.

Triton from 3.3 compiles a 16-bit ``tl.dot`` for compute capability below 8.0 (a T4) as fp32 FMAs on
CUDA cores (``LaunchConfig.tensor_cores``), 8 TFLOP/s on a T4 where cuBLAS's fp16 products run on its
tensor cores at 65. The recompute design ("min") has two of its four N x V x D products in Triton: the
forward's lse (``lse_forward_kernel``) and the backward's G (``gradient_chunk_kernel``). On such a tier
(``HostTuning.logits_in_cublas_bytes`` > 0) both take their logits from cuBLAS instead, a vocabulary chunk
at a time, and only read them (``Z_GIVEN``):

- the forward: Z = E C[v0:v1]^T (N, V_c) in E's dtype into a buffer of at most that many bytes, then the
  LSE kernel walks those columns as one split (its splits are the chunks, merged as before);
- the backward ("gemm"): Z = E_r C[v0:v1]^T written where G_c would live (dE's or dC's unwritten rows, or
  the G buffer: the same bytes), and the G kernel reads each tile and writes G over it.

Everything after the logits is the same kernels' arithmetic: the bias added in fp32, the soft cap, the
temperature, every loss term and the filter. What changes is that the logits are rounded once to the
inputs' dtype, as the naive path and the three-product schedule (``helpers.cce.forward_grads``) round
them: fp16 logits could overflow where |z| passes fp16's range, so fp16 inputs use cuBLAS only where
``logits_bound`` (Cauchy-Schwarz, one host read; C's part kept for the backward of the same step) is
within ``HostTuning.fp16_logit_limit``, and never where the host may not read the device (torch.compile,
a CUDA graph's capture): the Triton products there. bf16 has fp32's range. fp32 inputs keep Triton's
products (a T4's cuBLAS runs fp32 on the same CUDA cores). Reference: ``helpers.spec``
(``tests/cce/test_cublas_logits.py``).
"""

from __future__ import annotations

import torch

from helpers.cce.kernels.configs import HostTuning
from helpers.cce.shared import no_host_sync


def logits_bound(E: torch.Tensor, C: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bound on every |z|, max ||E_i|| max ||C_v|| + max |b| (Cauchy-Schwarz), as a device scalar:
    one pass over E and C. Where it passes ``HostTuning.fp16_logit_limit``, fp16 logits could overflow."""
    bound = (torch.linalg.vector_norm(E, dim=1, dtype=torch.float32).amax()
             * _largest_row_norm(C))
    return bound + bias.abs().amax().float() if bias is not None else bound


# C's largest row norm for the C seen last (its storage, version and shape): the forward and the backward of
# one step read the same C, so the backward's bound costs no second pass over it.
_C_NORM: dict = {}


def _largest_row_norm(C: torch.Tensor) -> torch.Tensor:
    key = (C.data_ptr(), C._version, tuple(C.shape), C.dtype, C.device)
    if key not in _C_NORM:
        _C_NORM.clear()
        _C_NORM[key] = torch.linalg.vector_norm(C, dim=1, dtype=torch.float32).amax()
    return _C_NORM[key]


def uses_cublas_logits(E: torch.Tensor, C: torch.Tensor, bias: torch.Tensor | None, host: HostTuning) -> bool:
    """Whether this call's recompute products take their logits from cuBLAS (module doc): the tier says so,
    the inputs are 16-bit, and fp16's logits are bounded within its range (a host read) where one may be made."""
    if host.logits_in_cublas_bytes <= 0 or E.dtype not in (torch.float16, torch.bfloat16):
        return False
    if E.dtype == torch.bfloat16:
        return True
    if no_host_sync(E):
        return False
    return float(logits_bound(E.detach(), C.detach(), bias.detach() if bias is not None else None)) <= (
        host.fp16_logit_limit)


def written_product(out, a, b, *, alpha: float, mode: str, bias=None):
    """out = alpha a @ b (+ bias) from an fp32 sum, rounded once to out's dtype (fp32 logits of 16-bit
    operands: ``fp32_product``). On the CPU the operands are copied to fp32 (exact products for the
    tests, as ``product_mode``'s "upcast")."""
    from helpers.cce.backward.gemm import fp32_product

    if out.dtype == torch.float32 and a.dtype != torch.float32:
        fp32_product(out, a, b, alpha=alpha, accumulate=False, mode=mode)
        if bias is not None:
            out += bias.float()
    elif out.device.type != "cuda":
        product = torch.mm(a.float(), b.float())
        if bias is not None:
            product += bias.float()
        out.copy_(product.mul_(alpha) if alpha != 1.0 else product)
    elif bias is not None:
        torch.addmm(bias, a, b, alpha=alpha, out=out)
    else:
        torch.addmm(out, a, b, beta=0.0, alpha=alpha, out=out)  # beta = 0: out's contents ignored


def chunk_columns(N: int, V: int, itemsize: int, block_v: int, host: HostTuning) -> int:
    """The forward's vocabulary chunk: the most columns, a multiple of ``block_v`` (its tiles never cross
    a chunk), whose (N, columns) logits fit ``host.logits_in_cublas_bytes``; at least one tile."""
    cols = host.logits_in_cublas_bytes // max(1, N * itemsize) // block_v * block_v
    return min(max(block_v, cols), -(-V // block_v) * block_v)
