"""The registry's baselines (``helpers.compare.methods``): the article's naive loss, the same
under torch.compile, a pure-PyTorch chunked loss, and exact, the naive loss in fp32 (the training
A/Bs' yardstick). Each with its loss, where it runs and its memory formula.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from helpers.compare.methods.entry import Method, Reason
from helpers.spec import reference_logits, softcap_slope


# ---------------------------------------------------------------------------------------------
# naive: the article's original trainer. Materialises the N×V logits, then an fp32 copy of them.
# ---------------------------------------------------------------------------------------------


def naive_loss(E, C, x, *, bias=None, ignore_index=-100, reduction="mean", softcap=None):
    # (N, V) logits in the input dtype, then (N, V) in fp32: two full copies alive at once, plus
    # the (N, V) softmax gradient in backward. This is the 9.96 GB tensor of the introduction.
    z = (E @ C.T if bias is None else E @ C.T + bias).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, x.long(), ignore_index=ignore_index, reduction=reduction)


def naive_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None) -> int:
    # Forward: z = E @ C.T in the input dtype (N V b) is upcast to fp32 (N V 4) and dies right
    # after the cast; log_softmax saves its fp32 output (N V 4) for backward. Backward, inside
    # log_softmax's backward, three fp32 N×V tensors are alive at once: the saved log-softmax, the
    # gradient nll_loss hands it (dense, N V 4) and the gradient it returns (N V 4). That is the
    # peak: 12 bytes per logit in every input dtype. After it: the fp32 gradient, its cast to the
    # input dtype (16-bit inputs only), then dE and dC.
    after = (4 + (b if b < 4 else 0)) * N * V + (N * D + V * D) * b
    return max(12 * N * V, after)


NAIVE = Method(
    name="naive",
    label="naive",
    summary="E @ C.T in the input dtype, upcast to fp32, F.cross_entropy: the article's trainer; "
    "holds the N×V logits twice.",
    implementation=naive_loss,
    availability=lambda device, dtype, softcap: None,
    supports_bias=True,
    peak_bytes=naive_peak_bytes,
    peak_formula="12·N·V: three fp32 N×V tensors inside log_softmax's backward",
)


# ---------------------------------------------------------------------------------------------
# torch_compile: the same code under torch.compile (Inductor fuses the softmax, keeps the logits).
# ---------------------------------------------------------------------------------------------


@functools.cache
def _compiled_per_token_loss():
    # Past its recompile limit dynamo silently runs the function eagerly: a benchmark of
    # "torch.compile" would then measure the naive path. Raise the limit and make hitting it an
    # error instead of a fallback.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # The compiled graph is the per-token loss, with dynamic shapes from the first call: one graph
    # per dtype and soft cap, not one per shape and reduction (compiles cost seconds each). The
    # N×V logits live inside it exactly as in the naive loss; the reduction after it is O(N).
    return torch.compile(functools.partial(naive_loss, reduction="none"), dynamic=True)


def torch_compile_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    per_token = _compiled_per_token_loss()(E, C, x, ignore_index=ignore_index, softcap=softcap)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    return total if reduction == "sum" else total / (x != ignore_index).sum()


def _compile_reason(device, dtype, softcap) -> Reason:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (7, 0):
        return "torch.compile's Triton backend needs a GPU of compute capability 7.0 or newer"
    return None


def torch_compile_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None) -> int:
    # Inductor fuses upcast, softmax and the loss into one kernel that keeps only the input-dtype
    # logits (N V b) for backward; backward writes the logits' gradient over them (same size,
    # same dtype), then the two matmuls add dE and dC. Peak: one N×V tensor in the input dtype.
    return N * V * b + (N * D + V * D) * b


TORCH_COMPILE = Method(
    name="torch_compile",
    label="torch.compile",
    summary="the naive loss under torch.compile: one fused pass, but the N×V logits still exist.",
    implementation=torch_compile_loss,
    availability=_compile_reason,
    peak_bytes=torch_compile_peak_bytes,
    peak_formula="N·V·b + (N·D + V·D)·b: the input-dtype logits, then dE, dC",
)


# ---------------------------------------------------------------------------------------------
# chunked: pure PyTorch, no dependency. Only a (chunk, V) block of logits ever exists.
# ---------------------------------------------------------------------------------------------

# Bytes of fp32 logits one chunk may hold. 256 MiB keeps each matmul large enough to run near peak
# on a GPU while staying a small fraction of a 16 GB card.
CHUNK_BYTES = 256 * 1024**2


def chunk_rows(V: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows of E per chunk so that one (rows, V) fp32 logit block fits in ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * V))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward keeps only lse (N,); backward recomputes each (chunk, V) logit block.

    Per chunk of rows i:  z = cap(E_i C^T),  lse_i = logsumexp(z),  loss_i = lse_i - z[x_i].
    Backward:  G = (softmax(z) - onehot(x)) * w_i * cap'(z),  dE_i = G C,  dC += G^T E_i,
    where w_i is the upstream gradient of token i (0 where x_i is ignored).
    """

    @staticmethod
    def forward(ctx, E, C, x, ignore_index, softcap, rows):
        N = E.shape[0]
        lse = torch.empty(N, dtype=torch.float32, device=E.device)
        target_logit = torch.empty(N, dtype=torch.float32, device=E.device)
        kept = x != ignore_index
        safe_x = torch.where(kept, x, 0).long()
        for start in range(0, N, rows):
            i = slice(start, start + rows)
            z = reference_logits(E[i], C, softcap, torch.float32)  # (rows, V)
            lse[i] = torch.logsumexp(z, dim=1)
            target_logit[i] = z.gather(1, safe_x[i, None]).squeeze(1)
        ctx.save_for_backward(E, C, safe_x, kept, lse)
        ctx.softcap, ctx.rows = softcap, rows
        return torch.where(kept, lse - target_logit, 0.0)  # (N,) per-token loss, 0 where ignored

    @staticmethod
    def backward(ctx, grad_loss):
        E, C, safe_x, kept, lse = ctx.saved_tensors
        softcap, rows = ctx.softcap, ctx.rows
        w = torch.where(kept, grad_loss.float(), 0.0)  # (N,)
        dE = torch.empty_like(E)
        dC = torch.zeros(C.shape, dtype=torch.float32, device=C.device)
        C32 = C.float()
        for start in range(0, E.shape[0], rows):
            i = slice(start, start + rows)
            E32 = E[i].float()
            raw = E32 @ C32.T  # (rows, V)
            z = softcap * torch.tanh(raw / softcap) if softcap is not None else raw
            slope = softcap_slope(raw, softcap) if softcap is not None else None
            G = torch.exp(z - lse[i, None])  # softmax, (rows, V)
            G.scatter_add_(1, safe_x[i, None], torch.full_like(lse[i, None], -1.0))
            G *= w[i, None]
            if slope is not None:
                G *= slope  # d/draw [s tanh(raw/s)], without 1 - tanh^2's rounding to 0 (``softcap_slope``)
            del z, raw, slope
            dE[i] = (G @ C32).to(E.dtype)
            dC.addmm_(G.T, E32)
            del G  # else it lives until the next chunk's G is assigned: one more (rows, V) block
        return dE, dC.to(C.dtype), None, None, None, None


def chunked_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None, rows=None):
    per_token = ChunkedLinearCrossEntropy.apply(
        E, C, x, ignore_index, softcap, rows or chunk_rows(C.shape[0])
    )
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / (x != ignore_index).sum()  # 0/0 = NaN when every token is ignored, as torch


def chunked_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None,
                       rows: int | None = None) -> int:
    # ChunkedLinearCrossEntropy above, with chunked_loss's ``rows`` (None: chunk_rows(V)). Backward
    # holds dE (N D b), the fp32 accumulator dC32 (V D 4), for 16-bit inputs an fp32 copy of C
    # (V D 4) and of the chunk's rows of E, and fp32 (rows, V) blocks at the peak: raw logits,
    # (z - lse) and G = exp(z - lse); each chunk's G is freed before the next chunk starts. The last
    # step casts dC32 to the input dtype (V D b) while dC32 and the copy of C are still alive.
    rows = min(N, rows or chunk_rows(V))
    blocks = 3
    upcast = b < 4
    per_chunk = N * D * b + V * D * 4 + upcast * (V * D * 4 + rows * D * 4) + blocks * rows * V * 4
    last_step = N * D * b + V * D * 4 + upcast * (V * D * 4 + V * D * b)
    return max(per_chunk, last_step)


CHUNKED = Method(
    name="chunked",
    label="chunked (PyTorch)",
    summary="pure PyTorch over row chunks; forward keeps only the per-row LSE, backward "
    "recomputes each chunk: memory is one (chunk, V) fp32 block plus dE and dC.",
    implementation=chunked_loss,
    availability=lambda device, dtype, softcap: None,
    peak_bytes=chunked_peak_bytes,
    peak_formula="dE + 2 fp32 (V, D) + 4 fp32 (chunk, V) blocks (3 if one chunk); chunk = 256 MiB / 4V rows",
)


# ---------------------------------------------------------------------------------------------
# exact: the convergence A/B's yardstick, naive on inputs upcast to fp32.
# ---------------------------------------------------------------------------------------------


def exact_loss(E, C, x, *, bias=None, ignore_index=-100, reduction="mean", softcap=None):
    # Every arm gets the same low-precision E and C; this one upcasts them and computes fp32 logits,
    # so only the arithmetic differs. (naive multiplies in the input dtype.)
    return naive_loss(E.float(), C.float(), x, bias=None if bias is None else bias.float(), ignore_index=ignore_index,
                      reduction=reduction, softcap=softcap)


EXACT = Method(
    name="exact",
    label="exact (fp32 logits)",
    summary="E and C upcast to fp32, logits materialised, F.cross_entropy: the yardstick of training A/Bs.",
    implementation=exact_loss,
    availability=lambda device, dtype, softcap: None,
    preset_of="naive",
    supports_bias=True,
)


__all__ = ["NAIVE", "TORCH_COMPILE", "CHUNKED", "EXACT", "CHUNK_BYTES", "ChunkedLinearCrossEntropy", "chunk_rows",
           "chunked_loss", "exact_loss", "naive_loss"]
