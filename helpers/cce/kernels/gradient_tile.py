"""The gradient of the loss with respect to a logit tile, shared by every backward kernel.

``gradient_tile`` rebuilds a (BLOCK_N, BLOCK_V) logit tile (``logit_tile``, plus the bias) and forms

    G_{i, v} = a_i S_{i, v} - b_i [v = x_i] - c_i / V,    S = exp(z - lse),

its target column taken from the host as t_i = (a_i - b_i) - a_i r_i (+ the entropy's term below), r_i
the row's non-target mass 1 - S_{i, x_i} from the forward (``lse_forward_kernel``'s NONTARGET): formed
here as a exp(z_x - lse) - b it would be a difference of two rounded numbers, wrong by ~ulp(|z|)
however close S_x is to 1 (the bug class of a peer's 100% error at p >= 0.999). So coef's second row
is t, not b (``helpers.cce.backward.rows.RowGradient``).

times 1 / temperature and, under the soft cap, its derivative 1 - t^2, t = tanh((E C^T + b) / softcap)
(the logits are z = softcap t / temperature).
With CLASS_WEIGHTS (torch's class weights with label smoothing, ``helpers.cce.class_weights``) the
smoothing term is c_i w_v / V, w the class weights (V,). With ENTROPY (per-token outputs with an
entropy gradient, ``helpers.cce.outputs``) a fourth row coefficient d adds d_i S_{i, v} (z_{i, v} - lse_i):
the entropy's gradient -S (z - lse + H) is not of the form above
(``helpers.cce.backward.rows.RowGradient.of_outputs``). The row coefficients come from the host
(``helpers.cce.backward.rows.RowGradient``): for the loss alone a = 1 + 2 zl lse, b = 1 - ls, c = ls,
each divided by the row's weight w (its upstream gradient, applied after the products); a gradient
flowing into the returned lse adds to a; ignored rows and padding have a = t = c = 0. The "atomic" kernel
(``atomic_gradients.py``), the "gemm" backward's G kernel (``gradient_chunk.py``) and the "sparse"
backward's kernels (``pair_gradients.py``, through ``gradient_and_softmax_tile``, which also returns
S) call this one function, so all compute the same G to the bit. ``grouped_tile`` orders their programs as Triton
tutorial 03 does. Reference: autograd through ``helpers.spec.reference_loss``.

The filter's mass. Every backward's gradient filter skips a row's tile when the row's |G| mass there
is below eps; the mass is taken before the soft cap's derivative 1 - t^2, of the gradient with respect
to the capped logits. Taken after it, a cap that saturates (pre-cap logits many times the cap) shrinks
the whole row's gradient, every tile falls below an absolute eps, and the filter dropped a few percent
of what was left (fp16, logits ~170 under a cap of 5: dE 1.9e-2 against 9e-4 unfiltered). Before it,
a row drops at most eps of that mass per tile whatever the cap, as without one, and the derivative
(<= 1) only shrinks what it drops. Without a cap the two are the same number. The 1 / temperature
factor stays in the mass: it scales every entry of a row alike, as the loss's own gradient does. The
derivative itself is r (2 - r) from r = 1 - t (``slope_from_gap``): 1 - t^2 is 0 wherever t rounds to 1.
"""

import triton
import triton.language as tl

from helpers.cce.kernels.logits import add_bias, exp_of, logit_tile, logit_tile_tma, slope_from_gap, soft_cap_and_gap


@triton.jit
def grouped_tile(pid, N, v_count, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_N: tl.constexpr):
    """(pid_n, pid_v) of program ``pid`` over (N / BLOCK_N) x (v_count / BLOCK_V) tiles, in
    Triton tutorial 03's grouped order: GROUP_N row blocks in a row take turns over the vocabulary
    blocks, so a C strip is reused from L2 by GROUP_N programs."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_v = tl.cdiv(v_count, BLOCK_V)
    num_pid_in_group = GROUP_N * num_pid_v
    first_pid_n = (pid // num_pid_in_group) * GROUP_N
    group_size = tl.minimum(num_pid_n - first_pid_n, GROUP_N)
    pid_n = first_pid_n + (pid % num_pid_in_group) % group_size
    pid_v = (pid % num_pid_in_group) // group_size
    return pid_n, pid_v


@triton.jit
def gradient_tile(
    E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr,  # E (N, D), C (V, D), x (N,), lse (N,) fp32,
    # coef (3, N) fp32 rows a, t, c; bias (V,) (HAS_BIAS only)
    rows, cols,  # (BLOCK_N,) int64, (BLOCK_V,) int32 or int64 indices into E and C
    row_mask, col_mask,
    V, D,
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef,
    softcap,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    E_DESC: tl.constexpr = False,
    C_DESC: tl.constexpr = False,
    row0=0, col0=0,
    inv_temperature=1.0,
    ENTROPY: tl.constexpr = False,
    class_weight_ptr=None,
    CLASS_WEIGHTS: tl.constexpr = False,
    Z_GIVEN: tl.constexpr = False,
    z_ptrs=None, z_mask=None,
):
    """(G, mass): G = dloss_i / dz_{i, v} / w_i for the tile, (BLOCK_N, BLOCK_V) fp32, 0 at ignored
    rows and padding, and each row's |G| mass before the soft cap's derivative, (BLOCK_N,) fp32: what
    the gradient filter judges (module doc). Shared by every backward kernel (this file's callers and
    ``pair_gradients.py``'s, through ``gradient_and_softmax_tile``), so all compute the same G."""
    G, S, mass = gradient_and_softmax_tile(E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr, rows, cols,
                                           row_mask, col_mask, V, D,
                                           stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef,
                                           softcap, BLOCK_N, BLOCK_V, BLOCK_D, HAS_SOFTCAP, HAS_BIAS, DOT_PRECISION,
                                           E_DESC, C_DESC, row0, col0, inv_temperature, ENTROPY, class_weight_ptr,
                                           CLASS_WEIGHTS, Z_GIVEN, z_ptrs, z_mask)
    return G, mass


@triton.jit
def gradient_and_softmax_tile(
    E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr,
    rows, cols,
    row_mask, col_mask,
    V, D,
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef,
    softcap,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    E_DESC: tl.constexpr = False,  # E_ptr (and C_ptr, with C_DESC) are tensor descriptors
    C_DESC: tl.constexpr = False,
    row0=0, col0=0,  # with E_DESC: the tile's first row of E and (C_DESC) of C
    inv_temperature=1.0,  # 1 / temperature: the logits are cap(E C^T + b) / temperature
    ENTROPY: tl.constexpr = False,  # coef has a fourth row d: G += d S (z - lse) (module doc)
    class_weight_ptr=None,  # (V,) fp32 class weights w (CLASS_WEIGHTS only)
    CLASS_WEIGHTS: tl.constexpr = False,  # the smoothing term is c_i w_v / V (module doc)
    # The logits E C^T already in memory (a tier whose Triton products are FMAs has cuBLAS make them:
    # ``HostTuning.logits_in_cublas``): loaded from ``z_ptrs`` (BLOCK_N, BLOCK_V) where ``z_mask``, not rebuilt.
    Z_GIVEN: tl.constexpr = False,
    z_ptrs=None, z_mask=None,
):
    """(G, S, mass): ``gradient_tile``'s G and mass, and the softmax S = exp(z - lse) G was formed
    from, (BLOCK_N, BLOCK_V) fp32 and 0 in padding columns (the "sparse" backward reports the softmax
    mass it skipped). A caller that drops S compiles to ``gradient_tile``'s code."""
    # The logit tile, recomputed on chip (Algorithm 3, line 3), or read where cuBLAS made it.
    if Z_GIVEN:
        z = tl.load(z_ptrs, mask=z_mask, other=0.0).to(tl.float32)
    elif E_DESC:
        z = logit_tile_tma(E_ptr, C_ptr, row0, col0, cols, col_mask, D, stride_Cv, stride_Cd,
                           BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION, C_DESC)
    else:
        z = logit_tile(E_ptr, C_ptr, rows, cols.to(tl.int64), row_mask, col_mask, D,
                       stride_En, stride_Ed, stride_Cv, stride_Cd,
                       BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION)
    if HAS_BIAS:
        z = add_bias(z, bias_ptr, cols, col_mask)
    # The row's coefficients (module doc), each (BLOCK_N,).
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    a = tl.load(coef_ptr + rows, mask=row_mask, other=0.0)
    t_x = tl.load(coef_ptr + stride_coef + rows, mask=row_mask, other=0.0)
    c = tl.load(coef_ptr + 2 * stride_coef + rows, mask=row_mask, other=0.0)
    if ENTROPY:
        d = tl.load(coef_ptr + 3 * stride_coef + rows, mask=row_mask, other=0.0)
    else:
        d = a  # not read
    x = tl.load(x_ptr + rows * stride_x, mask=row_mask, other=-1)
    # Compared in int32 (a valid target is below V < 2^31; anything else matches no column), so
    # that no int64 column index is held per element of the tile.
    x = tl.where((x >= 0) & (x < V), x, -1).to(tl.int32)
    if BLOCK_V >= 128:
        # [Two column halves] one half's softmax and cap gap live at a time, not the whole tile's: on sm_90
        # the Hopper G kernel (128 x 256, bf16, the filter on) spills 94 values a thread against 185 with
        # the cap, 50 against 72 without (Triton 3.9, cuobjdump); no layout conversion (the halves are the
        # register halves of the dot's accumulator). The same arithmetic per element: the same G and S.
        z_l, z_r = _column_halves(z, BLOCK_N, BLOCK_V)
        cols_l, cols_r = _column_halves(cols[None, :], 1, BLOCK_V)
        mask_l, mask_r = _column_halves(col_mask[None, :], 1, BLOCK_V)
        G_l, S_l, mass_l = gradient_of_logits(z_l, cols_l, mask_l, lse, a, t_x, c, d, x, V, softcap,
                                              inv_temperature, class_weight_ptr, HAS_SOFTCAP, ENTROPY,
                                              CLASS_WEIGHTS, DOT_PRECISION == "ieee")
        G_r, S_r, mass_r = gradient_of_logits(z_r, cols_r, mask_r, lse, a, t_x, c, d, x, V, softcap,
                                              inv_temperature, class_weight_ptr, HAS_SOFTCAP, ENTROPY,
                                              CLASS_WEIGHTS, DOT_PRECISION == "ieee")
        return (_joined_halves(G_l, G_r, BLOCK_N, BLOCK_V), _joined_halves(S_l, S_r, BLOCK_N, BLOCK_V),
                mass_l + mass_r)
    return gradient_of_logits(z, cols[None, :], col_mask[None, :], lse, a, t_x, c, d, x, V, softcap,
                              inv_temperature, class_weight_ptr, HAS_SOFTCAP, ENTROPY, CLASS_WEIGHTS,
                              DOT_PRECISION == "ieee")


@triton.jit
def _column_halves(t, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(left, right): the (ROWS, COLS / 2) column halves of the (ROWS, COLS) tile ``t``."""
    return tl.split(tl.permute(tl.reshape(t, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@triton.jit
def _joined_halves(left, right, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``_column_halves``' inverse: the (ROWS, COLS) tile."""
    return tl.reshape(tl.permute(tl.join(left, right), (0, 2, 1)), (ROWS, COLS))


@triton.jit
def gradient_of_logits(
    z, cols, col_mask,  # the logits before the cap (BLOCK_N, W) fp32; their columns (1, W) and mask (1, W)
    lse, a, t_x, c, d, x,  # the rows' lse, coefficients and targets (int32, -1: none), each (BLOCK_N,)
    V, softcap, inv_temperature, class_weight_ptr,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, CLASS_WEIGHTS: tl.constexpr,
    PRECISE: tl.constexpr,  # fp32 inputs: the cap's and exp's precise forms (``soft_cap_and_gap``, ``exp_of``)
):
    """(G, S, mass) of ``gradient_and_softmax_tile`` for logits ``z`` of any width W."""
    if HAS_SOFTCAP:
        z, gap = soft_cap_and_gap(z, softcap, PRECISE)
    # The temperature divides the capped logit (x * 1.0 is exact: no temperature, the same bits).
    z = z * inv_temperature

    # G = a S - c / V (+ d S (z - lse)) off the target, t - c / V on it (module doc), then the
    # chain rule through the temperature and the soft cap.
    log_S = z - lse[:, None]
    S = exp_of(log_S, PRECISE)
    is_target = x[:, None] == cols.to(tl.int32)
    G = a[:, None] * S
    if ENTROPY:
        # The entropy's term: -e S (z - lse + H) = d S log S + (-e H) S, the second part already in a
        # (on the target column, in t).
        G += d[:, None] * S * log_S
    G = tl.where(is_target, t_x[:, None], G)
    if CLASS_WEIGHTS:
        w = tl.load(class_weight_ptr + cols, mask=col_mask, other=0.0)
        G = G - c[:, None] * (w / V)
    else:
        G = G - c[:, None] / V
    # Padding columns contribute nothing, and must not keep a tile from being skipped.
    G = tl.where(col_mask, G * inv_temperature, 0.0)
    # What the filter judges: each row's |G| mass in the tile before the soft cap's derivative (the
    # gradient with respect to the capped logits; module doc). Without a cap, the mass of G itself.
    mass = tl.sum(tl.abs(G), axis=1)
    if HAS_SOFTCAP:
        # The slope is 0, not NaN, in a padding column whose logit E . 0 is NaN (an inf in E), so its G
        # stays 0 (``slope_from_gap``); a real column with a NaN logit has a NaN G already.
        G = G * slope_from_gap(gap)
    return G, tl.where(col_mask, S, 0.0), mass
