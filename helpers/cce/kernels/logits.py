"""The one piece every CCE kernel shares: a logit tile z = E_rows @ C_cols^T recomputed on chip.

Cut Cross-Entropy never writes the (N, V) logits to global memory. Each kernel instead rebuilds
the (BLOCK_N, BLOCK_V) tile it needs from a strip of E (BLOCK_N, D) and a strip of C (BLOCK_V, D),
walking D in BLOCK_D steps and accumulating in fp32. Reference: ``helpers.spec.reference_logits``.
"""

import triton
import triton.language as tl


# Where ``soft_cap_and_gap``'s PRECISE form takes tanh(y) / y's Taylor series (to y^13, Horner in fp32:
# within 1.5 fp32 ulp of tanh for |y| < 0.4).
PRECISE_CAP_BELOW = tl.constexpr(0.4)


@triton.jit
def soft_cap_and_gap(z, softcap, PRECISE: tl.constexpr = False):
    # (softcap * tanh(z / softcap), r = 1 - tanh(z / softcap)): every kernel's soft cap, forward and backward
    # alike, so that the backward's softmax is the forward's. tanh(y) = 1 - 2 / (exp(2y) + 1), formed as
    # r = 2 / (2^(z k) + 1) with k = 2 log2(e) / softcap a scalar: one multiply and ex2 a logit, where
    # exp(2 (z / softcap)) cost a division, exp's scaling and its range checks (sm_90, the Hopper G kernel
    # without a bias: 7,152 SASS instructions against 8,576). exp2 and division exist on every backend, the
    # interpreter included (libdevice's tanh does not); 2^(z k) overflowing to inf gives t = 1 exactly.
    # Near 0, t's absolute error is ~1 fp32 ulp of 1 (~1e-7 * softcap on the logit); k's rounding moves
    # the exponent by ~6e-8 relative, under ex2.approx's own error. A caller that needs the cap's slope
    # keeps r, not t: one value per logit, as 1 - t * t kept t (``slope_from_gap``; keeping the slope as
    # q r^2 with q = exp(2y) spilled: the Hopper G kernel's stack 1,384 bytes against 608).
    # PRECISE (fp32 inputs): 1 - r loses t's relative precision as y -> 0 (at a cap of 30, logits under
    # ~12 carried ~1e-6 * |z| where fp32 holds 6e-8, and fp32 gradients erred 2.0-2.3x the naive path's), so
    # below |y| = 0.4 the capped logit is z (tanh(y) / y) from its Taylor series (7 FMAs a logit; the exp
    # form is within ~1 ulp rms above 0.4). 16-bit inputs carry more rounding than either form.
    r = 2.0 / (tl.exp2(z * (2.8853900817779268 / softcap)) + 1.0)
    capped = softcap * (1.0 - r)
    if PRECISE:
        y = z * (1.0 / softcap)
        y2 = y * y
        p = 21844 / 6081075 * y2 - 1382 / 155925
        p = p * y2 + 62 / 2835
        p = p * y2 - 17 / 315
        p = p * y2 + 2 / 15
        p = p * y2 - 1 / 3
        p = p * y2 + 1.0
        capped = tl.where(tl.abs(y) < PRECISE_CAP_BELOW, z * p, capped)
    return capped, r


@triton.jit
def exp_of(x, PRECISE: tl.constexpr = False):
    # exp(x). tl.exp on a GPU is ex2.approx(x * log2(e)): the product's rounding moves the exponent by up to
    # |x| 2^-24 log2(e), a relative error of ~|x| 6e-8 in the result (4e-7 at x = -6, where a probability of
    # 2.5e-3 still counts), beside ex2.approx's own few ulp; CUDA's expf (torch's) keeps ~1 ulp. PRECISE
    # (fp32 inputs) forms it from fp32 operations alone, to ~1 ulp on every backend: x = n ln2 + r with n the
    # nearest integer to x log2(e) and r by two FMAs (Cody and Waite: ln2's high part has 16 bits, so n ln2_hi
    # is exact for |n| < 2^8), e^r on |r| <= ln2 / 2 by its Taylor series to r^7 (truncation 5e-9 relative),
    # scaled by 2^n as two exact powers of two built from their bits (so that results down to fp32's
    # subnormals, and underflow to 0, come out as expf's). x is clamped to [-104, 89] first: exp(-inf) = 0,
    # exp(89) = inf; a NaN stays NaN.
    if PRECISE:
        xc = tl.minimum(tl.maximum(x, -104.0), 89.0)
        n = tl.floor(xc * 1.4426950408889634 + 0.5)
        r = tl.fma(n, -0.693145751953125, xc)  # ln2's high part: 0x3F317200, its last 8 bits zero
        r = tl.fma(n, -1.4286068203094172e-06, r)  # ln2 - its high part
        e = 1.0 / 5040
        e = tl.fma(e, r, 1.0 / 720)
        e = tl.fma(e, r, 1.0 / 120)
        e = tl.fma(e, r, 1.0 / 24)
        e = tl.fma(e, r, 1.0 / 6)
        e = tl.fma(e, r, 0.5)
        e = tl.fma(e, r, 1.0)
        e = tl.fma(e, r, 1.0)
        k = n.to(tl.int32)
        half = k >> 1  # 2^n = 2^half 2^(n - half), each factor a normal number for n in [-150, 128]
        scale_a = ((half + 127) << 23).to(tl.float32, bitcast=True)
        scale_b = ((k - half + 127) << 23).to(tl.float32, bitcast=True)
        return tl.where(x == x, (e * scale_a) * scale_b, x)
    else:
        return tl.exp(x)


@triton.jit
def soft_cap(z, softcap, PRECISE: tl.constexpr = False):
    # softcap * tanh(z / softcap), with ``soft_cap_and_gap``'s bits.
    capped, _ = soft_cap_and_gap(z, softcap, PRECISE)
    return capped


@triton.jit
def slope_from_gap(r):
    # 1 - tanh(y)^2 from r = 1 - tanh(y), y = z / softcap (``soft_cap_and_gap``): r (2 - r), accurate for y >= 0, the side where a logit
    # can carry its row's softmax, up to y ~ 44 where exp(2y) overflows (1 - t * t is 0 once t rounds to 1, y above
    # ~9, while the slope is ~4 exp(-2y)): a few ulp under the interpreter; on a GPU ex2.approx's relative
    # error grows with y (~1e-5 at y = 40). For y < 0, 2 - r (= 1 + t) carries an
    # absolute error of ~3e-7, as 1 - t * t did: the slope reaches 0 below y ~ -8 (README, Caveats). A NaN r (a
    # padding column's E . 0 with an inf in E) gives 0: maximum returns its number operand (max.f32; the
    # interpreter's fmax).
    return tl.maximum(r * (2.0 - r), 0.0)


@triton.jit
def target_complement(r, log_p):
    # 1 - p(target) as the backward takes it (its target column is a (1 - r) - b = (a - b) - a r): r, the row's
    # non-target mass to fp32's relative precision, where r < 1/2 (a confident token); else 1 - exp(log p),
    # log p = z_x - lse, rounded once near 1 as the naive path's p - 1 is: r's own relative error (~1e-6, a sum
    # of V terms over its lse) is ~1e-6 absolute there, and an fp32 flat row's target column erred ~40x the
    # naive path's (its dC 1.5-2.6x over the whole gradient). Where that form is NaN (an infinite lse), r.
    # ``helpers.cce.forward.nontarget_mass`` is the same rule for the torch paths.
    from_target = 1.0 - exp_of(log_p, True)
    return tl.where((r < 0.5) | (from_target != from_target), r, from_target)


@triton.jit
def sum_rounding(a, b, s):
    # (a + b) - s for s = fl(a + b), exactly (Knuth's TwoSum: six additions, no assumption on |a| and |b|);
    # 0 where s is not finite. An lse kept as s + this (``lse_forward_kernel``'s LSE_LO, ``row_loss_kernel``)
    # is exact to ~1e-14 where s alone rounds to ulp(s) / 2 (~1e-6 at 30), which shifts a whole row's softmax.
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    return tl.where(s - s == 0.0, err, 0.0)


@triton.jit
def log1p_neg(r):
    # log1p(-r) for r in [0, 1), without libdevice (the interpreter has none): with q = 1 - r rounded,
    # log(q) r / (1 - q) is accurate to a few ulp, 1 - q being exact (Goldberg, "What every computer
    # scientist should know about floating-point arithmetic", theorem 4); -r where q rounds to 1.
    q = 1.0 - r
    return tl.where(q == 1.0, -r, tl.log(q) * tl.math.div_rn(r, tl.where(q == 1.0, 1.0, 1.0 - q)))


@triton.jit
def dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc + a b in fp32 (acc None: a b), as ``DOT_PRECISION`` says: tl.dot's input_precision ("ieee" for
    fp32 inputs, "tf32" for 16-bit ones, whose tensor-core product it does not change), or "fma": the
    operands upcast to fp32 and multiplied with fp32 FMAs, what Triton compiles a 16-bit tl.dot to for a
    GPU without tensor-core support in it (``LaunchConfig.tensor_cores``), spelled out so that a bigger
    GPU standing in for one pays the same."""
    if DOT_PRECISION == "fma":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def logit_tile(
    E_ptr, C_ptr,  # E (N, D), C (V, D), any strides
    rows, cols,  # (BLOCK_N,), (BLOCK_V,) int64 indices into E and C
    row_mask, col_mask,
    D,
    stride_En, stride_Ed, stride_Cv, stride_Cd,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """z = E[rows] @ C[cols]^T in fp32, (BLOCK_N, BLOCK_V); masked rows/cols read as zeros."""
    offs_d = tl.arange(0, BLOCK_D)
    e_ptrs = E_ptr + rows[:, None] * stride_En + offs_d[None, :] * stride_Ed  # (BLOCK_N, BLOCK_D)
    c_ptrs = C_ptr + cols[None, :] * stride_Cv + offs_d[:, None] * stride_Cd  # (BLOCK_D, BLOCK_V)
    z = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_mask = offs_d < D - d0
        e = tl.load(e_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        c = tl.load(c_ptrs, mask=d_mask[:, None] & col_mask[None, :], other=0.0)
        # DOT_PRECISION is "ieee" for fp32 inputs: real fp32 products, not tf32 (10-bit mantissa).
        z = dot(e, c, z, DOT_PRECISION)
        e_ptrs += BLOCK_D * stride_Ed
        c_ptrs += BLOCK_D * stride_Cd
    return z


@triton.jit
def logit_tile_tma(
    E_desc, C,  # E: a tensor descriptor (N, D) of (BLOCK_N, BLOCK_D) blocks; C: the same (C_DESC) or a pointer
    row0, col0,  # the tile's first row of E and, with C_DESC, its first row of C
    cols, col_mask,  # (BLOCK_V,) C's rows (any order) when C is a pointer
    D,
    stride_Cv, stride_Cd,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    C_DESC: tl.constexpr,
):
    """``logit_tile`` with E (and, for C's rows in order, C) read through tensor descriptors: on
    Hopper the copy engine (TMA) moves each block to shared memory, with no address arithmetic in
    the warps, and fills rows, columns and the D tail beyond the tensor's bounds with zeros. A
    gathered C (the sorted vocabulary) stays a pointer load: Hopper's TMA cannot gather rows."""
    z = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if not C_DESC:
        offs_d = tl.arange(0, BLOCK_D)
        c_ptrs = C + cols[None, :] * stride_Cv + offs_d[:, None] * stride_Cd  # (BLOCK_D, BLOCK_V)
    for d0 in range(0, D, BLOCK_D):
        e = E_desc.load([row0, d0])
        if C_DESC:
            c = C.load([col0, d0]).T
        else:
            c = tl.load(c_ptrs, mask=(offs_d < D - d0)[:, None] & col_mask[None, :], other=0.0)
            c_ptrs += BLOCK_D * stride_Cd
        z = dot(e, c, z, DOT_PRECISION)
    return z


@triton.jit
def add_bias(z, bias_ptr, cols, col_mask):
    """z + b[cols] for a logit tile (BLOCK_N, BLOCK_V) fp32: the head's bias, read in its dtype and
    added in fp32 before the soft cap (``cap(E C^T + b)``). Reference: ``reference_logits``."""
    b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return z + b[None, :]
