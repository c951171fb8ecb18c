"""How sparse is the softmax gradient of our input regimes, at which granularity? Plain torch, CPU.

    PYTHONPATH=. python scripts/experiments/speed_v3_density.py [--quick] [--out density.jsonl]

For each shape, regime (``helpers.compare.inputs``) and vocabulary order (as given, or sorted by
C . mean(E) as ``helpers.cce.shared.vocabulary_order`` does), the fp32 softmax is formed row chunk
by row chunk and reduced to the |G| mass of every (row, vocabulary tile), G = S - onehot(x):

- active (row, tile) pairs under the tile rule (mass >= eps, the rule of our filter), for tiles of
  BLOCK_V in {64, 128, 256}, and active (row group, tile) pairs for groups of R consecutive rows,
  R in {1, 16, 64, 128} (a group is active when any of its rows is);
- the same for a forward-time bit, S mass >= eps * (the row's running softmax sum, a lower bound of
  the final one) in the forward's split order: "fwd" with the H200's vocabulary splits for this N,
  "fwd1" with one split, "fwd+x" also seeded with exp(z_target) (the indexed dot runs first),
  "fwdi+x" seeded and with interleaved splits (split s walks tiles s, s + S, ...), "fwdp+x"
  seeded and with a pilot: the first 1,024 columns in one split, whose sum seeds every other split;
- pack waste: rows computed / active pairs when each tile's active rows are packed P at a time;
- "B/T": the sparse backward's default, eps = B / T with a row budget B = 2^-7 (so <= B per row),
  and "fwdp+x B/T" the forward's (pilot) bits at that eps;
- the skipped |G| mass per row under each rule: "tile" (eps per tile, <= T eps per row),
  "tile/T" (eps / T per tile: <= eps per row), "budget" (skip the smallest tiles while their sum
  stays <= eps: the most that a per-row bound of eps allows);
- how the active pairs sit: the share of tiles with any active row, and of active pairs that lie
  in "dense" tiles (>= 25% of the rows active).

eps = 2^-12 (bf16's "auto"). Rows are iid in both regimes, so consecutive rows are random groups.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from helpers.compare.inputs import make_inputs  # noqa: E402
from helpers.compare.results_file import ResultsWriter, run_meta  # noqa: E402

EPS = 2.0**-12
ROW_BUDGET = 2.0**-7
BLOCKS = (64, 128, 256)
GROUPS = (1, 16, 64, 128)
H200_SMS = 132


def h200_splits(N: int, V: int, block_n: int = 128, block_v: int = 256) -> int:
    """The forward's vocabulary splits on an H200 (``helpers.cce.forward``, hopper bf16 tiles)."""
    n_blocks = math.ceil(N / block_n)
    v_blocks = math.ceil(V / block_v)
    splits = math.ceil(4 * H200_SMS / n_blocks)
    per = math.ceil(v_blocks / max(1, min(splits, v_blocks)))
    return math.ceil(v_blocks / per)


def tile_masses(E, C, x, order, block_v, rows=None):
    """(G mass (N, T), S mass (N, T), S at the target (N,)), fp64 reductions of fp32 softmaxes,
    columns in ``order`` (None: as given)."""
    N, V = E.shape[0], C.shape[0]
    rows = rows or max(64, 2**26 // V)
    T = math.ceil(V / block_v)
    pad = T * block_v - V
    Cf = C.float() if order is None else C.float()[order]
    pos = torch.arange(V) if order is None else torch.empty(V, dtype=torch.long).scatter_(0, order, torch.arange(V))
    G_mass = torch.empty(N, T, dtype=torch.float64)
    S_mass = torch.empty(N, T, dtype=torch.float64)
    S_target = torch.empty(N, dtype=torch.float64)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        z = E[n0:n1].float() @ Cf.T
        S = torch.softmax(z, dim=1).double()
        p = pos[x[n0:n1]]
        r = torch.arange(n1 - n0)
        S_target[n0:n1] = S[r, p]
        S = torch.nn.functional.pad(S, (0, pad))
        S_mass[n0:n1] = S.view(n1 - n0, T, block_v).sum(-1)
        S[r, p] = (S[r, p] - 1).abs()
        G_mass[n0:n1] = S.view(n1 - n0, T, block_v).sum(-1)
    return G_mass, S_mass, S_target


def forward_bits(S_mass, S_target, splits, seeded, interleaved=False, eps=EPS):
    """The bit a forward would emit: S mass >= eps * running sum (in units of the final sum), the
    running sum restarting at each of ``splits`` vocabulary splits: contiguous ranges, or
    ``interleaved`` (split s walks tiles s, s + splits, s + 2 splits, ...)."""
    N, T = S_mass.shape
    bits = torch.zeros(N, T, dtype=torch.bool)
    if interleaved:
        parts = [torch.arange(s, T, splits) for s in range(splits)]
    else:
        per = math.ceil(T / splits)
        parts = [torch.arange(t0, min(T, t0 + per)) for t0 in range(0, T, per)]
    for idx in parts:
        m = S_mass[:, idx]
        running = m.cumsum(dim=1)
        if seeded:
            running = torch.maximum(running, S_target[:, None])
        bits[:, idx] = m >= eps * running
    return bits


def pilot_bits(S_mass, S_target, splits, head_tiles, eps=EPS):
    """Forward bits with a pilot: the first ``head_tiles`` tiles (the head of the sorted vocabulary)
    in one split, then the rest in ``splits`` contiguous splits whose running sums start from the
    head's sum (disjoint columns: head + running is still a lower bound), all seeded by the target."""
    N, T = S_mass.shape
    bits = torch.zeros(N, T, dtype=torch.bool)
    head = S_mass[:, :head_tiles]
    running = torch.maximum(head.cumsum(dim=1), S_target[:, None])
    bits[:, :head_tiles] = head >= eps * running
    head_sum = head.sum(dim=1, keepdim=True)
    rest = T - head_tiles
    per = math.ceil(rest / splits) if rest else 1
    for t0 in range(head_tiles, T, per):
        m = S_mass[:, t0:t0 + per]
        running = torch.maximum(head_sum + m.cumsum(dim=1), S_target[:, None])
        bits[:, t0:t0 + per] = m >= eps * running
    return bits


def pack_waste(active, R_scale, packs=(32, 64, 128)):
    """Rows computed / active pairs when each tile's active rows are gathered into packs of P rows,
    for a batch ``R_scale`` times this one (rows are iid: a tile's count scales with N)."""
    counts = active.sum(dim=0).double() * R_scale
    pairs = counts.sum()
    return {P: round(float((torch.ceil(counts / P) * P).sum() / pairs), 3) for P in packs}


def group_active(active, R):
    N, T = active.shape
    groups = math.ceil(N / R)
    padded = torch.zeros(groups * R, T, dtype=torch.bool)
    padded[:N] = active
    return padded.view(groups, R, T).any(dim=1)


def skipped_mass(G_mass, active):
    s = (G_mass * (~active)).sum(dim=1)
    return float(s.mean()), float(s.max())


def budget_active(G_mass, budget):
    """Per row, skip the smallest tiles while their total stays <= budget."""
    sorted_mass, idx = G_mass.sort(dim=1)
    skip_sorted = sorted_mass.cumsum(dim=1) <= budget
    active = torch.ones_like(G_mass, dtype=torch.bool)
    active.scatter_(1, idx, ~skip_sorted)
    return active


def measure(N, V, D, regime, sort, seed=0, splits_for_N=None):
    """``splits_for_N``: simulate the forward's splits of a batch of that many rows (the heads'
    real N) on these N rows."""
    E, C, x = make_inputs(N, V, D, torch.float32, "cpu", regime=regime, seed=seed)
    order = None
    if sort:
        order = torch.argsort(C.float() @ E.float().mean(0), descending=True)
    splits = h200_splits(splits_for_N or N, V)
    out = []
    G64, S64, S_target = tile_masses(E, C, x, order, BLOCKS[0])
    for bv in BLOCKS:
        k = bv // BLOCKS[0]  # tiles of bv columns: sums of k tiles of 64 (V padded with zeros)
        pad = (-G64.shape[1]) % k
        G_mass = torch.nn.functional.pad(G64, (0, pad)).view(N, -1, k).sum(-1)
        S_mass = torch.nn.functional.pad(S64, (0, pad)).view(N, -1, k).sum(-1)
        T = G_mass.shape[1]
        rules = {
            "tile": G_mass >= EPS,
            "tile/T": G_mass >= EPS / T,
            "budget": budget_active(G_mass, EPS),
            "fwd": forward_bits(S_mass, S_target, splits, False),
            "fwd1": forward_bits(S_mass, S_target, 1, False),
            "fwd+x": forward_bits(S_mass, S_target, splits, True),
            "fwdi+x": forward_bits(S_mass, S_target, splits, True, interleaved=True),
            "fwdp+x": pilot_bits(S_mass, S_target, splits, max(1, 1024 // bv)),
            # The sparse backward's default: a row budget B = 2^-7 (bf16's machine epsilon), eps = B / T.
            "B/T": G_mass >= ROW_BUDGET / T,
            "fwdp+x B/T": pilot_bits(S_mass, S_target, splits, max(1, 1024 // bv), eps=ROW_BUDGET / T),
        }
        # The forward bits see S only; the target's tile is always computed by the backward.
        tgt_tile = (G_mass - S_mass).abs().argmax(dim=1)  # where |S_x - 1| replaced S_x
        for name in ("fwd", "fwd1", "fwd+x", "fwdi+x", "fwdp+x", "fwdp+x B/T"):
            rules[name][torch.arange(N), tgt_tile] = True
        rec = dict(N=N, V=V, D=D, regime=regime, sort=sort, block_v=bv, tiles=T, h200_splits=splits)
        for name, act in rules.items():
            for R in GROUPS:
                rec[f"{name}@{R}"] = round(float(group_active(act, R).float().mean()), 5)
            rec[f"{name}:skip_mean"], rec[f"{name}:skip_max"] = skipped_mass(G_mass, act)
        tile_rule = rules["tile"]
        row_share = tile_rule.float().mean(dim=0)  # per tile, share of rows active
        rec["tiles_touched"] = round(float((row_share > 0).float().mean()), 5)
        dense = row_share >= 0.25
        rec["dense_tiles"] = int(dense.sum())
        rec["pairs_in_dense_tiles"] = round(float(tile_rule[:, dense].sum() / max(1, tile_rule.sum())), 4)
        rec["active_tiles_per_row"] = round(float(tile_rule.sum(1).float().mean()), 2)
        scale = (splits_for_N or N) / N
        rec["pack_waste_tile"] = pack_waste(tile_rule, scale)
        rec["pack_waste_fwdp+x"] = pack_waste(rules["fwdp+x"], scale)
        rec["pack_waste_B/T"] = pack_waste(rules["B/T"], scale)
        rec["pack_waste_fwdp+x B/T"] = pack_waste(rules["fwdp+x B/T"], scale)
        out.append(rec)
    return out


def filter_errors(N=1024, V=32768, D=128, seed=0):
    """Relative L2 error of dE and dC (float64, mean reduction) when G is filtered by a rule, against
    the exact float64 gradients, next to the naive bf16 path's error (torch's CPU bf16 matmuls):
    what a filter costs in accuracy, before any rounding of ours. Rules: "row" (a (row, tile) pair
    is dropped when its |G| mass < eps: the sparse backward's rule) and "block128" (a (128-row
    block, tile) is dropped when every row's mass < eps: the "gemm" backward's filter)."""
    out = []
    for regime in ("realistic", "uniform"):
        E, C, x = make_inputs(N, V, D, torch.bfloat16, "cpu", regime=regime, seed=seed)
        E64, C64 = E.double(), C.double()
        # Exact float64 gradients, and the naive bf16 path's.
        z = E64 @ C64.T
        G = torch.softmax(z, dim=1)
        G[torch.arange(N), x] -= 1
        G /= N
        dE_ref, dC_ref = G @ C64, G.T @ E64
        En, Cn = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
        torch.nn.functional.cross_entropy((En @ Cn.T).float(), x).backward()
        naive = dict(dE=_rel(En.grad.double(), dE_ref), dC=_rel(Cn.grad.double(), dC_ref))
        for sort in (False, True):
            order = torch.argsort(C.float() @ E.float().mean(0), descending=True) if sort else torch.arange(V)
            Gs = G[:, order]
            for bv in (64, 128, 256):
                T = math.ceil(V / bv)
                pad = T * bv - V
                Gp = torch.nn.functional.pad(Gs, (0, pad)).view(N, T, bv)
                mass = Gp.abs().sum(-1) * N  # the unscaled |G| mass of each (row, tile)
                for log2_eps in (-12, -14, -15, -16, -17, -18):
                    eps = 2.0**log2_eps
                    for rule in ("row", "block128") if log2_eps == -12 else ("row",):
                        keep = mass >= eps
                        if rule == "block128":
                            keep = group_active(keep, 128).repeat_interleave(128, dim=0)[:N]
                        Gk = (Gp * keep[..., None]).view(N, -1)[:, :V]
                        Gf = torch.empty_like(Gk)
                        Gf[:, order] = Gk
                        dE, dC = Gf @ C64, Gf.T @ E64
                        rec = dict(regime=regime, sort=sort, block_v=bv, eps=f"2^{log2_eps}", rule=rule,
                                   kept=round(float(keep.float().mean()), 4),
                                   dE_err=_rel(dE, dE_ref), dC_err=_rel(dC, dC_ref),
                                   naive_dE_err=naive["dE"], naive_dC_err=naive["dC"])
                        rec["dE_ratio"] = round(rec["dE_err"] / naive["dE"], 3)
                        rec["dC_ratio"] = round(rec["dC_err"] / naive["dC"], 3)
                        out.append(rec)
                        print(json.dumps(rec), flush=True)
                if regime == "uniform":
                    break  # nothing is filtered on a dense softmax; one line shows it
            if regime == "uniform":
                break
    return out


def _rel(a, r):
    return float((a - r).norm() / r.norm())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape")
    parser.add_argument("--heads", action="store_true",
                        help="the heads' vocabularies (Qwen3 151,936, Gemma 256,000) on 2,048 rows, "
                             "D=256, the forward's splits as at N=16,384 and 8,192; realistic only")
    parser.add_argument("--out", default=None)
    parser.add_argument("--errors", action="store_true",
                        help="the gradient error each filter rule and eps costs, against naive bf16")
    parser.add_argument("--errors-shape", type=int, nargs=3, default=(1024, 32768, 128), metavar=("N", "V", "D"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.errors:
        records = filter_errors(*args.errors_shape)
        if args.out:
            writer = ResultsWriter(args.out, run_meta("cpu"))
            for record in records:
                writer.append(record)
        return
    shapes = [(1024, 32768, 256)] if args.quick else [
        (1024, 32768, 256), (4096, 32768, 256), (1024, 65536, 1024), (4096, 65536, 1024)]
    regimes = ("uniform", "realistic")
    shapes = [(*s, None) for s in shapes]
    if args.heads:
        shapes, regimes = [(2048, 151_936, 256, 16_384), (2048, 256_000, 256, 8_192)], ("realistic",)
    records = []
    for N, V, D, splits_for_N in shapes:
        for regime in regimes:
            for sort in (False, True):
                t = time.time()
                recs = measure(N, V, D, regime, sort, splits_for_N=splits_for_N)
                records += recs
                for r in recs:
                    print(json.dumps(r), flush=True)
                print(f"# {N}x{V}x{D} {regime} sort={sort}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    if args.out:
        writer = ResultsWriter(args.out, run_meta("cpu", eps=EPS))
        for record in records:
            writer.append(record)


if __name__ == "__main__":
    main()
