"""The units every comparison reports in, one definition each.

Memory is in GB = 10^9 bytes (the seed article's unit, and what vendors print on the box); the
lower bound (LB) of any method is the bytes of the two gradients it must return, dE (N, D) and
dC (V, D) in the input dtype. A dtype may be given as a torch.dtype or by its name ("bfloat16").
"""

from __future__ import annotations

import torch

GB = 1e9


DTYPES = ("float32", "float16", "bfloat16")


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)


def dtype_name(dtype: torch.dtype | str) -> str:
    """"bfloat16" for torch.bfloat16 (or for "bfloat16")."""
    return str(dtype).replace("torch.", "")


def dtype_bytes(dtype: torch.dtype | str) -> int:
    return torch_dtype(dtype).itemsize


def lower_bound_bytes(N: int, V: int, D: int, dtype: torch.dtype | str) -> int:
    """dE (N, D) and dC (V, D) in the input dtype: what any method must hand back."""
    return (N * D + V * D) * dtype_bytes(dtype)


def memory_unit(largest_bytes: int | float | None) -> tuple[str, float]:
    """("GB", 1e9), or ("MB", 1e6) when the largest number to show is under 0.1 GB (the CPU)."""
    return ("GB", GB) if (largest_bytes or 0) >= 0.1 * GB else ("MB", 1e6)


def format_bytes(n: float) -> str:
    """"1.23 GB", or "4.56 MB" under a tenth of a GB (the CPU's smoke sizes)."""
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / 1e6:.2f} MB"


__all__ = ["GB", "DTYPES", "format_bytes", "memory_unit", "torch_dtype", "dtype_name", "dtype_bytes", "lower_bound_bytes",
           "timed_calls"]


def timed_calls(repeats: list[int] | set[int] | tuple[int, ...]) -> str:
    """What a reported time is, from the timed calls each point ran: "one timed call each" (the smoke
    profiles time one: no median, no spread), "median of 7 calls", or "median of 5-10 calls"."""
    counts = sorted({int(n) for n in repeats if n})
    if counts == [1]:
        return "one timed call each"
    if not counts:
        return "median"
    return f"median of {counts[0]} calls" if len(counts) == 1 else f"median of {counts[0]}-{counts[-1]} calls"

