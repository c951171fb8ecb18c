"""The Triton kernels of our Cut Cross-Entropy (``helpers.cce``), one file per idea:

- ``logits.py``: the logit tile E_rows @ C_cols^T rebuilt on chip, shared by all kernels;
- ``indexed_dot.py``: Algorithm 1, the target logit z_{i, x_i};
- ``lse_forward.py``: Algorithm 2, the online log-sum-exp over vocabulary blocks; ``lse_forward_pingpong.py``:
  its plain case on Hopper, warp-specialized (Gluon);
- ``gradient_tile.py``: the gradient G of a logit tile, shared by every backward kernel;
- ``gradient_chunk.py``: G written per vocabulary chunk, for the "gemm" backward's two cuBLAS
  products; ``gradient_chunk_pingpong.py``: the same G for 16-bit chunks on Hopper, warp-specialized
  (Gluon);
- ``row_gradient.py``: a row's lse, loss and G over a chunk of whole rows of logits (the three-product
  schedule, ``helpers.cce.forward_grads``);
- ``row_loss.py``: the forward's last step, each row's lse from its splits, its loss, and the kept
  and out-of-range counts, in one launch; ``row_weights.py``: each row's upstream weight and gradient
  coefficients for the backward, in two (with few tokens the host's launches bound the loss);
- ``atomic_gradients.py``: dE and dC added with fp32 atomics, Algorithms 3-4 in one kernel (the
  "atomic" backward);
- ``pair_list.py``: the marked (row, tile) pairs of the forward's activity bits, listed by tile;
- ``pair_gradients.py``: G, dE and dC of the marked pairs only (the "sparse" backward);
- ``configs.py``: the launch configurations, chosen by shared memory per block.
"""

from helpers.cce.kernels.atomic_gradients import backward_atomic_kernel
from helpers.cce.kernels.gradient_chunk import gradient_chunk_kernel
from helpers.cce.kernels.configs import CCEConfigs, LaunchConfig, select_configs
from helpers.cce.kernels.indexed_dot import indexed_dot_kernel
from helpers.cce.kernels.lse_forward import lse_forward_kernel

__all__ = [
    "CCEConfigs",
    "LaunchConfig",
    "backward_atomic_kernel",
    "gradient_chunk_kernel",
    "indexed_dot_kernel",
    "lse_forward_kernel",
    "select_configs",
]
