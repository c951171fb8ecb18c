"""What the forward's non-target mass costs the Triton LSE kernel: the kernel with NONTARGET off, on
with no target in any row (x = -1: the compare and select alone), on with the real targets masking
every tile, and on with Algorithm 1's tile flags (TILE_FLAGS: only the tiles holding a target masked,
the shipped walk).

    python scripts/experiments/nontarget_cost.py [--out results.jsonl]      # a GPU
    python scripts/experiments/nontarget_cost.py --tiny                     # a CPU check of the script

bf16, flat softmax, the tier's forward configuration and the loss's own grid (``_lse_splits``'s),
median of 20 launches after 3 (``call_times_ms``), at the Gemma-2-2B head (N 8,192) and the Qwen3
head (N 16,384; the Triton kernel, not the Hopper tier's Gluon one, which has no switch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import helpers  # noqa: E402,F401  (the environment first: helpers.env, the interpreter on a CPU)

from helpers.cce import resolve_options  # noqa: E402
from helpers.cce.descriptors import operand_descriptors  # noqa: E402
from helpers.cce.forward import indexed_dot, _launch_flags, _tile_flags, grid_order, split_grid  # noqa: E402
from helpers.cce.kernels.configs import select_configs  # noqa: E402
from helpers.cce.kernels.lse_forward import lse_forward_kernel  # noqa: E402
from helpers.compare.heads import GEMMA2, QWEN3  # noqa: E402
from helpers.compare.inputs import make_inputs  # noqa: E402
from helpers.compare.measure import call_times_ms  # noqa: E402
from helpers.compare.results_file import ResultsWriter, run_meta  # noqa: E402


def launcher(E, C, x, nontarget: bool, flagged: bool = False):
    """A closure that launches the LSE kernel as ``_lse_splits`` does (its outputs (lse, non-target lse))."""
    o = resolve_options(E.dtype, filter_eps=None)
    fwd = select_configs(E.device).for_dtype(E.dtype)[0]
    N, D = E.shape
    V = C.shape[0]
    n_blocks, v_splits = split_grid(N, fwd, E.device, None, D, E.element_size())
    v_blocks = triton.cdiv(V, fwd.BLOCK_V)
    blocks_per_split = triton.cdiv(v_blocks, max(1, min(v_splits, v_blocks)))
    v_splits = triton.cdiv(v_blocks, blocks_per_split)
    lse_split, nontarget_split = torch.empty(2, v_splits, N, dtype=torch.float32, device=E.device).unbind(0)
    E_arg, C_arg, e_desc = operand_descriptors(E, C, fwd, gathered=False)
    launch = _launch_flags(fwd, o, None, E.dtype, n_blocks, e_desc)
    # Algorithm 1's target logit and its tile flags, as the loss's forward makes them.
    tile_flags = _tile_flags(N, V, fwd.BLOCK_N, fwd.BLOCK_V, E.device)
    z_x = indexed_dot(E, C, x, None, o, select_configs(E.device).for_dtype(E.dtype)[2], tile_flags=tile_flags)
    flags = tile_flags.flags

    def run():
        lse_forward_kernel[grid_order(n_blocks, v_splits)](
            E_arg, C_arg, lse_split, lse_split, lse_split, lse_split, lse_split, lse_split, lse_split,
            x, lse_split, lse_split, lse_split, nontarget_split, z_x, flags, N, V, D, 0, -100, blocks_per_split,
            E.stride(0), E.stride(1), C.stride(0), C.stride(1), 1.0, 0.0, 1.0,
            ROW_STATS=False, NONTARGET=nontarget, TILE_FLAGS=flagged, **launch)
        return lse_split, nontarget_split
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results file, JSON Lines")
    parser.add_argument("--tiny", action="store_true", help="one tiny head (a CI check of this script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    writer = ResultsWriter(args.out or os.devnull, run_meta(device))
    heads = [("tiny", 16, 300, 32)] if args.tiny else [("gemma2-8192", 8192, GEMMA2.V, GEMMA2.D),
                                                       ("qwen3-16384", 16384, QWEN3.V, QWEN3.D)]
    repeats, warmup = (1, 1) if args.tiny else (20, 3)
    failed = 0
    for name, N, V, D in heads:
        E, C, x = make_inputs(N, V, D, dtype, device, regime="uniform", seed=1)
        record = dict(case=name, N=N, V=V, D=D)
        variants = {"off": (x, False, False), "on_no_target": (torch.full_like(x, -1), True, False),
                    "on": (x, True, False), "on_flags": (x, True, True)}
        for variant, (targets, flag, flagged) in variants.items():
            run = launcher(E, C, targets, flag, flagged)
            record[f"{variant}_ms"] = statistics.median(call_times_ms(run, warmup=warmup, repeats=repeats, device=device))
        z = E[:64].double() @ C.double().T
        want = 1 - torch.softmax(z, 1).gather(1, x[:64, None]).squeeze(1)
        for key, flagged in (("r_err_64_rows", False), ("r_err_64_rows_flags", True)):
            lse, nontarget = launcher(E, C, x, True, flagged)()
            r = torch.exp(torch.logsumexp(nontarget, 0) - torch.logsumexp(lse, 0))
            record[key] = float(((r[:64].double() - want).abs() / want).max())
        record["status"] = "ok" if max(record["r_err_64_rows"], record["r_err_64_rows_flags"]) < 1e-3 else "DIFFERS"
        writer.append(record)
        print(f"{name:12s} off {record['off_ms']:8.3f}  on, no target {record['on_no_target_ms']:8.3f}  "
              f"on {record['on_ms']:8.3f}  flags {record['on_flags_ms']:8.3f} ms   "
              f"r err {record['r_err_64_rows']:.1e} / {record['r_err_64_rows_flags']:.1e}")
        failed += record["status"] != "ok"
    writer.update_meta(failed=failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
