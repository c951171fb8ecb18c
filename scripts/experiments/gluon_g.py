"""The "gemm" backward's G kernel on Hopper: the warp-specialized Gluon kernel against the Triton one.

    timeout 300 python scripts/experiments/gluon_g.py [--out $OUT/gluon_g.jsonl]   # on an H200: check, then time
    python scripts/experiments/gluon_g.py --compile-only                  # any machine: compile for sm_90
    python scripts/experiments/gluon_g.py --check-protocol                # any machine: its barriers, in Python

The kernel, why it exists and what it covers: ``helpers/cce/kernels/gradient_chunk_pingpong.py``
(the Hopper tier's G kernel since 2026-12-02, ``HostTuning.g_pingpong``). This script, at the
Gemma-2-2B head (N = 8,192) and the Qwen3 head (N = 16,384), bf16, flat softmax:

1. one G chunk as wide as the backward's first in-place chunk: its bits against the Triton
   kernel's with the filter off, the tiles each keeps with it on, and both kernels' median times at
   the ring's 4 and 3 stages (the first run, 2026-12-02: ``docs/measurements/h200-2026-12-02-gluon/``);
2. forward+backward through ``linear_cross_entropy`` with the Gluon kernel (the tier as shipped) and
   without it (``g_pingpong=False``): the loss and both gradients bit for bit with the filter off,
   their largest difference with it on, and the median times of both, in one process.

``--compile-only`` compiles the kernel for sm_90 with this machine's Triton and prints its shared
memory and registers; ``--check-protocol`` plays its barrier protocol out in Python
(``ring_protocol_check``); the CPU tests run both, since Gluon kernels do not run under the Triton
interpreter. A barrier mistake the model does not cover would hang the GPU: run it under a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

# The scripts run from a checkout (or its copy on a GPU box), not from an installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import helpers  # noqa: E402,F401  (the environment first: helpers.env)
from helpers.cce.kernels.gradient_chunk_pingpong import (  # noqa: E402
    BLOCK_D,
    BLOCK_N,
    BLOCK_V,
    STAGES,
    check_ring_protocol,
    compile_for_sm90,
    gradient_chunk_pingpong_kernel,
    MAXNREG,
    pingpong_descriptor,
)


def gradient_chunk_pingpong(E, C, x, lse, coef, v_begin: int, v_count: int, eps: float, G=None, stages=STAGES):
    """(G, tile_kept) of vocabulary chunk [v_begin, v_begin + v_count) at ``stages`` ring stages."""
    N, D = E.shape
    G = torch.empty(N, v_count, dtype=E.dtype, device=E.device) if G is None else G
    tiles = triton.cdiv(N, BLOCK_N) * triton.cdiv(v_count, BLOCK_V)
    kept = torch.empty(tiles, dtype=torch.int8, device=E.device)
    programs = min(tiles, torch.cuda.get_device_properties(E.device).multi_processor_count)
    gradient_chunk_pingpong_kernel[(programs,)](
        pingpong_descriptor(E, BLOCK_N, BLOCK_D), pingpong_descriptor(C, BLOCK_V, BLOCK_D),
        pingpong_descriptor(G, BLOCK_N, BLOCK_V), x, lse, coef, kept, N, C.shape[0], D, v_begin, v_count,
        x.stride(0), coef.stride(0), eps, stages, num_warps=4, maxnreg=MAXNREG)
    return G, kept


def _shipped_chunk(E, C, x, lse, coef, v_begin, v_count, eps, G, kept, cfg):
    """The shipped G kernel (``gradient_chunk_kernel``) on one chunk, launched as ``backward_gemm`` launches it."""
    from helpers.cce.descriptors import block_descriptor, operand_descriptors
    from helpers.cce.kernels.gradient_chunk import gradient_chunk_kernel

    N, D = E.shape
    E_desc, C_desc, _ = operand_descriptors(E, C, cfg, gathered=False)
    G_desc = block_descriptor(G, cfg.BLOCK_N, cfg.BLOCK_V // cfg.g_subtile)
    tiles = triton.cdiv(N, cfg.BLOCK_N) * triton.cdiv(v_count, cfg.BLOCK_V)
    programs = torch.cuda.get_device_properties(E.device).multi_processor_count
    gradient_chunk_kernel[(min(tiles, cfg.persistent * programs) if cfg.persistent else tiles,)](
        E_desc, C_desc, x, lse, coef, lse, kept, G_desc, G, kept, N, C.shape[0], D, v_begin, v_count,
        E.stride(0), E.stride(1), C.stride(0), C.stride(1), x.stride(0), G.stride(0), G.stride(1), coef.stride(0),
        1.0, eps, HAS_SOFTCAP=False, HAS_BIAS=False, FILTER=eps > 0, SPLIT_G=False, SORTED=False,
        DOT_PRECISION="tf32", E_DESC=True, G_DESC=True, G_SUBTILE=cfg.g_subtile, PERSISTENT=cfg.persistent > 0,
        **cfg.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D", "GROUP_N"), **cfg.launch)


def run_on_gpu(out: str) -> int:
    """Per shape, one G chunk as wide as the shipped backward's first in-place chunk: the bits against
    the shipped kernel's with the filter off (the same tiles' products and formula), the tiles each
    kept with it on, and both kernels' median times."""
    from helpers.cce import cce_forward, resolve_options
    from helpers.cce.backward.rows import RowGradient
    from helpers.cce.kernels.configs import select_configs
    from helpers.cce.options import tile_eps
    from helpers.compare.heads import GEMMA2, QWEN3
    from helpers.compare.inputs import make_inputs
    from helpers.compare.measure import latency
    from helpers.compare.results_file import ResultsWriter, run_meta

    def median_ms(fn):
        return latency(fn, warmup=1, repeats=20, device=device).median_ms

    device = torch.device("cuda")
    cfg = select_configs(device).backward_gemm_for(torch.bfloat16)
    writer = ResultsWriter(out, run_meta(device))
    records = []
    for name, N, V, D, cols in (("gemma2", 8192, GEMMA2.V, GEMMA2.D, 16_384), ("qwen3-16k", 16_384, QWEN3.V, QWEN3.D, 8192)):
        rec = {"case": name, "N": N, "V": V, "D": D, "chunk_columns": cols, "shipped": repr(cfg)}
        try:
            E, C, x = make_inputs(N, V, D, torch.bfloat16, device, regime="uniform", seed=N)
            o = resolve_options(torch.bfloat16, vocabulary=V)
            _, lse, r = cce_forward(E, C, x, o)
            up = RowGradient.of(torch.full((N,), 1.0 / N, device=device), None, x, o.ignore_index, lse, r, o)
            coef = up.coef
            G_ref = torch.empty(N, cols, dtype=E.dtype, device=device)
            G_new = torch.empty_like(G_ref)
            kept_ref = torch.empty(triton.cdiv(N, cfg.BLOCK_N) * triton.cdiv(cols, cfg.BLOCK_V), dtype=torch.int8,
                                   device=device)
            # 1. Correctness: the filter off, both kernels, the same G to the bit (or the largest difference).
            _shipped_chunk(E, C, x, lse, coef, 0, cols, 0.0, G_ref, kept_ref, cfg)
            gradient_chunk_pingpong(E, C, x, lse, coef, 0, cols, 0.0, G=G_new)
            torch.cuda.synchronize()
            rec["bitwise_equal"] = bool(torch.equal(G_ref, G_new))
            rec["max_abs_diff"] = float((G_ref.float() - G_new.float()).abs().max())
            rec["G_abs_max"] = float(G_ref.float().abs().max())
            # 2. Time, the filter on at each kernel's tile width (as shipped).
            eps_ref, eps_new = tile_eps(o.filter_eps, cfg.BLOCK_V), tile_eps(o.filter_eps, BLOCK_V)
            t_ref = median_ms(lambda: _shipped_chunk(E, C, x, lse, coef, 0, cols, eps_ref, G_ref, kept_ref, cfg))
            flop = 2 * N * cols * D
            rec.update(shipped_ms=round(t_ref, 3), shipped_tflops=round(flop / t_ref / 1e9, 1),
                       shipped_kept=float(kept_ref.float().mean()))
            for stages in (STAGES, STAGES - 1):  # 224 KB and 184 KB of shared memory
                _, kept_new = gradient_chunk_pingpong(E, C, x, lse, coef, 0, cols, eps_new, G=G_new, stages=stages)
                t_new = median_ms(lambda: gradient_chunk_pingpong(E, C, x, lse, coef, 0, cols, eps_new, G=G_new,
                                                                   stages=stages))  # noqa: B023
                rec[f"pingpong_s{stages}_ms"] = round(t_new, 3)
                rec[f"pingpong_s{stages}_tflops"] = round(flop / t_new / 1e9, 1)
                rec[f"pingpong_s{stages}_kept"] = float(kept_new.float().mean())
            rec["status"] = "ok" if rec["bitwise_equal"] else "DIFFERS"
        except Exception as error:  # noqa: BLE001 (recorded; the next shape still runs)
            rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:1500]}")
        print(json.dumps(rec), flush=True)
        records.append(rec)
        writer.append(rec)
        torch.cuda.empty_cache()
    for name, N, V, D in (("gemma2", 8192, GEMMA2.V, GEMMA2.D), ("qwen3-16k", 16_384, QWEN3.V, QWEN3.D)):
        rec = end_to_end(name, N, V, D, device)
        print(json.dumps(rec), flush=True)
        records.append(rec)
        writer.append(rec)
        torch.cuda.empty_cache()
    return 0 if all(r["status"] == "ok" for r in records) else 1


def end_to_end(name: str, N: int, V: int, D: int, device) -> dict:
    """Forward+backward through the loss, Gluon G kernel on (as shipped) and off: bits with the
    filter off, the largest gradient difference with it on, median ms of each, and which G kernel
    ran (``stats["g_kernels"]``)."""
    from helpers.cce import linear_cross_entropy
    from helpers.cce.kernels.configs import select_configs
    from helpers.compare.inputs import make_inputs
    from helpers.compare.measure import latency

    rec = {"case": f"end_to_end/{name}", "N": N, "V": V, "D": D}
    try:
        E, C, x = make_inputs(N, V, D, torch.bfloat16, device, regime="uniform", seed=N)
        shipped = select_configs(device)
        variants = {"pingpong": shipped, "triton": shipped.tuned(g_pingpong=False)}

        def grads(configs, eps, stats=None):
            E_ = E.detach().requires_grad_(True)
            C_ = C.detach().requires_grad_(True)
            loss = linear_cross_entropy(E_, C_, x, configs=configs, filter_eps=eps, stats=stats)
            dE, dC = torch.autograd.grad(loss, (E_, C_))
            return loss.detach(), dE, dC

        out = {}
        for variant, configs in variants.items():
            stats = {}
            out[variant] = {eps: grads(configs, eps, stats if eps == "auto" else None) for eps in (None, "auto")}
            rec[f"{variant}_g_kernels"] = stats.get("g_kernels")
            rec[f"{variant}_ms"] = round(latency(lambda: grads(configs, "auto"), warmup=2, repeats=10,  # noqa: B023
                                                 device=device).median_ms, 2)
        a, b = out["pingpong"], out["triton"]
        rec["bitwise_equal_filter_off"] = all(torch.equal(p, q) for p, q in zip(a[None], b[None]))
        rec["max_grad_diff_filter_on"] = max(float((p.float() - q.float()).abs().max()) for p, q in
                                             zip(a["auto"][1:], b["auto"][1:]))
        rec["speedup"] = round(rec["triton_ms"] / rec["pingpong_ms"], 3)
        ran = (rec["pingpong_g_kernels"] or {}).get("pingpong", 0)
        rec["status"] = "ok" if rec["bitwise_equal_filter_off"] and ran > 0 else "DIFFERS" if ran else "not run"
    except Exception as error:  # noqa: BLE001 (recorded; the next shape still runs)
        rec.update(status="error", error=f"{type(error).__name__}: {str(error)[:1500]}")
    return rec


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 and report; no GPU needed")
    parser.add_argument("--check-protocol", action="store_true",
                        help="play the kernel's barrier protocol out in Python over many interleavings; no GPU needed")
    parser.add_argument("--out", default="gluon_g.jsonl")
    args = parser.parse_args()
    if args.check_protocol:
        result = check_ring_protocol()
        print(json.dumps(result, indent=1))
        return 0 if result["status"] == "ok" else 1
    if args.compile_only or not torch.cuda.is_available():
        result = compile_for_sm90()
        print(json.dumps(result, indent=1))
        return 0 if result["status"] == "ok" else 1
    return run_on_gpu(args.out)


if __name__ == "__main__":
    sys.exit(main())
