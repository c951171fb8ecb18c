"""The library: our Cut Cross-Entropy in Triton, the loss of a linear head without its logits.
``linear_cross_entropy`` (autograd), its forward, three backward versions ("gemm", "atomic",
"sparse"; the ``backward`` package), the default "auto" that picks one per call (``auto``), its
vocabulary-parallel form over torch.distributed (``parallel``), the distillation divergence of a
student head from a teacher head (``distill``: ``linear_kl_div``), options, device limits and kernels.
It imports nothing of the package but ``helpers.spec``; start at ``api``."""

from helpers.cce.api import LinearCrossEntropy, LinearCrossEntropyFunction, linear_cross_entropy
from helpers.cce.auto import forget_backward_choices
from helpers.cce.backward import cce_backward
from helpers.cce.backward.atomic import atomic_chunks
from helpers.cce.backward.gemm import gemm_chunks, gemm_plan, product_mode
from helpers.cce.distill import linear_kl_div
from helpers.cce.forward import cce_forward, cce_forward_outputs
from helpers.cce.outputs import TokenOutputs, linear_cross_entropy_outputs
from helpers.cce.parallel import vocab_parallel_cross_entropy, vocab_parallel_outputs
from helpers.cce.options import (
    ACCUMULATIONS,
    BACKWARD_CHOICES,
    BACKWARD_IMPLS,
    FILTER_EPS_AUTO,
    CCEOptions,
    resolve_options,
    triton_reason,
    why_unavailable,
)

__all__ = [
    "linear_cross_entropy",
    "linear_cross_entropy_outputs",
    "linear_kl_div",
    "TokenOutputs",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_outputs",
    "LinearCrossEntropyFunction",
    "LinearCrossEntropy",
    "cce_forward",
    "cce_forward_outputs",
    "cce_backward",
    "forget_backward_choices",
    "CCEOptions",
    "resolve_options",
    "why_unavailable",
    "triton_reason",
    "ACCUMULATIONS",
    "BACKWARD_CHOICES",
    "BACKWARD_IMPLS",
    "FILTER_EPS_AUTO",
    "gemm_chunks",
    "gemm_plan",
    "atomic_chunks",
    "product_mode",
]
