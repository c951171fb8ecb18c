"""The backward pass, Algorithms 3 and 4: dE and dC from the logits rebuilt tile by tile.

For a kept row i the gradient of its loss with respect to a logit is

    G_{i, v} = S_{i, v} (1 + 2 zl lse_i) - (1 - ls) [v = x_i] - ls / V,   S = softmax(z),

times d cap(a) / da = 1 - tanh^2(a / softcap) under the soft cap (a the pre-cap logit); dE = g G C and dC = G^T (g E), g the
upstream gradient of each row. Three implementations compute it, chosen by ``backward_impl``:
"gemm" (``helpers.cce.backward.gemm``), "atomic" (``helpers.cce.backward.atomic``) and "sparse"
(``helpers.cce.backward.sparse``: only the (row, tile) pairs the forward's activity bits mark, "gemm"
when they mark too many); ``linear_cross_entropy``'s default "auto" picks "sparse" or "gemm" per call
before the forward (``helpers.cce.auto``). All form G in the same code (``gradient_tile``), filter
it by the same rule (a row's |G| mass in a tile below eps: "gemm" and "atomic" drop a tile when every
row of their row block is below, "sparse" each row on its own) and accumulate in fp32.
"""

from __future__ import annotations

import torch

from helpers.cce.activity import Activity
from helpers.cce.auto import RECORD
from helpers.cce.backward.atomic import backward_atomic
from helpers.cce.backward.gemm import backward_gemm
from helpers.cce.backward.rows import RowGradient
from helpers.cce.backward.sparse import backward_sparse, sparse_plan
from helpers.cce.kernels.configs import CCEConfigs
from helpers.cce.options import CCEOptions, CCEPlan, plan_for
from helpers.cce.shared import vocabulary_order


def cce_backward(
    E: torch.Tensor,
    C: torch.Tensor,
    x: torch.Tensor,
    lse: torch.Tensor,
    r: torch.Tensor,
    grad_rows: torch.Tensor,
    options: CCEOptions = CCEOptions(),
    configs: CCEConfigs | str | None = None,
    n_chunk: int | None = None,
    v_chunk: int | None = None,
    stats: dict | None = None,
    backward_impl: str = "gemm",
    *,
    grad_lse: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    need: tuple[bool, bool, bool] = (True, True, False),
    activity: Activity | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dE (N, D), dC (V, D), db (V,)) in the inputs' dtypes; None for a gradient that ``need``
    (dE, dC, db) does not ask for, which is then not computed.

    lse: (N,) fp32, ``cce_forward``'s lse; r: (2N,) fp32, its rows for the backward (1 - p(target) and
    the lse's rounding).
    grad_rows: (N,) fp32, the upstream gradient of each row's loss (0 at ignored rows is implied).
    grad_lse: (N,) fp32 or None, the gradient flowing into the returned lse (``return_lse``).
    bias: the head's bias (V,), or None. backward_impl: "gemm", "atomic" or "sparse" (module doc;
    not "auto", which chooses before the forward); "atomic" computes no db. activity: the forward's
    activity bits (``cce_forward(..., emit_activity=True)``), which "sparse" needs (without them it
    runs "gemm", unsorted, at the same eps; it fixes them up in place: call it with bits it may
    change). ``stats["backward"]`` names the backward that ran. "sparse" fills ``stats`` with
    its own counts: "fallback" (None, or why "gemm" ran), "density" (marked share of the pairs),
    "pairs", "marked", "kept_pairs", "skipped_mass_max" / "_mean" (|G| mass a row lost, the quantity the rule bounds),
    "work_fraction" (tile products against "gemm"'s), "extra_bytes"; "tiles" and "skipped" count
    (row, tile) pairs there.
    configs: a ``CCEConfigs``, a tier's name, or None for the device's tier; its ``host`` knobs (chunk
    widths, budgets) are the ones the backward reads.
    n_chunk, v_chunk: "gemm": rows per dE accumulator, and the widest G chunk (None: chunks as wide
    as the unwritten rows of dE and dC allow, ``gemm_plan``); "atomic": rows of dE's and of dC's
    fp32 scratch (fp16/bf16 only). None: ``gemm_chunks`` or ``atomic_chunks``.
    stats: when a dict is given, the kernels count the tiles the filter skipped and the dict gets
    {"tiles": tiles computed, "skipped": tiles skipped, "launches": kernel launches}; "gemm" adds
    "products", how its fp32-output products were made (``product_mode``), "g_places", how many
    G chunks lived in dE's rows, dC's rows and the buffer, and "dead_chunks",
    the launches whose every tile the filter skipped (their GEMMs multiply zeros).
    """
    plan = plan_for(E, C, options, configs, backward_impl, return_lse=grad_lse is not None, need=need)
    return run_backward(E, C, x, lse, r, grad_rows, plan, n_chunk, v_chunk, stats, grad_lse=grad_lse, bias=bias,
                        activity=activity)


def no_target_at_ignored(x: torch.Tensor, ignore_index: int, V: int) -> torch.Tensor:
    """x as G's kernels read it: -1 (no target column) at ignored rows where ``ignore_index`` is a class
    id in [0, V) (torch allows ``ignore_index=0``), else x itself. The forward's lse and non-target mass
    treat an ignored row as having no target; G must too, or a gradient into the returned lse at that
    row loses column ``ignore_index``'s S (the row weights give it a = h and t = a - a r = 0 there).
    The kernels already match no column for -100 or any target outside [0, V)."""
    if 0 <= ignore_index < V:
        return torch.where(x == ignore_index, -1, x)
    return x


def run_backward(E, C, x, lse, r, grad_rows, plan: CCEPlan, n_chunk: int | None = None, v_chunk: int | None = None,
                 stats: dict | None = None, *, grad_lse=None, bias=None, activity: Activity | None = None,
                 divisor=None, out=None):
    """``cce_backward`` by a resolved ``CCEPlan`` (``helpers.cce.options``): the dispatch to the
    plan's backward, the "sparse" backward's hand-over to "gemm" (``stats["fallback"]`` says why),
    and what "auto"'s record learns from it (``helpers.cce.auto``). ``stats["backward"]``: the
    backward that ran; ``stats["auto"]``: why "auto" chose as it did. ``grad_rows`` and ``divisor``:
    ``RowGradient.of``'s (grad_rows None: no gradient into the loss). ``out``: "gemm"'s (dE, dC) to write
    (``backward_gemm``); the other backwards refuse it."""
    if out is not None and plan.backward_impl != "gemm":
        raise ValueError(f'out is for the "gemm" backward, not {plan.backward_impl!r}')
    o, configs, need = plan.options, plan.configs, plan.need
    cw = plan.class_weight
    if cw is None:
        up = RowGradient.of(grad_rows, grad_lse, x, o.ignore_index, lse, r, o, divisor)
    else:
        if divisor is not None:
            raise ValueError("class weights reduce after the kernels: their rows take no divisor")
        up = RowGradient.of_class_weights(grad_rows, grad_lse, x, o.ignore_index, cw, o.label_smoothing, r)
    x = no_target_at_ignored(x, o.ignore_index, C.shape[0])
    if stats is not None and plan.auto is not None:
        stats["auto"] = plan.auto.why
    if plan.backward_impl == "sparse":
        if not any(need):
            return None, None, None
        reason, sparse = sparse_plan(E, C, x, lse, up, activity, o, configs, need, plan.sparse_reason)
        if plan.auto is not None:
            RECORD.observe(plan.auto, sparse["density"] if sparse else None, reason)
        if reason is None:
            grads = backward_sparse(E, C, x, lse, up, activity, o, configs, sparse, stats, bias, need)
            if stats is not None:
                stats["backward"] = "sparse"
            return grads
        # "gemm" as backward_impl="gemm" runs it (``CCEPlan.fallback``): its own eps, and unsorted (the
        # sort serves the filter, which in "gemm" saves no time; sorted, it would gather C's rows).
        grads = backward_gemm(E, C, x, lse, up, None, plan.fallback, configs.backward_gemm_for(E.dtype), n_chunk,
                              v_chunk, stats, bias, need, host=configs.host, class_weight=cw)
        if stats is not None:
            stats.update(backward="gemm", fallback=reason, density=sparse["density"] if sparse else None)
        return grads
    if stats is not None:
        stats["backward"] = plan.backward_impl
    order = vocabulary_order(E, C) if o.sort_vocab else None
    if plan.backward_impl == "gemm":
        return backward_gemm(E, C, x, lse, up, order, o, configs.backward_gemm_for(E.dtype), n_chunk, v_chunk,
                             stats, bias, need, host=configs.host, class_weight=cw, out=out)
    dE, dC = backward_atomic(E, C, x, lse, up, order, o, configs.for_dtype(E.dtype)[1], n_chunk, v_chunk, stats,
                             bias, need[:2], class_weight=cw)
    return dE, dC, None
