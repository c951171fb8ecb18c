"""Distillation through the heads, for notebook 06 and ``scripts/gpu/distill_check.py``: the three ways
to compute one divergence between a student's and a teacher's softmax (ours, the naive path on full
logits, Liger-Kernel's fused linear JSD), a float64 check of ours, and a tiny distillation run.

The divergence and its kinds: ``helpers.cce.distill`` (``linear_kl_div``) and ``helpers.spec``
(``reference_kl_div``, ``divergence_of_logits``). Every path here returns the mean over the kept
tokens of each token's divergence summed over V, with gradients to the student (E_s, C_s) only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from helpers.cce import linear_kl_div
from helpers.cce.options import triton_reason
from helpers.compare.inputs import ignore_targets, make_inputs
from helpers.spec import divergence_of_logits, reference_kl_div, relative_error

KINDS = ("forward", "reverse", "jsd")
# Liger's generalized JSD's beta for each of our kinds (its 0 and 1 are the two KLs).
LIGER_BETA = {"forward": 0.0, "reverse": 1.0, "jsd": 0.5}


class Heads(NamedTuple):
    """A student's hidden states and head (E_s (N, D_s), C_s (V, D_s)), a teacher's (E_t (N, D_t),
    C_t (V, D_t)) and targets x (N,) whose ignored entries (-100) say which tokens do not count."""

    E_s: torch.Tensor
    C_s: torch.Tensor
    E_t: torch.Tensor
    C_t: torch.Tensor
    x: torch.Tensor


def heads(N: int, V: int, D_s: int, D_t: int, dtype: torch.dtype, device, seed: int = 0) -> Heads:
    """Both heads in the uniform regime of ``helpers.compare.inputs`` (a dense softmax each, logits of
    standard deviation ~2), every 7th token ignored."""
    E_s, C_s, x = make_inputs(N, V, D_s, dtype, device, regime="uniform", seed=seed)
    E_t, C_t, _ = make_inputs(N, V, D_t, dtype, device, regime="uniform", seed=seed + 1)
    return Heads(E_s, C_s, E_t, C_t, ignore_targets(x, "some"))


def naive_kl_div(E_s, C_s, E_t, C_t, x, *, kind, beta=0.5, temperature=1.0, softcap=None, bias_s=None, bias_t=None,
                 reduction="mean"):
    """The naive path: each head's logits in the dtype, then fp32, capped and tempered, the teacher's
    under no_grad; ``helpers.spec.divergence_of_logits`` on them."""

    def logits(E, C, b):
        z = (E @ C.T if b is None else E @ C.T + b).float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        return z / temperature

    with torch.no_grad():
        t = logits(E_t, C_t, bias_t)
    return divergence_of_logits(logits(E_s, C_s, bias_s), t, kind=kind, beta=beta, mask=x != -100,
                                reduction=reduction)


def liger_kl_div(E_s, C_s, E_t, C_t, x, *, kind, temperature=1.0):
    """Liger-Kernel's ``LigerFusedLinearJSD`` at the beta of ``kind`` (mean over the tokens ``x`` keeps)."""
    from liger_kernel.transformers import LigerFusedLinearJSD

    return LigerFusedLinearJSD(jsd_beta=LIGER_BETA[kind], temperature=temperature)(E_s, C_s, E_t, C_t, x)


def liger_reason(device, dtype: torch.dtype) -> str | None:
    """Why Liger's fused JSD cannot run on ``device`` in ``dtype`` (None: it can). Its Triton kernel runs
    where ours does: a CUDA GPU, or the CPU under the Triton interpreter (not in bf16 there)."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as error:
        return f"liger-kernel is not installed ({error})"
    return triton_reason(device, dtype)


def ours_kl_div(E_s, C_s, E_t, C_t, x, **options):
    """Ours: ``linear_kl_div`` with the tokens ``x`` keeps."""
    return linear_kl_div(E_s, C_s, E_t, C_t, x=x, **options)


PATHS: dict[str, Callable] = {"ours": ours_kl_div, "naive": naive_kl_div, "liger": liger_kl_div}


def step(path: str, h: Heads, kind: str, configs=None) -> Callable[[], torch.Tensor]:
    """One forward and backward of ``path`` ("ours", "naive" or "liger") on ``h`` as a callable that
    returns the loss (dE_s and dC_s computed, not accumulated: each call starts from the same memory).
    ``configs``: ours' launch configurations (``linear_kl_div``'s)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}")
    E_s, C_s = h.E_s.detach().requires_grad_(True), h.C_s.detach().requires_grad_(True)
    options = {"configs": configs} if PATHS[path] is ours_kl_div and configs is not None else {}

    def run():
        loss = PATHS[path](E_s, C_s, h.E_t, h.C_t, h.x, kind=kind, **options)
        torch.autograd.grad(loss, (E_s, C_s))
        return loss.detach()

    return run


def student_grads(loss_fn, E_s, C_s, bias_s=None, grad_output=None):
    """(loss, (dE_s, dC_s[, db_s])) of ``loss_fn(E_s, C_s[, bias_s])`` on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (E_s, C_s) + ((bias_s,) if bias_s is not None else ())]
    loss = loss_fn(*leaves)
    loss.backward(grad_output if grad_output is not None else torch.ones_like(loss))
    return loss.detach(), tuple(t.grad for t in leaves)


def check_against_float64(h: Heads, kind: str, temperature: float = 0.7) -> dict:
    """Ours and the naive path against ``reference_kl_div`` in float64 on ``h``: the relative errors
    of the loss, dE_s and dC_s, the gate's bound for each (``helpers.compare.verdicts.gate_bound``:
    max(the dtype's floor, 2 x naive's error)) and whether ours is within every bound ("ok")."""
    from helpers.compare.units import dtype_name
    from helpers.compare.verdicts import gate_bound

    mask = h.x != -100
    ref = student_grads(lambda E, C: reference_kl_div(E, C, h.E_t.double(), h.C_t.double(), mask=mask, kind=kind,
                                                      temperature=temperature), h.E_s.double(), h.C_s.double())
    errors = {}
    for path in ("ours", "naive"):
        loss, grads = student_grads(lambda E, C: PATHS[path](E, C, h.E_t, h.C_t, h.x, kind=kind,
                                                             temperature=temperature), h.E_s, h.C_s)
        errors[path] = {q: relative_error(got, want) for q, got, want in
                        zip(("loss", "dE", "dC"), (loss, *grads), (ref[0], *ref[1]))}
    name = dtype_name(h.E_s.dtype)
    bounds = {q: gate_bound(name, q, errors["naive"][q]) for q in errors["ours"]}
    return {"kind": kind, "dtype": name, "errors": errors, "bounds": bounds,
            "ok": all(errors["ours"][q] <= bounds[q] for q in bounds)}


def distill_student(V: int, D_s: int, D_t: int, *, steps: int, tokens: int, lr: float, kind: str, seed: int = 0,
                    device="cpu", configs=None) -> list[float]:
    """A tiny distillation: a fixed teacher head over features f (tokens, D_t) and a student that maps
    them to its own width (a linear layer, D_t -> D_s) before its head C_s (V, D_s), trained with Adam on
    ``linear_kl_div`` of ``kind`` (``configs``: its launch configurations); returns the divergence at
    each step (fp32, on fresh features)."""
    g = torch.Generator().manual_seed(seed)
    C_t = (2.0 * torch.randn(V, D_t, generator=g) / D_t**0.5).to(device)
    project = torch.nn.Linear(D_t, D_s, bias=False).to(device)
    C_s = torch.nn.Parameter((torch.randn(V, D_s, generator=g) / D_s**0.5).to(device))
    optimizer = torch.optim.Adam([*project.parameters(), C_s], lr=lr)
    curve = []
    for _ in range(steps):
        features = torch.randn(tokens, D_t, generator=g).to(device)
        loss = linear_kl_div(project(features), C_s, features, C_t, kind=kind, configs=configs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append(loss.item())
    return curve


__all__ = ["KINDS", "LIGER_BETA", "PATHS", "Heads", "heads", "ours_kl_div", "naive_kl_div", "liger_kl_div", "liger_reason", "step",
           "student_grads", "check_against_float64", "distill_student"]
