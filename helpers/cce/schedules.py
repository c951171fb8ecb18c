"""Schedules under a memory budget: which way of computing the loss and its gradients a call runs,
and the one place that predicts each schedule's memory and time.

Two schedules compute the same loss and gradients:

- "recompute" (the default design, ``memory_budget="min"``): the forward keeps each row's lse, and
  the backward rebuilds the logits per vocabulary chunk (``helpers.cce.backward``). Four N x V x D
  products (forward, G, G C, G^T E), two of them in our Triton kernels; memory near LB.
- "forward_grads" (``helpers.cce.forward_grads``): the gradients are made in the forward, as Liger
  and torch.compile make them, from the logits of R rows at a time held in memory (Z = E_r C^T + b,
  cuBLAS). Three products, all in cuBLAS; memory for the logit chunk and dC's fp32 accumulator.

LB = (N + V) D b: the gradients dE and dC themselves (those wanted). A budget counts the bytes a call
may hold above its inputs and LB. Predicted extra bytes, per schedule (b: the inputs' bytes per
element; b_z: the logits', b or 4 for fp16 logits that could overflow):

    recompute      = dE's fp32 accumulator (16-bit, n_chunk x D x 4) + its G buffer and staged dC
                     rows where ``gemm_plan`` needs them + 24 N (per-row state)
                     (+ the backward's piece of fp32 logits where cuBLAS makes them, at most
                     ``HostTuning.logits_in_cublas_bytes``: ``helpers.cce.cublas_logits``)
    forward_grads  = R V b_z                               (one chunk: R = N; fp32 inputs; or
                                                            16-bit dC accumulated in itself)
                   = 4 V D + max(R V b_z - V D b, 0)       (16-bit, several chunks, dC's fp32
                     accumulator, and the chunk's logits beyond the room dC takes only at the end)
                   + 4 V (db's fp32 accumulator) + 16 N (per-row state)
    forward_grads, fp16 inputs: dE and dC held in fp32 until the backward (the loss scale of fp16
                     training reaches them there; rounded to fp16 before it, small gradients were lost:
                     ``helpers.cce.forward_grads``), each rounded to fp16 in turn:
                   = max(2 (N + V) D + R V b_z, 4 N D + 2 V D, 4 V D) + 4 V + 16 N, as above

dC's accumulator over several bf16 chunks is fp32 (4 V D bytes), or dC itself, in its dtype,
rounded once per chunk, for at most ``HostTuning.dC_in_dtype_chunks`` chunks (the error that costs:
``HostTuning``): the faster of the two that fit. In its own dtype it leaves the budget to larger
chunks and moves b / 4 of the bytes per chunk, so it is the faster wherever it fits: at the Qwen3
head (N 16,384) 1 GiB gives 5 chunks against fp32's 13; at the Gemma-2-2B head the fp32
accumulator alone is 2.36 GB, so 1 GiB runs there only this way (4 chunks of 2,048 rows).

The time model (constants per tier: ``HostTuning``): FLOP at the tier's matmul rate (Triton kernels
at ``triton_share`` of it, or of its fp32 rate on a tier whose Triton has no tensor-core products: a T4),
plus the bytes each schedule moves beyond its products' operands at the memory's bandwidth, plus host
time per launch:

    recompute      = 2 P / (share rate) + (n_E + n_C) P / rate + 3 N V b / bw      (G written, read twice)
                     where cuBLAS makes the logits: 2 P / rate, and 16 N V / bw more (fp32 logits written
                     and read, forward and backward)
    forward_grads  = (1 + n_E + n_C) P / rate + 6 N V b_z / bw                      (Z written; read
                     twice, written once by the row kernel; read by two products)
                     + chunks x 2 x a V D / bw                                      (dC's accumulator,
                                                                                      a = 4 or b)

with P = 2 N V D FLOP per product and n_E, n_C = 1 for each gradient wanted. A call runs the
fastest schedule whose predicted extra fits its budget (``choose_schedule``). A budget below the
recompute plan's own need and every forward_grads chunk's runs the recompute design with fewer rows
per dE accumulator (``recompute_rows``): less memory, more and smaller products, slower than the
time model says (it counts launches, not the narrow products: 60 ms measured at 16k tokens and 8,192
rows against 40 predicted).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton

from helpers.cce.backward.gemm import gemm_chunks, gemm_plan
from helpers.cce.cublas_logits import chunk_columns
from helpers.cce.kernels.configs import CCEConfigs

SCHEDULES = ("recompute", "forward_grads")
# "auto": this share of the memory free on the device (the driver's free memory plus what torch's
# allocator holds unused, within a pretend card's memory) once dE and dC are counted. Half: the
# schedule's extra memory is held only during the loss's forward, while the model's activations
# are resident, and half of what is free then leaves the rest for fragmentation and for the step's
# other transients. On the CPU "auto" is "min".
AUTO_SHARE = 0.5
# Per-row state of each schedule, bytes (fp32 lse, loss, coefficients, masks).
RECOMPUTE_ROW_BYTES = 24
FORWARD_GRADS_ROW_BYTES = 16


class MemoryBudgetError(RuntimeError):
    """No schedule fits the memory budget: the message gives the budget and each schedule's need."""


def check_memory_budget(memory_budget) -> str | int:
    """``memory_budget`` as "default", "min", "auto" or a whole number of bytes; a ``ValueError`` naming it
    otherwise."""
    if isinstance(memory_budget, str) and memory_budget in ("default", "min", "auto"):
        return memory_budget
    if (isinstance(memory_budget, (int, float)) and not isinstance(memory_budget, bool)
            and math.isfinite(memory_budget) and memory_budget >= 0):
        return int(memory_budget)
    raise ValueError(f"memory_budget must be 'default', 'min', 'auto' or a number of bytes >= 0 (extra memory "
                     f"beyond the inputs, dE and dC), got {memory_budget!r}")


def resolve_memory_budget(memory_budget, configs: CCEConfigs, device: torch.device) -> str | int:
    """``memory_budget`` checked, with "default" replaced by what it means for this tier on this device: the
    tier's ``HostTuning.default_budget`` on a GPU ("min", or a number of bytes on a tier whose Triton has no
    tensor-core products, where our Triton products are the slow ones), "min" on the CPU."""
    memory_budget = check_memory_budget(memory_budget)
    if memory_budget != "default":
        return memory_budget
    return configs.host.default_budget if device.type == "cuda" else "min"


def lower_bound_bytes(N: int, V: int, D: int, itemsize: int, need: tuple[bool, bool, bool] = (True, True, False)) -> int:
    """LB: the bytes of the gradients a call returns, dE (N, D) and dC (V, D) where wanted."""
    return (need[0] * N + need[1] * V) * D * itemsize


def recompute_extra_bytes(N: int, V: int, D: int, itemsize: int, configs: CCEConfigs, *, upcast: bool = False,
                          need: tuple[bool, bool, bool] = (True, True, False)) -> int:
    """The "recompute" schedule's predicted bytes above its inputs and LB (its "gemm" backward's plan;
    the "sparse" and "atomic" backwards hold about as much). ``upcast``: the products copy 16-bit
    operands to fp32 (the CPU's ``product_mode``): those copies, and dC's staged rows, count too.
    A call whose forward makes dE holds ``helpers.cce.forward_de.forward_de_extra_bytes`` instead."""
    dtype = torch.float32 if itemsize == 4 else torch.float16
    g_cfg = configs.backward_gemm_for(dtype)
    plan = gemm_plan(N, V, D, dtype, g_cfg.BLOCK_V, host=configs.host, need_dE=need[0], need_dC=need[1],
                     tensor_cores=g_cfg.tensor_cores)
    n_chunk, widest = plan.n_chunk, plan.widest
    staged = min(plan.v_chunk, widest)  # dC's rows staged in fp32, a piece of a chunk at a time
    low = itemsize < 4
    scratch = plan.buffer_elements * itemsize + low * need[0] * n_chunk * D * 4
    if low and need[1] and (N > n_chunk or upcast):
        scratch += staged * D * 4
    if low and upcast:  # the larger of the two products' fp32 operand copies
        scratch += max(n_chunk * widest + widest * D, n_chunk * staged + n_chunk * D) * 4
    if low and configs.host.logits_in_cublas_bytes > 0:  # cuBLAS's fp32 logits (``helpers.cce.cublas_logits``)
        # The backward's piece of a G chunk's logits, (n_chunk, columns) fp32.
        scratch += n_chunk * min(chunk_columns(n_chunk, widest, D, dtype, g_cfg.BLOCK_V, configs.host), widest) * 4
    extra = scratch + RECOMPUTE_ROW_BYTES * N + need[2] * 4 * V
    if low and configs.host.logits_in_cublas_bytes > 0:
        # The forward's chunk, held before dE and dC exist (its splits merged as they come): the peak only where
        # it passes them.
        cols = chunk_columns(N, V, D, dtype, configs.for_dtype(dtype)[0].BLOCK_V, configs.host)
        forward = min(cols, V) * N * 4 + RECOMPUTE_ROW_BYTES * N
        extra = max(extra, forward - lower_bound_bytes(N, V, D, itemsize, need))
    return extra


def forward_grads_extra_bytes(N: int, V: int, D: int, itemsize: int, rows: int, logits_itemsize: int, *,
                              need: tuple[bool, bool, bool] = (True, True, False), fp32_dC: bool = True,
                              fp16: bool = False) -> int:
    """The "forward_grads" schedule's predicted bytes above its inputs and LB, with chunks of ``rows``
    rows and logits of ``logits_itemsize`` bytes; ``fp32_dC``: 16-bit dC accumulated in fp32 over
    several chunks (else in itself); ``fp16``: fp16 inputs, whose gradients are held in fp32 until the
    backward (module doc)."""
    rows = min(rows, N)
    chunk = rows * V * logits_itemsize
    if fp16:  # dE and dC in fp32 through the forward; in the backward each is rounded to fp16 in turn
        E2, C2 = need[0] * 2 * N * D, need[1] * 2 * V * D
        extra = max(E2 + C2 + chunk, 2 * E2 + C2, 2 * C2)
    elif need[1] and itemsize < 4 and rows < N and fp32_dC:  # dC's fp32 accumulator; dC itself only at the end
        extra = 4 * V * D + max(chunk - V * D * itemsize, 0)
    else:
        extra = chunk
    return extra + FORWARD_GRADS_ROW_BYTES * N + need[2] * (4 * V + rows * itemsize)


def forward_grads_rows(N: int, V: int, D: int, itemsize: int, logits_itemsize: int, budget: int,
                       configs: CCEConfigs, need: tuple[bool, bool, bool] = (True, True, False),
                       fp32_dC: bool = True, fp16: bool = False) -> int:
    """The most rows a "forward_grads" chunk may take within ``budget`` extra bytes: N when all the
    rows fit, else a multiple of ``host.row_multiple``; 0 when not even one such chunk fits.
    ``host.forward_grads_rows`` instead, when set and it fits. ``fp32_dC``, ``fp16``: as
    ``forward_grads_extra_bytes``."""

    def extra(rows):
        return forward_grads_extra_bytes(N, V, D, itemsize, rows, logits_itemsize, need=need, fp32_dC=fp32_dC,
                                         fp16=fp16)

    fixed = configs.host.forward_grads_rows
    if fixed:
        fixed = min(fixed, N)
        return fixed if extra(fixed) <= budget else 0
    if extra(N) <= budget:
        return N
    step = configs.host.row_multiple
    best, low, high = 0, 1, triton.cdiv(N, step) - 1  # chunks of step .. N - 1 rows, in steps
    while low <= high:
        middle = (low + high) // 2
        if extra(middle * step) <= budget:
            best, low = middle * step, middle + 1
        else:
            high = middle - 1
    return best


def _rate(itemsize: int, configs: CCEConfigs) -> float:
    return 1e12 * configs.matmul_tflops(_DTYPE_OF[itemsize])


def _logit_rate(itemsize: int, configs: CCEConfigs) -> float:
    """The recompute design's logit products' rate (``CCEConfigs.logit_tflops``), FLOP/s."""
    return 1e12 * configs.logit_tflops(_DTYPE_OF[itemsize])


_DTYPE_OF = {2: torch.float16, 4: torch.float32}  # the rates go by the inputs' bytes


def recompute_seconds(N: int, V: int, D: int, itemsize: int, configs: CCEConfigs,
                      need: tuple[bool, bool, bool] = (True, True, False)) -> float:
    """The "recompute" schedule's predicted time (module doc), seconds."""
    host, rate = configs.host, _rate(itemsize, configs)
    P = 2.0 * N * V * D
    dtype = torch.float32 if itemsize == 4 else torch.float16
    g_cfg = configs.backward_gemm_for(dtype)
    plan = gemm_plan(N, V, D, dtype, g_cfg.BLOCK_V, host=host, tensor_cores=g_cfg.tensor_cores)
    launches = 3 * sum(len(chunks) for _, _, chunks in plan.row_chunks)
    moved = 3 * N * V * itemsize  # G written once, read by its two products
    if host.logits_in_cublas_bytes > 0 and itemsize < 4:  # ``helpers.cce.cublas_logits``
        moved += 4 * N * V * 4  # fp32 logits written by cuBLAS and read by a kernel, in the forward and the backward
        forward_chunks = triton.cdiv(V, chunk_columns(N, V, D, dtype, configs.for_dtype(dtype)[0].BLOCK_V, host))
        pieces = sum(triton.cdiv(v1 - v0, chunk_columns(plan.n_chunk, plan.widest, D, dtype, g_cfg.BLOCK_V, host))
                     for _, _, chunks in plan.row_chunks for v0, v1, _ in chunks)
        launches += 4 * forward_chunks + 2 * pieces  # a product, the kernel (and the forward's merges)
    return (2 * P / _logit_rate(itemsize, configs) + (need[0] + need[1]) * P / rate
            + moved / (host.bandwidth_gbs * 1e9) + launches * host.launch_us * 1e-6)


def forward_grads_seconds(N: int, V: int, D: int, itemsize: int, rows: int, logits_itemsize: int,
                          configs: CCEConfigs, need: tuple[bool, bool, bool] = (True, True, False),
                          fp32_dC: bool = True, fp16: bool = False) -> float:
    """The "forward_grads" schedule's predicted time with chunks of ``rows`` rows (module doc), seconds."""
    host, rate = configs.host, _rate(itemsize, configs)
    chunks = triton.cdiv(N, rows)
    accumulator = need[1] * (chunks > 1 or fp16) * 2 * (4 if fp32_dC or fp16 else itemsize) * V * D * chunks
    held = fp16 * 6 * (need[0] * N + need[1] * V) * D  # fp16: the fp32 gradients read, their fp16 written
    return ((1 + need[0] + need[1]) * 2.0 * N * V * D / rate
            + (6 * N * V * logits_itemsize + accumulator + held) / (host.bandwidth_gbs * 1e9)
            + 5 * chunks * host.launch_us * 1e-6)


@dataclass(frozen=True)
class Schedule:
    """The schedule a call runs, with what was predicted and why it was chosen (``stats``)."""

    name: str  # "recompute" or "forward_grads"
    budget_bytes: int | None  # the budget in bytes (None: "min")
    predicted_extra_bytes: int  # above the inputs and LB: what the budget bounds
    predicted_peak_bytes: int  # above the inputs: LB + the extra (what the benchmark measures)
    predicted_ms: float
    why: str
    rows: int | None = None  # "forward_grads": rows per chunk
    logits_dtype: torch.dtype | None = None  # "forward_grads": the dtype its logit chunks are held in
    # "forward_grads": dC accumulated over several chunks in fp32 (True) or in its own dtype (False).
    fp32_dC: bool = True
    # "recompute" under a budget below its default plan's need: (rows per dE accumulator, columns per
    # G chunk) for ``HostTuning.gemm_chunks`` (``recompute_rows``); None: the default plan.
    gemm_chunks: tuple[int, int] | None = None
    # "recompute": whether its G buffer (``HostTuning.g_buffer_lb_share``, few tokens) is kept; a budget
    # below the default plan's need drops it first.
    g_buffer: bool = True

    def tuning(self) -> dict:
        """The ``HostTuning`` knobs the call runs with (``CCEConfigs.tuned``): none for a default plan."""
        return ({} if self.gemm_chunks is None else {"gemm_chunks": self.gemm_chunks}) | (
            {} if self.g_buffer else {"g_buffer_lb_share": 0.0})

    def as_stats(self) -> dict:
        return {"schedule": self.name, "budget_bytes": self.budget_bytes,
                "predicted_extra_bytes": self.predicted_extra_bytes,
                "predicted_peak_bytes": self.predicted_peak_bytes, "predicted_ms": self.predicted_ms,
                "why": self.why, "rows": self.rows,
                "logits_dtype": str(self.logits_dtype).removeprefix("torch.") if self.logits_dtype else None,
                "dC_accumulator": None if self.name != "forward_grads" else "fp32" if self.fp32_dC else "dtype",
                "gemm_chunks": list(self.gemm_chunks) if self.gemm_chunks else None, "g_buffer": self.g_buffer}


def auto_budget_bytes(device: torch.device, lb: int) -> int | None:
    """What ``memory_budget="auto"`` means on ``device``: ``AUTO_SHARE`` of the memory free there
    beyond LB (None on the CPU: "min"). Free: what the driver and the allocator's cache hold, within a
    pretend card's memory and the allocator's per-process cap."""
    if device.type != "cuda":
        return None
    from helpers.cce.device import device_info

    free, card = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    free += torch.cuda.memory_reserved(device) - allocated  # the allocator's cached, unused blocks
    total = device_info(device).total_memory_bytes  # a pretend card's
    if total is not None:
        free = min(free, total - allocated)
    # A cap on this process's allocator (``torch.cuda.set_per_process_memory_fraction``, as a notebook
    # sets a 16 GB card's wall on a bigger GPU): past it an allocation fails whatever the driver has free.
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    free = min(free, int(fraction * card) - allocated)
    return max(0, int(AUTO_SHARE * (free - lb)))


def _least_forward_grads_bytes(N: int, V: int, D: int, itemsize: int, logits_itemsize: int, configs: CCEConfigs,
                               need: tuple[bool, bool, bool], fp16: bool) -> int:
    """The least extra memory "forward_grads" runs in: chunks of ``host.row_multiple`` rows with dC's
    fp32 accumulator, or (bf16) dC accumulated in itself over at most ``host.dC_in_dtype_chunks`` chunks."""
    host = configs.host
    least = forward_grads_extra_bytes(N, V, D, itemsize, min(N, host.row_multiple), logits_itemsize, need=need,
                                      fp16=fp16)
    if need[1] and itemsize < 4 and host.dC_in_dtype_chunks and not fp16:
        rows = min(N, host.row_multiple * triton.cdiv(triton.cdiv(N, host.dC_in_dtype_chunks), host.row_multiple))
        least = min(least, forward_grads_extra_bytes(N, V, D, itemsize, rows, logits_itemsize, need=need,
                                                     fp32_dC=False))
    return least


def recompute_rows(N: int, V: int, D: int, dtype: torch.dtype, configs: CCEConfigs, budget: int, *, upcast: bool,
                   need: tuple[bool, bool, bool]) -> tuple[tuple[int, int], int] | None:
    """The recompute schedule with fewer rows per dE accumulator than its default plan, where the
    default's extra memory passes ``budget``: ((rows, columns), extra bytes) for the most rows, down
    to 1/16 of the default's, that fit (multiples of 256 from 512 rows), or None; ``configs`` as the
    caller tuned them (``choose_schedule``: without the G buffer). Fewer rows shrink
    dE's fp32 accumulator but narrow the later row chunks' G chunks to the room in dE's rows not yet
    written, and fold dC once more per row chunk: on an H200 at the Qwen3 head (16k tokens) 8,192
    rows took 1.12 LB and 60 ms against 1.20 LB and 37 ms, 4,096 rows 1.07 LB and 103 ms
    (docs/PERFORMANCE.md). The last schedule a tight budget gets, not a fast one."""
    for chunks in _fewer_rows(N, V, D, dtype, configs):
        extra = recompute_extra_bytes(N, V, D, dtype.itemsize, configs.tuned(gemm_chunks=chunks), upcast=upcast,
                                      need=need)
        if extra <= budget:
            return chunks, extra
    return None


def _fewer_rows(N: int, V: int, D: int, dtype: torch.dtype, configs: CCEConfigs) -> list[tuple[int, int]]:
    """``recompute_rows``' candidates, most rows first: (rows, columns) with the default plan's rows
    divided by 2 to 16 (multiples of 256 from 512 rows), its columns kept."""
    n_default, v_chunk = configs.host.gemm_chunks or gemm_chunks(N, V, D, dtype, configs.backward_gemm_for(dtype).BLOCK_V)
    n_default = min(N, n_default)
    step = 256 if n_default >= 512 else 1
    rows = sorted({max(step, n_default // k // step * step) for k in range(2, 17)} - {n_default}, reverse=True)
    return [(r, v_chunk) for r in rows if r < n_default]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} B"


def choose_schedule(N: int, V: int, D: int, dtype: torch.dtype, memory_budget, configs: CCEConfigs, *,
                    need: tuple[bool, bool, bool], device: torch.device = torch.device("cpu"),
                    not_forward_grads: str | None = None, logits_itemsize: int | None = None,
                    ask_free: bool = True, forward_de_extra: int | None = None) -> Schedule:
    """The fastest schedule whose predicted extra memory fits ``memory_budget`` (``resolve_memory_budget``).
    ``not_forward_grads``: why "forward_grads" cannot run for this call (None: it can); ``logits_itemsize``:
    its logits' bytes (None: the inputs'); ``forward_de_extra``: the default recompute plan's extra bytes where
    its forward makes dE (``helpers.cce.forward_de.forward_de_extra_bytes``; a plan tuned to a tight budget
    does not make it). Raises ``MemoryBudgetError`` when a number of bytes the caller gave fits no schedule;
    a tier's default budget that fits none runs "min". ``ask_free``: a raised default (``_raised_default``)
    is bounded by what ``device`` has free; False for a prediction of a card other than this process's
    (``helpers.compare``'s formulas), which leaves that bound out."""
    budget = resolve_memory_budget(memory_budget, configs, device)
    choose = functools.partial(_choose_schedule, N, V, D, dtype, configs=configs, need=need, device=device,
                               not_forward_grads=not_forward_grads, logits_itemsize=logits_itemsize,
                               forward_de_extra=forward_de_extra)
    if memory_budget != "default" or budget == "min":
        return choose(budget)
    said = f"the {configs.name} tier's default budget, {_mib(budget)}"
    try:
        schedule = choose(budget)
    except MemoryBudgetError:
        schedule = choose("min")
        return replace(schedule, why=f"{said} fits no schedule: {schedule.why}")
    raised = None if schedule.name != "recompute" else _raised_default(
        N, V, D, dtype, budget, configs, need, device, not_forward_grads, logits_itemsize, ask_free)
    if raised is not None:
        room, least = raised
        bigger = choose(room)
        if bigger.name == "forward_grads":
            return replace(bigger, why=f"{said}, raised to {_mib(room)} (forward_grads' least need here, "
                                       f"{_mib(least)}, plus the default; at most {_mib(configs.host.default_budget_max)} "
                                       f"and {AUTO_SHARE:.0%} of what is free): {bigger.why}")
    return replace(schedule, why=f"{said}: {schedule.why}")


def _raised_default(N: int, V: int, D: int, dtype: torch.dtype, budget: int, configs: CCEConfigs,
                    need: tuple[bool, bool, bool], device: torch.device, not_forward_grads: str | None,
                    logits_itemsize: int | None, ask_free: bool = True) -> tuple[int, int] | None:
    """(room, least): where the tier's numeric default ``budget`` is below "forward_grads"' least need
    (``least``), the default raised to least + budget, at most ``HostTuning.default_budget_max`` and
    ``auto_budget_bytes`` (what is free; not asked unless ``ask_free``); None where it is not raised (no
    ceiling, forward_grads cannot run or already fits, or it would not fit the room)."""
    ceiling = configs.host.default_budget_max
    if not ceiling or not_forward_grads is not None:
        return None
    b = dtype.itemsize
    least = _least_forward_grads_bytes(N, V, D, b, logits_itemsize or b, configs, need, dtype == torch.float16)
    if least <= budget:
        return None
    room = min(ceiling, least + budget)
    free = auto_budget_bytes(device, lower_bound_bytes(N, V, D, b, need)) if ask_free else None
    room = room if free is None else min(room, free)
    return (room, least) if room >= least else None


def _choose_schedule(N: int, V: int, D: int, dtype: torch.dtype, memory_budget, *, configs: CCEConfigs,
                     need: tuple[bool, bool, bool], device: torch.device, not_forward_grads: str | None,
                     logits_itemsize: int | None, forward_de_extra: int | None = None) -> Schedule:
    b = dtype.itemsize
    upcast = device.type != "cuda" and b < 4
    lb = lower_bound_bytes(N, V, D, b, need)
    recompute = (recompute_extra_bytes(N, V, D, b, configs, upcast=upcast, need=need)
                 if forward_de_extra is None else forward_de_extra,
                 1e3 * recompute_seconds(N, V, D, b, configs, need))

    def recompute_schedule(budget, why):
        return Schedule("recompute", budget, recompute[0], lb + recompute[0], recompute[1], why)

    if memory_budget == "min":
        return recompute_schedule(None, "memory_budget='min': the recompute design, its default plan")
    budget = memory_budget if memory_budget != "auto" else auto_budget_bytes(device, lb)
    if budget is None:
        return recompute_schedule(None, "memory_budget='auto' on the CPU means 'min'")
    fits_recompute = recompute[0] <= budget
    bare = configs.tuned(g_buffer_lb_share=0.0)  # recompute without its G buffer: a tight budget's first step

    def fewer_rows(why_not_forward_grads):
        """Recompute without its G buffer, then with fewer rows per dE accumulator, where one fits."""
        if fits_recompute:
            return None
        extra = recompute_extra_bytes(N, V, D, b, bare, upcast=upcast, need=need)
        if extra <= budget:
            return Schedule("recompute", budget, extra, lb + extra, 1e3 * recompute_seconds(N, V, D, b, bare, need),
                            f"recompute without its G buffer fits {_mib(budget)} ({_mib(extra)}; its default plan "
                            f"needs {_mib(recompute[0])}, and {why_not_forward_grads}): more, narrower G chunks",
                            g_buffer=False)
        found = recompute_rows(N, V, D, dtype, bare, budget, upcast=upcast, need=need)
        if found is None:
            return None
        chunks, extra = found
        ms = 1e3 * recompute_seconds(N, V, D, b, bare.tuned(gemm_chunks=chunks), need)
        return Schedule("recompute", budget, extra, lb + extra, ms,
                        f"recompute with {chunks[0]:,} rows per dE accumulator fits {_mib(budget)} ({_mib(extra)}; "
                        f"its default plan needs {_mib(recompute[0])}, and {why_not_forward_grads}): less memory "
                        "for more launches and smaller products", gemm_chunks=chunks, g_buffer=False)

    if not_forward_grads:
        tight = fewer_rows(f"forward_grads cannot run: {not_forward_grads}")
        if tight is not None:
            return tight
        if not fits_recompute and memory_budget != "auto":
            raise MemoryBudgetError(
                f"memory_budget {_mib(budget)}: the recompute schedule needs {_mib(recompute[0])} beyond the inputs, "
                f"dE and dC, and the forward_grads schedule cannot run here ({not_forward_grads})")
        return recompute_schedule(budget, f"forward_grads cannot run: {not_forward_grads}")
    bz = logits_itemsize or b
    # Its chunks' rows with dC's fp32 accumulator, and with dC accumulated in itself (16-bit, several
    # chunks, at most ``dC_in_dtype_chunks``): the faster of the two that fit.
    # fp16: the gradients held in fp32 until the backward, dC's accumulator fp32 (``forward_grads``).
    candidates, fp16 = [], dtype == torch.float16
    rows = forward_grads_rows(N, V, D, b, bz, budget, configs, need, fp16=fp16)
    if rows:
        candidates.append((forward_grads_seconds(N, V, D, b, rows, bz, configs, need, fp16=fp16), rows, True))
    if need[1] and b < 4 and rows < N and not fp16:
        in_dtype = forward_grads_rows(N, V, D, b, bz, budget, configs, need, fp32_dC=False)
        if in_dtype and triton.cdiv(N, in_dtype) <= configs.host.dC_in_dtype_chunks:
            candidates.append((forward_grads_seconds(N, V, D, b, in_dtype, bz, configs, need, fp32_dC=False),
                               in_dtype, False))
    if candidates:
        seconds, rows, fp32_dC = min(candidates, key=lambda c: c[0])  # a tie keeps fp32's
        extra = forward_grads_extra_bytes(N, V, D, b, rows, bz, need=need, fp32_dC=fp32_dC, fp16=fp16)
        ms = 1e3 * seconds
        chunks = triton.cdiv(N, rows)
        if not fits_recompute or ms < recompute[1]:
            accumulator = "" if chunks == 1 or fp32_dC or b == 4 else f", dC accumulated in {str(dtype)[6:]}"
            why = (f"forward_grads, {chunks} chunk(s) of {rows:,} rows{accumulator}, fits {_mib(budget)} "
                   f"({_mib(extra)}) and is predicted {ms:.2f} ms against recompute's {recompute[1]:.2f} ms")
            if not fits_recompute:
                why = (f"only forward_grads fits {_mib(budget)} ({_mib(extra)}{accumulator}; recompute needs "
                       f"{_mib(recompute[0])})")
            return Schedule("forward_grads", budget, extra, lb + extra, ms, why, rows,
                            torch.float32 if bz == 4 else dtype, fp32_dC)
        return recompute_schedule(budget, f"recompute predicted faster ({recompute[1]:.2f} ms) than forward_grads "
                                          f"in {chunks} chunk(s) of {rows:,} rows ({ms:.2f} ms)")
    least = _least_forward_grads_bytes(N, V, D, b, bz, configs, need, fp16)
    if fits_recompute:
        return recompute_schedule(budget, f"forward_grads needs at least {_mib(least)}, more than the budget "
                                          f"{_mib(budget)}")
    tight = fewer_rows(f"forward_grads at least {_mib(least)}")
    if tight is not None:
        return tight
    if memory_budget == "auto":  # too little free: the least memory, and the allocator decides
        return recompute_schedule(budget, f"memory_budget='auto' ({_mib(budget)} free to take) fits no schedule: "
                                          "the least memory")
    fewest = _fewer_rows(N, V, D, dtype, bare)[-1:]
    least_recompute = recompute_extra_bytes(N, V, D, b, bare.tuned(gemm_chunks=fewest[0]) if fewest else bare,
                                            upcast=upcast, need=need)
    raise MemoryBudgetError(
        f"memory_budget {_mib(budget)} fits no schedule at N={N:,}, V={V:,}, D={D:,} ({str(dtype)[6:]}): recompute "
        f"needs {_mib(recompute[0])} ({_mib(least_recompute)} with its fewest rows per dE accumulator) and "
        f"forward_grads at least {_mib(least)} beyond the inputs, dE and dC ({_mib(lb)}); give a larger budget or 'min'")
