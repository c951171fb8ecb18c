"""The divergence between two heads' softmaxes, tile by tile: the kernels of ``helpers.cce.distill``.

A student head (E_s (N, D_s), C_s (V, D_s)) and a teacher head (E_t (N, D_t), C_t (V, D_t)) share the
vocabulary; each kernel rebuilds, for one (BLOCK_N, BLOCK_V) block of the vocabulary, both logit tiles
(``head_tile``, twice: two ``logit_tile`` products over different D) and keeps neither:

    s = cap(E_s C_s^T + b_s) / tau,   t = cap(E_t C_t^T + b_t) / tau,
    log q = (s - m_s) - l_s (the student's softmax),   log p = (t - m_t) - l_t (the teacher's),

each head's lse kept as its row's maximum m and log sum_v exp(z_v - m) = l, not rounded into one fp32
m + l: at a low temperature |s| ~ 1 / tau, and lse's rounding (ulp(m + l), ~4e-6 at 50) would shift
every log q of the row by as much, which G = q - p and the KLs' G turn into errors 2-12x the naive
path's (torch's log_softmax, which takes (s - m) - l, makes none).

``divergence_forward_kernel`` walks a vocabulary split per program, as ``lse_forward_kernel`` does.
First pass (every kind): both running (max, sum) pairs, the online softmax of each head, and for
the two KLs the running sum of c = (t - m_t) - (s - m_s), the logits' gap with each head centred on its
row maximum, weighted by one head's exp and rescaled with that head's sum; when the maxima move to m',
every c already summed moves by (m_s' - m_s) - (m_t' - m_t):

    A' = (A + S_w ((m_s' - m_s) - (m_t' - m_t))) exp(m_w - m_w') + sum_v exp(w_v - m_w') c'_v,   mean = A / S_w,

w = t (forward KL: mean = sum_v p_v c_v) or w = s (reverse: sum_v q_v c_v). Centred, c is as small as
the two heads' log-probabilities, where t - s is ~1 / tau: the reverse KL's G = q (mean - c) is a difference
of such numbers (with t - s, a student sharper than its teacher erred 3-36x the naive path's on its top
column, where the true G is damped by 1 - q). A split's mean is under its own softmax and maxima; the host
merges splits (``helpers.cce.distill``).
Second pass (JSD only): log M = log(beta p + (1 - beta) q) needs both whole rows' lse, which no
rescaling gives, so the JSD walks the tiles again with them known and sums its terms directly, each
from g = log p - log q = c - (l_t - l_s) and log q/M = -log(beta e^g + 1 - beta) (``student_to_teacher``),
never as a difference of two log-probabilities.
Every exp is ``exp_of``, PRECISE for fp32 inputs (``tl.exp`` on a GPU is ex2.approx of a rounded product,
~|x| 6e-8 relative). For fp32 inputs ``helpers.cce.distill`` compiles these kernels without FMA contraction:
with it, fp32 dE_s at a temperature of 0.1 erred 2.1-4.5x the naive path's on an H100 (exp_of changed
none of those figures; the interpreter shows neither).

``divergence_gradient_chunk_kernel`` writes one chunk of G = dloss_i / ds_{i, v} / w_i (the row's
upstream weight w_i applied after the products, as ``gradient_chunk_kernel``'s G), the operand of
the "gemm" backward's two cuBLAS products (``helpers.cce.backward.gemm``, through its ``g_chunk``).

Why not flags on ``lse_forward_kernel`` and ``gradient_tile``: each takes one head; a second head is
a second E, C, bias, D and four strides in every call, and their callers (every backward, the
per-token outputs, the sparse backward's bits) would carry them unused. What these kernels share
with those is the logit tile, the bias and the soft cap (``logits.py``) and the grouped order.

Two fp32 tiles are live at once (the student's while the teacher's is built), so ``helpers.cce.distill``
runs these kernels with half the tier's BLOCK_V (``pair_config``). Reference: ``helpers.spec.reference_kl_div``.
"""

import triton
import triton.language as tl

from helpers.cce.kernels.gradient_tile import grouped_tile
from helpers.cce.kernels.logits import add_bias, exp_of, logit_tile, slope_from_gap, soft_cap, soft_cap_and_gap

# The divergences, by their kernels' KIND (constexpr: a kernel reads no other global).
FORWARD_KL, REVERSE_KL, JSD = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def head_tile(
    E_ptr, C_ptr, bias_ptr,  # E (N, D), C (V, D), bias (V,) (HAS_BIAS only)
    rows, cols, row_mask, col_mask,  # (BLOCK_N,) int64, (BLOCK_V,) int64
    D, stride_En, stride_Ed, stride_Cv, stride_Cd,
    softcap,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """cap(E[rows] C[cols]^T + b[cols]), (BLOCK_N, BLOCK_V) fp32, before the temperature."""
    z = head_logits(E_ptr, C_ptr, bias_ptr, rows, cols, row_mask, col_mask, D, stride_En, stride_Ed,
                    stride_Cv, stride_Cd, BLOCK_N, BLOCK_V, BLOCK_D, HAS_BIAS, DOT_PRECISION)
    if HAS_SOFTCAP:
        z = soft_cap(z, softcap, DOT_PRECISION == "ieee")
    return z


@triton.jit
def head_logits(
    E_ptr, C_ptr, bias_ptr, rows, cols, row_mask, col_mask,
    D, stride_En, stride_Ed, stride_Cv, stride_Cd,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """E[rows] C[cols]^T + b[cols], (BLOCK_N, BLOCK_V) fp32: ``head_tile``'s logits before the cap."""
    z = logit_tile(E_ptr, C_ptr, rows, cols, row_mask, col_mask, D, stride_En, stride_Ed, stride_Cv, stride_Cd,
                   BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION)
    if HAS_BIAS:
        z = add_bias(z, bias_ptr, cols, col_mask)
    return z


@triton.jit
def log_mixture(log_p, log_q, beta, PRECISE: tl.constexpr = False):
    """log M = log(beta p + (1 - beta) q), from the logs, without underflow: both relative to their
    maximum (finite in real columns: the logs are t - lse_t and s - lse_s)."""
    top = tl.maximum(log_p, log_q)
    return top + tl.log(beta * exp_of(log_p - top, PRECISE) + (1.0 - beta) * exp_of(log_q - top, PRECISE))


@triton.jit
def student_to_teacher(s, t, m_s, m_t, l_s, l_t):
    """g = log p - log q of (BLOCK_N, BLOCK_V) tiles, from the centred gap and the two log sums: as small as
    the two heads' log-probabilities' difference, where log p and log q are each rounded at their own size
    (~ulp(log V)). The JSD's log q/M = -log(beta e^g + 1 - beta) = -``log_mixture(g, 0, beta)`` then keeps it:
    formed as log q - log M, a difference of two such numbers, its gradient erred 2.5-2.7x the naive path's
    at beta = 0.1 (M ~ q, log q/M ~ beta g)."""
    return centred_gap(s, t, m_s, m_t) - (l_t - l_s)[:, None]


@triton.jit
def excess(log_a, x, PRECISE: tl.constexpr = False):
    """a log(a/b) - a + b = a h(x) >= 0 with x = log a/b, h(x) = x - 1 + e^-x: to fp32's relative precision,
    from h's Taylor series below |x| = 1 (h ~ x^2 / 2, where a (x - 1) + b would cancel to ~1e-7 a), as
    a (x - 1) + exp(log a - x) above (b = exp(log a - x): no overflow however small a is beside b)."""
    p = x * (-1.0 / 479001600) + 1.0 / 39916800
    p = p * x - 1.0 / 3628800
    p = p * x + 1.0 / 362880
    p = p * x - 1.0 / 40320
    p = p * x + 1.0 / 5040
    p = p * x - 1.0 / 720
    p = p * x + 1.0 / 120
    p = p * x - 1.0 / 24
    p = p * x + 1.0 / 6
    p = p * x - 0.5
    a = exp_of(log_a, PRECISE)
    return tl.where(tl.abs(x) < 1.0, a * (-(x * x) * p), a * (x - 1.0) + exp_of(log_a - x, PRECISE))


@triton.jit
def row_normaliser(norm_ptr, rows, row_mask, stride_norm):
    """A head's (m, l) of ``rows`` (module doc): log softmax = (z - m) - l."""
    m = tl.load(norm_ptr + rows, mask=row_mask, other=0.0)
    return m, tl.load(norm_ptr + stride_norm + rows, mask=row_mask, other=0.0)


@triton.jit
def centred_gap(s, t, m_s, m_t):
    """c = (t - m_t) - (s - m_s) of (BLOCK_N, BLOCK_V) tiles and (BLOCK_N,) maxima (module doc)."""
    return (t - m_t[:, None]) - (s - m_s[:, None])


@triton.jit
def divergence_forward_kernel(
    # pointers
    Es_ptr, Cs_ptr, bs_ptr,  # the student: E_s (N, D_s), C_s (V, D_s), b_s (V,) (HAS_BIAS_S only)
    Et_ptr, Ct_ptr, bt_ptr,  # the teacher: E_t (N, D_t), C_t (V, D_t), b_t (V,) (HAS_BIAS_T only)
    norm_s_ptr, norm_t_ptr,  # (2, N) fp32: whole rows' (m, l) (SECOND_PASS only; module doc)
    out_ptr,  # (5, SPLITS, N) fp32. First pass: m_s, l_s, m_t, l_t and the mean of (t - s) (the KLs)
    #           per split. Second pass: the JSD's terms, sum q (log q - log M) and sum q per split.
    # sizes
    N, V, D_s, D_t,
    blocks_per_split,  # vocabulary blocks of BLOCK_V per split
    # strides
    stride_Esn, stride_Esd, stride_Csv, stride_Csd,
    stride_Etn, stride_Etd, stride_Ctv, stride_Ctd,
    stride_out,  # SPLITS * N: from one output to the next
    stride_norm,  # from a normaliser's m to its l
    # options
    softcap, inv_temperature, beta,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    KIND: tl.constexpr,  # FORWARD_KL, REVERSE_KL or JSD
    SECOND_PASS: tl.constexpr,  # JSD only: the sums with both lse known
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS_S: tl.constexpr, HAS_BIAS_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_MAJOR: tl.constexpr,  # grid (SPLITS, N / BLOCK_N) instead of (N / BLOCK_N, SPLITS)
):
    if SPLIT_MAJOR:
        split = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N

    m_s = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    m_t = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    sum_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sum_t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    cross = tl.zeros((BLOCK_N,), dtype=tl.float32)  # A (first pass) or the JSD's terms (second)
    k_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)  # K's sum q (log q - log M) (second pass)
    q_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)  # K's normaliser sum q (second pass)
    if SECOND_PASS:
        m_s, l_s = row_normaliser(norm_s_ptr, rows, row_mask, stride_norm)
        m_t, l_t = row_normaliser(norm_t_ptr, rows, row_mask, stride_norm)

    v_begin = split * blocks_per_split * BLOCK_V
    v_end = tl.minimum(V, v_begin + blocks_per_split * BLOCK_V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        # 1. Both logit tiles, rebuilt on chip (finite in padding columns: zeros, capped).
        s = head_tile(Es_ptr, Cs_ptr, bs_ptr, rows, cols.to(tl.int64), row_mask, col_mask, D_s,
                      stride_Esn, stride_Esd, stride_Csv, stride_Csd, softcap,
                      BLOCK_N, BLOCK_V, BLOCK_D, HAS_SOFTCAP, HAS_BIAS_S, DOT_PRECISION) * inv_temperature
        t = head_tile(Et_ptr, Ct_ptr, bt_ptr, rows, cols.to(tl.int64), row_mask, col_mask, D_t,
                      stride_Etn, stride_Etd, stride_Ctv, stride_Ctd, softcap,
                      BLOCK_N, BLOCK_V, BLOCK_D, HAS_SOFTCAP, HAS_BIAS_T, DOT_PRECISION) * inv_temperature
        if SECOND_PASS:
            # 2b. [JSD] beta p (log p - log M) + (1 - beta) q (log q - log M), and K's q (log q - log M);
            # padding columns give 0.
            log_q = (s - m_s[:, None]) - l_s[:, None]
            log_p = (t - m_t[:, None]) - l_t[:, None]
            g = student_to_teacher(s, t, m_s, m_t, l_s, l_t)
            log_q_over_M = -log_mixture(g, 0.0, beta, DOT_PRECISION == "ieee")
            q = tl.where(col_mask[None, :], exp_of(log_q, DOT_PRECISION == "ieee"), 0.0)
            # The loss's terms as beta (p log p/M - p + M) + (1 - beta) (q log q/M - q + M) (``excess``): the
            # same sum, since beta (M - p) + (1 - beta) (M - q) = 0, but each term >= 0 and second order in
            # g, where beta p log p/M + (1 - beta) q log q/M are first-order terms that cancel (near zero
            # divergence the loss erred up to 10x the naive path's, relative).
            terms = (beta * excess(log_p, g + log_q_over_M, DOT_PRECISION == "ieee")
                     + (1.0 - beta) * excess(log_q, log_q_over_M, DOT_PRECISION == "ieee"))
            cross += tl.sum(tl.where(col_mask[None, :], terms, 0.0), axis=1)
            k_sum += tl.sum(q * log_q_over_M, axis=1)
            q_sum += tl.sum(q, axis=1)
        else:
            # 2a. [Online softmax] of each head, padding columns -inf (exp gives 0); every tile holds a
            # real column, so the maxima are finite.
            s_real, t_real = s, t
            s = tl.where(col_mask[None, :], s, float("-inf"))
            t = tl.where(col_mask[None, :], t, float("-inf"))
            m_s_new = tl.maximum(m_s, tl.max(s, axis=1))
            m_t_new = tl.maximum(m_t, tl.max(t, axis=1))
            e_s = exp_of(s - m_s_new[:, None], DOT_PRECISION == "ieee")
            e_t = exp_of(t - m_t_new[:, None], DOT_PRECISION == "ieee")
            if KIND != JSD:
                # [Cross term] sum_v exp(w_v - m_w) c_v, c centred on the maxima (module doc): w = t or s.
                c = tl.where(col_mask[None, :], centred_gap(s_real, t_real, m_s_new, m_t_new), 0.0)
                if KIND == FORWARD_KL:
                    sum_w, alpha, e_w = sum_t, exp_of(m_t - m_t_new, DOT_PRECISION == "ieee"), e_t
                else:
                    sum_w, alpha, e_w = sum_s, exp_of(m_s - m_s_new, DOT_PRECISION == "ieee"), e_s
                # The first tile: nothing summed yet, and the maxima's move is -inf - -inf.
                shift = tl.where(sum_w > 0, (m_s_new - m_s) - (m_t_new - m_t), 0.0)
                cross = (cross + sum_w * shift) * alpha + tl.sum(e_w * c, axis=1)
            sum_s = sum_s * exp_of(m_s - m_s_new, DOT_PRECISION == "ieee") + tl.sum(e_s, axis=1)
            sum_t = sum_t * exp_of(m_t - m_t_new, DOT_PRECISION == "ieee") + tl.sum(e_t, axis=1)
            m_s = m_s_new
            m_t = m_t_new

    # 3. Per split: each head's (m, log sum), the mean of c under the weighting head's softmax; or the JSD's
    # sums.
    out = split.to(tl.int64) * N + rows
    if SECOND_PASS:
        tl.store(out_ptr + out, cross, mask=row_mask)
        tl.store(out_ptr + stride_out + out, k_sum, mask=row_mask)
        tl.store(out_ptr + 2 * stride_out + out, q_sum, mask=row_mask)
    else:
        tl.store(out_ptr + out, m_s, mask=row_mask)
        tl.store(out_ptr + stride_out + out, tl.log(sum_s), mask=row_mask)
        tl.store(out_ptr + 2 * stride_out + out, m_t, mask=row_mask)
        tl.store(out_ptr + 3 * stride_out + out, tl.log(sum_t), mask=row_mask)
        if KIND != JSD:
            weight_sum = sum_t if KIND == FORWARD_KL else sum_s
            tl.store(out_ptr + 4 * stride_out + out, cross / weight_sum, mask=row_mask)


@triton.jit
def divergence_gradient_chunk_kernel(
    # pointers
    Es_ptr, Cs_ptr, bs_ptr,  # the student's rows of this chunk E_s (rows, D_s), C_s (V, D_s), b_s (V,)
    Et_ptr, Ct_ptr, bt_ptr,  # the teacher's: E_t (rows, D_t), C_t (V, D_t), b_t (V,)
    norm_s_ptr, norm_t_ptr,  # (2, rows) fp32: each head's (m, l) (module doc)
    row_stat_ptr,  # (rows,) fp32: sum_v q c (REVERSE_KL; module doc) or K = KL(q || M) (JSD); unused for FORWARD_KL
    sign_ptr,  # (rows,) fp32: the sign of the row's upstream gradient, 0 at ignored rows
    G_ptr,  # (rows, v_count) in E_s's dtype
    # sizes
    N, V, D_s, D_t,
    v_begin, v_count,  # this launch covers vocabulary columns [v_begin, v_begin + v_count)
    # strides
    stride_Esn, stride_Esd, stride_Csv, stride_Csd,
    stride_Etn, stride_Etd, stride_Ctv, stride_Ctd,
    stride_Gn, stride_Gv,
    stride_norm,  # from a normaliser's m to its l
    # options
    softcap, inv_temperature, beta,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    KIND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS_S: tl.constexpr, HAS_BIAS_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # 1. [Grouped order] the tile's place in the chunk.
    pid_n, pid_v = grouped_tile(tl.program_id(0), N, v_count, BLOCK_N, BLOCK_V, GROUP_N)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    local_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = local_v < v_count
    cols = (v_begin + local_v).to(tl.int64)

    # 2. Both logit tiles rebuilt, the slope of the student's cap kept for the chain rule. The teacher's
    # first, so that one tile (its), not two (the student's and its slope), is live across the other's
    # product loop.
    t = head_tile(Et_ptr, Ct_ptr, bt_ptr, rows, cols, row_mask, col_mask, D_t,
                  stride_Etn, stride_Etd, stride_Ctv, stride_Ctd, softcap,
                  BLOCK_N, BLOCK_V, BLOCK_D, HAS_SOFTCAP, HAS_BIAS_T, DOT_PRECISION) * inv_temperature
    z_s = head_logits(Es_ptr, Cs_ptr, bs_ptr, rows, cols, row_mask, col_mask, D_s,
                      stride_Esn, stride_Esd, stride_Csv, stride_Csd,
                      BLOCK_N, BLOCK_V, BLOCK_D, HAS_BIAS_S, DOT_PRECISION)
    if HAS_SOFTCAP:
        z_s, gap = soft_cap_and_gap(z_s, softcap, DOT_PRECISION == "ieee")
    m_s, l_s = row_normaliser(norm_s_ptr, rows, row_mask, stride_norm)
    m_t, l_t = row_normaliser(norm_t_ptr, rows, row_mask, stride_norm)
    sign = tl.load(sign_ptr + rows, mask=row_mask, other=0.0)
    s = z_s * inv_temperature
    log_q = (s - m_s[:, None]) - l_s[:, None]
    log_p = (t - m_t[:, None]) - l_t[:, None]
    q = exp_of(log_q, DOT_PRECISION == "ieee")

    # 3. G = dloss / ds per kind (``helpers.cce.distill``'s module doc derives each):
    if KIND == FORWARD_KL:
        G = q - exp_of(log_p, DOT_PRECISION == "ieee")  # KL(p || q): q - p
    else:
        r = tl.load(row_stat_ptr + rows, mask=row_mask, other=0.0)
        if KIND == REVERSE_KL:
            # KL(q || p): q (log q - log p - KL) = q (sum_u q_u c_u - c), c centred (module doc): every
            # term as small as the log-probabilities, not ~1 / tau as s, t, their lse and the KL's parts.
            G = q * (r[:, None] - centred_gap(s, t, m_s, m_t))
        else:
            # (1 - beta) q (log q/M - K), log q/M = -log(beta e^g + 1 - beta) with g = log p - log q.
            log_q_over_M = -log_mixture(student_to_teacher(s, t, m_s, m_t, l_s, l_t), 0.0, beta,
                                        DOT_PRECISION == "ieee")
            G = (1.0 - beta) * q * (log_q_over_M - r[:, None])
    # then the chain rule through the temperature and the student's soft cap.
    G = G * (sign * inv_temperature)[:, None]
    if HAS_SOFTCAP:
        G = G * slope_from_gap(gap)
    G = tl.where(col_mask[None, :], G, 0.0)

    # 4. G_c in the input dtype, the operand of both products.
    g_ptrs = G_ptr + rows[:, None] * stride_Gn + local_v.to(tl.int64)[None, :] * stride_Gv
    tl.store(g_ptrs, G.to(G_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
