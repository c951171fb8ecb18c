"""Our Cut Cross-Entropy (Wijmans et al., arXiv 2411.09009) in Triton: the loss of a linear head
without the (N, V) logits in global memory.

The memory arithmetic. A language model's head computes logits z = E C^T from E (N, D) and
C (V, D). At the Gemma-2-2B head (N = 8,192, V = 256,000, D = 2,304) the fp32 logits are
N * V * 4 = 8.4 GB, and autograd keeps them plus their gradient: the naive path peaks at 24 GB
for a loss whose inputs are 1.2 GB. The gradients dE and dC alone are 1,161 MB in bf16: the lower
bound (LB) of any method. CCE gets within ~10% of LB by never writing a logit: every kernel
rebuilds the (BLOCK_N, BLOCK_V) logit tiles it needs from E and C in on-chip memory.

The math, in the paper's notation (x: targets, S = softmax(z), lse: log-sum-exp per row):

    loss_i = lse_i - z_{i, x_i}                                  (cross-entropy)
    z_{i, x_i} = E_i . C_{x_i}                                   Algorithm 1, indexed dot
    lse_i = log sum_v exp(E_i . C_v)                             Algorithm 2, online over V blocks
    G = dloss/dz = S - 1[v = x],  dE = G C,  dC = G^T E          Algorithms 3-4, tiles recomputed

plus the options: Gemma-2's soft cap z = s tanh(z / s), PaLM's z-loss (+ zl * lse_i^2, Liger's
``lse_square_scale``), torch's label smoothing (loss_i = lse_i - (1 - ls) z_{i, x_i} -
(ls / V) sum_v z_{i, v}) and ``ignore_index``, reduced exactly as ``F.cross_entropy`` does on fp32
logits (``helpers.reference`` is the specification).

Design (kernels in ``helpers/kernels/``, launch configurations in ``helpers/kernels/configs.py``):

- forward: ``indexed_dot_kernel`` on a grid of N / BLOCK_N programs; ``lse_forward_kernel`` on a
  (N / BLOCK_N, SPLITS) grid, each program an online LSE over one split of the vocabulary, the
  splits merged with a logsumexp on the host (SPLITS is chosen so the grid fills the GPU; its
  buffer is SPLITS * N * 4 bytes). Saved for backward: lse, N * 4 bytes.
- backward (the default, version 2, ``backward_impl="gemm"``): per vocabulary chunk of V_c
  columns, ``cce_gradient_chunk_kernel`` rebuilds the logit tiles and writes G_c (N x V_c, input
  dtype) to scratch, then two cuBLAS products: dC[v0:v1] = G_c^T E, written once, and
  dE_acc += G_c C_c into an fp32 (N x D) accumulator (an fp32-output product where torch has one,
  see ``product_mode``), rounded once into dE at the end. Scratch: G_c <= max(32 MiB, LB / 32)
  (none when V_c <= D: G_c then lives in the rows of dE not yet written) and dE_acc <=
  max(64 MiB, LB / 16) (rows in chunks beyond that; ``gemm_chunks``): ~1.06 LB at the Gemma-2-2B
  head, 1.12-1.21 LB at the Qwen3 head (the MiB floors; docs/PERFORMANCE.md).
  With several row chunks dC is rounded to the input dtype once per chunk (bf16 at N = 131,072,
  8 chunks: dC error 2.1x the naive path's on the H200); ``accumulation="kahan"`` carries the
  rounding error of those folds in a compensation buffer (V * D in the input dtype, allocated
  only when there are several chunks) so dC is rounded once (1.0x there). fp32 inputs need no
  accumulator (dE and dC are fp32 already). The filter writes zeros for skipped tiles; cuBLAS
  multiplies them anyway, so in this version the filter saves no time (it costs ~3 ms of 78 at
  the Gemma head); ``stats`` counts the tiles and whole chunks it skipped.
- backward version 1 (``backward_impl="atomic"``): one kernel on a grid of (N / BLOCK_N) *
  (V / BLOCK_V) tiles, grouped so consecutive programs share C strips in L2. Each tile rebuilds
  its logits, forms G, skips itself when the gradient filter allows, and adds G C_tile into dE and
  G^T E_tile into dC with fp32 atomics into fp32 scratch (row and vocabulary chunks, as above;
  defaults max(64 MiB, LB / 10) and max(16 MiB, LB / 40)). The paper's structure, kept for
  teaching and comparison: its ~300 GB of atomics make it 1.9x slower than version 2 on the H200.
  Apple's CCE adds dE in bf16 across ~1000 vocabulary blocks and is 18x less accurate than the
  naive path; fp32 accumulation keeps both versions at the naive path's accuracy.
- gradient filter (paper 4.2): a tile whose |G| sums to less than eps in every row skips its two
  products (the paper bounds each entry; bounding the row mass also holds on a flat softmax, where
  every entry is tiny and their sum is not: see helpers/kernels/backward.py). eps
  defaults from the dtype ("auto"): 2^-12 for bf16 as in the paper, i.e. 2^-5 of bf16's machine
  epsilon, and the same 2^-5 of fp16's (2^-15); off for fp32. With label smoothing "auto" turns the
  filter off: the uniform term -ls/V sits below eps in every tile, so skipping would drop it.
  ``full_c`` / ``full_e`` (the paper's CCE-Kahan-FullC/FullE) keep the filter for one gradient only.
- vocabulary sort (paper 4.3): ``sort_vocab=True`` orders the vocabulary by average logit,
  (C Ebar)_v with Ebar the mean row of E (the average of E_i . C_v over i, an O((N + V) D) matvec),
  so large softmax entries share tiles and more tiles pass the filter. Off by default: it only pays
  when the filter has something to skip and frequent tokens share structure (ANCHORS.md measured
  nothing skippable on random data), and it costs a sort of V, a gathered read of C and a
  scattered dC.

What it does not do: a bias on the head, vocabulary parallelism, returning lse, and the paper's
lock-free bf16 atomics (we trade ~9% of LB in scratch for accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from helpers.device import device_info
from helpers.kernels.backward import cce_backward_kernel
from helpers.kernels.backward_gemm import cce_gradient_chunk_kernel
from helpers.kernels.configs import CCEConfigs, select_configs, tier
from helpers.kernels.indexed_dot import indexed_dot_kernel
from helpers.kernels.lse_forward import lse_forward_kernel
from helpers.reference import SUPPORTED_DTYPES, validate_inputs

ACCUMULATIONS = ("fp32", "kahan")
BACKWARD_IMPLS = ("atomic", "gemm")  # v1 (fp32 atomics), v2 (G chunks + cuBLAS, the default)

# The paper's eps = 2^-12 for bf16 is 2^-5 of bf16's machine epsilon (2^-7): an entry that small
# moves a sum of O(1) gradients by less than its own rounding. The same ratio for fp16 (eps 2^-10).
FILTER_EPS_AUTO = {torch.bfloat16: 2.0**-12, torch.float16: 2.0**-15, torch.float32: None}

MiB = 1024 * 1024


def why_unavailable(
    device: torch.device | str, dtype: torch.dtype, softcap: float | None = None
) -> str | None:
    """None when ``linear_cross_entropy`` can run on ``device`` with ``dtype``, else why not.

    ``softcap`` is accepted for the registry's common signature; every soft cap is supported.
    """
    device = torch.device(device)
    if dtype not in SUPPORTED_DTYPES:
        return f"it supports float32, float16 and bfloat16 inputs, not {dtype}"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "this torch build or machine has no CUDA device"
        major, minor = device_info(device).capability  # a pretend T4's sm_75 too
        if (major, minor) < (7, 0):
            return f"its Triton kernels need a GPU of compute capability 7.0 or newer; this one is sm_{major}{minor}"
        if dtype == torch.bfloat16 and (major, minor) < (8, 0):
            return (
                f"bfloat16 needs an Ampere (sm_80) or newer GPU; this one is sm_{major}{minor} "
                "(a T4 is sm_75): use float16 or float32"
            )
        return None
    if device.type == "cpu":
        if not _interpreting():
            return (
                "its Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 set before triton is "
                "imported to run them on the CPU (import helpers first and it is set for you)"
            )
        if dtype == torch.bfloat16:
            return (
                "the Triton interpreter computes bfloat16 wrongly (it does arithmetic on bf16's bit "
                "patterns, a known Triton bug); use float32 or float16 on the CPU"
            )
        return None
    return f"it runs on CUDA GPUs, or on the CPU under the Triton interpreter, not on {device.type}"


def _interpreting() -> bool:
    """Whether our kernels were built for the interpreter (decided when triton.jit ran)."""
    return not isinstance(lse_forward_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class CCEOptions:
    """Every option of ``linear_cross_entropy``, validated and resolved for one dtype."""

    ignore_index: int = -100
    reduction: str = "mean"
    softcap: float | None = None
    filter_eps: float | None = None  # resolved: None means off
    sort_vocab: bool = False
    accumulation: str = "fp32"
    full_c: bool = False
    full_e: bool = False
    z_loss: float = 0.0
    label_smoothing: float = 0.0


def resolve_options(dtype: torch.dtype, *, filter_eps="auto", **options) -> CCEOptions:
    """Check the options that ``validate_inputs`` does not know, and resolve ``filter_eps``."""
    z_loss = options.get("z_loss", 0.0)
    label_smoothing = options.get("label_smoothing", 0.0)
    accumulation = options.get("accumulation", "fp32")
    if isinstance(filter_eps, str):
        if filter_eps != "auto":
            raise ValueError(f"filter_eps must be 'auto', None or a number >= 0, got {filter_eps!r}")
        eps = None if label_smoothing else FILTER_EPS_AUTO[dtype]
    elif filter_eps is None:
        eps = None
    elif isinstance(filter_eps, (int, float)) and not isinstance(filter_eps, bool) and filter_eps >= 0:
        eps = float(filter_eps) or None  # 0 means off
    else:
        raise ValueError(f"filter_eps must be 'auto', None or a number >= 0, got {filter_eps!r}")
    if not (isinstance(z_loss, (int, float)) and not isinstance(z_loss, bool) and z_loss >= 0):
        raise ValueError(f"z_loss must be a number >= 0, got {z_loss!r}")
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation must be one of {ACCUMULATIONS}, got {accumulation!r}")
    for flag in ("sort_vocab", "full_c", "full_e"):
        if not isinstance(options.get(flag, False), bool):
            raise ValueError(f"{flag} must be True or False, got {options[flag]!r}")
    if options.get("softcap") is not None:
        options["softcap"] = float(options["softcap"])
    options.update(z_loss=float(z_loss), label_smoothing=float(label_smoothing))
    return CCEOptions(filter_eps=eps, **options)


def _resolve_configs(configs: CCEConfigs | str | None, device: torch.device) -> CCEConfigs:
    if configs is None:
        return select_configs(device)
    return tier(configs) if isinstance(configs, str) else configs


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get real fp32 products; for fp16/bf16 operands the setting has no effect.
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------------------------
# Host functions: plain tensors in, tensors out, usable without autograd
# ---------------------------------------------------------------------------------------------


def cce_forward(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    options: CCEOptions = CCEOptions(),
    configs: CCEConfigs | str | None = None,
    v_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row (N,) fp32, 0 at ignored rows; lse (N,) fp32), from Algorithms 1 and 2.

    ``v_splits``: vocabulary splits of the LSE grid; None picks enough to fill the device.
    """
    N, D = E.shape
    V = C.shape[0]
    o = options
    fwd, _, dot_cfg = _resolve_configs(configs, E.device).for_dtype(E.dtype)
    softcap = o.softcap if o.softcap is not None else 1.0

    # Algorithm 1: z_{i, x_i}, (N,).
    target_logit = torch.empty(N, dtype=torch.float32, device=E.device)
    indexed_dot_kernel[(triton.cdiv(N, dot_cfg.BLOCK_N),)](
        E, C, x, target_logit,
        N, D,
        E.stride(0), E.stride(1), C.stride(0), C.stride(1), x.stride(0),
        o.ignore_index, softcap,
        HAS_SOFTCAP=o.softcap is not None,
        **dot_cfg.tiles("BLOCK_N", "BLOCK_D"), **dot_cfg.launch,
    )

    # Algorithm 2: lse over vocabulary splits, (SPLITS, N), then merged.
    n_blocks = triton.cdiv(N, fwd.BLOCK_N)
    v_blocks = triton.cdiv(V, fwd.BLOCK_V)
    if v_splits is None:
        programs_wanted = 4 * _multiprocessors(E.device)
        v_splits = triton.cdiv(programs_wanted, n_blocks)
    blocks_per_split = triton.cdiv(v_blocks, max(1, min(v_splits, v_blocks)))
    v_splits = triton.cdiv(v_blocks, blocks_per_split)
    lse_split = torch.empty(v_splits, N, dtype=torch.float32, device=E.device)
    smoothing = o.label_smoothing > 0
    logit_sum_split = torch.empty_like(lse_split) if smoothing else lse_split
    lse_forward_kernel[(n_blocks, v_splits)](
        E, C, lse_split, logit_sum_split,
        N, V, D, blocks_per_split,
        E.stride(0), E.stride(1), C.stride(0), C.stride(1),
        softcap,
        HAS_SOFTCAP=o.softcap is not None,
        SUM_LOGITS=smoothing,
        DOT_PRECISION=_dot_precision(E.dtype),
        **fwd.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D"), **fwd.launch,
    )
    lse = torch.logsumexp(lse_split, dim=0) if v_splits > 1 else lse_split[0]

    loss = lse - (1.0 - o.label_smoothing) * target_logit
    if smoothing:
        loss = loss - (o.label_smoothing / V) * logit_sum_split.sum(dim=0)
    if o.z_loss:
        loss = loss + o.z_loss * lse * lse
    return torch.where(x != o.ignore_index, loss, 0.0), lse


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return device_info(device).multiprocessors
    return 1  # the interpreter runs programs one by one: a couple of splits just exercise the merge


def default_chunks(N: int, V: int, D: int, dtype: torch.dtype) -> tuple[int, int]:
    """(n_chunk, v_chunk): rows of E and of C whose fp32 scratch the backward keeps at once.

    dE's scratch: max(64 MiB, LB / 10); dC's: max(16 MiB, LB / 40), LB = (N + V) * D * itemsize.
    """
    lb = (N + V) * D * dtype.itemsize
    n_chunk = max(64 * MiB, lb // 10) // (D * 4)
    v_chunk = max(16 * MiB, lb // 40) // (D * 4)
    # Multiples of 256 rows, so no launch ends in a partial tile except the last.
    n_chunk, v_chunk = (c // 256 * 256 if c >= 256 else c for c in (n_chunk, v_chunk))
    return max(1, min(N, n_chunk)), max(1, min(V, v_chunk))


def check_backward_impl(backward_impl) -> str:
    if backward_impl not in BACKWARD_IMPLS:
        raise ValueError(f"backward_impl must be one of {BACKWARD_IMPLS}, got {backward_impl!r}")
    return backward_impl


def cce_backward(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    options: CCEOptions = CCEOptions(),
    configs: CCEConfigs | str | None = None,
    n_chunk: int | None = None,
    v_chunk: int | None = None,
    stats: dict | None = None,
    backward_impl: str = "gemm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dE (N, D), dC (V, D)) in E's dtype, from Algorithms 3 and 4.

    grad_rows: (N,) fp32, the upstream gradient of each row's loss (0 at ignored rows is implied).
    backward_impl: "gemm" (the default, version 2: G written per vocabulary chunk, the products in
    cuBLAS; see ``helpers/kernels/backward_gemm.py``) or "atomic" (version 1: one kernel, fp32
    atomics).
    n_chunk, v_chunk: "atomic": rows of dE's and of dC's fp32 scratch (fp16/bf16 only); "gemm":
    rows per dE accumulator and vocabulary columns per G chunk. None: ``default_chunks`` or
    ``gemm_chunks``.
    stats: when a dict is given, the kernel counts the tiles the filter skipped and the dict gets
    {"tiles": tiles computed, "skipped": tiles skipped, "launches": kernel launches}; "gemm" adds
    "products", how its fp32-output products were made (``product_mode``), and "dead_chunks",
    the launches whose every tile the filter skipped (their GEMMs multiply zeros).
    """
    check_backward_impl(backward_impl)
    N, D = E.shape
    V = C.shape[0]
    o = options
    dtype = E.dtype
    configs = _resolve_configs(configs, E.device)
    _, bwd, _ = configs.for_dtype(dtype)
    device = E.device

    kept = x != o.ignore_index
    g = torch.where(kept, grad_rows.to(torch.float32), 0.0)
    # g = g_rel * g_scale with |g_rel| <= 1: see accumulate_grads for why (fp16 underflow).
    g_scale = g.abs().amax().reshape(1)
    g_rel = torch.where(g_scale > 0, g / g_scale, 0.0)

    vocab_order = None
    if o.sort_vocab:
        # Average logit of v over the batch = C_v . mean_i E_i (the sort ignores the monotone cap).
        E_mean = E.mean(dim=0, dtype=torch.float32).to(dtype)
        vocab_order = torch.argsort(torch.mv(C, E_mean).float(), descending=True)

    if backward_impl == "gemm":
        # A mean or a sum hands every row the same upstream gradient (an expanded scalar).
        uniform = N == 1 or grad_rows.stride(0) == 0
        return _backward_gemm(E, C, x, lse, g, g_rel, g_scale, uniform, vocab_order, o,
                              configs.backward_gemm_for(dtype), n_chunk, v_chunk, stats)

    skip_count = torch.zeros(1, dtype=torch.int32, device=device)
    counters = {"tiles": 0, "launches": 0}
    filtering = o.filter_eps is not None and not (o.full_c and o.full_e)

    def launch(E_rows, x_rows, lse_rows, g_rows, dE_acc, dC_acc, v_begin, v_count, dc_local):
        n_tiles = triton.cdiv(E_rows.shape[0], bwd.BLOCK_N) * triton.cdiv(v_count, bwd.BLOCK_V)
        counters["tiles"] += n_tiles
        counters["launches"] += 1
        cce_backward_kernel[(n_tiles,)](
            E_rows, C, x_rows, lse_rows, g_rows, g_scale,
            vocab_order if vocab_order is not None else skip_count,
            dE_acc, dC_acc, skip_count,
            E_rows.shape[0], V, D, v_begin, v_count,
            E_rows.stride(0), E_rows.stride(1), C.stride(0), C.stride(1), x_rows.stride(0),
            dE_acc.stride(0), dE_acc.stride(1), dC_acc.stride(0), dC_acc.stride(1),
            o.ignore_index, o.softcap if o.softcap is not None else 1.0, o.z_loss,
            o.label_smoothing, o.filter_eps or 0.0,
            HAS_SOFTCAP=o.softcap is not None,
            FILTER=filtering,
            FULL_E=o.full_e,
            FULL_C=o.full_c,
            SORTED=vocab_order is not None,
            DC_LOCAL=dc_local,
            COUNT_SKIPS=stats is not None,
            DOT_PRECISION=_dot_precision(dtype),
            **bwd.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D", "GROUP_N"), **bwd.launch,
        )

    if dtype == torch.float32:
        # The outputs are fp32 already: the atomics add into them directly, one launch.
        dE = torch.zeros(N, D, dtype=dtype, device=device)
        dC = torch.zeros(V, D, dtype=dtype, device=device)
        launch(E, x, lse, g_rel, dE, dC, 0, V, False)
    else:
        dE, dC = _backward_low_precision(E, C, x, lse, g_rel, vocab_order, launch, o, n_chunk, v_chunk)

    if stats is not None:
        stats.update(counters, skipped=int(skip_count.item()))
    return dE, dC


def _fold_dC(dC, dC_rows, where, first, compensation):
    """dC[where] (+)= dC_rows (fp32), rounded to dC's dtype; ``compensation`` (Kahan) carries what
    each rounding lost to the next fold. dC_rows is used as scratch."""
    if not first:
        dC_rows += dC[where]
        if compensation is not None:
            dC_rows += compensation[where]
    rounded = dC_rows.to(dC.dtype)
    dC[where] = rounded
    if compensation is not None:
        compensation[where] = dC_rows.sub_(rounded).to(dC.dtype)


def _backward_low_precision(E, C, x, lse, g_rel, vocab_order, launch, o, n_chunk, v_chunk):
    """fp16/bf16: fp32 scratch per (row chunk, vocabulary chunk), rounded into dE and dC."""
    N, D = E.shape
    V = C.shape[0]
    dtype, device = E.dtype, E.device
    default_n, default_v = default_chunks(N, V, D, dtype)
    n_chunk = min(N, n_chunk or default_n)
    v_chunk = min(V, v_chunk or default_v)
    n_chunks = triton.cdiv(N, n_chunk)

    dE = torch.empty(N, D, dtype=dtype, device=device)
    dC = torch.empty(V, D, dtype=dtype, device=device)
    dE_acc = torch.empty(n_chunk, D, dtype=torch.float32, device=device)  # n_chunk * D * 4 bytes
    dC_acc = torch.empty(v_chunk, D, dtype=torch.float32, device=device)  # v_chunk * D * 4 bytes
    # Kahan-style compensation: what rounding dC to the dtype lost at each fold, carried to the
    # next fold. Only needed when dC is folded more than once per row (several row chunks).
    compensation = (
        torch.zeros(V, D, dtype=dtype, device=device) if o.accumulation == "kahan" and n_chunks > 1 else None
    )

    for chunk, n0 in enumerate(range(0, N, n_chunk)):
        n1 = min(N, n0 + n_chunk)
        dE_rows = dE_acc[: n1 - n0].zero_()
        for v0 in range(0, V, v_chunk):
            v1 = min(V, v0 + v_chunk)
            dC_rows = dC_acc[: v1 - v0].zero_()
            launch(E[n0:n1], x[n0:n1], lse[n0:n1], g_rel[n0:n1], dE_rows, dC_rows, v0, v1 - v0, True)
            # Fold this launch's fp32 dC rows into dC (rows are vocabulary positions, mapped to
            # C's rows through the sort when there is one).
            where = vocab_order[v0:v1] if vocab_order is not None else slice(v0, v1)
            _fold_dC(dC, dC_rows, where, chunk == 0, compensation)
        dE[n0:n1] = dE_rows
    return dE, dC


# ---------------------------------------------------------------------------------------------
# Backward version 2 ("gemm"): G per vocabulary chunk, products in cuBLAS
# ---------------------------------------------------------------------------------------------


def gemm_chunks(N: int, V: int, D: int, dtype: torch.dtype, block_v: int) -> tuple[int, int]:
    """(n_chunk, v_chunk) of backward v2: rows per fp32 dE accumulator, vocabulary columns per G.

    Rows: n_chunk * D * 4 <= max(64 MiB, LB / 16), multiples of 256 (fp32 inputs accumulate into
    dE itself, but the same rows keep their G chunks as wide). Columns: n_chunk * v_chunk *
    itemsize <= max(32 MiB, LB / 32), a multiple of ``block_v`` (the G kernel's BLOCK_V) so only
    the last chunk ends in a partial tile. LB = (N + V) * D * itemsize. At the Gemma-2-2B head in
    bf16 (LB 1,217 MB): all 8,192 rows (75.5 MB of fp32), 2,304 columns (37.7 MB of G), 112 chunks.
    """
    lb = (N + V) * D * dtype.itemsize
    n_chunk = max(64 * MiB, lb // 16) // (D * 4)
    n_chunk = max(1, min(N, n_chunk // 256 * 256 if n_chunk >= 256 else n_chunk))
    v_chunk = max(32 * MiB, lb // 32) // (n_chunk * dtype.itemsize)
    v_chunk = max(block_v, v_chunk // block_v * block_v)
    return n_chunk, min(V, v_chunk)


def g_fits_in_dE(dtype: torch.dtype, v_chunk: int, D: int) -> bool:
    """Whether backward v2 keeps each G chunk in the rows of dE it is computing: a row chunk's dE
    rows are written only after its last product has read G (same stream), so when a chunk of G
    (rows x v_chunk) fits in them (v_chunk <= D) it needs no scratch of its own: the Gemma-2-2B
    head, the Qwen3 head from 16,384 tokens on. Not for fp32 inputs, which accumulate in dE."""
    return dtype != torch.float32 and v_chunk <= D


# How this process makes an fp32-output product of fp16/bf16 operands, per (device, dtype):
PRODUCT_MODES = ("upcast", "addmm_out_dtype", "mm_out_dtype", "rounded")
_product_mode_cache: dict = {}


def product_mode(device: torch.device, dtype: torch.dtype) -> str:
    """How ``_product`` makes out (fp32) [+]= alpha * a @ b for a, b in ``dtype`` on ``device``.

    "upcast": operands copied to fp32 (fp32 inputs, where it costs nothing; and the CPU, whose
    tests want exact products). On CUDA, the first that works and is right on a small probe:
    "addmm_out_dtype", cuBLAS with an fp32 output accumulated in its epilogue (torch.addmm's
    out_dtype, torch >= 2.8 on CUDA; older releases want ``self`` in the operands' dtype);
    "mm_out_dtype", an fp32 product then an add (one more N x D fp32 pass and buffer);
    "rounded", the product in the operands' dtype then added (rounds each chunk's partial sum:
    dE loses ~1.5x in accuracy).
    """
    if dtype == torch.float32 or device.type != "cuda":
        return "upcast"
    key = (device.type, device.index, dtype)
    if key not in _product_mode_cache:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(96, 80, device=device, generator=g).to(dtype)
        b = torch.randn(80, 72, device=device, generator=g).to(dtype)
        start = torch.randn(96, 72, device=device, generator=g)
        want = start + 0.5 * (a.double() @ b.double()).float()
        for mode in PRODUCT_MODES[1:]:
            try:
                got = start.clone()
                _product(got, a, b, alpha=0.5, accumulate=True, mode=mode)
                if torch.allclose(got, want, rtol=1e-2, atol=1e-1):
                    break
            except (RuntimeError, TypeError):  # this torch lacks the overload, or refuses fp32 self
                continue
        _product_mode_cache[key] = mode
    return _product_mode_cache[key]


def _product(out, a, b, *, alpha: float, accumulate: bool, mode: str):
    """out (fp32) = [out +] alpha * (a @ b), a and b in one dtype; ``mode``: ``product_mode``."""
    beta = 1.0 if accumulate else 0.0  # beta = 0: out's old contents (maybe NaN) are ignored
    if mode == "upcast":
        torch.addmm(out, a.float(), b.float(), beta=beta, alpha=alpha, out=out)
    elif mode == "addmm_out_dtype":
        torch.addmm(out, a, b, out_dtype=torch.float32, beta=beta, alpha=alpha, out=out)
    else:
        product = torch.mm(a, b, out_dtype=torch.float32) if mode == "mm_out_dtype" else torch.mm(a, b)
        if accumulate:
            out.add_(product, alpha=alpha)
        else:
            torch.mul(product, alpha, out=out)


def _backward_gemm(E, C, x, lse, g, g_rel, g_scale, uniform, vocab_order, o, cfg, n_chunk, v_chunk,
                   stats):
    """Version 2: per (row chunk, vocabulary chunk), G_c from ``cce_gradient_chunk_kernel``, then
    dC[v0:v1] = g_scale G_c^T (g_rel E) and dE_acc += G_c C[v0:v1] in cuBLAS.

    Memory beyond LB, fp16/bf16: dE_acc (n_chunk * D * 4) + G_c (n_chunk * v_chunk * itemsize,
    nothing when ``g_fits_in_dE``; once more with FullC/FullE and the filter) + g_rel E
    (n_chunk * D * itemsize, only when rows have
    different upstream gradients, i.e. reduction="none") + C's gathered chunk (v_chunk * D *
    itemsize, sort only) + dC's fp32 fold (v_chunk * D * 4, several row chunks only) + Kahan's
    V * D compensation (several row chunks only) + O(N). fp32: no dE_acc (dE accumulates itself).
    """
    N, D = E.shape
    V = C.shape[0]
    dtype, device = E.dtype, E.device
    low_precision = dtype != torch.float32
    default_n, default_v = gemm_chunks(N, V, D, dtype, cfg.BLOCK_V)
    n_chunk = min(N, n_chunk or default_n)
    v_chunk = min(V, v_chunk or default_v)
    n_chunks = triton.cdiv(N, n_chunk)
    filtering = o.filter_eps is not None and not (o.full_c and o.full_e)
    # FullC / FullE with the filter: the kernel also writes the unfiltered G, for the exact side.
    split = filtering and (o.full_c or o.full_e)
    mode = product_mode(device, dtype)

    # dC's GEMM alpha, one host sync per backward. When every row has the same g (0 at ignored
    # rows, whose G is 0), alpha is that g and E is the operand as it is; otherwise g_scale, with
    # g_rel E the operand.
    alpha = float(g[g.abs().argmax()]) if uniform else float(g_scale)
    g_in_dE = g_fits_in_dE(dtype, v_chunk, D)
    G_buf = None if g_in_dE else torch.empty(n_chunk * v_chunk, dtype=dtype, device=device)
    G_exact_buf = torch.empty(n_chunk * v_chunk, dtype=dtype, device=device) if split else None
    tiles_max = triton.cdiv(n_chunk, cfg.BLOCK_N) * triton.cdiv(v_chunk, cfg.BLOCK_V)
    tile_kept = torch.empty(tiles_max if filtering else 1, dtype=torch.int8, device=device)
    skipped = torch.zeros((), dtype=torch.int64, device=device)
    dead_chunks = torch.zeros((), dtype=torch.int64, device=device)  # chunks with every tile skipped
    dE = torch.empty(N, D, dtype=dtype, device=device)
    dC = torch.empty(V, D, dtype=dtype, device=device)
    dE_acc = torch.empty(n_chunk, D, dtype=torch.float32, device=device) if low_precision else None
    E_scaled_buf = None if uniform else torch.empty(n_chunk, D, dtype=dtype, device=device)
    C_sorted_buf = torch.empty(v_chunk, D, dtype=dtype, device=device) if vocab_order is not None else None
    # dC rows in fp32 before they land in dC: folds (several row chunks), the sort's scatter,
    # the CPU's "upcast" products.
    staged = vocab_order is not None or (low_precision and (n_chunks > 1 or mode == "upcast"))
    dC_rows_buf = torch.empty(v_chunk, D, dtype=torch.float32, device=device) if staged else None
    compensation = (
        torch.zeros(V, D, dtype=dtype, device=device)
        if low_precision and o.accumulation == "kahan" and n_chunks > 1 else None
    )
    counters = {"tiles": 0, "launches": 0}

    for chunk, n0 in enumerate(range(0, N, n_chunk)):
        n1 = min(N, n0 + n_chunk)
        rows = n1 - n0
        E_rows = E[n0:n1]  # (rows, D)
        dE_rows = (dE_acc[:rows] if low_precision else dE[n0:n1]).zero_()  # (rows, D) fp32
        # dC's operand: g_rel E, (rows, D) in the dtype (rounded as v1 rounds G g_rel for dC).
        E_op = E_rows if uniform else torch.mul(E_rows, g_rel[n0:n1, None], out=E_scaled_buf[:rows])
        G_store = dE[n0:n1].view(-1) if g_in_dE else G_buf
        G_exact_store = G_exact_buf if split else G_store
        for v0 in range(0, V, v_chunk):
            v1 = min(V, v0 + v_chunk)
            cols = v1 - v0
            G = G_store[: rows * cols].view(rows, cols)  # (rows, V_c)
            G_exact = G_exact_store[: rows * cols].view(rows, cols)
            tiles = triton.cdiv(rows, cfg.BLOCK_N) * triton.cdiv(cols, cfg.BLOCK_V)
            counters["tiles"] += tiles
            counters["launches"] += 1
            # 1. G_c: the logit tiles rebuilt, G formed and filtered, written in the dtype.
            cce_gradient_chunk_kernel[(tiles,)](
                E_rows, C, x[n0:n1], lse[n0:n1],
                vocab_order if vocab_order is not None else tile_kept,
                G, G_exact, tile_kept,
                rows, V, D, v0, cols,
                E_rows.stride(0), E_rows.stride(1), C.stride(0), C.stride(1), x.stride(0),
                G.stride(0), G.stride(1),
                o.ignore_index, o.softcap if o.softcap is not None else 1.0, o.z_loss,
                o.label_smoothing, o.filter_eps or 0.0,
                HAS_SOFTCAP=o.softcap is not None,
                FILTER=filtering,
                SPLIT_G=split,
                SORTED=vocab_order is not None,
                DOT_PRECISION=_dot_precision(dtype),
                **cfg.tiles("BLOCK_N", "BLOCK_V", "BLOCK_D", "GROUP_N"), **cfg.launch,
            )
            if stats is not None and filtering:
                skipped += (tile_kept[:tiles] == 0).sum()
                dead_chunks += (tile_kept[:tiles] == 0).all()
            G_dE = G_exact if o.full_e else G  # FullE: dE exact; FullC: dC exact
            G_dC = G_exact if o.full_c else G
            if vocab_order is not None:
                where = vocab_order[v0:v1]
                C_c = torch.index_select(C, 0, where, out=C_sorted_buf[:cols])  # (V_c, D)
            else:
                where = slice(v0, v1)
                C_c = C[v0:v1]
            # 2. dE_acc += G_c C_c: (rows, V_c) @ (V_c, D), fp32 output.
            _product(dE_rows, G_dE, C_c, alpha=1.0, accumulate=True, mode=mode)
            # 3. dC[v0:v1] = alpha G_c^T (g_rel E): (V_c, rows) @ (rows, D).
            if not staged:
                # In place from cuBLAS's fp32 sum: written once in the dtype (one row chunk), or
                # accumulated in fp32 (fp32 inputs) across row chunks.
                dC_rows = dC[v0:v1]  # one view as input and output: addmm updates it in place
                torch.addmm(dC_rows, G_dC.T, E_op, beta=0.0 if chunk == 0 else 1.0, alpha=alpha,
                            out=dC_rows)
                continue
            dC_rows = dC_rows_buf[:cols]  # (V_c, D) fp32, then folded into dC's rows
            _product(dC_rows, G_dC.T, E_op, alpha=alpha, accumulate=False, mode=mode)
            if low_precision:
                _fold_dC(dC, dC_rows, where, chunk == 0, compensation)
            elif chunk == 0:
                dC.index_copy_(0, where, dC_rows)
            else:
                dC.index_add_(0, where, dC_rows)
        # 4. dE = g dE_acc, rounded once (fp32: scaled in place).
        if low_precision:
            torch.mul(dE_rows, g[n0:n1, None], out=dE[n0:n1])
        else:
            dE_rows.mul_(g[n0:n1, None])

    if stats is not None:
        stats.update(counters, skipped=int(skipped.item()), dead_chunks=int(dead_chunks.item()),
                     products=mode)
    return dE, dC


# ---------------------------------------------------------------------------------------------
# Autograd and the public function
# ---------------------------------------------------------------------------------------------


class LinearCrossEntropyFunction(torch.autograd.Function):
    """loss = CE(E C^T, x) with the CCE kernels; backward recomputes the logits (saves only lse)."""

    @staticmethod
    def forward(ctx, E, C, x, options: CCEOptions, configs, backward_impl="gemm", stats=None):
        loss_rows, lse = cce_forward(E, C, x, options, configs)
        kept = x != options.ignore_index
        n_kept = kept.sum()
        if options.reduction == "none":
            loss = loss_rows
        elif options.reduction == "sum":
            loss = loss_rows.sum()
        else:
            loss = loss_rows.sum() / n_kept  # 0 / 0 = NaN when every token is ignored, as torch
        ctx.save_for_backward(E, C, x, lse, n_kept)
        ctx.options, ctx.configs, ctx.backward_impl, ctx.stats = options, configs, backward_impl, stats
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        E, C, x, lse, n_kept = ctx.saved_tensors
        o = ctx.options
        grad_loss = grad_loss.to(torch.float32)
        if o.reduction == "none":
            grad_rows = grad_loss
        elif o.reduction == "sum":
            grad_rows = grad_loss.expand(x.shape[0])
        else:
            # All ignored: torch's gradients are 0, not NaN, so divide by at least 1.
            grad_rows = (grad_loss / n_kept.clamp(min=1)).expand(x.shape[0])
        dE, dC = cce_backward(E, C, x, lse, grad_rows, o, ctx.configs, stats=ctx.stats,
                              backward_impl=ctx.backward_impl)
        return (
            dE if ctx.needs_input_grad[0] else None,
            dC if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
    filter_eps: float | str | None = "auto",
    sort_vocab: bool = False,
    accumulation: str = "fp32",
    full_c: bool = False,
    full_e: bool = False,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    configs: CCEConfigs | str | None = None,
    backward_impl: str = "gemm",
    stats: dict | None = None,
) -> torch.Tensor:
    """Cross-entropy of the logits E C^T against x, without materialising the logits.

    E (N, D), C (V, D), x (N,) int targets; fp32, fp16 or bf16 (E and C alike). Returns an fp32
    loss: a scalar for "mean"/"sum", (N,) for "none" (0 at ignored rows); exactly
    ``F.cross_entropy(softcap(E C^T).float(), x, ...)`` up to rounding, NaN for a mean over zero
    kept tokens (with zero gradients), as torch gives.

    filter_eps: "auto" (2^-12 bf16, 2^-15 fp16, off for fp32; off with label smoothing), a number
        (0 = off) or None (off). sort_vocab: order the vocabulary by average logit for the filter.
    accumulation: "fp32" (fp32 scratch, rounded once per row chunk) or "kahan" (also compensates
        dC's folds across row chunks). With one row chunk (N * D * 4 <= max(64 MiB, LB / 16): all
        N up to 16,384 at the Qwen3 head, 8,192+ at Gemma's) "fp32" keeps bf16 dE and dC within
        1.5x of the naive bf16 path's error (0.55-1.0x measured on the H200); past it dC is rounded
        once per chunk (2.1x at N = 131,072) and "kahan" brings it back to 1.0x for a V * D buffer
        in the input dtype (+0.54 LB at N = 131,072, Qwen3 head). full_c / full_e: filter only
        dE / only dC.
    z_loss: adds z_loss * lse^2 per kept token. label_smoothing: torch's definition, in [0, 1].
    configs: a ``CCEConfigs`` or tier name from ``helpers.kernels.configs``; None picks by the
        device's shared memory per block.
    backward_impl: "gemm" (the default, version 2: G per vocabulary chunk in scratch, its two
        products in cuBLAS) or "atomic" (version 1, fp32 atomics in one kernel; 1.9x slower on
        the H200); ``helpers/kernels/backward_gemm.py``. fp32 "gemm" products follow torch's fp32
        matmul setting (default: no TF32).
    stats: a dict the backward fills with what its gradient filter did: "tiles" (logit tiles
        rebuilt), "skipped" (tiles whose gradient the filter dropped), "launches"; see
        ``cce_backward``. Counting costs one host sync per backward.
    """
    validate_inputs(E, C, x, ignore_index=ignore_index, reduction=reduction, softcap=softcap)
    options = resolve_options(
        E.dtype,
        filter_eps=filter_eps,
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=softcap,
        sort_vocab=sort_vocab,
        accumulation=accumulation,
        full_c=full_c,
        full_e=full_e,
        z_loss=z_loss,
        label_smoothing=label_smoothing,
    )
    check_backward_impl(backward_impl)
    reason = why_unavailable(E.device, E.dtype, softcap)
    if reason:
        raise RuntimeError(f"helpers.cce.linear_cross_entropy cannot run here: {reason}")
    if stats is not None and not isinstance(stats, dict):
        raise ValueError(f"stats must be a dict (filled by the backward) or None, got {type(stats).__name__}")
    return LinearCrossEntropyFunction.apply(E, C, x, options, configs, backward_impl, stats)
