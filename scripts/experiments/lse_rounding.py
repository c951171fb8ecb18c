"""What one fp32 lse a row costs fp32 gradients: the cross-entropy's dE and dC formed from torch's fp32 logits
with the lse rounded to fp32, and with it exact, against the naive fp32 path's error.

    python scripts/experiments/lse_rounding.py [--out results.jsonl]    # plain torch; a CPU in seconds
    python scripts/experiments/lse_rounding.py --tiny                    # one seed, one scale

Our kernels form G = exp(z - lse) with one fp32 lse a row: its rounding (ulp(lse) / 2, ~1e-6 at lse ~ 30)
shifts every softmax entry of the row by as much, where torch's log_softmax keeps (z - m) - l with
l = log sum exp(z - m) <= log V. This emulates only that: z = E C^T in fp32 (torch), G in float64 from
exp(z - lse) with lse either fl32(lse) or exact, the target column as ours forms it (1 - p from the
non-target mass where it is below 1/2), G rounded to fp32 and both products in fp32. Inputs: those of
``softcap_precision.py`` (N 48, V 301, D 32), logits of rms 1, 3 and 10. Nothing is asserted (status
"ok" when every number is finite).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from softcap_precision import inputs  # noqa: E402

from helpers.compare.results_file import ResultsWriter, run_meta  # noqa: E402
from helpers.spec import reference_loss, relative_error  # noqa: E402


def measure(seed: int, scale: float) -> dict:
    E, C, _, _, x = inputs(seed, scale, "cpu")
    n = E.shape[0]
    e, c = E.double().requires_grad_(), C.double().requires_grad_()
    reference_loss(e, c, x, reduction="sum").backward()
    exact = (e.grad, c.grad)
    e, c = E.clone().requires_grad_(), C.clone().requires_grad_()
    torch.nn.functional.cross_entropy(e @ c.T, x, reduction="sum").backward()
    naive = (relative_error(e.grad, exact[0]), relative_error(c.grad, exact[1]))
    z = (E @ C.T).double()
    lse = torch.logsumexp(z, 1)
    r = 1 - torch.softmax(z, 1)[torch.arange(n), x]
    record = dict(case=f"rms{scale:g}/seed{seed}", scale=scale, seed=seed, lse_mean=lse.mean().item())
    for name, row_lse in (("lse_fp32", lse.float().double()), ("lse_exact", lse)):
        G = torch.exp(z - row_lse[:, None])
        G[torch.arange(n), x] = torch.where(r < 0.5, -r, G[torch.arange(n), x] - 1)
        G = G.float()
        dE, dC = (G @ C).double(), (G.T @ E).double()
        record[f"{name}_dE"] = relative_error(dE, exact[0]) / naive[0]
        record[f"{name}_dC"] = relative_error(dC, exact[1]) / naive[1]
    record["status"] = "ok" if all(math.isfinite(v) for v in record.values() if isinstance(v, float)) else "not finite"
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results file, JSON Lines")
    parser.add_argument("--tiny", action="store_true", help="one seed, one scale (a CI check of this script)")
    args = parser.parse_args()
    writer = ResultsWriter(args.out or os.devnull, run_meta("cpu"))
    failed = 0
    print(f"{'case':14s} {'lse':>6s} {'fp32 lse: dE':>13s} {'dC':>6s} {'exact lse: dE':>14s} {'dC':>6s}   (over naive's error)")
    for scale in ((10.0,) if args.tiny else (1.0, 3.0, 10.0)):
        for seed in ((0,) if args.tiny else (0, 1, 2)):
            r = measure(seed, scale)
            failed += r["status"] != "ok"
            writer.append(r)
            print(f"{r['case']:14s} {r['lse_mean']:6.1f} {r['lse_fp32_dE']:13.2f} {r['lse_fp32_dC']:6.2f} "
                  f"{r['lse_exact_dE']:14.2f} {r['lse_exact_dC']:6.2f}")
    writer.update_meta(failed=failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
