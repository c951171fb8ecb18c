"""The "gemm" backward's kernel: G written per vocabulary chunk, its two products left to cuBLAS.

Why. The "atomic" backward (``atomic_gradients.py``) forms each (BLOCK_N, BLOCK_V) block of G on chip and adds
G C_tile into dE and G^T E_tile into dC with fp32 atomics: every tile adds (BLOCK_N + BLOCK_V) * D
values. At the Gemma-2-2B head (N = 8,192, V = 256,000, D = 2,304, 128 x 128 tiles) that is
128,000 tiles x 256 x 2,304 = 7.5e10 atomic adds, ~300 GB of read-modify-write through L2 for a
2.4 GB result: ~100 of its 128 ms backward (docs/PERFORMANCE.md). Here G goes to global memory
instead, one vocabulary chunk [v0, v1) of V_c columns at a time, and the products become two
dense GEMMs that write each gradient element once per chunk:

    G_c  = dloss / dz[:, v0:v1]             (N, V_c) in E's dtype    this kernel
    dC[v0:v1] = g_scale * G_c^T (g_rel * E)  (V_c, D), written once   cuBLAS
    dE_acc   += G_c C[v0:v1]                 (N, D) fp32              cuBLAS, fp32 output
    dE        = g * dE_acc, rounded once                              after the last chunk

The bytes: G_c is written once and read twice (3 N V itemsize bytes over the whole backward:
12.6 GB at Gemma bf16, ~3 ms at 4.3 TB/s), and dE_acc is read and written once per chunk
(2 N D 4 bytes per chunk), against 300 GB of atomics. The arithmetic is unchanged: the logit
product here plus the two products, 3 of the 4 N x V x D products of a recomputing backward.

G is the "atomic" kernel's, to the bit: ``gradient_tile`` (``gradient_tile.py``, shared by every backward) rebuilds the logits and
forms G = S (1 + 2 zl lse) - (1 - ls) [v = x] - ls / V (times 1 - (z / softcap)^2 under the soft
cap), 0 at ignored rows. The upstream gradient g_i stays out of G, as in the "atomic" kernel and for the same
reason (fp16: g = 1/N_kept times S ~ 1e-6 underflows): dE is scaled per row after its product,
and dC's product takes g_rel E (g_rel = g / max|g|, |g_rel| <= 1) with g_scale = max|g| as the
GEMM's alpha; for a mean or sum, g_rel is 1 at every kept row and the host passes E itself.

Gradient filter (paper section 4.2, the row-mass rule of ``gradient_tile.py``'s callers): a tile whose rows each hold less than eps of |G|
mass writes zeros and records itself in ``tile_kept`` (0 = skipped), so that the GEMMs could skip
it; they do not yet (dense cuBLAS products read the zeros). FULL_C / FULL_E (one gradient exact)
use SPLIT_G: the kernel writes the real G to ``G_exact_ptr`` as well, and the host feeds the exact
gradient's product from it, the filtered one's from ``G_ptr``.

Tensor descriptors (E_DESC, G_DESC; ``helpers.cce.descriptors``): on the Hopper tier E and C come
through the copy engine and G leaves through it, for chunks large enough that the descriptors'
host time per launch is hidden (``HostTuning.tma_min_chunk_flop``, ``helpers.cce.kernels.configs``); same bits.

Persistent walk (PERSISTENT, ``LaunchConfig.persistent``; the Hopper tier): a program per
multiprocessor takes tiles pid, pid + programs, ... in one loop that the compiler fuses with the
logit loop inside it (``tl.range(flatten=True)``), so the next tile's first loads are in flight
while this tile's G is formed, filtered and stored, and the copy engine's store of G waits only
before the next one. One program per tile instead refills its pipeline and drains its store each
time. Same tiles, same arithmetic: the same bits.

Reference: autograd through ``helpers.spec.reference_loss`` (tests/cce/test_cce.py runs every
option with ``backward_impl="gemm"``, the default); the host function is ``helpers.cce.cce_backward``.
"""

import triton
import triton.language as tl

from helpers.cce.kernels.gradient_tile import gradient_tile, grouped_tile


@triton.jit
def gradient_chunk_kernel(
    # pointers
    E_ptr, C_ptr, x_ptr,  # E (N, D), C (V, D), x (N,) targets
    lse_ptr,  # (N,) fp32 from the forward pass
    coef_ptr,  # (3 or 4, stride_coef) fp32: each row's G coefficients a, t, c (and d: ENTROPY) (``gradient_tile``)
    bias_ptr,  # (V,) the head's bias (HAS_BIAS only)
    vocab_order_ptr,  # (V,) int64: C's row at each sorted position (SORTED only)
    G_ptr,  # (N, v_count) in E's dtype: G of this chunk, zeros in skipped tiles
    G_exact_ptr,  # (N, v_count) in E's dtype: G of this chunk, no tile skipped (SPLIT_G only)
    tile_kept_ptr,  # (N / BLOCK_N, v_count / BLOCK_V) int8: 0 where the filter skipped (FILTER only)
    # sizes
    N, V, D,
    v_begin, v_count,  # this launch covers vocabulary positions [v_begin, v_begin + v_count)
    # strides
    stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x,
    stride_Gn, stride_Gv,  # shared by G and G_exact
    stride_coef,
    # options
    softcap, eps,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FILTER: tl.constexpr,
    SPLIT_G: tl.constexpr,
    SORTED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    E_DESC: tl.constexpr = False,  # E_ptr (and C_ptr unless SORTED) are tensor descriptors
    G_DESC: tl.constexpr = False,  # G_ptr is a tensor descriptor of (BLOCK_N, BLOCK_V // G_SUBTILE) blocks
    G_SUBTILE: tl.constexpr = 1,  # G_DESC: the tile leaves in this many column blocks (1 or 2)
    PERSISTENT: tl.constexpr = False,  # each program walks tiles pid, pid + programs, ... (one flattened loop)
    inv_temperature=1.0,  # 1 / temperature (``gradient_tile``)
    ENTROPY: tl.constexpr = False,  # coef has a fourth row: the entropy's term (``gradient_tile``)
    class_weight_ptr=None,  # (V,) fp32: the smoothing term's class weights (CLASS_WEIGHTS, ``gradient_tile``)
    CLASS_WEIGHTS: tl.constexpr = False,
    # The chunk's logits E C^T already made (by cuBLAS: ``helpers.cce.cublas_logits``), (N, v_count) fp32 with row
    # stride stride_zn: read, not rebuilt.
    z_ptr=None, stride_zn=0,
    Z_GIVEN: tl.constexpr = False,
    # Each tile's row masses, the filter's sums of |G| (ROW_SUMS), stored at row_sums_ptr (v_count / BLOCK_V, N)
    # fp32, tile column pid_v's row i at pid_v N + i: with G's coefficients (1, 0, 0) and the target's logit as
    # the lse, each row's sum of exp(z - z_x) off the target (``helpers.cce.forward_de``).
    row_sums_ptr=None,
    ROW_SUMS: tl.constexpr = False,
):
    if PERSISTENT:
        # [Persistent walk] one loop over this program's tiles, flattened with the logit loop inside,
        # so that the pipeliner issues the next tile's first loads while this tile's epilogue
        # (G formed, filtered and stored) runs.
        tiles = tl.cdiv(N, BLOCK_N) * tl.cdiv(v_count, BLOCK_V)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
            _gradient_chunk_tile(
                tile, E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr, vocab_order_ptr, G_ptr, G_exact_ptr,
                tile_kept_ptr, N, V, D, v_begin, v_count, stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x,
                stride_Gn, stride_Gv, stride_coef, softcap, eps, BLOCK_N, BLOCK_V, BLOCK_D, GROUP_N,
                HAS_SOFTCAP, HAS_BIAS, FILTER, SPLIT_G, SORTED, DOT_PRECISION, E_DESC, G_DESC, G_SUBTILE,
                inv_temperature, ENTROPY, class_weight_ptr, CLASS_WEIGHTS, z_ptr, stride_zn, Z_GIVEN,
                row_sums_ptr, ROW_SUMS)
    else:
        _gradient_chunk_tile(
            tl.program_id(0), E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr, vocab_order_ptr, G_ptr,
            G_exact_ptr, tile_kept_ptr, N, V, D, v_begin, v_count, stride_En, stride_Ed, stride_Cv, stride_Cd,
            stride_x, stride_Gn, stride_Gv, stride_coef, softcap, eps, BLOCK_N, BLOCK_V, BLOCK_D, GROUP_N,
            HAS_SOFTCAP, HAS_BIAS, FILTER, SPLIT_G, SORTED, DOT_PRECISION, E_DESC, G_DESC, G_SUBTILE,
            inv_temperature, ENTROPY, class_weight_ptr, CLASS_WEIGHTS, z_ptr, stride_zn, Z_GIVEN,
            row_sums_ptr, ROW_SUMS)


@triton.jit
def _gradient_chunk_tile(
    tile, E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr, vocab_order_ptr, G_ptr, G_exact_ptr,
    tile_kept_ptr, N, V, D, v_begin, v_count, stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x,
    stride_Gn, stride_Gv, stride_coef, softcap, eps,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, FILTER: tl.constexpr, SPLIT_G: tl.constexpr,
    SORTED: tl.constexpr, DOT_PRECISION: tl.constexpr, E_DESC: tl.constexpr, G_DESC: tl.constexpr,
    G_SUBTILE: tl.constexpr, inv_temperature, ENTROPY: tl.constexpr, class_weight_ptr,
    CLASS_WEIGHTS: tl.constexpr, z_ptr, stride_zn, Z_GIVEN: tl.constexpr,
    row_sums_ptr, ROW_SUMS: tl.constexpr,
):
    """Tile ``tile`` of the chunk (``gradient_chunk_kernel``'s arguments)."""
    # 1. [Grouped order] the tile's place in the chunk; C strips are shared through L2.
    pid_n, pid_v = grouped_tile(tile, N, v_count, BLOCK_N, BLOCK_V, GROUP_N)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_mask = rows < N
    # Columns in int32 (below V < 2^31): the tile's per-element indices stay 32-bit; products
    # with a stride are made in int64 (``logit_tile``, the G pointers).
    local_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # (BLOCK_V,) columns of G_c
    col_mask = local_v < v_count
    if SORTED:
        # [Vocabulary sort, section 4.3] position -> C row, so tiles of large logits are dense.
        cols = tl.load(vocab_order_ptr + v_begin + local_v, mask=col_mask, other=0).to(tl.int32)
    else:
        cols = v_begin + local_v

    g_ptrs = rows[:, None] * stride_Gn + local_v.to(tl.int64)[None, :] * stride_Gv  # (BLOCK_N, BLOCK_V)
    g_mask = row_mask[:, None] & col_mask[None, :]
    if Z_GIVEN:
        z_ptrs = z_ptr + rows[:, None] * stride_zn + local_v.to(tl.int64)[None, :]
    else:
        z_ptrs = g_ptrs  # not read

    # 2. The logit tile rebuilt on chip (or, Z_GIVEN, read where cuBLAS wrote it) and its gradient, exactly as
    # the "atomic" kernel forms it.
    G, mass = gradient_tile(E_ptr, C_ptr, x_ptr, lse_ptr, coef_ptr, bias_ptr, rows, cols, row_mask, col_mask,
                          V, D, stride_En, stride_Ed, stride_Cv, stride_Cd, stride_x, stride_coef, softcap,
                          BLOCK_N, BLOCK_V, BLOCK_D, HAS_SOFTCAP, HAS_BIAS, DOT_PRECISION,
                          E_DESC, E_DESC and not SORTED, pid_n * BLOCK_N, v_begin + pid_v * BLOCK_V,
                          inv_temperature, ENTROPY, class_weight_ptr, CLASS_WEIGHTS,
                          Z_GIVEN, z_ptrs, g_mask)

    if ROW_SUMS:  # the filter's row sums, kept (module doc; the kernel's ROW_SUMS)
        tl.store(row_sums_ptr + pid_v.to(tl.int64) * N + rows, mass, mask=row_mask)

    if G_DESC:
        dtype = G_ptr.dtype
    else:
        dtype = G_ptr.dtype.element_ty

    # 3. [Gradient filter, section 4.2] a tile whose rows each hold less than eps of |G| mass
    # (the row-mass rule: the sum, not the largest entry) is written as zeros and recorded as skipped.
    if FILTER:
        kept_tile = tl.max(mass) >= eps
        tl.store(tile_kept_ptr + pid_n * tl.cdiv(v_count, BLOCK_V) + pid_v, kept_tile.to(tl.int8))
        if SPLIT_G:
            tl.store(G_exact_ptr + g_ptrs, G.to(dtype), mask=g_mask)
        G = tl.where(kept_tile, G, 0.0)

    # 4. G_c in the input dtype, the operand of both GEMMs (a bf16/fp16 product rounds G there
    # anyway, as the "atomic" kernel's tl.dot and the naive path's matmuls do).
    if G_DESC and G_SUBTILE == 2:  # two column halves: half the shared memory for the copy engine
        halves = tl.permute(tl.reshape(G.to(dtype), (BLOCK_N, 2, BLOCK_V // 2)), (0, 2, 1))
        G_left, G_right = tl.split(halves)
        G_ptr.store([pid_n * BLOCK_N, pid_v * BLOCK_V], G_left)
        G_ptr.store([pid_n * BLOCK_N, pid_v * BLOCK_V + BLOCK_V // 2], G_right)
    elif G_DESC:  # the copy engine writes the block, clipped to the chunk's bounds
        G_ptr.store([pid_n * BLOCK_N, pid_v * BLOCK_V], G.to(dtype))
    else:
        tl.store(G_ptr + g_ptrs, G.to(dtype), mask=g_mask)
