"""Logits made by cuBLAS for the recompute design, on a tier whose Triton products are FMAs.

Triton from 3.3 compiles a 16-bit ``tl.dot`` for compute capability below 8.0 (a T4) as fp32 FMAs on
CUDA cores (``LaunchConfig.tensor_cores``), 8 TFLOP/s on a T4 where cuBLAS's fp16 products run on its
tensor cores at 65. The recompute design ("min") has two of its four N x V x D products in Triton: the
forward's lse (``lse_forward_kernel``) and the backward's G (``gradient_chunk_kernel``). On such a tier
(``HostTuning.logits_in_cublas_bytes`` > 0) both take their logits from cuBLAS instead and only read them
(``Z_GIVEN``), in fp32 (cuBLAS's fp32 output of 16-bit operands, ``helpers.cce.backward.gemm.product_mode``;
where this torch cannot give it, "rounded", the Triton products run):

- the forward: Z = E C[v0:v1]^T (N, V_c) a vocabulary chunk at a time into one buffer of at most that many
  bytes; the LSE kernel walks its columns as a split of its own, and each chunk's lse, non-target lse and
  logit sum are merged into the running ones as they come (the splits' rows stay O(N) however many chunks);
- the backward ("gemm"): per G chunk, Z of its rows, a piece of at most that many bytes at a time, into one
  buffer; the G kernel reads each tile of it and writes G_c where it lives (``helpers.cce.backward.gemm``).

Everything after the logits is the same kernels' arithmetic, to the same fp32 logits as their own
products give (up to summation order): the bias added in fp32, the soft cap, the temperature, every loss
term and the filter. "auto" runs the dense backward on such a tier (the sparse one's gathered products stay
Triton's, ``helpers.cce.options``); the per-token outputs' row statistics keep the Triton forward. The
memory: the buffer, ``HostTuning.logits_in_cublas_bytes``, above the recompute design's own; the time and
memory models count it (``helpers.cce.schedules``). Reference: ``helpers.spec``
(``tests/cce/test_cublas_logits.py``).
"""

from __future__ import annotations

from helpers.cce.kernels.configs import HostTuning


def chunk_columns(N: int, V: int, itemsize: int, block_v: int, host: HostTuning) -> int:
    """The most columns, a multiple of ``block_v`` (tiles never cross a chunk), whose (N, columns) logits of
    ``itemsize`` bytes fit ``host.logits_in_cublas_bytes``; at least one tile, at most V's tiles."""
    cols = host.logits_in_cublas_bytes // max(1, N * itemsize) // block_v * block_v
    return min(max(block_v, cols), -(-V // block_v) * block_v)
