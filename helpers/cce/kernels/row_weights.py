"""Each row's upstream weight and gradient coefficients (``helpers.cce.backward.rows.RowGradient``) in
two launches instead of ~20 small torch operators.

With few tokens the backward is bound by the host's launches (docs/PERFORMANCE.md, "1,024 tokens"):
the per-row arithmetic below was two dozen element-wise torch operators of N elements each, each a
launch of its own. Here it is two kernels over blocks of rows:

    row_weights_kernel (one program per BLOCK rows):
        g = g_i at kept rows (labels_i != ignore), else 0, divided by max(n_kept, 1) for a mean (DIVIDE);
        h = h_i (0 without a gradient into the lse)
        w = max(|g|, |h|);  safe = w where w > 0, else 1
        coef = (a exp(-lo), t, c) with a = (g (1 + 2 zl lse) + h) / safe,  t = (g (2 zl lse + ls) + h) / safe - a r,
        c = g ls / safe
        (3, N): t is the target column's a S_x - b with S_x = 1 - r, r the row's non-target mass from
        the forward (``helpers.cce.kernels.gradient_tile``), and a - b formed without the subtraction
        block_max[program] = max w over the program's rows (NaN if any w is NaN)
    row_scale_kernel (the same blocks):
        w_scale = max over block_max (every program reduces them itself; program 0 stores it)
        w_rel = w / w_scale where w_scale > 0, else 0

Up to ``ONE_PROGRAM_ROWS`` rows, one launch does both: a single program walks the blocks twice
(``ONE_PROGRAM``), the same arithmetic, so the same bits. A launch costs the host more than these
rows cost the GPU there; past it, one program's walk would cost the GPU more than the launch saves.

The same arithmetic, in the same fp32 order, as the torch expressions it replaced, NaN included
(a NaN upstream gradient at a kept row makes w, its coefficients and w_scale NaN, as
``torch.maximum`` and ``amax`` do): the same bits under the interpreter, within fp32's rounding on a
GPU (whose fused multiply-adds round differently). The torch expressions stay in
tests/cce/test_cce.py as the reference.

Every division is correctly rounded (``tl.math.div_rn``), as torch's is. Triton's ``/`` on fp32
compiles to ``div.full.f32``, within 2 ulp: g / |g| came out past 1 for some g on an H200, past the
|a| <= 1 the forward's activity bits are made for, so the sparse backward refused every call with a
per-row upstream gradient (``reduction="none"``). Rounded correctly, g / |g| is exactly +-1 and
w / max w is at most 1 (exactly 1 for a mean or a sum); the bounds the bits and w_rel rely on hold.
"""

import triton
import triton.language as tl

from helpers.cce.kernels.logits import exp_of


ONE_PROGRAM_ROWS = 8192  # the most rows one program of ``row_weights_kernel`` takes alone (module doc)


@triton.jit
def _block_weights(g_ptr, h_ptr, labels_ptr, divisor_ptr, lse_ptr, r_ptr, w_ptr, coef_ptr, rows, N, stride_g, stride_h,
                   stride_labels, ignore, stride_coef, z_loss, label_smoothing, HAS_G: tl.constexpr,
                   HAS_H: tl.constexpr, DIVIDE: tl.constexpr, BLOCK: tl.constexpr):
    """w and coef of ``rows`` stored; returns (the block's largest w, whether a w is NaN)."""
    inside = rows < N
    kept = tl.load(labels_ptr + rows * stride_labels, mask=inside, other=ignore) != ignore
    if HAS_G:
        g = tl.load(g_ptr + rows * stride_g, mask=inside & kept, other=0.0).to(tl.float32)  # 0 where not kept
    else:
        g = tl.zeros([BLOCK], dtype=tl.float32)
    if DIVIDE:  # a mean: g / max(n_kept, 1), as torch divides (its gradient is 0, not NaN, with nothing kept)
        g = tl.math.div_rn(g, tl.maximum(tl.load(divisor_ptr), 1).to(tl.float32))
    if HAS_H:
        h = tl.load(h_ptr + rows * stride_h, mask=inside, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK], dtype=tl.float32)
    lse = tl.load(lse_ptr + rows, mask=inside, other=0.0)
    w = tl.maximum(tl.abs(g), tl.abs(h), propagate_nan=tl.PropagateNan.ALL)
    safe = tl.where(w > 0, w, 1.0)
    tl.store(w_ptr + rows, w, mask=inside)
    r = tl.load(r_ptr + rows, mask=inside, other=0.0)
    lo = tl.load(r_ptr + N + rows, mask=inside, other=0.0)
    a = tl.math.div_rn(g * (1.0 + 2.0 * z_loss * lse) + h, safe)
    t = tl.math.div_rn(g * (2.0 * z_loss * lse + label_smoothing) + h, safe) - a * r
    tl.store(coef_ptr + stride_coef + rows, t, mask=inside)
    # The kernels form S = exp(z - lse) from the fp32 lse; the row's lse is lse + lo, so its softmax is
    # S exp(-lo): folded into a (the target column's t takes r, which needs no lse).
    tl.store(coef_ptr + rows, a * exp_of(-lo, True), mask=inside)
    tl.store(coef_ptr + 2 * stride_coef + rows, tl.math.div_rn(g * label_smoothing, safe), mask=inside)
    w_in = tl.where(inside, w, 0.0)
    return tl.max(w_in, axis=0), tl.max((w_in != w_in).to(tl.int32), axis=0)


@triton.jit
def row_weights_kernel(
    # g (N,) upstream gradient per row, any float dtype (stride 0: one value for every row), or any
    # pointer without HAS_G (g = 0); h (N,) the gradient into the lse, or any pointer without HAS_H;
    # labels (N,) integers, a row kept where labels != ignore (the targets and ignore_index, or a kept
    # mask and 0); divisor: an int64 scalar, n_kept, with DIVIDE; lse (N,) fp32; r (2N,) fp32: the
    # target column's 1 - S_x and the lse's rounding lo (``cce_forward``'s).
    g_ptr, h_ptr, labels_ptr, divisor_ptr, lse_ptr, r_ptr,
    # Outputs: w (N,) fp32; coef (3, N) fp32, rows stride_coef apart; block_max (programs,) fp32;
    # with ONE_PROGRAM (one program, every row) w_rel (N,) and w_scale (1,) instead of block_max.
    w_ptr, coef_ptr, block_max_ptr, w_rel_ptr, w_scale_ptr,
    N, stride_g, stride_h, stride_labels, ignore, stride_coef,
    z_loss, label_smoothing,
    HAS_G: tl.constexpr, HAS_H: tl.constexpr, DIVIDE: tl.constexpr, BLOCK: tl.constexpr, ONE_PROGRAM: tl.constexpr,
):
    if ONE_PROGRAM:
        top = 0.0
        nan = 0
        for r0 in range(0, N, BLOCK):
            block_top, block_nan = _block_weights(
                g_ptr, h_ptr, labels_ptr, divisor_ptr, lse_ptr, r_ptr, w_ptr, coef_ptr, r0 + tl.arange(0, BLOCK), N,
                stride_g, stride_h, stride_labels, ignore, stride_coef, z_loss, label_smoothing, HAS_G, HAS_H, DIVIDE,
                BLOCK)
            top = tl.maximum(top, block_top)
            nan = tl.maximum(nan, block_nan)
        scale = tl.where(nan > 0, float("nan"), top)
        tl.store(w_scale_ptr, scale)
        tl.debug_barrier()  # every thread's w stored before any is read back (a thread may read another's)
        for r0 in range(0, N, BLOCK):
            _store_w_rel(w_ptr, w_rel_ptr, r0 + tl.arange(0, BLOCK), N, scale)
    else:
        pid = tl.program_id(0)
        block_top, block_nan = _block_weights(
            g_ptr, h_ptr, labels_ptr, divisor_ptr, lse_ptr, r_ptr, w_ptr, coef_ptr, pid * BLOCK + tl.arange(0, BLOCK),
            N, stride_g, stride_h, stride_labels, ignore, stride_coef, z_loss, label_smoothing, HAS_G, HAS_H, DIVIDE,
            BLOCK)
        tl.store(block_max_ptr + pid, tl.where(block_nan > 0, float("nan"), block_top))


@triton.jit
def row_scale_kernel(
    w_ptr, block_max_ptr, w_rel_ptr, w_scale_ptr,
    N, blocks,
    BLOCK: tl.constexpr, MAX_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    top = tl.zeros([MAX_BLOCK], dtype=tl.float32)
    nan = tl.zeros([MAX_BLOCK], dtype=tl.int32)
    for b0 in range(0, blocks, MAX_BLOCK):
        b = b0 + tl.arange(0, MAX_BLOCK)
        m = tl.load(block_max_ptr + b, mask=b < blocks, other=0.0)
        nan = tl.maximum(nan, (m != m).to(tl.int32))
        top = tl.maximum(top, tl.where(m != m, 0.0, m))
    scale = tl.where(tl.max(nan, axis=0) > 0, float("nan"), tl.max(top, axis=0))
    if pid == 0:
        tl.store(w_scale_ptr, scale)
    _store_w_rel(w_ptr, w_rel_ptr, pid * BLOCK + tl.arange(0, BLOCK), N, scale)


@triton.jit
def _store_w_rel(w_ptr, w_rel_ptr, rows, N, scale):
    """w_rel = w / w_scale of ``rows`` (0 where w_scale is 0)."""
    inside = rows < N
    w = tl.load(w_ptr + rows, mask=inside, other=0.0)
    w_rel = tl.math.div_rn(w, tl.where(scale > 0, scale, 1.0))
    tl.store(w_rel_ptr + rows, tl.where(scale > 0, w_rel, 0.0), mask=inside)
