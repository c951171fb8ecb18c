"""The JSD in fp32 against float64, by beta and temperature: its gradients as a multiple of the naive fp32
path's error, and its value's relative error, ours and naive's.

    python scripts/experiments/jsd_precision.py [--out results.jsonl]    # a CPU (the interpreter) or a GPU
    python scripts/experiments/jsd_precision.py --tiny                    # one seed, one beta, one teacher

``helpers.linear_kl_div(kind="jsd")`` against ``helpers.spec.reference_kl_div`` in float64 and in fp32 (the
naive path: torch on the full fp32 logits, log M by logsumexp). Teachers: "apart" (the teacher's logits
twice the student's scale, drawn apart) and "near" (the student's hidden states plus 1% noise through the
same head: a JSD of ~1e-5 a row, where its terms cancel). Logits of rms ~1 (flat: log q ~ -log V) and 3.
Per case the worst of three seeds: max(dE, dC) error over naive's, and the summed loss's relative error of
each. Run it in two checkouts to compare a change. Nothing is asserted (status "ok" when every number is
finite); the gates are in ``tests/cce/test_distill.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import helpers  # noqa: E402,F401  (the environment first: helpers.env, the interpreter on a CPU)

from helpers.cce import linear_kl_div  # noqa: E402
from helpers.compare.results_file import ResultsWriter, run_meta  # noqa: E402
from helpers.spec import reference_kl_div, relative_error  # noqa: E402

N, V, D = 48, 301, 32


def heads(seed: int, scale: float, teacher: str, device: str):
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(N, D, generator=g) * (scale / D**0.5)
    C = torch.randn(V, D, generator=g)
    if teacher == "near":
        E_t, C_t = E + 0.01 * torch.randn(N, D, generator=g) * (scale / D**0.5), C
    else:
        E_t, C_t = torch.randn(N, D, generator=g) * (2 * scale / D**0.5), torch.randn(V, D, generator=g)
    return [t.to(device) for t in (E, C, E_t, C_t)]


def measure(seed, scale, teacher, beta, tau, device) -> dict:
    E, C, E_t, C_t = heads(seed, scale, teacher, device)
    options = dict(kind="jsd", beta=beta, temperature=tau, reduction="sum")
    grads, values = {}, {}
    for name, dtype in (("exact", torch.float64), ("naive", torch.float32), ("ours", torch.float32)):
        e, c = (t.detach().to(dtype).requires_grad_(True) for t in (E, C))
        if name == "ours":
            loss = linear_kl_div(e, c, E_t, C_t, **options)
        else:
            loss = reference_kl_div(e, c, E_t.to(dtype), C_t.to(dtype), dtype=dtype, **options)
        loss.backward()
        grads[name], values[name] = (e.grad, c.grad), loss.item()
    ratio = max(relative_error(grads["ours"][i], grads["exact"][i]) / relative_error(grads["naive"][i], grads["exact"][i])
                for i in (0, 1))
    return dict(grad_ratio=ratio, loss_ours=abs(values["ours"] - values["exact"]) / abs(values["exact"]),
                loss_naive=abs(values["naive"] - values["exact"]) / abs(values["exact"]), jsd=values["exact"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results file, JSON Lines")
    parser.add_argument("--tiny", action="store_true", help="one seed, one beta, one teacher (a CI check of this script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seeds = (0,) if args.tiny else (0, 1, 2)
    betas = (0.1,) if args.tiny else (0.1, 0.5, 0.9)
    taus = (2.0,) if args.tiny else (0.5, 1.0, 2.0)
    teachers = ("apart",) if args.tiny else ("apart", "near")
    scales = (1.0,) if args.tiny else (1.0, 3.0)
    writer = ResultsWriter(args.out or os.devnull, run_meta(device))
    failed = 0
    print(f"{'case':34s} {'grads/naive':>11s} {'loss ours':>10s} {'loss naive':>10s}   (worst of {len(seeds)} seeds)")
    for teacher in teachers:
        for scale in scales:
            for beta in betas:
                for tau in taus:
                    runs = [measure(seed, scale, teacher, beta, tau, device) for seed in seeds]
                    r = dict(case=f"{teacher}/rms{scale:g}/beta{beta:g}/tau{tau:g}", teacher=teacher, scale=scale,
                             beta=beta, temperature=tau, seeds=len(seeds),
                             **{k: max(run[k] for run in runs) for k in ("grad_ratio", "loss_ours", "loss_naive")},
                             jsd_min=min(run["jsd"] for run in runs))
                    finite = all(math.isfinite(r[k]) for k in ("grad_ratio", "loss_ours", "loss_naive"))
                    r["status"] = "ok" if finite else "not finite"
                    failed += not finite
                    writer.append(r)
                    print(f"{r['case']:34s} {r['grad_ratio']:11.2f} {r['loss_ours']:10.1e} {r['loss_naive']:10.1e}",
                          flush=True)
    writer.update_meta(failed=failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
