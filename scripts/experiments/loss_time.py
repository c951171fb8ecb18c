"""The loss's forward and forward+backward time at the Qwen3 and Gemma-2-2B heads, for an A/B of two trees.

    python scripts/experiments/loss_time.py [--out results.jsonl] [--label new]      # a GPU
    python scripts/experiments/loss_time.py --tiny                                   # a CPU check of the script

It calls only the public ``helpers.linear_cross_entropy``, so the same script times any tree: put a
tree first on PYTHONPATH (``PYTHONPATH=/path/to/old/tree python .../loss_time.py --label old``) and
alternate the trees in one session, old, new, old, new, to see a change's cost beside the GPU's drift
(the clock under its power cap moves ~5% between runs). Per head, bf16, a flat softmax (and at 16k
tokens a realistic one, where "auto" runs the sparse backward): the forward alone (no_grad) and
forward+backward, median of 15 calls after 3 (``call_times_ms``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

import helpers  # noqa: F401  (the environment first: helpers.env, the interpreter on a CPU)

from helpers.cce import linear_cross_entropy
from helpers.compare.heads import GEMMA2, QWEN3
from helpers.compare.inputs import make_inputs
from helpers.compare.measure import call_times_ms
from helpers.compare.results_file import ResultsWriter, run_meta


def cases(tiny: bool):
    """(name, N, V, D, softmax regime): "realistic" is where "auto" runs the sparse backward, whose
    forward is another kernel (activity bits, the sorted walk)."""
    if tiny:
        return [("tiny", 8, 300, 32, "uniform")]
    return ([(f"qwen3-{n}", n, QWEN3.V, QWEN3.D, "uniform") for n in (1024, 16384)]
            + [("qwen3-16384-realistic", 16384, QWEN3.V, QWEN3.D, "realistic"),
               ("gemma2-8192", 8192, GEMMA2.V, GEMMA2.D, "uniform")])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results file, JSON Lines")
    parser.add_argument("--label", default="", help="names the tree in the records (e.g. old, new)")
    parser.add_argument("--tiny", action="store_true", help="one tiny head (a CI check of this script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    writer = ResultsWriter(args.out or os.devnull, run_meta(device))
    repeats, warmup = (2, 1) if args.tiny else (15, 3)
    print(f"tree {args.label or '-'}: helpers from {os.path.dirname(os.path.dirname(helpers.__file__))}")
    for name, n, v, d, regime in cases(args.tiny):
        E, C, x = make_inputs(n, v, d, dtype, device, regime=regime, seed=0)
        E, C = E.requires_grad_(), C.requires_grad_()

        def forward():
            with torch.no_grad():
                linear_cross_entropy(E, C, x)

        def step():
            E.grad = C.grad = None
            linear_cross_entropy(E, C, x).backward()

        record = dict(case=name, label=args.label, N=n, V=v, D=d, regime=regime,
                      dtype=str(dtype).replace("torch.", ""))
        for key, fn in (("forward_ms", forward), ("step_ms", step)):
            record[key] = statistics.median(call_times_ms(fn, warmup=warmup, repeats=repeats, device=device))
        record["status"] = "ok"
        writer.append(record)
        print(f"{args.label or '-':4s} {name:14s} forward {record['forward_ms']:8.3f} ms   fwd+bwd {record['step_ms']:8.3f} ms")
    writer.update_meta(failed=0)
    sys.exit(0)


if __name__ == "__main__":
    main()
