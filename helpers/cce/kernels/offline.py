"""Our kernels compiled on this machine for a GPU it need not have (``triton.compile`` with a
``GPUTarget``): what the tests check of each tier (shared memory, operand layouts, tensor cores) and
what ``scripts/experiments/registers.py`` prints (registers, spills, programs per multiprocessor).

A launch's arguments are specialized here as the JIT specializes them on contiguous tensors: an int
equal to 1 becomes a constant (the unit strides), and pointers and ints divisible by 16 carry that fact.
Without it the loads are not known to be contiguous, so the pipeliner does not multi-buffer them, and
the shared memory reported is a fraction of a real launch's. Row strides and D (the model's hidden
size) are multiples of 16 in every real model: what lets a row's loads be vectorized.

Triton cannot compile a kernel under the interpreter (``TRITON_INTERPRET=1`` makes ``@triton.jit``
build interpreted functions): callers run these in a process without it.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

UNIT_STRIDES = ("stride_Ed", "stride_Cd", "stride_dEd", "stride_dCd", "stride_Gv", "stride_x")
ROW_STRIDES = ("stride_En", "stride_Cv", "stride_dEn", "stride_dCv", "stride_Gn", "stride_Y", "D")
# The dtype of each pointer argument by its name (fp32 unless listed; ``dtype`` is the inputs').
_POINTERS = {
    "x_ptr": "i64", "vocab_order_ptr": "i64", "skip_count_ptr": "i32", "tile_kept_ptr": "i8",
    "tile_flags_ptr": "i8", "bits_ptr": "u8", "live_ptr": "u8", "seg_start_ptr": "i32", "cnt_ptr": "i32",
    "popcount_ptr": "i32", "off_ptr": "i64", "rank_ptr": "i32", "row_slot_ptr": "i64",
    "seg_slot_base_ptr": "i64", "pair_row_ptr": "i32", "pair_slot_ptr": "i32", "pack_off_ptr": "i64",
    "pair_off_ptr": "i64", "pair_cnt_ptr": "i32", "kept_ptr": "i32",
}
_INPUT_POINTERS = ("E_ptr", "C_ptr", "G_ptr", "G_exact_ptr", "Gc_ptr", "Z_ptr")
_FLOATS = {"softcap", "z_loss", "label_smoothing", "eps", "inv_temperature", "target_weight", "smoothing_weight",
           "max_sum"}
# A tensor core's instruction in PTX: mma.sync (Ampere's and Turing's) or wgmma (Hopper's).
TENSOR_CORE_PTX = re.compile(r"\b(?:mma\.sync|wgmma\.mma_async)\b")


def signature(kernel_name: str, fn, dtype: str, constexprs: dict | None = None, cfg=None) -> dict:
    """Triton signature strings for each argument of one of our kernels, by naming convention; with
    ``constexprs`` asking for tensor descriptors (E_DESC, G_DESC), E's, C's (unless SORTED) and G's as
    descriptors of ``cfg``'s blocks."""
    pointers = dict(_POINTERS, **{name: dtype for name in _INPUT_POINTERS})
    if kernel_name.startswith("sparse"):
        # The outputs themselves, not fp32 scratch; the bias in the inputs' dtype.
        pointers.update(dE_ptr=dtype, dC_ptr=dtype, bias_ptr=dtype, Y_ptr="fp32" if dtype == "fp32" else "fp16")
    if kernel_name.startswith("forward_de"):  # dE's rows in the inputs' dtype
        pointers.update(out_ptr=dtype, dE_ptr=dtype)
    sig = {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + pointers.get(name, "fp32")
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    constexprs = constexprs or {}
    if constexprs.get("E_DESC"):
        sig["E_ptr"] = f"tensordesc<{dtype}[{cfg.BLOCK_N}, {cfg.BLOCK_D}]>"
        if not constexprs.get("SORTED"):
            sig["C_ptr"] = f"tensordesc<{dtype}[{cfg.BLOCK_V}, {cfg.BLOCK_D}]>"
        if constexprs.get("G_DESC"):
            sig["G_ptr"] = f"tensordesc<{dtype}[{cfg.BLOCK_N}, {cfg.BLOCK_V // cfg.g_subtile}]>"
    return sig


def specialize(fn, sig: dict, constexprs: dict) -> dict:
    """``sig`` and ``constexprs`` as a launch on contiguous tensors would specialize them (in place);
    returns the attrs."""
    for name in UNIT_STRIDES:
        if name in sig:
            sig[name] = "constexpr"
            constexprs[name] = 1
    attrs = {}
    for i, param in enumerate(fn.params):
        kind = sig.get(param.name, "")
        if (kind.startswith("*") or param.name in ROW_STRIDES) and param.name not in constexprs:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_for(fn, sig: dict, constexprs: dict, capability: tuple[int, int], options: dict):
    """``fn`` compiled for a GPU of ``capability`` with ``options`` (a launch's num_warps, ...)."""
    import triton

    attrs = specialize(fn, sig, constexprs)
    major, minor = capability
    return triton.compile(
        triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
        target=triton.backends.compiler.GPUTarget("cuda", 10 * major + minor, 32),
        options=options,
    )


def _tool(name: str) -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


def resource_usage(cubin: bytes) -> dict | None:
    """cuobjdump's registers a thread and stack frame a thread (bytes; where ptxas puts the registers it
    spills) of a compiled kernel. None where Triton's wheel ships no cuobjdump; a ``RuntimeError`` where its
    answer lacks them."""
    tool = _tool("cuobjdump")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = {key: re.search(rf"{key}:(\d+)", usage) for key in ("REG", "STACK")}
    if not all(found.values()):
        raise RuntimeError(f"cuobjdump -res-usage gave no REG or STACK: {usage[-300:]!r}")
    return {"registers": int(found["REG"].group(1)), "stack": int(found["STACK"].group(1))}


def tensor_cores(compiled) -> bool:
    """Whether the compiled kernel's products run on tensor cores (an mma instruction in its PTX)."""
    return bool(TENSOR_CORE_PTX.search(compiled.asm["ptx"]))
