"""What ``linear_cross_entropy`` accepts, and where it can run.

``resolve_options`` checks every option that ``helpers.spec.validate_inputs`` does not know and
resolves the gradient filter's threshold for the dtype; ``why_unavailable`` says, in a sentence,
why our kernels cannot run on a device in a dtype (None when they can). The comparison's registry
asks the same function, so the two can never disagree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from helpers.cce.device import device_info
from helpers.cce.kernels.configs import CCEConfigs, select_configs, tier
from helpers.cce.kernels.logits import logit_tile
from helpers.spec import SUPPORTED_DTYPES

ACCUMULATIONS = ("fp32", "kahan")
# The backward implementations, by the one name each has everywhere: "gemm" (the default: G
# written per vocabulary chunk, its products in cuBLAS), "atomic" (one kernel, fp32 atomics) and
# "sparse" (opt-in: only the (row, tile) pairs the forward marked; "gemm" when it marks too many).
BACKWARD_IMPLS = ("gemm", "atomic", "sparse")

# The paper's eps = 2^-12 for bf16 is 2^-5 of bf16's machine epsilon (2^-7): an entry that small
# moves a sum of O(1) gradients by less than its own rounding. The same ratio for fp16 (eps 2^-10).
FILTER_EPS_AUTO = {torch.bfloat16: 2.0**-12, torch.float16: 2.0**-15, torch.float32: None}
# The dense backwards' filter compares a row's |G| mass in a tile of BLOCK_V columns with
# eps * BLOCK_V / FILTER_COLUMNS: eps is per 256 vocabulary columns, so that narrower tiles (the
# T4's 64, consumer Ampere's 128) drop about what 256-column ones drop. In float64 on the realistic
# regime at the Gemma-2-2B head, the filter's share of dE's norm: fp16 (2^-15), 64-column tiles
# 1.4e-3 at eps per tile -> 9.1e-5 scaled (256 columns: 9.4e-6); bf16 (2^-12), 128-column tiles
# 7.0e-3 -> 2.7e-3 (256: 1.6e-3). Mass is not linear in width, so the dependence shrinks but
# stays; the tier tables keep 256-column G tiles where the accuracy was measured (Hopper, A100).
FILTER_COLUMNS = 256


def tile_eps(filter_eps: float | None, block_v: int) -> float:
    """The dense filter's threshold for one tile of ``block_v`` columns (0.0 when the filter is off)."""
    return (filter_eps or 0.0) * block_v / FILTER_COLUMNS


def triton_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why Triton kernels (ours, or a peer's) cannot run on the CPU here, if they cannot; None on
    a CUDA device (its own limits are the caller's to check)."""
    device = torch.device(device)
    if device.type == "cuda":
        return None
    interpreted = not isinstance(logit_tile, triton.runtime.JITFunction)  # decided when @triton.jit ran
    if os.environ.get("TRITON_INTERPRET") != "1" or not interpreted:
        return (
            "Triton kernels need a CUDA GPU, or the Triton interpreter (TRITON_INTERPRET=1) switched on "
            "before the kernels are defined; import helpers first and it is set for you"
        )
    if dtype == torch.bfloat16:
        return (
            "the Triton interpreter computes bfloat16 wrongly (it does arithmetic on bf16's bit patterns, "
            "a known Triton bug); use float32 or float16 on the CPU"
        )
    return None


def why_unavailable(
    device: torch.device | str, dtype: torch.dtype, softcap: float | None = None
) -> str | None:
    """None when ``linear_cross_entropy`` can run on ``device`` with ``dtype``, else why not.

    ``softcap`` is accepted for the registry's common signature; every soft cap is supported.
    """
    device = torch.device(device)
    if dtype not in SUPPORTED_DTYPES:
        return f"it supports float32, float16 and bfloat16 inputs, not {dtype}"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "this torch build or machine has no CUDA device"
        major, minor = device_info(device).capability  # a pretend T4's sm_75 too
        if (major, minor) < (7, 0):
            return f"its Triton kernels need a GPU of compute capability 7.0 or newer; this one is sm_{major}{minor}"
        if dtype == torch.bfloat16 and (major, minor) < (8, 0):
            return (
                f"bfloat16 needs an Ampere (sm_80) or newer GPU; this one is sm_{major}{minor} "
                "(a T4 is sm_75): use float16 or float32"
            )
        return None
    if device.type == "cpu":
        return triton_reason(device, dtype)
    return f"it runs on CUDA GPUs, or on the CPU under the Triton interpreter, not on {device.type}"


@dataclass(frozen=True)
class CCEOptions:
    """Every option of ``linear_cross_entropy``, validated and resolved for one dtype."""

    ignore_index: int = -100
    reduction: str = "mean"
    softcap: float | None = None
    filter_eps: float | None = None  # resolved: None means off
    sort_vocab: bool = False
    accumulation: str = "fp32"
    full_c: bool = False
    full_e: bool = False
    z_loss: float = 0.0
    label_smoothing: float = 0.0


def resolve_options(dtype: torch.dtype, *, filter_eps="auto", **options) -> CCEOptions:
    """Check the options that ``validate_inputs`` does not know, and resolve ``filter_eps``."""
    z_loss = options.get("z_loss", 0.0)
    label_smoothing = options.get("label_smoothing", 0.0)
    accumulation = options.get("accumulation", "fp32")
    if isinstance(filter_eps, str):
        if filter_eps != "auto":
            raise ValueError(f"filter_eps must be 'auto', None or a number >= 0, got {filter_eps!r}")
        eps = None if label_smoothing else FILTER_EPS_AUTO[dtype]
    elif filter_eps is None:
        eps = None
    elif isinstance(filter_eps, (int, float)) and not isinstance(filter_eps, bool) and filter_eps >= 0:
        eps = float(filter_eps) or None  # 0 means off
    else:
        raise ValueError(f"filter_eps must be 'auto', None or a number >= 0, got {filter_eps!r}")
    if not (isinstance(z_loss, (int, float)) and not isinstance(z_loss, bool) and z_loss >= 0):
        raise ValueError(f"z_loss must be a number >= 0, got {z_loss!r}")
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation must be one of {ACCUMULATIONS}, got {accumulation!r}")
    for flag in ("sort_vocab", "full_c", "full_e"):
        if not isinstance(options.get(flag, False), bool):
            raise ValueError(f"{flag} must be True or False, got {options[flag]!r}")
    if options.get("softcap") is not None:
        options["softcap"] = float(options["softcap"])
    options.update(z_loss=float(z_loss), label_smoothing=float(label_smoothing))
    return CCEOptions(filter_eps=eps, **options)


def check_backward_impl(backward_impl) -> str:
    if backward_impl not in BACKWARD_IMPLS:
        raise ValueError(f"backward_impl must be one of {BACKWARD_IMPLS}, got {backward_impl!r}")
    return backward_impl


def resolve_configs(configs: CCEConfigs | str | None, device: torch.device) -> CCEConfigs:
    """The launch configurations to use: the device's tier (None), a named tier, or as given."""
    if configs is None:
        return select_configs(device)
    return tier(configs) if isinstance(configs, str) else configs


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision: fp32 inputs get real fp32 products (a GPU's default for an
    fp32 dot is tf32, a 10-bit mantissa); for fp16/bf16 operands the setting has no effect."""
    return "ieee" if dtype == torch.float32 else "tf32"
