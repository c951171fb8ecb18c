"""The registry's peers (``helpers.compare.methods``): other projects' kernels, each behind an
adapter with the registry's signature. Liger-Kernel, Apple's Cut Cross-Entropy (and its presets),
PyTorch's own F.linear_cross_entropy. Where a peer's convention differs from torch's, its adapter
maps it and says so in the entry's ``notes``.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from helpers.cce import triton_reason
from helpers.compare.methods.entry import Method, Reason


# ---------------------------------------------------------------------------------------------
# Conventions and formulas shared by several peers
# ---------------------------------------------------------------------------------------------


def _all_ignored_mean_is_nan(loss: torch.Tensor, x: torch.Tensor, ignore_index: int, reduction: str):
    """torch's convention for a mean over zero kept tokens (0/0 = NaN), gradients left untouched."""
    if reduction == "mean" and not bool((x != ignore_index).any()):
        return loss + torch.full_like(loss, float("nan")).detach()
    return loss


def floor_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None) -> int:
    # No formula beyond the floor: the gradients plus O(N) per-row state, which is what these
    # methods are designed to reach (Apple CCE measured within 0.5% of it on an H200).
    return (N * D + V * D) * b


# ---------------------------------------------------------------------------------------------
# liger: Liger-Kernel's fused linear cross-entropy (gradients computed during the forward pass).
# ---------------------------------------------------------------------------------------------


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def liger_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(
        E, C, x, ignore_index=ignore_index, reduction=reduction, softcap=softcap
    )
    return _all_ignored_mean_is_nan(loss, x, ignore_index, reduction)


def _liger_reason(device, dtype, softcap) -> Reason:
    if not _installed("liger_kernel"):
        return "liger-kernel is not installed (pip install liger-kernel)"
    reason = triton_reason(device, dtype)
    if reason:
        return reason
    if device.type == "cpu" and softcap is not None:
        return "Liger's softcap path fails under the Triton interpreter (it calls .to() on a Python float)"
    return None


def liger_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None) -> int:
    # liger_kernel.ops.fused_linear_cross_entropy: dE and dC (input dtype) computed during the
    # forward pass, over row chunks whose (rows, V) logits are about the size of E:
    # rows = next_pow2(ceil(N / ceil(V / D))). The kernel writes the logits' gradient over the
    # logits. dC accumulates in place (addmm) only on CUDA sm_80+ in fp16/bf16. Elsewhere each
    # chunk adds `mm(G^T, E_chunk).float()` to dC: a (V, D) matmul result and its fp32 copy (one
    # tensor in fp32). On the CPU, adding that fp32 tensor into a 16-bit dC in place allocates two
    # more fp32 (V, D) temporaries (CUDA casts inside the kernel instead).
    rows = min(N, _next_power_of_2(math.ceil(N / math.ceil(V / D))))
    if capability is not None and capability >= (8, 0) and b == 2:
        temporaries = 0
    elif b == 4:
        temporaries = V * D * 4
    elif capability is not None:
        temporaries = V * D * (b + 4)
    else:
        temporaries = V * D * (4 + 2 * 4)
    return (N * D + V * D) * b + rows * V * b + temporaries + N * 4


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


LIGER = Method(
    name="liger",
    kind="peer",
    label="Liger",
    summary="Liger-Kernel's fused linear cross-entropy: chunks over rows and computes dE, dC "
    "during the forward pass, so backward only scales them.",
    implementation=liger_loss,
    availability=_liger_reason,
    notes="Liger returns 0 for a mean over zero kept tokens; the adapter returns NaN as torch does. "
    "Liger 0.8.5 computes no dC when E does not require a gradient (a head trained on frozen "
    "features does not train); notebook 03 shows it.",
    peak_bytes=liger_peak_bytes,
    peak_formula=("(N·D + V·D)·b + a (chunk, V) logit block of about N·D elements, + (V, D) "
             "temporaries for dC except on sm_80+ in 16-bit"),
)


# ---------------------------------------------------------------------------------------------
# apple_cce: Apple's Cut Cross-Entropy (the cut-cross-entropy package).
# ---------------------------------------------------------------------------------------------

# Shared memory its backward kernel asks for with 128×128×32 tiles (98,304 B for fp16 with Triton
# 3.4-3.9, compiled for sm_75). tests/cce/test_configs.py re-derives the figure by compiling it.
APPLE_CCE_BACKWARD_SHARED_BYTES = {torch.float16: 98_304, torch.bfloat16: 98_304}


def apple_cce_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(
        E, C, x.long(), ignore_index=ignore_index, softcap=softcap, reduction=reduction
    )


def _apple_cce_reason(device, dtype, softcap) -> Reason:
    if not _installed("cut_cross_entropy"):
        return "cut-cross-entropy is not installed (pip install cut-cross-entropy)"
    if device.type != "cuda":
        return (
            "Apple CCE's Triton kernels need a CUDA GPU (they fail under the Triton interpreter); "
            "this is a CPU"
        )
    if dtype == torch.float32:
        return "cut-cross-entropy's backward accepts only fp16 or bf16 embeddings (it asserts so)"
    from helpers.cce.device import device_info

    info = device_info(device)
    need = APPLE_CCE_BACKWARD_SHARED_BYTES[dtype]
    if info.shared_memory_per_block_bytes < need:
        return (
            f"Apple CCE's backward kernel needs about {need // 1024} KB of shared memory per block; "
            f"this {info.name} offers {info.shared_memory_per_block_bytes // 1024} KB"
        )
    if dtype == torch.bfloat16 and not info.has_bf16_matmul:
        return f"bf16 needs an Ampere or newer GPU; this {info.name} has no bf16 tensor cores"
    return None


APPLE_CCE = Method(
    name="apple_cce",
    kind="peer",
    label="Apple CCE",
    summary="Apple's Cut Cross-Entropy (cut-cross-entropy package, default gradient filter): "
    "never materialises logits; recomputes them blockwise in backward.",
    implementation=apple_cce_loss,
    availability=_apple_cce_reason,
    peak_bytes=floor_peak_bytes,
    peak_formula="(N·D + V·D)·b: the floor (its O(N) LSE not counted)",
)


# ---------------------------------------------------------------------------------------------
# torch_lce: PyTorch's own F.linear_cross_entropy with chunking (torch 2.13 and newer).
# ---------------------------------------------------------------------------------------------


def torch_lce_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    # torch falls back to the unchunked reference path, with only a warning, for configurations its
    # chunked path does not support; that would be a silent swap, so it is turned into an error.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return F.linear_cross_entropy(
            E,
            C,
            x.long(),
            reduction=reduction,
            ignore_index=ignore_index,
            options=torch.nn.LinearCrossEntropyOptions(),
        )


def _torch_lce_reason(device, dtype, softcap) -> Reason:
    if not hasattr(F, "linear_cross_entropy"):
        return f"needs PyTorch 2.13 or newer for F.linear_cross_entropy; this is {torch.__version__}"
    if softcap is not None:
        return "F.linear_cross_entropy has no soft cap"
    return None


TORCH_LCE = Method(
    name="torch_lce",
    kind="peer",
    label="torch LCE",
    summary="PyTorch's F.linear_cross_entropy with LinearCrossEntropyOptions() (chunked path).",
    implementation=torch_lce_loss,
    availability=_torch_lce_reason,
)


# ---------------------------------------------------------------------------------------------
# Apple CCE's presets for pretraining. The paper recommends "CCE-Kahan-FullC" there:
# Kahan summation for the bf16 gradient accumulators and no filter on dC, so that rare tokens'
# classifier rows keep their small gradients. Apple's own code (GitHub, 25.6+) offers it as
# impl="cce_kahan_full_c"; the PyPI package 25.1.1 is a fork of 24.12.1 without it (no Kahan, no
# fp32 accumulation, no per-gradient filter), and offers only the filter's threshold.
# ---------------------------------------------------------------------------------------------

APPLE_KAHAN_FULL_C_IMPL = "cce_kahan_full_c"


def apple_cce_impls() -> set[str]:
    """The ``impl=`` values the installed cut-cross-entropy accepts (lower case): its
    ``LinearCrossEntropyImpl`` members, which both the PyPI fork and Apple's code export."""
    from cut_cross_entropy import LinearCrossEntropyImpl

    return {name.lower() for name in LinearCrossEntropyImpl.__members__}


def _apple_cce_kahan_full_c_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(E, C, x.long(), ignore_index=ignore_index, softcap=softcap, reduction=reduction,
                                impl=APPLE_KAHAN_FULL_C_IMPL)


def _apple_cce_kahan_full_c_reason(device, dtype, softcap) -> Reason:
    if _installed("cut_cross_entropy") and APPLE_KAHAN_FULL_C_IMPL not in apple_cce_impls():
        import importlib.metadata

        version = importlib.metadata.version("cut-cross-entropy")
        return (f"cut-cross-entropy {version} has no Kahan-FullC (impl={APPLE_KAHAN_FULL_C_IMPL!r}, the paper's "
                "setting for pretraining): it is in Apple's own code (pip install "
                "'cut-cross-entropy @ git+https://github.com/apple/ml-cross-entropy.git'), not in the PyPI fork")
    return _apple_cce_reason(device, dtype, softcap)


APPLE_CCE_KAHAN_FULL_C = Method(
    name="apple_cce_kahan_full_c",
    kind="peer",
    label="Apple CCE (Kahan-FullC)",
    summary="Apple CCE as its paper recommends for pretraining: Kahan-compensated gradient accumulation and "
    "no filter on dC (impl='cce_kahan_full_c'; Apple's GitHub code, not the PyPI fork).",
    implementation=_apple_cce_kahan_full_c_loss,
    availability=_apple_cce_kahan_full_c_reason,
    preset_of="apple_cce",
)


def _apple_cce_nofilter_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(E, C, x.long(), ignore_index=ignore_index, softcap=softcap, reduction=reduction,
                                filter_eps=None)


APPLE_CCE_NOFILTER = Method(
    name="apple_cce_nofilter",
    kind="peer",
    label="Apple CCE (filter off)",
    summary="Apple CCE with its gradient filter off (filter_eps=None): dC and dE unfiltered, the nearest the "
    "PyPI fork comes to Kahan-FullC; its gradients still accumulate in bf16, without Kahan.",
    implementation=_apple_cce_nofilter_loss,
    availability=_apple_cce_reason,
    preset_of="apple_cce",
)


__all__ = ["LIGER", "APPLE_CCE", "TORCH_LCE", "APPLE_CCE_KAHAN_FULL_C", "APPLE_CCE_NOFILTER",
           "APPLE_CCE_BACKWARD_SHARED_BYTES", "APPLE_KAHAN_FULL_C_IMPL", "apple_cce_impls", "apple_cce_loss",
           "floor_peak_bytes", "liger_loss", "liger_peak_bytes", "torch_lce_loss"]
