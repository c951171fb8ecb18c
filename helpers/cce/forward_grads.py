"""The "forward_grads" schedule: the loss and its gradients in the forward, from the logits of R rows
at a time; three N x V x D products, all in cuBLAS, instead of the recompute design's four.

Per chunk of R rows (``helpers.cce.schedules`` sizes R from the memory budget):

    1. Z = E_r C^T (+ b)          (R, V) in E's dtype (fp32 where fp16 could overflow)    cuBLAS
    2. lse_r, loss_r, G = dloss/dz, G written over Z                                      row_gradient_kernel
    3. dE_r = s G C               (R, D), written once in the dtype (the chunk holds whole rows)   cuBLAS
    4. dC  += G^T E_r             (V, D), fp32, accumulated in the product's epilogue       cuBLAS
                                  (or in dC itself, rounded once per chunk, where the budget
                                  holds no fp32 accumulator: ``helpers.cce.schedules``)
       db  += G^T 1               (V,), fp32

s is the reduction's scale (1 / N_kept for a mean, 1 for a sum), applied to fp32 results so that G
in 16 bits carries no 1/N (``helpers.cce.backward.rows``). dC is rounded to its dtype once, at the end;
with one chunk (or fp32 inputs) it is written by the product itself; accumulated in its own 16-bit
dtype, each chunk's product is added to it in fp32 and rounded once (``_accumulated_product``). The backward then only
multiplies the stored gradients by the upstream scalar: so the schedule serves a "mean" or a "sum"
whose only gradient is the loss's (not reduction "none", not a gradient into a returned lse; the
schedule chooser refuses those, ``schedule_reason``). The gradient filter does not apply: cuBLAS
multiplies every entry of G anyway.

fp16 inputs hold dE, dC and db in fp32 until the backward, which rounds each to fp16 after the upstream
scalar: fp16 training scales the loss (``torch.amp.GradScaler``) so that small gradients survive fp16's
range, and that scale arrives only as the upstream gradient. Rounded to fp16 in the forward, as Liger
rounds them, gradients below fp16's range were lost before it: on an H100 as a T4, notebook 03's fp16
fine-tuning under this schedule drifted 0.0475 from exact (bound 0.001), and on the CPU with E and C of
~1e-4 and a scale of 2^16, dE and dC erred 1.6e-2 against float64 where the recompute design erred 2.2e-4
(``tests/cce/test_forward_grads.py``). bf16 has fp32's range and keeps its own dtype.

Why holding logits pays: on an H200 one bf16 product at the Qwen3 head (N 16,384) is 6.4 ms; the
schedule moves ~6 N V b bytes more than its products' operands (Z written, read twice and written by
the row kernel, read by two products: 30 GB, ~6 ms at 4.8 TB/s) and saves the recompute design's two
Triton products (~18 ms at their measured share of cuBLAS's rate). The model and the memory formula:
``helpers.cce.schedules``. Reference: ``helpers.spec`` (tests/cce/test_forward_grads.py).
"""

from __future__ import annotations

import torch

from helpers.cce.backward.gemm import fp32_product, product_mode
from helpers.cce.forward_de import forward_de_extra_bytes, forward_de_reason
from helpers.cce.kernels.configs import CCEConfigs
from helpers.cce.kernels.row_gradient import row_gradient_kernel
from helpers.cce.options import CCEOptions, CCEPlan, fp_fusion
from helpers.cce.schedules import Schedule, choose_schedule, resolve_memory_budget
from helpers.spec import raise_for_targets, targets_out_of_range

# The dtype the forward holds the gradients in until the backward, by input dtype (module doc); else the inputs'.
HELD = {torch.float16: torch.float32}


def schedule_reason(options: CCEOptions, *, return_lse: bool, need: tuple[bool, bool, bool]) -> str | None:
    """Why the "forward_grads" schedule cannot serve a call (None: it can)."""
    if not any(need):
        return "no gradient is wanted (no grad mode, or no input requires grad)"
    if options.reduction == "none":
        return "reduction 'none' (or class weights) gives each row its own upstream gradient"
    if return_lse:
        return "return_lse: a gradient may flow into the lse"
    return None


def logits_bound(E: torch.Tensor, C: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bound on every |z|, max ||E_i|| max ||C_v|| + max |b| (Cauchy-Schwarz), as a device scalar:
    one pass over E and C. Where it passes ``HostTuning.fp16_logit_limit``, fp16 logits could overflow."""
    bound = (torch.linalg.vector_norm(E, dim=1, dtype=torch.float32).amax()
             * torch.linalg.vector_norm(C, dim=1, dtype=torch.float32).amax())
    return bound + bias.abs().amax().float() if bias is not None else bound


def plan_schedule(E: torch.Tensor, C: torch.Tensor, bias: torch.Tensor | None, plan: CCEPlan, memory_budget, *,
                  return_lse: bool) -> Schedule:
    """The schedule of one call of ``linear_cross_entropy`` (E (N, D) flattened) under ``memory_budget``
    (``helpers.cce.schedules.choose_schedule``): "forward_grads" where it can serve the call
    (``schedule_reason``), with fp32 logits for fp16 inputs whose logits could overflow fp16
    (``logits_bound``: one host read, only for fp16 under a budget other than "min")."""
    reason = schedule_reason(plan.options, return_lse=return_lse, need=plan.need)
    logits_itemsize = None
    budget = resolve_memory_budget(memory_budget, plan.configs, E.device)
    if budget != "min" and reason is None and E.dtype == torch.float16:
        if float(logits_bound(E.detach(), C.detach(), bias.detach() if bias is not None else None)) > plan.configs.host.fp16_logit_limit:
            logits_itemsize = 4
    N, D = E.shape
    V = C.shape[0]
    forward_de_extra = (forward_de_extra_bytes(N, V, D, E.dtype.itemsize, plan.configs)
                        if forward_de_reason(E, C, bias, plan) is None else None)
    return choose_schedule(N, V, D, E.dtype, memory_budget, plan.configs, need=plan.need,
                           device=E.device, not_forward_grads=reason, logits_itemsize=logits_itemsize,
                           forward_de_extra=forward_de_extra)


def _written_product(out, a, b, *, alpha: float, mode: str, bias=None):
    """out = alpha a @ b (+ bias) from an fp32 sum, rounded once to out's dtype (fp32 logits of
    16-bit operands: ``fp32_product``). On the CPU the operands are copied to fp32 (exact products
    for the tests, as ``product_mode``'s "upcast")."""
    if out.dtype == torch.float32 and a.dtype != torch.float32:
        fp32_product(out, a, b, alpha=alpha, accumulate=False, mode=mode)
        if bias is not None:
            out += bias.float()
    elif out.device.type != "cuda":
        product = torch.mm(a.float(), b.float())
        if bias is not None:
            product += bias.float()
        out.copy_(product.mul_(alpha) if alpha != 1.0 else product)
    elif bias is not None:
        torch.addmm(bias, a, b, alpha=alpha, out=out)
    else:
        torch.addmm(out, a, b, beta=0.0, alpha=alpha, out=out)  # beta = 0: out's contents ignored


def _accumulated_product(out, a, b, *, alpha: float, first: bool, mode: str):
    """out = [out +] alpha a @ b, summed in fp32 and rounded once to out's dtype (cuBLAS's epilogue
    with beta = 1). On the CPU the 16-bit operands are copied to fp32 (as ``product_mode``'s "upcast")
    and the sum rounded by hand, the same arithmetic."""
    if out.device.type == "cuda" or out.dtype == torch.float32:
        out.addmm_(a, b, beta=0.0 if first else 1.0, alpha=alpha)
    else:
        product = torch.mm(a.float(), b.float()).mul_(alpha)
        out.copy_(product if first else product.add_(out.float()))


def forward_grads(E: torch.Tensor, C: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                  options: CCEOptions, configs: CCEConfigs, rows: int, scale: float,
                  need: tuple[bool, bool, bool], logits_dtype: torch.dtype | None = None, fp32_dC: bool = True):
    """(loss (N,) fp32, 0 at ignored rows; lse (N,) fp32; dE, dC, db of the loss summed over rows
    times ``scale``, None where ``need`` says not wanted), in chunks of ``rows`` rows (module doc).
    ``logits_dtype``: the chunks' dtype (None: E's); ``fp32_dC``: 16-bit dC accumulated over several
    chunks in fp32 (else in itself). For fp16 inputs dE, dC and db are returned in fp32 (``HELD``)."""
    o = options
    need_dE, need_dC, need_db = need
    N, D = E.shape
    V = C.shape[0]
    dtype, device = E.dtype, E.device
    z_dtype = logits_dtype or dtype
    rows = max(1, min(rows, N))
    several = rows < N
    mode = configs.host.product_mode or product_mode(device, dtype)
    cfg = configs.row_gradient
    loss = torch.empty(N, dtype=torch.float32, device=device)
    lse = torch.empty(N, dtype=torch.float32, device=device)
    held = HELD.get(dtype, dtype)
    dE = torch.empty(N, D, dtype=held, device=device) if need_dE else None
    # dC: written by its one product (one chunk), accumulated in itself (fp32), else in fp32 and rounded at the
    # end (or kept in fp32: fp16).
    dC_acc = None
    dC = None
    if need_dC:
        if held != dtype or (several and dtype != torch.float32 and fp32_dC):
            dC_acc = torch.empty(V, D, dtype=torch.float32, device=device)
        else:
            dC = torch.empty(V, D, dtype=dtype, device=device)
    db_acc = torch.empty(V, 1, dtype=torch.float32, device=device) if need_db else None
    ones = torch.ones(rows, 1, dtype=dtype, device=device) if need_db else None
    Z_buf = torch.empty(rows * V, dtype=z_dtype, device=device)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        r = n1 - n0
        first = n0 == 0
        E_r = E[n0:n1]  # (r, D)
        Z = Z_buf[: r * V].view(r, V)
        # 1. Z = E_r C^T (+ b): (r, D) @ (D, V), rounded once to the logits' dtype.
        _written_product(Z, E_r, C.T, alpha=1.0, mode=mode, bias=bias)
        # G in the inputs' dtype: Z itself, or the first half of each fp32 row (fp16 inputs).
        G = Z if z_dtype == dtype else Z.view(dtype)[:, :V]
        # 2. lse, loss and G, row by row, G over the logits.
        row_gradient_kernel[(r,)](
            Z, G, x[n0:n1], lse[n0:n1], loss[n0:n1],
            V, Z.stride(0), G.stride(0), x.stride(0),
            o.ignore_index, o.softcap if o.softcap is not None else 1.0, 1.0 / o.temperature, o.z_loss,
            o.label_smoothing,
            BLOCK_V=cfg.BLOCK_V, HAS_SOFTCAP=o.softcap is not None, SUM_LOGITS=o.label_smoothing > 0,
            enable_fp_fusion=fp_fusion(E.dtype), **cfg.launch,
        )
        # 3. dE_r = s G C: (r, V) @ (V, D), written once.
        if need_dE:
            _written_product(dE[n0:n1], G, C, alpha=scale, mode=mode)
        # 4. dC (+)= G^T E_r: (V, r) @ (r, D), fp32 in the epilogue.
        if dC_acc is not None:
            fp32_product(dC_acc, G.T, E_r, alpha=1.0, accumulate=not first, mode=mode)
        elif need_dC and not several:
            _written_product(dC, G.T, E_r, alpha=scale, mode=mode)
        elif need_dC:  # fp32 inputs, or no room for an fp32 accumulator: dC is its own
            _accumulated_product(dC, G.T, E_r, alpha=scale, first=first, mode=mode)
        if need_db:
            fp32_product(db_acc, G.T, ones[:r], alpha=1.0, accumulate=not first, mode=mode)
    del Z_buf, G, Z
    if dC_acc is not None and held != dtype:
        dC = dC_acc.mul_(scale)  # held in fp32
    elif dC_acc is not None:
        dC = torch.empty(V, D, dtype=dtype, device=device)
        torch.mul(dC_acc, scale, out=dC)  # rounded once
    del dC_acc
    db = db_acc[:, 0] * scale if need_db else None
    db = db.to(bias.dtype) if need_db and held == dtype else db
    return loss, lse, dE, dC, db


class ForwardGradsFunction(torch.autograd.Function):
    """The loss (a scalar: "mean" or "sum") with its gradients made in the forward (``forward_grads``);
    the backward multiplies them by the upstream gradient."""

    @staticmethod
    def forward(ctx, E, C, x, bias, plan, schedule: Schedule, stats=None):
        ctx.dtypes = (E.dtype, C.dtype, bias.dtype if bias is not None else None)
        o = plan.options
        V = C.shape[0]
        kept = x != o.ignore_index
        n_kept = kept.sum()
        out_of_range = targets_out_of_range(x, V, o.ignore_index)
        count, bad = torch.stack([n_kept.float(), out_of_range.float()]).tolist()  # one host read
        raise_for_targets(x, V, o.ignore_index, bad > 0)
        # A mean over no kept row: the loss is 0 / 0 = NaN and every G is 0, as torch gives.
        scale = 1.0 if o.reduction == "sum" else 1.0 / max(int(count), 1)
        loss_rows, lse, dE, dC, db = forward_grads(E, C, x, bias, o, plan.configs, schedule.rows, scale, plan.need,
                                                   schedule.logits_dtype, schedule.fp32_dC)
        loss = loss_rows.sum() if o.reduction == "sum" else loss_rows.sum() / n_kept
        ctx.grads = (dE, dC, db)
        if stats is not None:
            stats.update(chunks=-(-x.shape[0] // schedule.rows), products=product_mode(E.device, E.dtype))
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("the forward_grads schedule's gradients were handed over by an earlier backward; "
                               "use memory_budget='min' to backpropagate through the loss twice")
        held = list(ctx.grads)  # dE, dC, db
        ctx.grads = None  # handed over: autograd may keep them as .grad without a copy
        if grad_loss is None:
            return None, None, None, None, None, None, None
        g = grad_loss.to(torch.float32)
        grads = []
        for i, dtype in enumerate(ctx.dtypes):  # each rounded to its dtype in turn (fp16: held in fp32 so far)
            t, held[i] = held[i], None
            grads.append(None if t is None else t.mul_(g).to(dtype))  # in place, then rounded once; x 1.0 is exact
            del t
        return grads[0], grads[1], None, grads[2], None, None, None
