"""Gradients under a soft cap in fp32: ours against the naive fp32 path, both against float64.

    python scripts/experiments/softcap_precision.py [--out results.jsonl]    # a CPU (the interpreter) or a GPU
    python scripts/experiments/softcap_precision.py --tiny                    # one seed, one cap

Every kernel caps a logit as cap (1 - r) with r = 2 / (2^(z k) + 1) (``helpers/cce/kernels/logits.py``,
``soft_cap_and_gap``). For a logit small beside the cap, 1 - r keeps r's absolute error (~6e-8), so the
capped logit carries ~6e-8 x cap absolute where fp32 holds 6e-8 relative: at a cap of 30 a logit of 1
rounds ~30x worse than fp32 allows. With fp32 inputs the kernels take tanh(y) / y's series below
|y| = 0.4 (``PRECISE``). This measures what reaches the gradients: per case, the cross-entropy's dE and
dC (``helpers.linear_cross_entropy``) and the three divergences' dE_s and dC_s
(``helpers.linear_kl_div``), each as its relative error against float64 (``helpers.spec``) divided by
the naive fp32 path's (torch on the full fp32 logits, capped by ``torch.tanh``); "cap0" cases have no cap. Run it on two trees
(before and after a change to the cap) to see the change: the ratio is the figure, 1 is the naive
path's accuracy. Nothing is asserted (status "ok" when every number is finite); the gates are
``tests/cce/test_cce.py`` and ``tests/cce/test_distill.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import helpers  # noqa: E402,F401  (the environment first: helpers.env, the interpreter on a CPU)

from helpers.cce import linear_cross_entropy, linear_kl_div  # noqa: E402
from helpers.compare.results_file import ResultsWriter, run_meta  # noqa: E402
from helpers.spec import DIVERGENCES, reference_kl_div, reference_loss, relative_error  # noqa: E402

# Irregular, and small enough for the interpreter: logits of rms ~`scale`, a vocabulary tile's worth of rows.
N, V, D = 48, 301, 32


def inputs(seed: int, scale: float, device: str):
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(N, D, generator=g) * (scale / D**0.5)
    C = torch.randn(V, D, generator=g)
    E_t = torch.randn(N, D, generator=g) * (2 * scale / D**0.5)  # the teacher twice as sharp
    C_t = torch.randn(V, D, generator=g)
    x = torch.randint(0, V, (N,), generator=g)
    return [t.to(device) for t in (E, C, E_t, C_t, x)]


def leaves(*tensors, dtype):
    return [t.detach().to(dtype).requires_grad_(True) for t in tensors]


def cross_entropy_ratios(E, C, x, softcap: float, **extra) -> dict:
    """dE's and dC's error ratios (``ratios``); ``extra``: more of the loss's options (e.g. temperature)."""
    grads = {}
    for name, dtype in (("exact", torch.float64), ("naive", torch.float32)):
        e, c = leaves(E, C, dtype=dtype)
        reference_loss(e, c, x, reduction="sum", softcap=softcap, dtype=dtype, **extra).backward()
        grads[name] = (e.grad, c.grad)
    e, c = leaves(E, C, dtype=torch.float32)
    linear_cross_entropy(e, c, x, reduction="sum", softcap=softcap, **extra).backward()
    grads["ours"] = (e.grad, c.grad)
    return ratios(grads)


def divergence_ratios(E, C, E_t, C_t, softcap: float, kind: str, **extra) -> dict:
    """dE_s's and dC_s's error ratios (``ratios``); ``extra``: more options (e.g. temperature)."""
    grads = {}
    options = dict(kind=kind, reduction="sum", softcap=softcap, **extra)
    for name, dtype in (("exact", torch.float64), ("naive", torch.float32)):
        e, c = leaves(E, C, dtype=dtype)
        reference_kl_div(e, c, E_t.to(dtype), C_t.to(dtype), dtype=dtype, **options).backward()
        grads[name] = (e.grad, c.grad)
    e, c = leaves(E, C, dtype=torch.float32)
    linear_kl_div(e, c, E_t, C_t, **options).backward()
    grads["ours"] = (e.grad, c.grad)
    return ratios(grads)


def status(record: dict) -> str:
    """"ok" when every error in ``record`` (``ratios``' keys) is finite, else "not finite"."""
    finite = all(math.isfinite(v) for k, v in record.items() if k.endswith(("_ours", "_naive")))
    return "ok" if finite else "not finite"


def ratios(grads: dict) -> dict:
    record = {}
    for i, name in enumerate(("dE", "dC")):
        ours = relative_error(grads["ours"][i], grads["exact"][i])
        naive = relative_error(grads["naive"][i], grads["exact"][i])
        record.update({f"{name}_ours": ours, f"{name}_naive": naive, f"{name}_ratio": ours / naive})
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results file, JSON Lines")
    parser.add_argument("--tiny", action="store_true", help="one seed, one cap, one scale (a CI check of this script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seeds = (0,) if args.tiny else (0, 1, 2)
    caps = (30.0,) if args.tiny else (None, 30.0, 50.0, 5.0)  # None: no cap, the rest's baseline
    scales = (3.0,) if args.tiny else (1.0, 3.0, 10.0)  # pre-cap logits' rms
    writer = ResultsWriter(args.out or os.devnull, run_meta(device))
    failed = 0
    print(f"{'case':34s} {'dE ours/naive':>14s} {'dC ours/naive':>14s}   (fp32 gradients' error against float64)")
    for softcap in caps:
        for scale in scales:
            for seed in seeds:
                E, C, E_t, C_t, x = inputs(seed, scale, device)
                for loss in ("cross_entropy", *DIVERGENCES):
                    r = (cross_entropy_ratios(E, C, x, softcap) if loss == "cross_entropy"
                         else divergence_ratios(E, C, E_t, C_t, softcap, loss))
                    r = dict(case=f"{loss}/cap{softcap or 0:g}/rms{scale:g}/seed{seed}", loss=loss, softcap=softcap,
                             scale=scale, seed=seed, **r)
                    r["status"] = status(r)
                    failed += r["status"] != "ok"
                    writer.append(r)
                    print(f"{r['case']:34s} {r['dE_ratio']:14.2f} {r['dC_ratio']:14.2f}", flush=True)
    writer.update_meta(failed=failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
