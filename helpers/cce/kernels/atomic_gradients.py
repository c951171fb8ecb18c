"""Algorithms 3 and 4 of the CCE paper: dE and dC from logit tiles recomputed on chip.

For a kept row i (target x_i), the loss of ``helpers.cce`` is

    loss_i = lse_i - (1 - ls) z_{i, x_i} - (ls / V) sum_v z_{i, v} + zl * lse_i^2

(ls = label smoothing, zl = z-loss weight), so with S = softmax(z) its gradient w.r.t. a logit is

    G_{i, v} = S_{i, v} (1 + 2 zl lse_i) - (1 - ls) [v = x_i] - ls / V,

times d cap(a) / da = 1 - (z / softcap)^2 under Gemma-2's soft cap (``gradient_tile.py`` forms it, with
per-row coefficients from the host). Then dE = G C and dC = G^T E (each scaled by the upstream
gradient of its row).

Each program owns one (BLOCK_N, BLOCK_V) tile: it rebuilds the logits (``logit_tile``), forms G,
and walks D in BLOCK_D steps adding G @ C_tile into dE's rows and G^T @ E_tile into dC's rows.
Several programs add into the same rows (every vocabulary block adds to the same dE rows), so
the adds are fp32 atomics into fp32 buffers: the host passes fp32 scratch for fp16/bf16 inputs
and casts once at the end, which keeps dE as accurate as a dense matmul (Apple's CCE adds dE in
bf16 across ~1000 vocabulary blocks and loses 18x in accuracy).

Gradient filter (paper section 4.2, made stricter): a tile's products are skipped when, in every
row, the tile's |G| entries SUM to less than eps. The paper skips when every entry is below eps;
on a flat softmax (a soft cap of 4 over V = 151,936: every entry ~1e-5, under bf16's 2^-12) that
skips every tile, and the dropped entries, each negligible, sum to the whole softmax: dE was off by
2.3e-2 on the H200. Bounding each tile's row mass keeps what a skip drops to eps per tile, and on a
peaked softmax (a trained model's: the tail's tiles hold ~1e-6 each) skips nearly as much. The mass
is taken before the soft cap's derivative (``gradient_tile.py``'s module doc). FULL_E (FULL_C)
computes dE (dC) for skipped tiles anyway, the paper's variants that keep one gradient exact.
Reference: autograd through ``helpers.spec.reference_loss``.
"""

import triton
import triton.language as tl

from helpers.cce.kernels.gradient_tile import gradient_tile, grouped_tile
from helpers.cce.kernels.logits import dot


@triton.jit
def accumulate_grads(
    G,  # (BLOCK_N, BLOCK_V) fp32, unscaled
    g_rel,  # (BLOCK_N,) fp32: the rows' upstream gradients divided by g_scale
    g_scale,  # fp32 scalar: max |g|
    E_ptr, C_ptr, dE_ptr, dC_ptr,
    rows, cols, dC_rows, row_mask, col_mask,
    D,
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_dEn, stride_dEd, stride_dCv, stride_dCd,
    BLOCK_D: tl.constexpr,
    DO_DE: tl.constexpr,
    DO_DC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    dtype = E_ptr.dtype.element_ty
    # The products run in the input dtype (tensor cores), as a dense matmul's backward does. The
    # upstream gradient is applied where it cannot underflow fp16: g = 1/N_kept would push
    # S ~ 1e-6 below fp16's smallest subnormal, so dE's G stays unscaled (rows scaled after the
    # product, exactly) and dC's G carries g relative to its maximum (g_scale applied after).
    G_dE = G.to(dtype)  # (BLOCK_N, BLOCK_V)
    G_dC = tl.trans(G * g_rel[:, None]).to(dtype)  # (BLOCK_V, BLOCK_N)
    dE_scale = (g_rel * g_scale)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs_d
        d_mask = d < D
        if DO_DE:
            c = tl.load(C_ptr + cols[:, None] * stride_Cv + d[None, :] * stride_Cd,
                        mask=col_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_V, BLOCK_D)
            # dE_tile = G_dE c, computed as (c^T G_dE^T)^T so that both operands of the product sit
            # in shared memory. Written as tl.dot(G_dE, c), Triton (3.6 and 3.9) keeps G_dE, the
            # cast of the logit tile's accumulator, in registers as the A operand of sm_90's wgmma
            # across this D loop, and ptxas (12.8 and 12.9) reuses those registers inside the loop
            # (for the scaled dE tile and dC's operand) without restoring them: on Hopper every D
            # block after the first multiplied c by stale values (relative error 1.0-1.4 at every
            # shape, fp16 and bf16; the interpreter has no registers and was right).
            # tests/cce/test_configs.py checks the sm_90 compile keeps no accumulator as operand.
            dE_tile = tl.trans(dot(tl.trans(c), tl.trans(G_dE), None, DOT_PRECISION))
            dE_tile = dE_tile * dE_scale  # (BLOCK_N, BLOCK_D)
            tl.atomic_add(dE_ptr + rows[:, None] * stride_dEn + d[None, :] * stride_dEd, dE_tile,
                          mask=row_mask[:, None] & d_mask[None, :], sem="relaxed")
        if DO_DC:
            e = tl.load(E_ptr + rows[:, None] * stride_En + d[None, :] * stride_Ed,
                        mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
            dC_tile = dot(G_dC, e, None, DOT_PRECISION) * g_scale  # (BLOCK_V, BLOCK_D)
            tl.atomic_add(dC_ptr + dC_rows[:, None] * stride_dCv + d[None, :] * stride_dCd, dC_tile,
                          mask=col_mask[:, None] & d_mask[None, :], sem="relaxed")


@triton.jit
def backward_atomic_kernel(
    # pointers
    E_ptr, C_ptr, x_ptr,  # E (N, D), C (V, D), x (N,) targets
    lse_ptr,  # (N,) fp32 from the forward pass
    coef_ptr,  # (3 or 4, stride_coef) fp32: each row's G coefficients a, t, c (and d: ENTROPY) (``gradient_tile``)
    bias_ptr,  # (V,) the head's bias (HAS_BIAS only)
    g_rel_ptr, g_scale_ptr,  # (N,) fp32 row weight w / g_scale; (1,) fp32 g_scale = max w
    vocab_order_ptr,  # (V,) int64: C's row at each sorted position (SORTED only)
    dE_ptr,  # (N, D) fp32 accumulator
    dC_ptr,  # fp32 accumulator: (v_count, D) chunk-local rows if DC_LOCAL, else (V, D)
    skip_count_ptr,  # (1,) int32: tiles the filter skipped (COUNT_SKIPS only)
    # sizes
    N, V, D,
    v_begin, v_count,  # this launch covers vocabulary positions [v_begin, v_begin + v_count)
    # strides
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x,
    stride_dEn, stride_dEd, stride_dCv, stride_dCd, stride_coef,
    # options
    softcap, eps,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NEED_DE: tl.constexpr,
    NEED_DC: tl.constexpr,
    FILTER: tl.constexpr,
    FULL_E: tl.constexpr,
    FULL_C: tl.constexpr,
    SORTED: tl.constexpr,
    DC_LOCAL: tl.constexpr,
    COUNT_SKIPS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    inv_temperature=1.0,  # 1 / temperature (``gradient_tile``)
    ENTROPY: tl.constexpr = False,  # coef has a fourth row: the entropy's term (``gradient_tile``)
    class_weight_ptr=None,  # (V,) fp32: the smoothing term's class weights (CLASS_WEIGHTS, ``gradient_tile``)
    CLASS_WEIGHTS: tl.constexpr = False,
):
    # 1. [Grouped order, Triton tutorial 03] GROUP_N row blocks in a row take turns over the
    # vocabulary blocks, so a C strip is reused from L2 by GROUP_N programs.
    pid_n, pid_v = grouped_tile(tl.program_id(0), N, v_count, BLOCK_N, BLOCK_V, GROUP_N)

    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    local_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = local_v < v_count
    if SORTED:
        # [Vocabulary sort, section 4.3] position -> C row, so tiles of large logits are dense.
        cols = tl.load(vocab_order_ptr + v_begin + local_v, mask=col_mask, other=0).to(tl.int64)
    else:
        cols = v_begin + local_v
    if DC_LOCAL:
        dC_rows = local_v
    else:
        dC_rows = cols

    # 2-3. The logit tile, recomputed on chip (Algorithm 3, line 3), and its gradient G.
    G, mass = gradient_tile(E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr, rows, cols, row_mask, col_mask,
                          V, D, stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef, softcap,
                          BLOCK_N, BLOCK_V, BLOCK_D, HAS_SOFTCAP, HAS_BIAS, DOT_PRECISION,
                          inv_temperature=inv_temperature, ENTROPY=ENTROPY, class_weight_ptr=class_weight_ptr,
                          CLASS_WEIGHTS=CLASS_WEIGHTS)

    g_rel = tl.load(g_rel_ptr + rows, mask=row_mask, other=0.0)
    g_scale = tl.load(g_scale_ptr)

    # 4. [Gradient filter, section 4.2] skip the products of a tile whose rows each hold less than
    # eps of |G| (sum, not max: see the module doc).
    if FILTER:
        if tl.max(mass) < eps:
            if COUNT_SKIPS:
                tl.atomic_add(skip_count_ptr, 1)
            if FULL_E and NEED_DE:
                accumulate_grads(G, g_rel, g_scale, E_ptr, C_ptr, dE_ptr, dC_ptr,
                                 rows, cols, dC_rows, row_mask, col_mask, D,
                                 stride_En, stride_Ed, stride_Cv, stride_Cd,
                                 stride_dEn, stride_dEd, stride_dCv, stride_dCd,
                                 BLOCK_D, True, False, DOT_PRECISION)
            if FULL_C and NEED_DC:
                accumulate_grads(G, g_rel, g_scale, E_ptr, C_ptr, dE_ptr, dC_ptr,
                                 rows, cols, dC_rows, row_mask, col_mask, D,
                                 stride_En, stride_Ed, stride_Cv, stride_Cd,
                                 stride_dEn, stride_dEd, stride_dCv, stride_dCd,
                                 BLOCK_D, False, True, DOT_PRECISION)
            return

    # 5. dE[rows] += G C[cols] and dC[cols] += G^T E[rows] (Algorithm 4), walking D.
    accumulate_grads(G, g_rel, g_scale, E_ptr, C_ptr, dE_ptr, dC_ptr,
                     rows, cols, dC_rows, row_mask, col_mask, D,
                     stride_En, stride_Ed, stride_Cv, stride_Cd,
                     stride_dEn, stride_dEd, stride_dCv, stride_dCd,
                     BLOCK_D, NEED_DE, NEED_DC, DOT_PRECISION)
