"""The Triton kernels of our Cut Cross-Entropy (``helpers.cce``), one file per idea:

- ``logits.py``: the logit tile E_rows @ C_cols^T rebuilt on chip, shared by all kernels;
- ``indexed_dot.py``: Algorithm 1, the target logit z_{i, x_i};
- ``lse_forward.py``: Algorithm 2, the online log-sum-exp over vocabulary blocks;
- ``backward.py``: Algorithms 3-4, dE and dC with the gradient filter (version 1, fp32 atomics);
- ``backward_gemm.py``: backward version 2 (the default), G written per vocabulary chunk for two
  cuBLAS products;
- ``configs.py``: the launch configurations, chosen by shared memory per block.
"""

from helpers.kernels.backward import cce_backward_kernel
from helpers.kernels.backward_gemm import cce_gradient_chunk_kernel
from helpers.kernels.configs import CCEConfigs, LaunchConfig, select_configs
from helpers.kernels.indexed_dot import indexed_dot_kernel
from helpers.kernels.lse_forward import lse_forward_kernel

__all__ = [
    "CCEConfigs",
    "LaunchConfig",
    "cce_backward_kernel",
    "cce_gradient_chunk_kernel",
    "indexed_dot_kernel",
    "lse_forward_kernel",
    "select_configs",
]
