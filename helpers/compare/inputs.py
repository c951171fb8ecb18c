"""Inputs for measurement: the regimes every speed claim is made in.

``uniform``: E and C random normal, C scaled by 2/sqrt(D), targets uniform. The softmax is dense
(every logit within a few nats of every other), so a gradient filter finds nothing to skip: the
worst case for CCE-style methods, and what the peers' published "random input" numbers use.

``realistic``: a softmax shaped like a trained model's. The paper's Figure 3 (real Gemma-2 weights)
has about 50 entries per row above 2^-12 out of 256k, and those entries are mostly the same frequent
tokens across rows; that shared structure is what lets vocabulary sorting gather them into few
blocks. We build it into E and C directly:

    z_{i,v} = g_{i,v} - alpha * log(1 + rank(v)),     g ~ N(0, sigma^2),

where rank is a random permutation of the vocabulary (token frequency order, hidden from the
kernels), the Zipf term rides in one hidden dimension (E[:, 0] = 1, C[:, 0] = bias) and the gaussian
term in the rest. Targets are sampled from softmax(z), so the mean loss is that of a model that
knows its data: 1-3 nats at the defaults. Scattered (unstructured) significant entries would leave
no block skippable (docs/PERFORMANCE.md measures both kinds).

``trained``: the softmax of a language model trained on the Python standard library at this V and
D (``helpers.compare.trained``; trained on first use, once per process): no generator of ours made
it, so it checks that what the two above show holds for a softmax nobody shaped.

``ignore_targets`` marks targets as ignored the one way every caller does it: none, some (every
7th token) or all.
"""

from __future__ import annotations

import math

import torch

REGIMES = ("uniform", "realistic", "trained")
IGNORE = ("none", "some", "all")


def make_inputs(
    N: int,
    V: int,
    D: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    regime: str = "uniform",
    seed: int = 0,
    sigma: float = 5.0,
    alpha: float = 2.0,
    requires_grad: bool = False,
    targets_device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E (N, D), C (V, D) in ``dtype`` and targets x (N,) int64, all on ``device``; with
    ``requires_grad`` E and C are leaves that require grad (a measured loss step's inputs).
    ``sigma`` and ``alpha`` shape the realistic regime only. ``targets_device``: where the realistic
    regime draws its targets from the softmax of the N x V logits (None: ``device``), with that
    device's generator seeded with ``seed``: E and C drawn on the CPU, the targets on a GPU (a CPU
    takes ~20 s for the logits of 4,096 tokens of the Qwen3 head)."""
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    if D < 2 and regime == "realistic":
        raise ValueError(f"D must be at least 2 for the realistic regime, got {D}")
    if regime == "trained":
        from helpers.compare.trained import trained_inputs

        E, C, x = trained_inputs(N, V, D, dtype, device, seed=seed)
        return E.requires_grad_(requires_grad), C.requires_grad_(requires_grad), x
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=g)
    if regime == "uniform":
        E = torch.randn(N, D, **kw)
        C = torch.randn(V, D, **kw) * (2 / math.sqrt(D))
        x = torch.randint(0, V, (N,), **kw)
        return E.to(dtype).requires_grad_(requires_grad), C.to(dtype).requires_grad_(requires_grad), x
    E = torch.randn(N, D, **kw)
    C = torch.randn(V, D, **kw) * (sigma / math.sqrt(D - 1))
    rank = torch.randperm(V, **kw)
    E[:, 0] = 1.0
    C[:, 0] = -alpha * torch.log1p(rank.float())
    E, C = E.to(dtype), C.to(dtype)
    if targets_device is not None and torch.device(targets_device) != torch.device(device):
        at = torch.device(targets_device)
        x = sample_targets(E.to(at), C.to(at), generator=torch.Generator(device=at).manual_seed(seed)).to(device)
    else:
        x = sample_targets(E, C, generator=g)
    return E.requires_grad_(requires_grad), C.requires_grad_(requires_grad), x


def confident_inputs(N: int, V: int, D: int, margin: float, seed: int = 0,
                     device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E (N, D), C (V, D) fp32 and targets x (N,) with each row's target logit ahead of every other by
    about ``margin`` (1 - p(target) ~ V exp(-margin)): the near-certain tokens whose per-row precision
    ``tests/cce/test_confident.py`` and ``scripts/experiments/confident_rows.py`` measure."""
    g = torch.Generator().manual_seed(seed)
    C = torch.randn(V, D, generator=g)
    x = torch.randint(0, V, (N,), generator=g)
    direction = C[x] / C[x].norm(dim=1, keepdim=True)
    E = 0.01 * torch.randn(N, D, generator=g) + direction * (margin + 10.0) / C[x].norm(dim=1, keepdim=True)
    return E.to(device), C.to(device), x.to(device)


def ignore_targets(x: torch.Tensor, which: str = "none", ignore_index: int = -100) -> torch.Tensor:
    """A copy of x with ``which`` targets set to ``ignore_index``: "none", "some" (every 7th token,
    from the first) or "all"."""
    if which not in IGNORE:
        raise ValueError(f"which must be one of {IGNORE}, got {which!r}")
    x = x.clone()
    if which == "some":
        x[::7] = ignore_index
    elif which == "all":
        x[:] = ignore_index
    return x


def sample_targets(E: torch.Tensor, C: torch.Tensor, generator=None, rows: int = 1024) -> torch.Tensor:
    """x_i ~ softmax(E_i C^T), drawn in row chunks so the N×V logits never exist at once."""
    out = torch.empty(E.shape[0], dtype=torch.long, device=E.device)
    for start in range(0, E.shape[0], rows):
        z = E[start : start + rows].detach().float() @ C.detach().float().T
        out[start : start + rows] = torch.multinomial(torch.softmax(z, dim=1), 1, generator=generator)[:, 0]
    return out
