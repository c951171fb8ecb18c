"""What ``linear_cross_entropy`` accepts, where it can run, and the one plan a call resolves to.

``resolve_options`` checks every option that ``helpers.spec.validate_inputs`` does not know and
resolves the gradient filter's threshold for the dtype; ``why_unavailable`` says, in a sentence,
why our kernels cannot run on a device in a dtype (None when they can). The comparison's registry
asks the same function, so the two can never disagree.

``plan_call`` (``linear_cross_entropy``'s entry) and ``plan_for`` (``cce_backward``'s, given resolved
options) validate a call and resolve it, once, into a ``CCEPlan``: the backward ("auto" chooses
here, ``helpers.cce.auto``), the options as that backward runs them (the filter's final threshold,
the vocabulary sort), the configuration tier with its host knobs, whether a gradient may flow into
the lse, which gradients are wanted, whether the "sparse" backward's forward makes its bits, and the
options "gemm" runs with if the sparse backward hands over to it. The forward and the backward only
read the plan. Each option's one owner: ``tests/cce/test_plan.py``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import triton

from helpers.cce.auto import RECORD, AutoChoice
from helpers.cce.device import device_info
from helpers.cce.kernels.configs import CCEConfigs, LaunchConfig, select_configs, tier
from helpers.cce.kernels.logits import logit_tile
from helpers.spec import SUPPORTED_DTYPES

ACCUMULATIONS = ("fp32", "kahan")
# The backward implementations, by the one name each has everywhere: "gemm" (G written per
# vocabulary chunk, its products in cuBLAS), "atomic" (one kernel, fp32 atomics) and "sparse" (only
# the (row, tile) pairs the forward marked; "gemm" when it marks too many).
BACKWARD_IMPLS = ("gemm", "atomic", "sparse")
# What ``linear_cross_entropy`` accepts: one of them, or "auto" (the default), which runs "sparse"
# where the last calls of the problem saw its bits pay and "gemm" elsewhere (``helpers.cce.auto``).
BACKWARD_CHOICES = ("auto", *BACKWARD_IMPLS)

# The paper's eps = 2^-12 for bf16 is 2^-5 of bf16's machine epsilon (2^-7): an entry that small
# moves a sum of O(1) gradients by less than its own rounding. The same ratio for fp16 (eps 2^-10).
FILTER_EPS_AUTO = {torch.bfloat16: 2.0**-12, torch.float16: 2.0**-15, torch.float32: None}
# "auto" for the "sparse" backward, whose filter is per row: at most this much of a row's |G| mass is
# dropped (eps = B / T for T tiles a row; ``helpers.cce.backward.sparse`` says why).
SPARSE_ROW_BUDGET = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: None}
# The dense backwards' filter compares a row's |G| mass in a tile of BLOCK_V columns with
# eps * BLOCK_V / FILTER_COLUMNS: eps is per 256 vocabulary columns, so that narrower tiles (the
# T4's 64, consumer Ampere's 128) drop about what 256-column ones drop. In float64 on the realistic
# regime at the Gemma-2-2B head, the filter's share of dE's norm: fp16 (2^-15), 64-column tiles
# 1.4e-3 at eps per tile -> 9.1e-5 scaled (256 columns: 9.4e-6); bf16 (2^-12), 128-column tiles
# 7.0e-3 -> 2.7e-3 (256: 1.6e-3). Mass is not linear in width, so the dependence shrinks but
# stays. A fixed eps per tile also lets a row lose up to eps x V / 256 of its mass, more the larger
# the vocabulary and the fewer the rows a tile holds: on an H200 the Hopper G kernel's 64-row tiles
# at 2^-12 took dE to 1.63x naive bf16's error at a Gemma-3-1B head (V 262,144, realistic softmax;
# 0.55x with the filter off), which no gate case had looked at. So "auto" also holds a row's loss to
# the "sparse" backward's budget B over the whole vocabulary: eps = min(FILTER_EPS_AUTO,
# B x 256 / V), the table's value up to 8,192 classes, 2^-17 at 262,144 (the filter's share of dE
# there, float64, 64-row tiles: 6.1e-3 -> 9.9e-5). The filter saves no time in "gemm" (its products
# are dense); in "atomic" a larger vocabulary now skips fewer tiles.
FILTER_COLUMNS = 256


def tile_eps(filter_eps: float | None, block_v: int) -> float:
    """The dense filter's threshold for one tile of ``block_v`` columns (0.0 when the filter is off)."""
    return (filter_eps or 0.0) * block_v / FILTER_COLUMNS


def triton_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why Triton kernels (ours, or a peer's) cannot run on the CPU here, if they cannot; None on
    a CUDA device (its own limits are the caller's to check)."""
    device = torch.device(device)
    if device.type == "cuda":
        return None
    interpreted = not isinstance(logit_tile, triton.runtime.JITFunction)  # decided when @triton.jit ran
    if os.environ.get("TRITON_INTERPRET") != "1" or not interpreted:
        return (
            "Triton kernels need a CUDA GPU, or the Triton interpreter (TRITON_INTERPRET=1) switched on "
            "before the kernels are defined; import helpers first and it is set for you"
        )
    if dtype == torch.bfloat16:
        return (
            "the Triton interpreter computes bfloat16 wrongly (it does arithmetic on bf16's bit patterns, "
            "a known Triton bug); use float32 or float16 on the CPU"
        )
    return None


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
        return triton_reason(device, dtype)
    return f"it runs on CUDA GPUs, or on the CPU under the Triton interpreter, not on {device.type}"


@dataclass(frozen=True)
class CCEOptions:
    """Every option of ``linear_cross_entropy``, validated and resolved for one dtype."""

    ignore_index: int = -100
    reduction: str = "mean"
    softcap: float | None = None
    filter_eps: float | None = None  # resolved: None means off
    sort_vocab: bool = False  # resolved: "auto" is True for the "sparse" backward, False for the others
    accumulation: str = "fp32"
    full_c: bool = False
    full_e: bool = False
    z_loss: float = 0.0
    label_smoothing: float = 0.0
    temperature: float = 1.0  # z = cap(E C^T + b) / temperature, before the lse and everything after it


FP32_MAX = 3.4028234663852886e38


def check_temperature(temperature) -> float:
    """``temperature`` as a float, or a ``ValueError`` naming it: a finite number > 0."""
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (the logits are divided by it), "
                         f"got {temperature!r}")
    if 1.0 / temperature > FP32_MAX:  # the kernels multiply by 1 / temperature in fp32: inf, then NaN
        raise ValueError(f"temperature must be at least 1 / {FP32_MAX:.3g} (the kernels scale by 1 / temperature "
                         f"in fp32), got {temperature!r}")
    return float(temperature)


def check_loss_terms(z_loss, label_smoothing) -> None:
    """A ``ValueError`` naming ``z_loss`` or ``label_smoothing`` unless each is a number (not a bool) in range:
    z_loss finite and >= 0, label_smoothing in [0, 1]. The public functions call it before they route these
    terms (class weights take the z-loss out of the kernels)."""
    if not (isinstance(z_loss, (int, float)) and not isinstance(z_loss, bool) and 0 <= z_loss < math.inf):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if not (isinstance(label_smoothing, (int, float)) and not isinstance(label_smoothing, bool)
            and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")


def resolve_options(dtype: torch.dtype, *, filter_eps="auto", vocabulary: int | None = None, **options) -> CCEOptions:
    """Check the options that ``validate_inputs`` does not know, and resolve ``filter_eps`` ("auto"
    for the dense backwards needs the ``vocabulary`` V: its threshold falls with V)."""
    z_loss = options.get("z_loss", 0.0)
    label_smoothing = options.get("label_smoothing", 0.0)
    accumulation = options.get("accumulation", "fp32")
    if isinstance(filter_eps, str):
        if filter_eps != "auto":
            raise ValueError(f"filter_eps must be 'auto', None or a number >= 0, got {filter_eps!r}")
        if vocabulary is None:
            raise ValueError("filter_eps='auto' needs vocabulary= (the number of classes V): its threshold "
                             "falls with V (auto_filter_eps)")
        eps = auto_filter_eps(dtype, label_smoothing, vocabulary=vocabulary)
    elif filter_eps is None:
        eps = None
    elif isinstance(filter_eps, (int, float)) and not isinstance(filter_eps, bool) and 0 <= filter_eps < math.inf:
        eps = float(filter_eps) or None  # 0 means off
    else:  # inf would skip every tile: every gradient 0, silently
        raise ValueError(f"filter_eps must be 'auto', None or a finite number >= 0, got {filter_eps!r}")
    check_loss_terms(z_loss, label_smoothing)
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation must be one of {ACCUMULATIONS}, got {accumulation!r}")
    for flag in ("sort_vocab", "full_c", "full_e"):
        if not isinstance(options.get(flag, False), bool):
            raise ValueError(f"{flag} must be True or False, got {options[flag]!r}")
    if options.get("softcap") is not None:
        options["softcap"] = float(options["softcap"])
    options.update(z_loss=float(z_loss), label_smoothing=float(label_smoothing),
                   temperature=check_temperature(options.get("temperature", 1.0)))
    return CCEOptions(filter_eps=eps, **options)


def auto_filter_eps(dtype: torch.dtype, label_smoothing: float = 0.0, *, vocabulary: int,
                    block_v: int | None = None) -> float | None:
    """What ``filter_eps="auto"`` means for a ``vocabulary`` of V classes, the one place that says it:
    off (None) with label smoothing and for fp32; for the dense backwards, per 256 columns,
    min(``FILTER_EPS_AUTO``, B x 256 / V); for the "sparse" backward (given its tiles of ``block_v``
    columns) B / T, T = ceil(V / block_v) tiles a row. B = ``SPARSE_ROW_BUDGET``: either way a row
    drops at most B of its |G| mass."""
    if not (isinstance(vocabulary, int) and not isinstance(vocabulary, bool) and vocabulary > 0):
        raise ValueError(f"vocabulary must be the number of classes V, an int > 0, got {vocabulary!r}")
    if label_smoothing:
        return None
    budget = SPARSE_ROW_BUDGET[dtype]
    if budget is None:
        return None
    if block_v is None:
        return min(FILTER_EPS_AUTO[dtype], budget * FILTER_COLUMNS / vocabulary)
    return budget / triton.cdiv(vocabulary, block_v)


def sparse_auto_eps(dtype: torch.dtype, V: int, block_v: int, label_smoothing: float = 0.0) -> float | None:
    """The "sparse" backward's "auto" threshold (``auto_filter_eps``)."""
    return auto_filter_eps(dtype, label_smoothing, vocabulary=V, block_v=block_v)


def check_backward_impl(backward_impl, choices: tuple[str, ...] = BACKWARD_IMPLS) -> str:
    if not isinstance(backward_impl, str) or backward_impl not in choices:
        hint = ('; "auto" is linear_cross_entropy\'s, which decides before the forward'
                if backward_impl == "auto" else "")
        raise ValueError(f"backward_impl must be one of {choices}, got {backward_impl!r}{hint}")
    return backward_impl


def _is_auto(value) -> bool:
    return isinstance(value, str) and value == "auto"


def resolve_configs(configs: CCEConfigs | str | None, device: torch.device) -> CCEConfigs:
    """The launch configurations to use: the device's tier (None), a named tier, or as given."""
    if configs is None:
        return select_configs(device)
    if isinstance(configs, str):
        return tier(configs)
    if not isinstance(configs, CCEConfigs):
        raise TypeError(f"configs must be None, a tier's name or a CCEConfigs (helpers.cce.kernels.configs.tier(...)), "
                        f"got {type(configs).__name__}")
    return configs


def dot_precision(dtype: torch.dtype, cfg: LaunchConfig) -> str:
    """Our kernels' DOT_PRECISION (``helpers.cce.kernels.logits.dot``): "ieee" for fp32 inputs (real fp32
    products; a GPU's default for an fp32 dot is tf32, a 10-bit mantissa); for fp16/bf16 "tf32" (the
    setting has no effect on their tensor-core product), or "fma" where ``cfg`` runs on a tier whose
    Triton has no tensor-core tl.dot (``LaunchConfig.tensor_cores``): the operands in fp32 and fp32 FMAs,
    as Triton compiles them for a T4."""
    if dtype == torch.float32:
        return "ieee"
    return "tf32" if cfg.tensor_cores else "fma"


def fp_fusion(dtype: torch.dtype) -> bool:
    """Triton's ``enable_fp_fusion`` launch option for the kernels that form logits: whether the compiler
    may contract a multiply and an add into one FMA. Off for fp32 inputs: the forward and the backward
    each rebuild z / tau and take z / tau - lse, and contracted differently in the two they disagree
    by ~ulp(z / tau) / 2, which at a cold temperature is larger than the gradient's own rounding (on an
    H100, fp32 distillation at tau 0.1 erred 2.1-4.5x the naive path's error with contraction and passed
    the tests' 2x without it; on an H200 the cross-entropy at tau 0.1 erred 1.4-12x). 16-bit inputs keep
    it: their G is stored in 16 bits. The interpreter ignores the option."""
    return dtype != torch.float32


def check_bias_gradient(backward_impl: str, wants_db: bool) -> None:
    if wants_db and backward_impl == "atomic":
        raise ValueError('a bias that requires grad needs backward_impl="gemm" or "sparse" '
                         '(the "atomic" backward has no db)')


def options_need_every_pair(o: CCEOptions) -> str | None:
    """Why these options leave nothing for the "sparse" backward to skip (None: they do not)."""
    if o.filter_eps is None:
        return "the filter is off (fp32 'auto', filter_eps=None or label smoothing)"
    if o.full_c or o.full_e:
        return "FullC / FullE keep one gradient exact: every pair"
    if o.label_smoothing:
        return "label smoothing puts -ls/V in every entry"
    if o.temperature != 1.0:
        return "its kernels take no temperature"
    return None


def too_small(N: int, V: int, block_v: int, min_pairs: int) -> str | None:
    """Why a problem is too small for the "sparse" backward (None when it is not): its plan, index and
    launches took 7.7 ms of host time at the Qwen3 head with N = 1,024 on an H200, where the whole
    "gemm" backward takes 3.0 ms; at N = 16,384 its forward+backward was 1.25x faster than "gemm"'s
    (``HostTuning.sparse_min_pairs``)."""
    pairs = N * triton.cdiv(V, block_v)
    if pairs < min_pairs:
        return f"N x tiles = {pairs:,} (row, tile) pairs, fewer than the {min_pairs:,} that pay for the sparse index"
    return None


@dataclass(frozen=True)
class CCEPlan:
    """One call of the loss, validated and resolved once at its entry; the forward and the backward
    only read it."""

    options: CCEOptions  # every loss option, as ``backward_impl`` runs them; filter_eps final (None: off)
    configs: CCEConfigs  # the tier for the device, with its host knobs (``HostTuning``)
    backward_impl: str  # "gemm", "atomic" or "sparse" ("auto" resolved: ``auto``)
    return_lse: bool  # the lse is returned: a gradient may flow into it (the sparse forward's bits allow for it)
    need: tuple[bool, bool, bool]  # (dE, dC, db): the gradients a backward computes
    # "sparse" only: why no (row, tile) pair can be skipped before any bit is made (the options need
    # every pair, or the problem is too small), so the forward makes no bits and "gemm" runs; None otherwise.
    sparse_reason: str | None = None
    # "sparse" only: the options "gemm" runs with when the sparse backward hands over to it: "gemm"'s own
    # "auto" eps (per tile), unsorted (sorted, "gemm" would gather C's rows, which costs it time).
    fallback: CCEOptions | None = None
    # backward_impl="auto" only: what it chose and why, and the problem whose record the backward updates.
    auto: AutoChoice | None = None
    # Class weights with label smoothing (``helpers.cce.class_weights``): (V,) fp32, summed with the logits
    # in the forward and carried by G's smoothing term; the rows come weighted. None otherwise.
    class_weight: torch.Tensor | None = None

    @property
    def emit_activity(self) -> bool:
        """Whether the forward writes activity bits: "sparse", a gradient wanted, nothing against it."""
        return self.backward_impl == "sparse" and any(self.need) and self.sparse_reason is None


def why_sparse_cannot_run(E: torch.Tensor, C: torch.Tensor, o: CCEOptions, configs: CCEConfigs) -> str | None:
    """Why the "sparse" backward can skip nothing here before any bit is made (``options_need_every_pair``,
    ``too_small``), None when it may; ``o``: the options as "sparse" runs them."""
    return options_need_every_pair(o) or too_small(E.shape[0], C.shape[0], configs.sparse_for(E.dtype).BLOCK_V,
                                                   configs.host.sparse_min_pairs)


def problem_key(E: torch.Tensor, C: torch.Tensor, o: CCEOptions, configs: CCEConfigs, return_lse: bool) -> tuple:
    """What decides whether the sparse backward pays, for "auto"'s record (``helpers.cce.auto``): the
    device, dtype and head (V, D), N rounded up to a power of two, the tier (its tiles, density limit
    and host knobs), the options as "sparse" runs them (eps, sort, soft cap, z-loss, ...) and whether
    the lse is returned (the bits' margin)."""
    N = E.shape[0]
    return (str(E.device), E.dtype, C.shape[0], E.shape[1], 1 << max(0, N - 1).bit_length(), configs.name,
            configs.dense_fallback, configs.sparse_for(E.dtype), configs.host, o, return_lse)


def plan_call(E: torch.Tensor, C: torch.Tensor, *, backward_impl: str, configs: CCEConfigs | str | None,
              return_lse: bool, need: tuple[bool, bool, bool], wants_db: bool, filter_eps="auto",
              sort_vocab="auto", vocabulary: int | None = None, **options) -> CCEPlan:
    """``linear_cross_entropy``'s plan: the backward's name, the options (``resolve_options``; "auto"
    eps by ``auto_filter_eps``, per row for "sparse"; "auto" sort for "sparse" only), the bias's
    gradient against the backward (``wants_db``: the bias requires grad), the device and dtype
    (``why_unavailable``), the tier, then for "auto" the backward (``helpers.cce.auto``). E (..., D) and
    C (V, D) give the device, the dtype and the sizes (E's leading dimensions flattened: N rows);
    ``vocabulary`` (default V) is the whole vocabulary "auto"'s threshold bounds a row's loss over,
    where C is one rank's shard of it."""
    check_backward_impl(backward_impl, BACKWARD_CHOICES)
    E = E.reshape(-1, E.shape[-1])  # (B, T, D) counts B T rows, not B ("auto"'s pairs, the plan's key); callers
    # that have the rows pass them (a reshape of a non-contiguous E would copy it)
    if not (_is_auto(sort_vocab) or isinstance(sort_vocab, bool)):
        raise ValueError(f"sort_vocab must be 'auto', True or False, got {sort_vocab!r}")
    configs = resolve_configs(configs, E.device)
    need = tuple(need)
    key = _plan_key(E, C, configs, backward_impl, return_lse, need, wants_db, filter_eps, sort_vocab, vocabulary,
                    options)
    resolved = _PLANS.pop(key, None) if key is not None else None
    if resolved is None:
        resolved = _resolve_plan(E, C, backward_impl=backward_impl, configs=configs, return_lse=return_lse, need=need,
                                 wants_db=wants_db, filter_eps=filter_eps, sort_vocab=sort_vocab, vocabulary=vocabulary,
                                 **options)
        if key is not None and len(_PLANS) >= _PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]  # the problem least recently used
    if key is not None:
        _PLANS[key] = resolved  # last in the order: the most recently used
    plan, sparse, problem = resolved
    if plan.backward_impl != "auto":
        return plan
    # "auto": the record decides on every call (it counts calls, ``helpers.cce.auto``).
    choice = RECORD.choose(problem, configs.host.auto_probe_calls)
    if choice.backward == "gemm":
        return replace(plan, backward_impl="gemm", auto=choice)
    return replace(sparse, auto=choice)


# The resolved plans of the problems used last (``plan_call``), least recently used first: resolving one
# is ~0.2 ms of Python, which a call with few tokens pays before its first launch (its host time bounds
# it, docs/PERFORMANCE.md); a loop whose N changes every call keeps its other problems' plans too.
_PLANS: dict = {}
_PLANS_KEPT = 64


def _plan_key(E, C, configs, backward_impl, return_lse, need, wants_db, filter_eps, sort_vocab, vocabulary,
              options) -> tuple | None:
    """What ``_resolve_plan``'s answer depends on, each value with its type (True and 1 are told apart:
    one is refused where the other is not), or None where an argument is not hashable (it is checked
    the long way, which says what is wrong with it). The tier by identity: the entry's plan holds it,
    so its id is not reused while the entry lives."""
    try:
        key = (E.device, E.dtype, E.shape[0], E.shape[1], C.shape[0], id(configs), backward_impl, return_lse, need,
               wants_db, type(filter_eps), filter_eps, type(sort_vocab), sort_vocab, type(vocabulary), vocabulary,
               *((k, type(v), v) for k, v in sorted(options.items())))
        hash(key)
    except TypeError:
        return None
    return key


def _resolve_plan(E: torch.Tensor, C: torch.Tensor, *, backward_impl: str, configs: CCEConfigs, return_lse: bool,
                  need: tuple[bool, bool, bool], wants_db: bool, filter_eps="auto", sort_vocab="auto",
                  vocabulary: int | None = None, **options) -> tuple[CCEPlan, CCEPlan | None, tuple | None]:
    """``plan_call``'s plan before "auto"'s record is asked: (the plan, None, None) for "gemm", "atomic",
    "sparse" and an "auto" that cannot run "sparse"; for the rest (a plan named "auto" with "gemm"'s
    options, the "sparse" plan, the record's ``problem_key``), of which ``plan_call`` returns one per call."""
    block_v = configs.sparse_for(E.dtype).BLOCK_V
    V = C.shape[0] if vocabulary is None else vocabulary

    def resolved(backward: str) -> CCEOptions:
        """The options as ``backward`` runs them."""
        eps = filter_eps
        if _is_auto(filter_eps) and backward == "sparse":
            eps = auto_filter_eps(E.dtype, options.get("label_smoothing", 0.0), vocabulary=V, block_v=block_v)
        sort = backward == "sparse" if _is_auto(sort_vocab) else sort_vocab
        return resolve_options(E.dtype, filter_eps=eps, vocabulary=V, sort_vocab=sort, **options)

    dense = resolved("gemm")  # every option checked here
    check_bias_gradient(backward_impl, wants_db)
    reason = why_unavailable(E.device, E.dtype, dense.softcap)
    if reason:
        raise RuntimeError(f"helpers.linear_cross_entropy cannot run here: {reason}")
    if backward_impl in ("gemm", "atomic"):
        return CCEPlan(dense, configs, backward_impl, return_lse, need), None, None
    sparse = resolved("sparse")
    cannot = why_sparse_cannot_run(E, C, sparse, configs)
    fallback = replace(dense, sort_vocab=False)
    if backward_impl == "sparse":
        return CCEPlan(sparse, configs, "sparse", return_lse, need, cannot, fallback), None, None
    if configs.host.logits_in_cublas_bytes > 0 and E.dtype != torch.float32:
        # The "sparse" backward's gathered products stay Triton's: on such a tier, FMAs (``helpers.cce.cublas_logits``).
        cannot = (f"the {configs.name} tier's Triton products are FMAs: the dense backward takes its logits from "
                  "cuBLAS, the sparse one's gathered products would stay FMAs")
    if not any(need) or cannot:
        why = "no gradient is wanted" if not any(need) else cannot
        return CCEPlan(dense, configs, "gemm", return_lse, need, auto=AutoChoice("gemm", why)), None, None
    return (CCEPlan(dense, configs, "auto", return_lse, need),
            CCEPlan(sparse, configs, "sparse", return_lse, need, None, fallback),
            problem_key(E, C, sparse, configs, return_lse))


def plan_for(E: torch.Tensor, C: torch.Tensor, options: CCEOptions, configs: CCEConfigs | str | None,
             backward_impl: str, *, return_lse: bool, need: tuple[bool, bool, bool]) -> CCEPlan:
    """The plan of a call of the host functions (``cce_backward``) with options already resolved
    (a number as eps serves "sparse" and its fallback alike)."""
    check_backward_impl(backward_impl)
    check_bias_gradient(backward_impl, need[2])
    configs = resolve_configs(configs, E.device)
    if backward_impl != "sparse":
        return CCEPlan(options, configs, backward_impl, return_lse, tuple(need))
    return CCEPlan(options, configs, backward_impl, return_lse, tuple(need), why_sparse_cannot_run(E, C, options, configs),
                   replace(options, sort_vocab=False))
