"""The Triton kernels of our Cut Cross-Entropy (``helpers.cce``), one file per idea:

- ``logits.py``: the logit tile E_rows @ C_cols^T rebuilt on chip, shared by all kernels;
- ``indexed_dot.py``: Algorithm 1, the target logit z_{i, x_i};
- ``lse_forward.py``: Algorithm 2, the online log-sum-exp over vocabulary blocks;
- ``gradient.py``: the gradient G of a logit tile, shared by both backward kernels;
- ``backward_atomic.py``: the "atomic" backward, Algorithms 3-4 in one kernel with fp32 atomics;
- ``backward_gemm.py``: the "gemm" backward's kernel (the default), G written per vocabulary chunk
  for two cuBLAS products;
- ``configs.py``: the launch configurations, chosen by shared memory per block.
"""

from helpers.cce.kernels.backward_atomic import backward_atomic_kernel
from helpers.cce.kernels.backward_gemm import gradient_chunk_kernel
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
