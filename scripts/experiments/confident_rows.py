"""Per-row precision of confident tokens: each row's dE against float64 as its target's probability nears 1.

    python scripts/experiments/confident_rows.py [--out results.jsonl]          # a CPU (fp32, fp16) or a GPU (+ bf16)
    python scripts/experiments/confident_rows.py --tiny                          # the same, fewer margins

The float64 gate compares whole gradients, where a confident row (p_target near 1, its gradient
(p - 1) C_x + sum_v p_v C_v of size ~(1 - p) |C|) weighs little. RL and inspection of per-token
gradients read rows one by one. The backward recomputes each logit z and subtracts the stored lse,
both fp32 numbers of the logits' magnitude, so p_x - 1 = exp(z_x - lse) - 1 carries an absolute error
of a few units in the last place of |z| (|z| ~ 30: ~4e-6), whatever 1 - p is. torch on fp32 logits has
one such rounding per logit; ours adds the lse's and a recomputed logit's.

Per margin (the target's logit leads every other by about that much; V 301, D 16, 6 rows) and dtype:
1 - p of the most confident row, and the largest per-row relative error of dE against float64 for
ours, for torch on logits in the dtype (the gate's naive path), and for torch on fp32 logits of the
same inputs, against ``helpers.spec.reference_loss_and_grads`` (float64). Nothing is asserted: it measures (status "ok" when every number is finite).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import helpers  # noqa: E402,F401  (the environment first: helpers.env, the interpreter on a CPU)
import torch.nn.functional as F  # noqa: E402

from helpers.cce import linear_cross_entropy  # noqa: E402
from helpers.compare.inputs import confident_inputs  # noqa: E402
from helpers.compare.results_file import ResultsWriter, run_meta  # noqa: E402
from helpers.spec import reference_loss_and_grads  # noqa: E402

N, V, D = 6, 301, 16


def row_errors(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm(dim=1) / want.norm(dim=1)).max().item()


def measure(margin: float, dtype: torch.dtype, device: str) -> dict:
    E, C, x = (t.to(dtype) if t.is_floating_point() else t for t in confident_inputs(N, V, D, margin, device=device))
    leaves = {"exact": reference_loss_and_grads(E, C, x, reduction="sum")[1]}
    for name, cast in (("naive", dtype), ("naive_fp32", torch.float32)):
        e, c = (t.detach().to(cast).requires_grad_() for t in (E, C))
        F.cross_entropy((e @ c.T).float(), x, reduction="sum").backward()
        leaves[name] = e.grad
    e, c = (t.detach().requires_grad_() for t in (E, C))
    stats = {}
    linear_cross_entropy(e, c, x, reduction="sum", stats=stats).backward()
    z = E.double() @ C.double().T
    p = torch.softmax(z, dim=1).gather(1, x[:, None]).squeeze(1)
    record = dict(case=f"margin{margin:g}/{str(dtype).replace('torch.', '')}", margin=margin,
                  one_minus_p_min=(1 - p).min().item(),
                  ours=row_errors(e.grad, leaves["exact"]), naive=row_errors(leaves["naive"], leaves["exact"]),
                  naive_fp32=row_errors(leaves["naive_fp32"], leaves["exact"]),
                  forward=stats.get("forward"), backward=stats.get("backward"), g_kernels=stats.get("g_kernels"))
    finite = all(math.isfinite(record[k]) for k in ("ours", "naive", "naive_fp32"))
    record["status"] = "ok" if finite else "not finite"
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results file, JSON Lines")
    parser.add_argument("--tiny", action="store_true", help="two margins (a CI check of this script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    margins = (10.0, 18.0) if args.tiny else (5.0, 10.0, 14.0, 18.0, 22.0)
    writer = ResultsWriter(args.out or os.devnull, run_meta(device))
    failed = 0
    print(f"{'case':22s} {'1 - p':>8s} {'ours':>8s} {'naive':>8s} {'fp32 lg':>8s}   (largest per-row dE error)")
    for margin in margins:
        for dtype in dtypes:
            r = measure(margin, dtype, device)
            failed += r["status"] != "ok"
            writer.append(r)
            print(f"{r['case']:22s} {r['one_minus_p_min']:8.1e} {r['ours']:8.1e} {r['naive']:8.1e} {r['naive_fp32']:8.1e}")
    writer.update_meta(failed=failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
