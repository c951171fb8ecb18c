"""Why is dE wrong for fp16/bf16 on the H200 (torch 2.11, triton 3.6, sm_90)? One GPU call.

    python bench/debug_de.py [--tiers]

1. A minimal chained-dot kernel, z = A B^T (fp32 accumulator), P = (0.05 z).to(dtype),
   out = P W: the dE product's shape of data flow (A operand of the second dot is the first dot's
   accumulator, cast), per tile size, warps and dtype, plus the transposed-product form.
2. ``helpers.cce.linear_cross_entropy`` per configuration tier, fp16/bf16, with dE diagnostics
   (norm ratio, cosine, bad rows) against float64 (``helpers.reference``).
3. Kernel variants built from ``helpers/kernels/backward.py`` by source substitution (of the
   pre-fix lines: against the fixed file the dE-product variants report "could not build").
4. On a single-tile problem (V < D, so C has full row rank) the G the kernel effectively used,
   G' = dE' C^+, against the true G: is it permuted, scaled, zero?
Writes the backward kernel's TTGIR/PTX under $OUT for comparison with a CPU-side compile.

Findings (H200, torch 2.11, triton 3.6, 2026-11-30), with ``tl.dot(G_dE, c)`` in backward.py:
the minimal chained dot is right (err ~1e-6) at every tile size and warp count; the real kernel's dE
is wrong in every tier, fp16 and bf16 (err 1.02 at D=136, 1.31 at D=520), while dC is right. dE
is right with the dC product removed from the loop, with 64x64 tiles on 8 warps (no register
operand), and with the transposed product (both operands in shared memory); "ieee" precision,
no input_precision and trans(trans(G)) change nothing. G recovered on one tile is right only in
part. The GPU's PTX reads G_dE's packed registers (%r942..., defined once before the D loop) in
every iteration; assembled with Triton's ptxas (12.8; 12.9 gives the same), the SASS puts them in
R84-R115 and overwrites those inside the loop (the scaled dE tile, then dC's LDSM operand) with no
restore: every D block after the first multiplies C by dC's operand. Predicted error
sqrt(2 (D - BLOCK_D) / D): 1.03 at D=136, 1.32 at D=520, 1.37 at D=1024, 1.39 at D=2304, as
measured. Fixed by the transposed product; with it all four tiers give dE 1.7e-3 (bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # a CPU dry run of this script (fp16 only)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import helpers.cce as cce  # noqa: E402
from helpers.kernels import configs as K  # noqa: E402
from helpers.reference import reference_loss_and_grads  # noqa: E402

T0 = time.time()
OUT = os.environ.get("OUT")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW = (torch.bfloat16, torch.float16) if DEVICE == "cuda" else (torch.float16,)
ROWS: list[str] = []


def log(msg: str):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def row(msg: str):
    ROWS.append(msg)
    log(msg)


# ---------------------------------------------------------------------------------------------
# 1. Minimal chained dot
# ---------------------------------------------------------------------------------------------


@triton.jit
def chained_dot_kernel(A_ptr, B_ptr, W_ptr, X_ptr, out_ptr, out2_ptr, K_dim, D,
                       BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_D: tl.constexpr, TRANS_PRODUCT: tl.constexpr, WITH_SECOND: tl.constexpr):
    # A (BLOCK_M, K), B (BLOCK_V, K), W (BLOCK_V, D), X (BLOCK_M, D); out = P W, out2 = P^T X.
    dtype = A_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    rv = tl.arange(0, BLOCK_V)
    rk = tl.arange(0, BLOCK_K)
    rd = tl.arange(0, BLOCK_D)
    z = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, K_dim, BLOCK_K):
        a = tl.load(A_ptr + rm[:, None] * K_dim + (k0 + rk)[None, :])
        b = tl.load(B_ptr + rv[None, :] * K_dim + (k0 + rk)[:, None])
        z = tl.dot(a, b, z)
    P = (z * 0.05).to(dtype)
    for d0 in range(0, D, BLOCK_D):
        w = tl.load(W_ptr + rv[:, None] * D + (d0 + rd)[None, :])
        if TRANS_PRODUCT:
            o = tl.trans(tl.dot(tl.trans(w), tl.trans(P)))
        else:
            o = tl.dot(P, w)
        tl.store(out_ptr + rm[:, None] * D + (d0 + rd)[None, :], o)
        if WITH_SECOND:
            xx = tl.load(X_ptr + rm[:, None] * D + (d0 + rd)[None, :])
            o2 = tl.dot(tl.trans(P), xx)
            tl.store(out2_ptr + rv[:, None] * D + (d0 + rd)[None, :], o2)


def rel(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def minimal(dtype, bm, bv, bk, bd, warps, trans, second, Kd=256, D=128):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    A = torch.randn(bm, Kd, device=DEVICE, generator=g).to(dtype)
    B = (torch.randn(bv, Kd, device=DEVICE, generator=g) / math.sqrt(Kd)).to(dtype)
    W = torch.randn(bv, D, device=DEVICE, generator=g).to(dtype)
    X = torch.randn(bm, D, device=DEVICE, generator=g).to(dtype)
    out = torch.full((bm, D), float("nan"), device=DEVICE)
    out2 = torch.full((bv, D), float("nan"), device=DEVICE)
    chained_dot_kernel[(1,)](A, B, W, X, out, out2, Kd, D, BLOCK_M=bm, BLOCK_V=bv, BLOCK_K=bk,
                             BLOCK_D=bd, TRANS_PRODUCT=trans, WITH_SECOND=second,
                             num_warps=warps, num_stages=2)
    P = ((A.double() @ B.double().T).float() * 0.05).to(dtype).double()
    e1 = rel(out, P @ W.double())
    e2 = rel(out2, P.T @ X.double()) if second else float("nan")
    row(f"minimal {str(dtype)[6:]:8s} tile {bm}x{bv}x{bk} bd {bd} warps {warps} trans={int(trans)} "
        f"second={int(second)}: P@W err {e1:.2e}  P^T@X err {e2:.2e}")


# ---------------------------------------------------------------------------------------------
# 2-4. The real function
# ---------------------------------------------------------------------------------------------


class Capture:
    """Stands in for a JITFunction in helpers.cce and keeps the last compiled kernel."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.last = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = self.kernel[grid](*args, **kwargs)
            return self.last
        return launch


def make_inputs(N, V, D, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    E = torch.randn(N, D, device=DEVICE, generator=g).to(dtype)
    C = (torch.randn(V, D, device=DEVICE, generator=g) * (2.0 / math.sqrt(D))).to(dtype)
    x = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    return E, C, x


def ours(E, C, x, grad_output=1.0, **options):
    E_ = E.detach().clone().requires_grad_(True)
    C_ = C.detach().clone().requires_grad_(True)
    loss = cce.linear_cross_entropy(E_, C_, x, **options)
    loss.backward(torch.as_tensor(grad_output, device=loss.device).expand_as(loss))
    return loss.detach(), E_.grad, C_.grad


def diagnose(dE, rdE):
    g, r = dE.double(), rdE.double()
    ratio = (g.norm() / r.norm()).item()
    cos = ((g * r).sum() / (g.norm() * r.norm()).clamp_min(1e-300)).item()
    row_err = (g - r).norm(dim=1) / r.norm(dim=1).clamp_min(1e-300)
    bad = (row_err > 0.05).double()
    # which rows of a 128-row tile go bad (in 16-row warp slices), and are rows swapped?
    by_warp = [f"{bad[(torch.arange(len(bad), device=bad.device) % 128) // 16 == w].mean().item():.2f}"
               for w in range(8)]
    n = min(128, g.shape[0])
    gn = g[:n] / g[:n].norm(dim=1, keepdim=True).clamp_min(1e-300)
    rn = r[:n] / r[:n].norm(dim=1, keepdim=True).clamp_min(1e-300)
    corr = gn @ rn.T
    best = corr.abs().argmax(dim=1)
    best_val = corr.abs().max(dim=1).values
    mapping = " ".join(f"{i}->{int(best[i])}({best_val[i].item():.2f})" for i in range(0, min(n, 40), 5))
    return (f"norm ratio {ratio:.3f} cos {cos:+.3f} bad rows {bad.mean().item():.2f} "
            f"bad by warp-slice [{' '.join(by_warp)}] | best-matching ref row: {mapping}")


def check(label, N, V, D, dtype, configs=None, detail=True, **options):
    E, C, x = make_inputs(N, V, D, dtype)
    # reduction="none" gets a random upstream gradient per row, as gpu_cce_check gives it
    go = (torch.randn(N, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
          if options.get("reduction") == "none" else torch.tensor(1.7, device=DEVICE))
    rloss, rdE, rdC = reference_loss_and_grads(E, C, x, go, **options)
    try:
        loss, dE, dC = ours(E, C, x, go, configs=configs, filter_eps=None, **options)
    except Exception as error:  # a variant that does not compile must not stop the others
        row(f"{label:44s} N={N} V={V} D={D} {str(dtype)[6:]}: ERROR {type(error).__name__}: "
            f"{str(error)[:300]}")
        return None
    loss_err = rel(loss.reshape(-1), rloss.reshape(-1))
    msg = (f"{label:44s} N={N} V={V} D={D} {str(dtype)[6:]}: loss {loss_err:.1e}"
           f" dE {rel(dE, rdE):.2e} dC {rel(dC, rdC):.2e}")
    row(msg)
    if detail:
        row("    dE " + diagnose(dE, rdE))
    return dE, rdE, E, C, x


def variant_module(name, replacements):
    """A copy of helpers/kernels/backward.py with ``replacements`` applied, imported as a module."""
    src = open(os.path.join(REPO, "helpers", "kernels", "backward.py")).read()
    for old, new in replacements:
        assert src.count(old) == 1, (name, old, src.count(old))
        src = src.replace(old, new)
    folder = os.path.join("/tmp", "cce_variants")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"backward_{name}.py")
    with open(path, "w") as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location(f"backward_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DE_LINE = "dE_tile = tl.dot(G_dE, c, input_precision=DOT_PRECISION) * dE_scale"
VARIANTS = {
    "trans-product": [(DE_LINE, "dE_tile = tl.trans(tl.dot(tl.trans(c), tl.trans(G_dE), "
                                "input_precision=DOT_PRECISION)) * dE_scale")],
    "trans-trans-G": [("G_dE = G.to(dtype)", "G_dE = tl.trans(tl.trans(G).to(dtype))")],
    "dE-only": [("BLOCK_D, True, True, DOT_PRECISION)", "BLOCK_D, True, False, DOT_PRECISION)")],
    "no-input-precision": [(DE_LINE, "dE_tile = tl.dot(G_dE, c) * dE_scale")],
}


def recover_G(dtype, configs):
    """Single tile, V < D: G' = dE' C^+ shows what the dE product multiplied C by."""
    N, V, D = 128, 64, 128
    E, C, x = make_inputs(N, V, D, dtype, seed=3)
    _, rdE, _ = reference_loss_and_grads(E, C, x, 1.0, reduction="sum")
    _, dE, _ = ours(E, C, x, configs=configs, reduction="sum", filter_eps=None)
    Cd = C.double()
    pinv = torch.linalg.pinv(Cd)  # (D, V)
    G_ref = rdE.double() @ pinv
    G_got = dE.double() @ pinv
    row(f"recover-G {str(dtype)[6:]} {getattr(configs, 'name', configs)}: |G'-G|/|G| "
        f"{rel(G_got, G_ref):.2e}, |G'|/|G| {(G_got.norm() / G_ref.norm()).item():.3f}")
    target_hit = (G_got.argmin(dim=1) == x).double().mean().item()
    where = G_got.argmin(dim=1)
    row(f"    rows whose most negative G' entry is their target: {target_hit:.2f}; "
        f"(row, target, argmin G'): "
        + " ".join(f"({i},{int(x[i])},{int(where[i])})" for i in range(0, 64, 4)))
    # column and row maps: G'[:, v] best matches G[:, u]?
    def best_map(a, b):
        an = a / a.norm(dim=0, keepdim=True).clamp_min(1e-300)
        bn = b / b.norm(dim=0, keepdim=True).clamp_min(1e-300)
        c = an.T @ bn
        return c.abs().argmax(dim=1), c.abs().max(dim=1).values
    cmap, cval = best_map(G_got, G_ref)
    rmap, rval = best_map(G_got.T, G_ref.T)
    row("    G' column v ~ G column: "
        + " ".join(f"{v}->{int(cmap[v])}({cval[v].item():.2f})" for v in range(0, 32)))
    row("    G' row i ~ G row:       "
        + " ".join(f"{i}->{int(rmap[i])}({rval[i].item():.2f})" for i in range(0, 128, 4)))
    row("    G'[0:2, 0:8] " + str([[round(v, 4) for v in r.tolist()] for r in G_got[:2, :8]]))
    row("    G [0:2, 0:8] " + str([[round(v, 4) for v in r.tolist()] for r in G_ref[:2, :8]]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiers", action="store_true",
                        help="only every configuration tier at the small shape (after a fix)")
    args = parser.parse_args()
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        log(f"{props.name} sm_{props.major}{props.minor}, torch {torch.__version__}, triton "
            f"{triton.__version__}, default tier {K.select_configs(torch.device('cuda')).name}")
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        log(f"CPU dry run under the Triton interpreter (fp16 only), triton {triton.__version__}")

    small = (257, 5003, 136) if DEVICE == "cuda" else (150, 300, 136)
    medium = (1031, 32011, 520) if DEVICE == "cuda" else (131, 517, 72)
    if args.tiers:
        for tier in ("hopper-227k", "ampere-163k", "ampere-99k", "turing-64k"):
            check(f"tier {tier}", *small, LOW[0], configs=tier, detail=False)
        print("\n".join(["=" * 100, *ROWS, f"done in {time.time() - T0:.0f} s"]))
        return

    # 1. minimal chained dot
    for dtype in LOW:
        for bm, bv, bk, bd, warps in ((128, 128, 64, 64, 8), (128, 128, 64, 64, 4),
                                      (64, 64, 32, 32, 4)):
            for trans, second in ((False, False), (False, True)):
                try:
                    minimal(dtype, bm, bv, bk, bd, warps, trans, second)
                except Exception as error:
                    row(f"minimal {dtype} {bm}x{bv} w{warps}: ERROR {type(error).__name__}: "
                        f"{str(error)[:200]}")
    try:
        minimal(LOW[0], 128, 128, 64, 64, 8, True, True)
    except Exception as error:
        row(f"minimal trans: ERROR {type(error).__name__}: {str(error)[:200]}")

    # 2. the real function, per tier
    capture = Capture(cce.cce_backward_kernel)
    cce.cce_backward_kernel = capture
    for dtype in LOW:
        for tier in ("hopper-227k", "ampere-163k", "ampere-99k", "turing-64k"):
            check(f"tier {tier}", *small, dtype, configs=tier, detail=tier == "hopper-227k")
            if dtype == LOW[0] and tier == "hopper-227k" and OUT and capture.last is not None:
                for key in ("ttgir", "ptx"):
                    with open(os.path.join(OUT, f"backward_bf16_hopper.{key}"), "w") as fh:
                        fh.write(capture.last.asm[key])
        check("tier hopper-227k", *medium, dtype, configs="hopper-227k", detail=False)
        check("tier turing-64k", *medium, dtype, configs="turing-64k", detail=False)
    check("tier hopper-227k reduction=none", *small, LOW[0], configs="hopper-227k", reduction="none")
    hopper = K.tier("hopper-227k")
    four_warps = dataclasses.replace(
        hopper, name="hopper-4warps",
        backward={**hopper.backward, 2: dataclasses.replace(hopper.backward[2], num_warps=4)})
    check("hopper tiles, 4 warps", *small, LOW[0], configs=four_warps)
    small_tiles_8w = dataclasses.replace(
        hopper, name="64x64-8warps",
        backward={**hopper.backward, 2: K.LaunchConfig(64, 64, 32, 8, 2)})
    check("64x64x32 tiles, 8 warps", *small, LOW[0], configs=small_tiles_8w)
    fp32_like = dataclasses.replace(
        hopper, name="64x64x32-4w-3st",
        backward={**hopper.backward, 2: K.LaunchConfig(64, 64, 32, 4, 3)})
    check("64x64x32 tiles, 4 warps, 3 stages", *small, LOW[0], configs=fp32_like)

    # 4. what G did the product use?
    for dtype in LOW:
        try:
            recover_G(dtype, "hopper-227k")
        except Exception as error:
            row(f"recover-G: ERROR {type(error).__name__}: {error}")
    try:
        recover_G(LOW[0], "turing-64k")
    except Exception as error:
        row(f"recover-G turing: ERROR {type(error).__name__}: {error}")

    # 3. kernel variants
    for name, replacements in VARIANTS.items():
        try:
            module = variant_module(name, replacements)
        except Exception as error:
            row(f"variant {name}: could not build: {error}")
            continue
        cce.cce_backward_kernel = module.cce_backward_kernel
        for dtype in LOW:
            for shape in (small, medium):
                if shape is medium and name not in ("trans-product",):
                    continue
                tiers = ("hopper-227k", "turing-64k") if name == "trans-product" else ("hopper-227k",)
                for tier in tiers:
                    check(f"variant {name} {tier}", *shape, dtype, configs=tier,
                          detail=shape is small and tier == "hopper-227k")
    cce.cce_backward_kernel = capture.kernel
    real_precision = cce._dot_precision
    cce._dot_precision = lambda dtype: "ieee"
    check("DOT_PRECISION=ieee everywhere", *small, LOW[0], configs="hopper-227k")
    cce._dot_precision = real_precision

    print("\n" + "=" * 100)
    for r in ROWS:
        print(r)
    print(f"done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
