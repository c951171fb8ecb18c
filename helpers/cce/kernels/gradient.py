"""The gradient of the loss with respect to a logit tile, shared by both backward kernels.

``gradient_tile`` rebuilds a (BLOCK_N, BLOCK_V) logit tile (``logit_tile``) and forms

    G = S (1 + 2 zl lse) - (1 - ls) [v = x] - ls / V,    S = exp(z - lse),

times 1 - (z / softcap)^2 under the soft cap, 0 at ignored rows and padding: the "atomic" kernel
(``backward_atomic.py``) and the "gemm" backward's G kernel (``backward_gemm.py``) call this one
function, so the two compute the same G to the bit. ``grouped_tile`` orders their programs as Triton
tutorial 03 does. Reference: autograd through ``helpers.spec.reference_loss``.
"""

import triton
import triton.language as tl

from helpers.cce.kernels.logits import logit_tile, tanh


@triton.jit
def grouped_tile(pid, N, v_count, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_N: tl.constexpr):
    """(pid_n, pid_v) of program ``pid`` over (N / BLOCK_N) x (v_count / BLOCK_V) tiles, in
    Triton tutorial 03's grouped order: GROUP_N row blocks in a row take turns over the vocabulary
    blocks, so a C strip is reused from L2 by GROUP_N programs."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_v = tl.cdiv(v_count, BLOCK_V)
    num_pid_in_group = GROUP_N * num_pid_v
    first_pid_n = (pid // num_pid_in_group) * GROUP_N
    group_size = tl.minimum(num_pid_n - first_pid_n, GROUP_N)
    pid_n = first_pid_n + (pid % num_pid_in_group) % group_size
    pid_v = (pid % num_pid_in_group) // group_size
    return pid_n, pid_v


@triton.jit
def gradient_tile(
    E_ptr, C_ptr, x_ptr, lse_ptr,  # E (N, D), C (V, D), x (N,), lse (N,) fp32
    rows, cols,  # (BLOCK_N,), (BLOCK_V,) int64 indices into E and C
    row_mask, col_mask,
    V, D,
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x,
    ignore_index, softcap, z_loss, label_smoothing,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """G = dloss_i / dz_{i, v} for the tile, (BLOCK_N, BLOCK_V) fp32, before the upstream
    gradient; 0 at ignored rows and padding. Shared by both backward kernels (this file's and
    ``backward_gemm.py``'s), so the two compute the same G."""
    # The logit tile, recomputed on chip (Algorithm 3, line 3).
    z = logit_tile(E_ptr, C_ptr, rows, cols, row_mask, col_mask, D,
                   stride_En, stride_Ed, stride_Cv, stride_Cd,
                   BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION)
    if HAS_SOFTCAP:
        t = tanh(z / softcap)
        z = softcap * t

    # G = S (1 + 2 zl lse) - (1 - ls) [v = x] - ls / V, then the soft cap's chain rule.
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    x = tl.load(x_ptr + rows * stride_x, mask=row_mask, other=ignore_index).to(tl.int64)
    kept = row_mask & (x != ignore_index)
    S = tl.exp(z - lse[:, None])
    is_target = x[:, None] == cols[None, :]
    G = (S * (1.0 + 2.0 * z_loss * lse)[:, None]
         - tl.where(is_target, 1.0 - label_smoothing, 0.0) - label_smoothing / V)
    if HAS_SOFTCAP:
        G = G * (1.0 - t * t)
    # Ignored rows and padding contribute nothing, and must not keep a tile from being skipped.
    return tl.where(kept[:, None] & col_mask[None, :], G, 0.0)
