"""dE's accumulator in 24 bits, in dE's own storage and one byte per element, against cuBLAS's fp32 one.

    timeout 240 python scripts/experiments/split_product.py [--out $OUT/split_product.jsonl]   # an H200
    python scripts/experiments/split_product.py --tiny                                          # a CPU (fp16)

The question. For 16-bit inputs the "gemm" backward sums dE_rows = sum_c G_c C_c over its vocabulary
chunks in an fp32 buffer (rows x D x 4 bytes, cuBLAS's fp32 output): what sits above LB (dE + dC)
from ~16,384 tokens, 1.20 LB at the Qwen3 head. No fp32 accumulator costs less than rows x D x 2
bytes (dE's own 16-bit storage holds half of one; docs/PERFORMANCE.md). A shorter float escapes that
bound: fp32's sign and exponent with 15 stored mantissa bits (16 significant bits, against the
output's 8 in bf16 and 11 in fp16), its top 16 bits in dE's own rows (read as int16), its low 8 in a
byte buffer, so rows x D bytes above LB. cuBLAS cannot merge such an accumulator, so dE's product moves
into Triton (``split_product_kernel`` below): per (BLOCK_N rows, BLOCK_D columns) tile of dE,

    acc   = G_c[tile rows] @ C_c[:, tile cols]      fp32, in registers (BLOCK_V columns of G a step)
    acc  += (hi << 16 | lo << 8) as fp32            the chunks before (ACCUMULATE)
    hi, lo = acc rounded to 24 bits                 to nearest (ties away from zero), NaN kept
or, at the last chunk (FINAL), w * acc rounded once to the dtype, written over hi in place. Each
chunk's rounding is at most 2^-16 of the running sum: after 19 chunks at most 2^-11.8 of the largest
partial sum, ~2^-14 as the roundings fall, against the output's own 2^-9 (bf16) or 2^-12 (fp16).

dE's product is one of the loss's four; for the design to cost under 3% of the loss's time the kernel
must run within ~12% of cuBLAS. The sections:

1. ``time``: one chunk's product, acc (+)= G_c C_c, bf16, at the Qwen3 head's chunks (16,384 rows,
   D 1,024, 8,192 and 1,024 columns) and the Gemma-2-2B head's (8,192 rows, D 2,304, 4,096 columns):
   cuBLAS's fp32 output accumulated in its epilogue (``fp32_product``) against the kernel with pointer
   loads and with tensor descriptors, per tile; median ms, TFLOP/s, and each variant's one-chunk sum
   against an fp32 product first (status "wrong" past 2^-14).
2. ``error``: dE over the Qwen3 head's whole vocabulary (151,936 columns in 19 chunks of 8,192; G a
   softmax's gradient, mostly tiny entries and one p - 1 per row) through the fp32 accumulator then
   rounded, and through the 24-bit one: each one's error against float64 (max and rms, relative to
   max |dE|) and the share of elements where the two differ.

Measured on an H200 (docs/measurements/h200-2026-12-04d): the 24-bit accumulator is as accurate as the
fp32 one (rms 3.0699e-4 against 3.0697e-4 of max |dE|, 0.3% of elements one unit apart), but the kernel
runs at 1.10x cuBLAS's time at the widest chunk (648 against 715 TFLOP/s), 1.34-1.38x at 1,024-column
chunks and 1.30x at the Gemma head; tensor descriptors did not help. So the design would cost the loss
~3-9% and, where G's tail chunks must then leave dE's rows, more; not shipped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import helpers  # noqa: E402,F401  (the environment first: helpers.env, the interpreter on a CPU)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from helpers.cce.backward.gemm import fp32_product, product_mode  # noqa: E402
from helpers.compare.measure import call_times_ms  # noqa: E402
from helpers.compare.results_file import ResultsWriter, run_meta  # noqa: E402


@triton.jit
def split_product_kernel(  # the module doc's; the tiles: ``TILES``
    G_ptr,  # (M, K) G_c in the dtype, or a tensor descriptor of (BLOCK_N, BLOCK_V) blocks (G_DESC)
    C_ptr,  # (K, D) C_c in the dtype, or a tensor descriptor of (BLOCK_V, BLOCK_D) blocks (C_DESC)
    hi_ptr,  # (M, D) int16: the accumulator's top 16 bits (dE's rows, read as int16)
    out_ptr,  # (M, D) in the dtype: the same storage as hi, written by the FINAL launch
    lo_ptr,  # (M, D) uint8: the accumulator's low 8 bits
    w_ptr,  # (M,) fp32: the rows' upstream weights (FINAL)
    M, K, D,
    stride_gm, stride_gk, stride_ck, stride_cd, stride_hm, stride_lm,
    ACCUMULATE: tl.constexpr,  # add the accumulator the chunks before left (else: set it)
    FINAL: tl.constexpr,  # write w * acc in the dtype instead of the accumulator
    G_DESC: tl.constexpr,
    C_DESC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_N)
    tiles_d = tl.cdiv(D, BLOCK_D)
    # Grouped order: GROUP_N row tiles share their C_c column strips in L2.
    per_group = GROUP_N * tiles_d
    first_m = (pid // per_group) * GROUP_N
    group_size = min(tiles_m - first_m, GROUP_N)
    pid_m = first_m + (pid % per_group) % group_size
    pid_d = (pid % per_group) // group_size

    rows = pid_m * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < M
    col_mask = cols < D
    ks = tl.arange(0, BLOCK_V)
    if not G_DESC:
        g_ptrs = G_ptr + rows.to(tl.int64)[:, None] * stride_gm + ks[None, :] * stride_gk
    if not C_DESC:
        c_ptrs = C_ptr + ks.to(tl.int64)[:, None] * stride_ck + cols[None, :] * stride_cd
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_V):
        if G_DESC:
            g = G_ptr.load([pid_m * BLOCK_N, k0])
        else:
            g = tl.load(g_ptrs, mask=row_mask[:, None] & (ks < K - k0)[None, :], other=0.0)
            g_ptrs += BLOCK_V * stride_gk
        if C_DESC:
            c = C_ptr.load([k0, pid_d * BLOCK_D])
        else:
            c = tl.load(c_ptrs, mask=(ks < K - k0)[:, None] & col_mask[None, :], other=0.0)
            c_ptrs += BLOCK_V * stride_ck
        acc = tl.dot(g, c, acc)

    mask = row_mask[:, None] & col_mask[None, :]
    h_ptrs = hi_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :]
    l_ptrs = lo_ptr + rows.to(tl.int64)[:, None] * stride_lm + cols[None, :]
    if ACCUMULATE:
        hi = tl.load(h_ptrs, mask=mask, other=0).to(tl.int32)  # sign-extended: the top bits land in place
        lo = tl.load(l_ptrs, mask=mask, other=0).to(tl.int32)  # zero-extended
        acc += ((hi << 16) | (lo << 8)).to(tl.float32, bitcast=True)
    if FINAL:
        w = tl.load(w_ptr + rows, mask=row_mask, other=0.0)
        o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :]
        tl.store(o_ptrs, (acc * w[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        bits = acc.to(tl.int32, bitcast=True)
        # + half of the dropped bits' unit on the magnitude (a carry into the exponent is the right
        # rounding); a NaN keeps its bits (a payload in the low bits alone would round to inf).
        rounded = tl.where(acc == acc, bits + 0x80, bits)
        tl.store(h_ptrs, (rounded >> 16).to(tl.int16), mask=mask)
        tl.store(l_ptrs, ((rounded >> 8) & 0xFF).to(tl.uint8), mask=mask)


TILES = ((128, 64, 256, 8, 3), (128, 64, 256, 8, 4), (128, 64, 128, 4, 4), (256, 64, 128, 8, 3),
         (128, 128, 128, 8, 3))  # BLOCK_N (rows), BLOCK_V (the K step), BLOCK_D, warps, stages
SHAPES = (("qwen3-16k-8192", 16_384, 8_192, 1_024), ("qwen3-16k-1024", 16_384, 1_024, 1_024),
          ("gemma2-4096", 8_192, 4_096, 2_304))


def split_product(hi_rows, lo, G, C_c, w, *, accumulate, final, tile, descriptors):
    """hi/lo (+)= G @ C_c (or, ``final``, hi_rows = w * acc in the dtype): one launch."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bn, bv, bd, warps, stages = tile
    M, K = G.shape
    D = C_c.shape[1]
    G_arg = TensorDescriptor.from_tensor(G, [bn, bv]) if descriptors else G
    C_arg = TensorDescriptor.from_tensor(C_c, [bv, bd]) if descriptors else C_c
    grid = (triton.cdiv(M, bn) * triton.cdiv(D, bd),)
    split_product_kernel[grid](
        G_arg, C_arg, hi_rows.view(torch.int16), hi_rows, lo, w, M, K, D,
        G.stride(0), G.stride(1), C_c.stride(0), C_c.stride(1), hi_rows.stride(0), lo.stride(0),
        ACCUMULATE=accumulate, FINAL=final, G_DESC=descriptors, C_DESC=descriptors,
        BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, GROUP_N=8, num_warps=warps, num_stages=stages)


def section_time(writer, device, dtype, tiny) -> int:
    failed = 0
    for name, rows, cols, D in SHAPES if not tiny else [("tiny", 40, 96, 48)]:
        g = torch.Generator(device=device).manual_seed(0)
        G = torch.randn(rows, cols, device=device, generator=g).to(dtype)
        C_c = torch.randn(cols, D, device=device, generator=g).to(dtype)
        acc = torch.zeros(rows, D, device=device)
        hi = torch.zeros(rows, D, device=device, dtype=dtype)
        lo = torch.zeros(rows, D, device=device, dtype=torch.uint8)
        w = torch.ones(rows, device=device)
        flop = 2 * rows * cols * D
        mode = product_mode(torch.device(device), dtype)
        runs = {"cublas_fp32": lambda: fp32_product(acc, G, C_c, alpha=1.0, accumulate=True, mode=mode)}
        tiles = TILES if not tiny else ((16, 32, 16, 1, 1),)
        for tile in tiles:
            for descriptors in (False, True):
                key = f"split_{'tma' if descriptors else 'ptr'}_{'x'.join(map(str, tile))}"
                runs[key] = (lambda tile=tile, descriptors=descriptors: split_product(
                    hi, lo, G, C_c, w, accumulate=True, final=False, tile=tile, descriptors=descriptors))
        base = None
        for key, fn in runs.items():
            record = dict(case=f"time/{name}/{key}", rows=rows, cols=cols, D=D)
            try:
                if device == "cuda":
                    ms = statistics.median(call_times_ms(fn, warmup=1, repeats=20, device=device))
                    record.update(ms=round(ms, 4), tflops=round(flop / ms / 1e9, 1))
                    base = ms if key == "cublas_fp32" else base
                    if base:
                        record["vs_cublas"] = round(ms / base, 3)
                else:
                    fn()
                record["status"] = "ok"
                if key != "cublas_fp32":  # the variant's sum of one chunk against cuBLAS's, before it is timed
                    hi.zero_()
                    lo.zero_()
                    fn()
                    got = ((hi.view(torch.int16).int() << 16) | (lo.int() << 8)).view(torch.float32)
                    want = torch.mm(G.float(), C_c.float())
                    record["rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
                    record["status"] = "ok" if record["rel_err"] <= 2**-14 else "wrong"
            except Exception as error:  # a tile past this GPU's shared memory: recorded, the rest go on
                record.update(status="error", error=f"{type(error).__name__}: {error}"[:300])
            print(record, flush=True)
            writer.append(record)
            failed += record["status"] != "ok" and record["status"] != "error"  # a tile past the memory is no failure
    return failed


def section_error(writer, device, dtype, tiny) -> int:
    rows, V, D, step = (16_384, 151_936, 1_024, 8_192) if not tiny else (40, 301, 48, 64)
    g = torch.Generator(device=device).manual_seed(1)
    C = (torch.randn(V, D, device=device, generator=g) * 0.05).to(dtype)
    E = (torch.randn(rows, D, device=device, generator=g)).to(dtype)
    x = torch.randint(0, V, (rows,), device=device, generator=g)
    acc = torch.zeros(rows, D, device=device)
    hi = torch.empty(rows, D, device=device, dtype=dtype)
    lo = torch.empty(rows, D, device=device, dtype=torch.uint8)
    w = torch.ones(rows, device=device)
    exact = torch.zeros(rows, D, device=device, dtype=torch.float64)
    lse = torch.logsumexp(E.float() @ C.float().T, dim=1) if tiny else None
    if lse is None:  # in chunks: the logits of 16,384 rows are 10 GB in fp32
        lse = torch.full((rows,), -float("inf"), device=device)
        for v0 in range(0, V, step):
            lse = torch.logaddexp(lse, torch.logsumexp(E.float() @ C[v0:v0 + step].float().T, dim=1))
    mode = product_mode(torch.device(device), dtype)
    tile = (128, 64, 256, 8, 3) if device == "cuda" else (16, 32, 16, 1, 1)
    starts = list(range(0, V, step))
    for k, v0 in enumerate(starts):
        v1 = min(V, v0 + step)
        p = torch.exp(E.float() @ C[v0:v1].float().T - lse[:, None])
        p[torch.arange(rows, device=device)[(x >= v0) & (x < v1)], (x - v0)[(x >= v0) & (x < v1)]] -= 1.0
        G = p.to(dtype)
        exact += G.double() @ C[v0:v1].double()
        fp32_product(acc, G, C[v0:v1], alpha=1.0, accumulate=k > 0, mode=mode)
        split_product(hi, lo, G, C[v0:v1], w, accumulate=k > 0, final=k == len(starts) - 1, tile=tile,
                      descriptors=False)
    via_fp32 = acc.to(dtype).double()
    scale = exact.abs().max().item()
    record = dict(case=f"error/{'qwen3-16k' if not tiny else 'tiny'}", chunks=len(starts), dtype=str(dtype))
    for name, got in (("fp32_acc", via_fp32), ("split24", hi.double()), ("exact_rounded", exact.to(dtype).double())):
        err = (got - exact).abs()
        record[f"{name}_max"] = err.max().item() / scale
        record[f"{name}_rms"] = err.pow(2).mean().sqrt().item() / scale
    record["differ_share"] = (hi.double() != via_fp32).float().mean().item()
    record["status"] = "ok" if record["split24_rms"] <= 1.05 * record["fp32_acc_rms"] else "worse"
    print(record, flush=True)
    writer.append(record)
    return record["status"] != "ok"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = os.path.join(os.environ["OUT"], "split_product.jsonl") if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--tiny", action="store_true", help="a CPU check of this script (fp16, the interpreter)")
    parser.add_argument("--sections", nargs="+", choices=("time", "error"), default=["time", "error"])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        sys.exit("no CUDA device: run with --tiny to check the script on a CPU")
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # the interpreter cannot do bf16
    writer = ResultsWriter(args.out or os.devnull, run_meta(device))
    failed = 0
    if "time" in args.sections:
        failed += section_time(writer, device, dtype, args.tiny)
    if "error" in args.sections:
        failed += section_error(writer, device, dtype, args.tiny)
    writer.update_meta(failed=failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
