"""Logits made by cuBLAS for the recompute design, on a tier whose Triton products are FMAs.

Triton from 3.3 compiles a 16-bit ``tl.dot`` for compute capability below 8.0 (a T4) as fp32 FMAs on
CUDA cores (``LaunchConfig.tensor_cores``), 8 TFLOP/s on a T4 where cuBLAS's fp16 products run on its
tensor cores at 65. The recompute design ("min") has two of its four N x V x D products in Triton: the
forward's lse (``lse_forward_kernel``) and the backward's G (``gradient_chunk_kernel``). On such a tier
(``HostTuning.logits_in_cublas_bytes`` > 0) both take their logits from cuBLAS instead and only read them
(``Z_GIVEN``), in fp32 (cuBLAS's fp32 output of 16-bit operands, ``helpers.cce.backward.gemm.product_mode``;
where this torch cannot give it, "rounded", the Triton products run):

- the forward: Z = E C[v0:v1]^T (N, V_c) a vocabulary chunk at a time into one buffer of that many bytes
  (more where so few columns would leave the GPU waiting on the host: ``chunk_columns``); the LSE kernel
  walks its columns as a split of its own, and each chunk's lse, non-target lse and logit sum are merged
  into the running ones as they come (the splits' rows stay O(N) however many chunks);
- the backward ("gemm"): per G chunk, Z of its rows, a piece of as many columns at a time, into one buffer;
  the G kernel reads each tile of it and writes G_c where it lives (``helpers.cce.backward.gemm``).

Everything after the logits is the same kernels' arithmetic, to the same fp32 logits as their own
products give (up to summation order): the bias added in fp32, the soft cap, the temperature, every loss
term and the filter. "auto" runs the dense backward on such a tier (the sparse one's gathered products stay
Triton's, ``helpers.cce.options``); the per-token outputs' row statistics keep the Triton forward. The
memory: the buffer, ``HostTuning.logits_in_cublas_bytes``, above the recompute design's own; the time and
memory models count it (``helpers.cce.schedules``). Reference: ``helpers.spec``
(``tests/cce/test_cublas_logits.py``).
"""

from __future__ import annotations

import math

from helpers.cce.kernels.configs import HostTuning, matmul_tflops


def chunk_columns(N: int, V: int, D: int, dtype, block_v: int, host: HostTuning) -> int:
    """The columns of one piece of (N, V) fp32 logits of inputs of ``dtype``, a multiple of ``block_v`` (tiles
    never cross a piece): the most whose bytes fit ``host.logits_in_cublas_bytes``, but at least as many as
    keep the GPU busy for ``host.g_chunk_host_us`` (the piece's product at the tier's cuBLAS rate, its logits
    written and read at its bandwidth), the host's time for one piece, so that pieces do not leave the GPU
    waiting on their launches; at least one tile, at most V's tiles.

    Why the floor: on an H100 as a T4 (fp16, the Qwen3 head, 16,384 tokens) 16 MiB pieces are 256 columns,
    594 a pass, and the host took ~130 us a piece (a cuBLAS call, a Triton launch, the forward's merges): the
    step 155 ms against 54 ms of GPU work, 44 ms with 256 MiB pieces (docs/measurements/h100-2026-12-06c).
    A T4's GPU takes ~0.24 ms for such a piece (``HostTuning``'s datasheet rates), a host as slow as that
    keeps it waiting."""
    per_column_s = N * (2 * D / (matmul_tflops(host, dtype) * 1e12) + 2 * 4 / (host.bandwidth_gbs * 1e9))
    busy = math.ceil(host.g_chunk_host_us * 1e-6 / per_column_s) if host.g_chunk_host_us > 0 else 0
    fit = host.logits_in_cublas_bytes // max(1, N * 4) // block_v * block_v  # rounded down: within the bytes
    cols = max(block_v, fit, -(-busy // block_v) * block_v)  # rounded up: at least that busy
    return min(cols, -(-V // block_v) * block_v)
