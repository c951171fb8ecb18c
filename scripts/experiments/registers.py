"""Registers, spills, shared memory and tensor cores of our two logit kernels (the forward's lse and the
"gemm" backward's G kernel), compiled on this machine for each tier's GPU: no GPU needed.

    python scripts/experiments/registers.py [--tier hopper-227k] [--out results.jsonl]
    python scripts/experiments/registers.py --tiny        # the Hopper tier's fp32 G kernel only

For each tier, input dtype (its 16-bit one, fp32) and soft cap (off, on): the registers a thread and the
stack frame a thread (where ptxas spills; cuobjdump), the shared memory a program asks, whether the
product runs on tensor cores (an mma in the PTX), and how many programs a multiprocessor holds by each
of its registers, its shared memory and its threads (the least of them is the occupancy). The flags
are a plain loss call's (no bias, no smoothing, the filter on) with the tier's launch options as
shipped (``LaunchConfig.launch``: warps, stages, ``maxnreg``).

The compile is Triton's own for the target, so it is only as true as the installed Triton: the GPU's may
be another version (the H200's 3.6 took 200 registers where 3.9 took 128 for the same kernel). To see
the GPU's, install its Triton in a virtual environment beside this one (``pip install --no-deps
triton==3.6.0`` into one made with ``--system-site-packages``) and run this script there; run it in two
checkouts (``PYTHONPATH``) to compare a change. Nothing is asserted (status "ok" where the compile
succeeded).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # a compile for a GPU, never the interpreter's functions
# This checkout's helpers unless one is on the path already (a comparison puts another tree first on PYTHONPATH).
if importlib.util.find_spec("helpers") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402

from helpers.cce.kernels import configs as K  # noqa: E402
from helpers.cce.kernels import offline  # noqa: E402
from helpers.cce.kernels.gradient_chunk import gradient_chunk_kernel  # noqa: E402
from helpers.cce.kernels.lse_forward import lse_forward_kernel  # noqa: E402
from helpers.cce.options import dot_precision, fp_fusion  # noqa: E402
from helpers.compare.results_file import ResultsWriter, run_meta  # noqa: E402

# Per multiprocessor, by compute capability: (32-bit registers, shared memory bytes, threads).
SM_LIMITS = {(7, 5): (65536, 64 * 1024, 1024), (8, 0): (65536, 164 * 1024, 2048),
             (8, 6): (65536, 100 * 1024, 1536), (8, 9): (65536, 100 * 1024, 1536),
             (9, 0): (65536, 228 * 1024, 2048)}


def _constexprs(kernel: str, cfg, dtype: torch.dtype, softcap: bool) -> dict:
    constexprs = cfg.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D")
    constexprs.update(DOT_PRECISION=dot_precision(dtype, cfg), HAS_SOFTCAP=softcap, HAS_BIAS=False, SORTED=False)
    if kernel == "G":
        constexprs.update(GROUP_N=cfg.GROUP_N, PERSISTENT=cfg.persistent > 0, G_SUBTILE=cfg.g_subtile,
                          FILTER=True, SPLIT_G=False, E_DESC=cfg.tma, G_DESC=cfg.tma)
    else:
        constexprs.update(SUM_LOGITS=False, EMIT_BITS=False, SUB=1, NONTARGET=True, TILE_FLAGS=True,
                          E_DESC=cfg.tma, LSE_LO=dtype == torch.float32)
    return constexprs


def measure(tier: K.CCEConfigs, kernel: str, dtype: torch.dtype, softcap: bool) -> dict:
    size = dtype.itemsize
    cfg = (tier.backward_gemm if kernel == "G" else tier.forward)[size]
    fn = gradient_chunk_kernel if kernel == "G" else lse_forward_kernel
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    record = dict(case=f"{tier.name}/{kernel}/{name}/{'cap' if softcap else 'nocap'}", tier=tier.name, kernel=kernel,
                  dtype=name, softcap=softcap, config=repr(cfg))
    constexprs = _constexprs(kernel, cfg, dtype, softcap)
    sig = offline.signature("backward_gemm" if kernel == "G" else "lse_forward", fn, name, constexprs, cfg)
    options = dict(cfg.launch, enable_fp_fusion=fp_fusion(dtype))
    try:
        compiled = offline.compile_for(fn, sig, constexprs, tier.target_capability, options)
    except Exception as error:  # recorded, and the sweep goes on
        return dict(record, status="error", error=f"{type(error).__name__}: {error}"[:500])
    usage = offline.resource_usage(compiled.asm["cubin"]) or {}
    registers_sm, shared_sm, threads_sm = SM_LIMITS[tier.target_capability]
    threads = 32 * cfg.num_warps
    shared = compiled.metadata.shared
    record.update(usage, shared=shared, tensor_cores=offline.tensor_cores(compiled), threads=threads,
                  programs_by_shared=shared_sm // max(shared, 1), programs_by_threads=threads_sm // threads,
                  status="ok")
    if "registers" in usage:
        record["programs_by_registers"] = registers_sm // (usage["registers"] * threads)
    record["programs"] = min(v for k, v in record.items() if k.startswith("programs_by_"))
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results file, JSON Lines")
    parser.add_argument("--tier", action="append", help="a tier's name (repeat; default: every tier)")
    parser.add_argument("--tiny", action="store_true", help="the Hopper tier's fp32 G kernel only (a CI check)")
    args = parser.parse_args()
    writer = ResultsWriter(args.out or os.devnull, run_meta("cpu", triton_compiled=triton.__version__))
    tiers = [K.tier(name) for name in (args.tier or [t.name for t in K.TIERS])]
    if args.tiny:
        tiers = [K.tier("hopper-227k")]
    failed = 0
    print(f"Triton {triton.__version__}; helpers from {os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(offline.__file__))))}")
    print(f"{'case':34s} {'regs':>5s} {'stack':>6s} {'shared':>7s} {'tensor cores':>12s}  programs/SM: "
          f"{'regs':>4s} {'smem':>4s} {'threads':>7s}")
    for tier in tiers:
        half = torch.float16 if tier.target_capability < (8, 0) else torch.bfloat16
        for dtype in ((torch.float32,) if args.tiny else (half, torch.float32)):
            for kernel in (("G",) if args.tiny else ("fwd", "G")):
                for softcap in (False, True):
                    r = measure(tier, kernel, dtype, softcap)
                    writer.append(r)
                    if r["status"] != "ok":
                        failed += 1
                        print(f"{r['case']:34s} {r['error']}")
                        continue
                    print(f"{r['case']:34s} {r.get('registers', '?'):>5} {r.get('stack', '?'):>6} {r['shared']:>7,} "
                          f"{'yes' if r['tensor_cores'] else 'no':>12s}  {'':12s}{r.get('programs_by_registers', '?'):>4} "
                          f"{r['programs_by_shared']:>4} {r['programs_by_threads']:>7}")
    writer.update_meta(failed=failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
