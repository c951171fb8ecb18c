"""The loss's forward and forward+backward time at the Qwen3 and Gemma-2-2B heads, for an A/B of two trees.

    python scripts/experiments/loss_time.py [--out results.jsonl] [--label new] [--cases qwen3-1024 ...]
                                            [--reference torch_compile ...]      # a GPU
    python scripts/experiments/loss_time.py --tiny                                   # a CPU check of the script

It calls only the public ``helpers.linear_cross_entropy``, so the same script times any tree: put a
tree first on PYTHONPATH (``PYTHONPATH=/path/to/old/tree python .../loss_time.py --label old``) and
alternate the trees in one session, old, new, old, new, to see a change's cost beside the GPU's drift
(the clock under its power cap moves ~5% between runs). Per head, bf16, a flat softmax (and at 16k
tokens a realistic one, where "auto" runs the sparse backward; two fp32 cases, whose kernels take the
precise exps, the two-word lse and no FMA contraction that 16-bit inputs do not): the forward alone (no_grad) and
forward+backward, median of 15 calls after 3 (``call_times_ms``), and the step's host time and GPU busy
time back to back (``host_and_device_time``: with few tokens the host bounds the step). ``--reference``
times methods of the comparison's registry (e.g. torch.compile's loss) on the same inputs and timers; each
is called with the case's ``softcap=`` (Gemma-2's cap of 30 in one case), as the registry's losses take it.
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
from helpers.compare.measure import call_times_ms, host_and_device_time
from helpers.compare.methods import get_method
from helpers.compare.results_file import ResultsWriter, run_meta


def cases(tiny: bool):
    """(name, N, V, D, softmax regime, soft cap, dtype): "realistic" is where "auto" runs the sparse backward,
    whose forward is another kernel (activity bits, the sorted walk); Gemma-2's own soft cap of 30 is
    another G kernel (the cap's derivative, and the filter's mass taken before it). None: bf16 on a GPU (fp32
    on the CPU); the fp32 cases are smaller (fp32 products run on CUDA cores, ~20x slower)."""
    if tiny:
        return [("tiny", 8, 300, 32, "uniform", None, None), ("tiny-softcap", 8, 300, 32, "uniform", 30.0, None)]
    return ([(f"qwen3-{n}", n, QWEN3.V, QWEN3.D, "uniform", None, None) for n in (1024, 16384)]
            + [("qwen3-16384-realistic", 16384, QWEN3.V, QWEN3.D, "realistic", None, None),
               ("gemma2-8192", 8192, GEMMA2.V, GEMMA2.D, "uniform", None, None),
               ("gemma2-8192-softcap30", 8192, GEMMA2.V, GEMMA2.D, "uniform", 30.0, None),
               ("qwen3-4096-fp32", 4096, QWEN3.V, QWEN3.D, "uniform", None, torch.float32),
               ("gemma2-2048-fp32-softcap30", 2048, GEMMA2.V, GEMMA2.D, "uniform", 30.0, torch.float32)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results file, JSON Lines")
    parser.add_argument("--label", default="", help="names the tree in the records (e.g. old, new)")
    parser.add_argument("--tiny", action="store_true", help="one tiny head (a CI check of this script)")
    parser.add_argument("--cases", nargs="*", help="only the cases of these names (e.g. qwen3-1024)")
    parser.add_argument("--reference", nargs="*", default=[],
                        help="also time these methods of the comparison's registry on the same inputs and the same "
                             "timers (e.g. torch_compile), each a record labelled by its name")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    writer = ResultsWriter(args.out or os.devnull, run_meta(device))
    repeats, warmup = (2, 1) if args.tiny else (15, 3)
    print(f"tree {args.label or '-'}: helpers from {os.path.dirname(os.path.dirname(helpers.__file__))}")
    for name, n, v, d, regime, softcap, dtype in cases(args.tiny):
        if args.cases and name not in args.cases:
            continue
        dtype = dtype or default_dtype
        E, C, x = make_inputs(n, v, d, dtype, device, regime=regime, seed=0)
        E, C = E.requires_grad_(), C.requires_grad_()
        for label, loss_fn in ((args.label, linear_cross_entropy),
                               *((ref, get_method(ref)) for ref in args.reference)):

            def forward(loss_fn=loss_fn):
                with torch.no_grad():
                    loss_fn(E, C, x, softcap=softcap)

            def step(loss_fn=loss_fn):
                E.grad = C.grad = None
                loss_fn(E, C, x, softcap=softcap).backward()

            record = dict(case=name, label=label, N=n, V=v, D=d, regime=regime, softcap=softcap,
                          dtype=str(dtype).replace("torch.", ""))
            for key, fn in (("forward_ms", forward), ("step_ms", step)):
                record[key] = statistics.median(call_times_ms(fn, warmup=warmup, repeats=repeats, device=device))
            # The host's time per step, back to back (``host_and_device_time``): with few tokens it bounds the step.
            timing = host_and_device_time(step, calls=repeats, warmup=warmup, device=device)
            record.update(step_host_ms=timing.host_ms, step_device_ms=timing.device_ms, status="ok")
            writer.append(record)
            print(f"{label or '-':4s} {name:14s} forward {record['forward_ms']:8.3f} ms   fwd+bwd "
                  f"{record['step_ms']:8.3f} ms   host {timing.host_ms:7.3f} ms   GPU busy {timing.device_ms:7.3f} ms")
    writer.update_meta(failed=0)
    sys.exit(0)


if __name__ == "__main__":
    main()
