"""The one registry of loss methods: ours, the peers, and the baselines they are measured against.

Every method has one signature,

    method(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None) -> loss

with E (N, D), C (V, D), x (N,), and the semantics of ``helpers.spec`` (exactly
``F.cross_entropy`` on the soft-capped fp32 logits). Autograd through the result gives dE and dC.

A method that cannot run on the device at hand says why, in a sentence, through
``method.why_unavailable(device, dtype, softcap=...)``; calling it anyway raises
``MethodUnavailable`` with that sentence. Nothing is skipped or swapped silently.

Each entry also carries its memory theory (``peak_bytes``, ``peak_formula``): the bytes above
the inputs it holds at its peak, from the arithmetic and from reading its code; written beside
its loss so that a change to one is seen next to the other. ``helpers.compare.theory`` asks them.

Presets are methods too: a registered method with other options (``ours_nofilter``: our loss with
the filter off; ``exact``: the naive loss on inputs upcast to fp32, the convergence A/B's
yardstick). They say whose preset they are (``preset_of``); ``primary_methods`` leaves them out
of the comparisons that would only repeat their parent (the gate, the sweep, the benchmark).

Where a peer's own convention differs from torch's, its adapter maps it and says so in ``notes``
(Liger returns 0 for a mean over zero kept tokens; torch, and so every method here, returns NaN).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from helpers.cce import linear_cross_entropy, triton_reason, why_unavailable
from helpers.compare.units import dtype_bytes
from helpers.spec import REDUCTIONS, reference_logits, validate_inputs


class MethodUnavailable(RuntimeError):
    """Raised when a method is called where it cannot run; the message says why."""


Reason = str | None  # None: the method can run; otherwise a sentence saying why not
# (N, V, D, bytes per element of E and C, CUDA compute capability or None for the CPU) -> bytes
PeakFormula = Callable[[int, int, int, int, "tuple[int, int] | None"], int]


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # short, for tables and legends
    summary: str  # one sentence: what it is and how it saves (or spends) memory
    implementation: Callable[..., torch.Tensor]
    availability: Callable[[torch.device, torch.dtype, float | None], Reason]
    kind: str = "baseline"  # "ours", "peer" (another project's kernel) or "baseline"
    notes: str = ""
    preset_of: str | None = None  # the method this one is a preset of (other options, same code)
    counts_skips: bool = False  # takes stats=, which its backward fills with the tiles it skipped
    # Its memory theory (helpers.compare.theory): bytes above the inputs E, C, x at the peak of one
    # forward+backward, from (N, V, D, bytes per element, CUDA capability or None for the CPU), and
    # the formula in words. None: no formula (compared with the floor dE + dC instead).
    peak_bytes: PeakFormula | None = None
    peak_formula: str = ""

    def predicted_peak_bytes(self, N: int, V: int, D: int, dtype: torch.dtype | str,
                             capability: tuple[int, int] | None = None) -> int | None:
        """Peak bytes above the inputs one forward+backward should need (None: no formula here).
        ``capability``: the CUDA compute capability whose code path runs (None: the CPU's)."""
        if self.peak_bytes is None:
            return None
        return int(self.peak_bytes(N, V, D, dtype_bytes(dtype), tuple(capability) if capability else None))

    def why_unavailable(
        self, device: torch.device | str, dtype: torch.dtype, softcap: float | None = None
    ) -> Reason:
        return self.availability(torch.device(device), dtype, softcap)

    def __call__(
        self,
        E: torch.Tensor,
        C: torch.Tensor,
        x: torch.Tensor,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        softcap: float | None = None,
        stats: dict | None = None,
    ) -> torch.Tensor:
        """The loss; ``stats``, for a method that ``counts_skips``, is filled by its backward with
        what its gradient filter skipped (other methods leave it empty)."""
        validate_inputs(E, C, x, ignore_index=ignore_index, reduction=reduction, softcap=softcap)
        reason = self.why_unavailable(E.device, E.dtype, softcap)
        if reason:
            raise MethodUnavailable(f"{self.name}: {reason}")
        extra = {"stats": stats} if self.counts_skips else {}
        return self.implementation(E, C, x, ignore_index=ignore_index, reduction=reduction, softcap=softcap, **extra)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"a method named {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def method_label(name: str) -> str:
    """A registered method's label (its name where it is not registered): the one name a person reads."""
    return METHODS[name].label if name in METHODS else name


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise KeyError(f"no method {name!r}; registered: {', '.join(METHODS)}")
    return METHODS[name]


def primary_methods() -> list[str]:
    """Every registered method but the presets: what the gate, the sweep and the benchmark compare."""
    return [n for n, m in METHODS.items() if m.preset_of is None]


def availability(
    device: torch.device | str, dtype: torch.dtype, names: list[str] | None = None
) -> dict[str, Reason]:
    """{method name: None if it runs here, else why not} for each named method (default: the
    primary ones)."""
    return {n: get_method(n).why_unavailable(device, dtype) for n in (names or primary_methods())}


# ---------------------------------------------------------------------------------------------
# Availability rules shared by several methods
# ---------------------------------------------------------------------------------------------


def _all_ignored_mean_is_nan(loss: torch.Tensor, x: torch.Tensor, ignore_index: int, reduction: str):
    """torch's convention for a mean over zero kept tokens (0/0 = NaN), gradients left untouched."""
    if reduction == "mean" and not bool((x != ignore_index).any()):
        return loss + torch.full_like(loss, float("nan")).detach()
    return loss


def floor_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None) -> int:
    # No formula beyond the floor: the gradients plus O(N) per-row state, which is what these
    # methods are designed to reach (Apple CCE measured within 0.5% of it on an H200).
    return (N * D + V * D) * b


# ---------------------------------------------------------------------------------------------
# naive: the article's original trainer. Materialises the N×V logits, then an fp32 copy of them.
# ---------------------------------------------------------------------------------------------


def naive_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    # (N, V) logits in the input dtype, then (N, V) in fp32: two full copies alive at once, plus
    # the (N, V) softmax gradient in backward. This is the 9.96 GB tensor of the introduction.
    z = (E @ C.T).float()
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


register(
    Method(
        name="naive",
        label="naive",
        summary="E @ C.T in the input dtype, upcast to fp32, F.cross_entropy: the article's trainer; "
        "holds the N×V logits twice.",
        implementation=naive_loss,
        availability=lambda device, dtype, softcap: None,
        peak_bytes=naive_peak_bytes,
        peak_formula="12·N·V: three fp32 N×V tensors inside log_softmax's backward",
    )
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


register(
    Method(
        name="torch_compile",
        label="torch.compile",
        summary="the naive loss under torch.compile: one fused pass, but the N×V logits still exist.",
        implementation=torch_compile_loss,
        availability=_compile_reason,
        peak_bytes=torch_compile_peak_bytes,
        peak_formula="N·V·b + (N·D + V·D)·b: the input-dtype logits, then dE, dC",
    )
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
            G = torch.exp(z - lse[i, None])  # softmax, (rows, V)
            G.scatter_add_(1, safe_x[i, None], torch.full_like(lse[i, None], -1.0))
            G *= w[i, None]
            if softcap is not None:
                # d/draw [s tanh(raw/s)] = 1 - tanh^2 = 1 - (z/s)^2
                G *= 1 - (z / softcap) ** 2
            del z, raw
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


def chunked_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None) -> int:
    # ChunkedLinearCrossEntropy above. Backward holds dE (N D b), the fp32 accumulator dC32
    # (V D 4), for 16-bit inputs an fp32 copy of C (V D 4) and of the chunk's rows of E, and fp32
    # (rows, V) blocks at the peak: raw logits, (z - lse) and G = exp(z - lse); each chunk's G is
    # freed before the next chunk starts. The last step casts dC32 to the input dtype (V D b) while
    # dC32 and the copy of C are still alive.
    rows = min(N, chunk_rows(V))
    blocks = 3
    upcast = b < 4
    per_chunk = N * D * b + V * D * 4 + upcast * (V * D * 4 + rows * D * 4) + blocks * rows * V * 4
    last_step = N * D * b + V * D * 4 + upcast * (V * D * 4 + V * D * b)
    return max(per_chunk, last_step)


register(
    Method(
        name="chunked",
        label="chunked (PyTorch)",
        summary="pure PyTorch over row chunks; forward keeps only the per-row LSE, backward "
        "recomputes each chunk: memory is one (chunk, V) fp32 block plus dE and dC.",
        implementation=chunked_loss,
        availability=lambda device, dtype, softcap: None,
        peak_bytes=chunked_peak_bytes,
        peak_formula="dE + 2 fp32 (V, D) + 4 fp32 (chunk, V) blocks (3 if one chunk); chunk = 256 MiB / 4V rows",
    )
)


# ---------------------------------------------------------------------------------------------
# liger: Liger-Kernel's fused linear cross-entropy (gradients computed during the forward pass).
# ---------------------------------------------------------------------------------------------


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def liger_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(
        E, C, x, ignore_index=ignore_index, reduction=reduction, softcap=softcap
    )
    return _all_ignored_mean_is_nan(loss, x, ignore_index, reduction)


def _liger_reason(device, dtype, softcap) -> Reason:
    if not _installed("liger_kernel"):
        return "liger-kernel is not installed (pip install liger-kernel)"
    reason = triton_reason(device, dtype)
    if reason:
        return reason
    if device.type == "cpu" and softcap is not None:
        return "Liger's softcap path fails under the Triton interpreter (it calls .to() on a Python float)"
    return None


def liger_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None) -> int:
    # liger_kernel.ops.fused_linear_cross_entropy: dE and dC (input dtype) computed during the
    # forward pass, over row chunks whose (rows, V) logits are about the size of E:
    # rows = next_pow2(ceil(N / ceil(V / D))). The kernel writes the logits' gradient over the
    # logits. dC accumulates in place (addmm) only on CUDA sm_80+ in fp16/bf16. Elsewhere each
    # chunk adds `mm(G^T, E_chunk).float()` to dC: a (V, D) matmul result and its fp32 copy (one
    # tensor in fp32). On the CPU, adding that fp32 tensor into a 16-bit dC in place allocates two
    # more fp32 (V, D) temporaries (CUDA casts inside the kernel instead).
    rows = min(N, _next_power_of_2(math.ceil(N / math.ceil(V / D))))
    if capability is not None and capability >= (8, 0) and b == 2:
        temporaries = 0
    elif b == 4:
        temporaries = V * D * 4
    elif capability is not None:
        temporaries = V * D * (b + 4)
    else:
        temporaries = V * D * (4 + 2 * 4)
    return (N * D + V * D) * b + rows * V * b + temporaries + N * 4


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


register(
    Method(
        name="liger",
        kind="peer",
        label="Liger",
        summary="Liger-Kernel's fused linear cross-entropy: chunks over rows and computes dE, dC "
        "during the forward pass, so backward only scales them.",
        implementation=liger_loss,
        availability=_liger_reason,
        notes="Liger returns 0 for a mean over zero kept tokens; the adapter returns NaN as torch does. "
        "Liger 0.8.5 computes no dC when E does not require a gradient (a head trained on frozen "
        "features does not train); notebook 03 shows it.",
        peak_bytes=liger_peak_bytes,
        peak_formula=("(N·D + V·D)·b + a (chunk, V) logit block of about N·D elements, + (V, D) "
                 "temporaries for dC except on sm_80+ in 16-bit"),
    )
)


# ---------------------------------------------------------------------------------------------
# apple_cce: Apple's Cut Cross-Entropy (the cut-cross-entropy package).
# ---------------------------------------------------------------------------------------------

# Shared memory its backward kernel asks for with 128×128×32 tiles (98,304 B for fp16 with Triton
# 3.4-3.9, compiled for sm_75). tests/cce/test_configs.py re-derives the figure by compiling it.
APPLE_CCE_BACKWARD_SHARED_BYTES = {torch.float16: 98_304, torch.bfloat16: 98_304}


def apple_cce_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(
        E, C, x.long(), ignore_index=ignore_index, softcap=softcap, reduction=reduction
    )


def _apple_cce_reason(device, dtype, softcap) -> Reason:
    if not _installed("cut_cross_entropy"):
        return "cut-cross-entropy is not installed (pip install cut-cross-entropy)"
    if device.type != "cuda":
        return (
            "Apple CCE's Triton kernels need a CUDA GPU (they fail under the Triton interpreter); "
            "this is a CPU"
        )
    if dtype == torch.float32:
        return "cut-cross-entropy's backward accepts only fp16 or bf16 embeddings (it asserts so)"
    from helpers.cce.device import device_info

    info = device_info(device)
    need = APPLE_CCE_BACKWARD_SHARED_BYTES[dtype]
    if info.shared_memory_per_block_bytes < need:
        return (
            f"Apple CCE's backward kernel needs about {need // 1024} KB of shared memory per block; "
            f"this {info.name} offers {info.shared_memory_per_block_bytes // 1024} KB"
        )
    if dtype == torch.bfloat16 and not info.has_bf16_matmul:
        return f"bf16 needs an Ampere or newer GPU; this {info.name} has no bf16 tensor cores"
    return None


register(
    Method(
        name="apple_cce",
        kind="peer",
        label="Apple CCE",
        summary="Apple's Cut Cross-Entropy (cut-cross-entropy package, default gradient filter): "
        "never materialises logits; recomputes them blockwise in backward.",
        implementation=apple_cce_loss,
        availability=_apple_cce_reason,
        peak_bytes=floor_peak_bytes,
        peak_formula="(N·D + V·D)·b: the floor (its O(N) LSE not counted)",
    )
)


# ---------------------------------------------------------------------------------------------
# torch_lce: PyTorch's own F.linear_cross_entropy with chunking (torch 2.13 and newer).
# ---------------------------------------------------------------------------------------------


def torch_lce_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    # torch falls back to the unchunked reference path, with only a warning, for configurations its
    # chunked path does not support; that would be a silent swap, so it is turned into an error.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return F.linear_cross_entropy(
            E,
            C,
            x.long(),
            reduction=reduction,
            ignore_index=ignore_index,
            options=torch.nn.LinearCrossEntropyOptions(),
        )


def _torch_lce_reason(device, dtype, softcap) -> Reason:
    if not hasattr(F, "linear_cross_entropy"):
        return f"needs PyTorch 2.13 or newer for F.linear_cross_entropy; this is {torch.__version__}"
    if softcap is not None:
        return "F.linear_cross_entropy has no soft cap"
    return None


register(
    Method(
        name="torch_lce",
        kind="peer",
        label="torch LCE",
        summary="PyTorch's F.linear_cross_entropy with LinearCrossEntropyOptions() (chunked path).",
        implementation=torch_lce_loss,
        availability=_torch_lce_reason,
    )
)


# ---------------------------------------------------------------------------------------------
# ours: this package's Triton Cut Cross-Entropy (helpers.cce); its presets with the filter off and
# with the sparse backward.
# ---------------------------------------------------------------------------------------------


def _ours(**options) -> Callable[..., torch.Tensor]:
    def loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None, stats=None):
        return linear_cross_entropy(E, C, x, ignore_index=ignore_index, reduction=reduction, softcap=softcap,
                                    stats=stats, **options)

    return loss


def _ours_reason(device, dtype, softcap) -> Reason:
    return why_unavailable(device, dtype, softcap)


def _ours_gemm_plan(N: int, V: int, D: int, dtype: torch.dtype, capability: tuple[int, int] | None):
    """helpers.cce's chunk plan for the "gemm" backward, with the BLOCK_V of the configuration tier
    ``capability`` gets: the one place the registry reads cce's planning internals."""
    from helpers.cce.backward.gemm import gemm_plan
    from helpers.cce.kernels.configs import tier_for_capability

    block_v = tier_for_capability(capability).backward_gemm_for(dtype).BLOCK_V
    return gemm_plan(N, V, D, dtype, block_v)


def ours_peak_bytes(N: int, V: int, D: int, b: int, capability: tuple[int, int] | None) -> int:
    # helpers.cce with its defaults (backward "gemm"): the forward keeps O(N) (lse per row and vocabulary
    # split); the backward allocates dE and dC, for 16-bit inputs dE's fp32 accumulator (n_chunk, D)
    # and, with several row chunks, dC rows staged in fp32 (v_chunk, D) before each fold. Each G chunk
    # lives in dE's or dC's rows not yet written, or in a buffer where neither has room (fp32):
    # helpers.cce.gemm_plan says which, with chunk sizes rounded to the BLOCK_V of the configuration
    # tier this capability gets. On the CPU the products run in fp32 ("upcast"): 16-bit operands
    # are copied to fp32 for each product, and the staged dC rows are used even for one row chunk.
    plan = _ours_gemm_plan(N, V, D, torch.float32 if b == 4 else torch.float16, capability)
    n_chunk, widest = plan.n_chunk, plan.widest
    staged = min(plan.v_chunk, widest)  # dC's rows staged in fp32, a piece of a chunk at a time
    low = b < 4
    several = N > n_chunk
    scratch = plan.buffer_elements * b + low * n_chunk * D * 4
    if low and (several or capability is None):
        scratch += staged * D * 4
    if low and capability is None:  # the larger of the two products' fp32 operand copies
        scratch += max(n_chunk * widest + widest * D, n_chunk * staged + n_chunk * D) * 4
    # Per row, fp32: the forward's lse, and the backward's row gradient (w, w / max w and the three
    # coefficients of G, helpers.cce.backward.rows.RowGradient).
    per_row = 24 * N
    return (N * D + V * D) * b + scratch + per_row


register(
    Method(
        name="ours",
        label="ours (Triton CCE)",
        summary="this package's Cut Cross-Entropy in Triton: logits rebuilt tile by tile on chip, "
        "gradient filter from the dtype, gradients accumulated in fp32.",
        implementation=_ours(),
        availability=_ours_reason,
        kind="ours",
        counts_skips=True,
        peak_bytes=ours_peak_bytes,
        peak_formula=("(N·D + V·D)·b + 16-bit: dE's fp32 accumulator + fp32: a G chunk (16-bit G lives "
                 "in dE's and dC's rows not yet written; helpers.cce.gemm_plan) + 24 bytes of per-row state"),
    )
)
register(
    Method(
        name="ours_nofilter",
        label="ours (filter off)",
        summary="ours with the gradient filter off (filter_eps=None): every tile's gradient is kept.",
        implementation=_ours(filter_eps=None),
        availability=_ours_reason,
        kind="ours",
        preset_of="ours",
    )
)
register(
    Method(
        name="ours_sparse",
        label="ours (sparse backward)",
        summary='ours with backward_impl="sparse": the forward marks the (row, tile) pairs that may carry '
        "gradient, the backward computes only those (a row loses at most 2^-7 of its gradient mass in "
        "bf16); it runs the default backward when the softmax is too flat to skip.",
        implementation=_ours(backward_impl="sparse", sort_vocab=True),
        availability=_ours_reason,
        kind="ours",
        preset_of="ours",
        counts_skips=True,
    )
)


# ---------------------------------------------------------------------------------------------
# exact: the convergence A/B's yardstick, naive on inputs upcast to fp32.
# ---------------------------------------------------------------------------------------------


def exact_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    # Every arm gets the same low-precision E and C; this one upcasts them and computes fp32 logits,
    # so only the arithmetic differs. (naive multiplies in the input dtype.)
    return naive_loss(E.float(), C.float(), x, ignore_index=ignore_index, reduction=reduction, softcap=softcap)


register(
    Method(
        name="exact",
        label="exact (fp32 logits)",
        summary="E and C upcast to fp32, logits materialised, F.cross_entropy: the yardstick of training A/Bs.",
        implementation=exact_loss,
        availability=lambda device, dtype, softcap: None,
        preset_of="naive",
    )
)


# ---------------------------------------------------------------------------------------------
# Apple CCE's presets for pretraining. The paper recommends "CCE-Kahan-FullC" there:
# Kahan summation for the bf16 gradient accumulators and no filter on dC, so that rare tokens'
# classifier rows keep their small gradients. Apple's own code (GitHub, 25.6+) offers it as
# impl="cce_kahan_full_c"; the PyPI package 25.1.1 is a fork of 24.12.1 without it (no Kahan, no
# fp32 accumulation, no per-gradient filter), and offers only the filter's threshold. Registered
# after every primary method, so that the colours of the others (plots.method_colors) stay put.
# ---------------------------------------------------------------------------------------------

APPLE_KAHAN_FULL_C = "cce_kahan_full_c"


def apple_cce_impls() -> set[str]:
    """The ``impl=`` values the installed cut-cross-entropy accepts (lower case): its
    ``LinearCrossEntropyImpl`` members, which both the PyPI fork and Apple's code export."""
    from cut_cross_entropy import LinearCrossEntropyImpl

    return {name.lower() for name in LinearCrossEntropyImpl.__members__}


def _apple_cce_kahan_full_c_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(E, C, x.long(), ignore_index=ignore_index, softcap=softcap, reduction=reduction,
                                impl=APPLE_KAHAN_FULL_C)


def _apple_cce_kahan_full_c_reason(device, dtype, softcap) -> Reason:
    if _installed("cut_cross_entropy") and APPLE_KAHAN_FULL_C not in apple_cce_impls():
        import importlib.metadata

        version = importlib.metadata.version("cut-cross-entropy")
        return (f"cut-cross-entropy {version} has no Kahan-FullC (impl={APPLE_KAHAN_FULL_C!r}, the paper's setting "
                "for pretraining): it is in Apple's own code (pip install "
                "'cut-cross-entropy @ git+https://github.com/apple/ml-cross-entropy.git'), not in the PyPI fork")
    return _apple_cce_reason(device, dtype, softcap)


register(
    Method(
        name="apple_cce_kahan_full_c",
        kind="peer",
        label="Apple CCE (Kahan-FullC)",
        summary="Apple CCE as its paper recommends for pretraining: Kahan-compensated gradient accumulation and "
        "no filter on dC (impl='cce_kahan_full_c'; Apple's GitHub code, not the PyPI fork).",
        implementation=_apple_cce_kahan_full_c_loss,
        availability=_apple_cce_kahan_full_c_reason,
        preset_of="apple_cce",
    )
)


def _apple_cce_nofilter_loss(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(E, C, x.long(), ignore_index=ignore_index, softcap=softcap, reduction=reduction,
                                filter_eps=None)


register(
    Method(
        name="apple_cce_nofilter",
        kind="peer",
        label="Apple CCE (filter off)",
        summary="Apple CCE with its gradient filter off (filter_eps=None): dC and dE unfiltered, the nearest the "
        "PyPI fork comes to Kahan-FullC; its gradients still accumulate in bf16, without Kahan.",
        implementation=_apple_cce_nofilter_loss,
        availability=_apple_cce_reason,
        preset_of="apple_cce",
    )
)


# ours with the "gemm" backward on every call: "ours" chooses per call (backward_impl="auto"), and the
# bench times it against both of its choices (this and ours_sparse). Registered last, apart from the
# other presets of ours: colours and markers go by registration order (helpers.lab.plots), and no
# earlier method's should move.
register(
    Method(
        name="ours_gemm",
        label="ours (gemm backward)",
        summary='ours with backward_impl="gemm" on every call: G per vocabulary chunk, its products in cuBLAS, '
        "whatever the softmax (ours chooses between it and the sparse backward).",
        implementation=_ours(backward_impl="gemm"),
        availability=_ours_reason,
        kind="ours",
        preset_of="ours",
        counts_skips=True,
    )
)


__all__ = [
    "Method",
    "MethodUnavailable",
    "METHODS",
    "REDUCTIONS",
    "register",
    "get_method",
    "method_label",
    "primary_methods",
    "availability",
    "apple_cce_impls",
    "chunk_rows",
]
