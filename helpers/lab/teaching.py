"""Reusable pieces for the kernel walkthrough (notebooks/04_kernel_walkthrough.py).

- ``memory_footprint``: the bytes of the logits a naive loss holds against the lower bound any
  method must pay (the two gradients), for a classifier head of shape (N, V, D);
- ``check`` and ``check_exercise``: the "does it match?" lines every step ends with, and the
  "your turn" checker that says right or not yet without stopping the notebook;
- ``solution``: the worked solution of each "your turn" cell, out of the attendee's sight (the
  notebook uses it under ``SOLUTIONS = True``, and until the attendee's own answer is right);
- ``block_mask`` and friends: which (BLOCK_N, BLOCK_V) tiles of the gradient the filter keeps, by
  the paper's rule (``block_mask``) and by the production kernel's (``row_mass_mask``).

The specifications themselves (indexed dot, online log-sum-exp, backward) live in the notebook,
next to their kernels; the only kernel code here is the solution of the Triton exercise.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from helpers.compare.heads import GEMMA2, QWEN3
from helpers.compare.theory import predicted_peak_bytes
from helpers.compare.units import GB, dtype_bytes, lower_bound_bytes
from helpers.spec import relative_error

# ---------------------------------------------------------------------------------------------
# Memory arithmetic
# ---------------------------------------------------------------------------------------------

# Vocabularies of real models, for the calculator's menu.
VOCABULARIES = {
    "GPT-2 (50,257)": 50_257,
    "Llama-3 (128,256)": 128_256,
    f"Qwen3 ({QWEN3.V:,})": QWEN3.V,
    f"Gemma-2 ({GEMMA2.V:,})": GEMMA2.V,
}


def memory_footprint(N: int, V: int, D: int, dtype: str | torch.dtype = "float32") -> dict[str, int]:
    """Bytes of what a linear cross-entropy over E (N, D), C (V, D) holds, by item.

    - ``logits``: the (N, V) logit matrix in the input dtype, N * V * bytes;
    - ``logits_fp32``: its fp32 copy for a stable softmax, N * V * 4; only for 16-bit inputs (fp32
      logits are upcast to themselves);
    - ``naive_peak``: what the naive loss really holds at its peak, 12 * N * V: three fp32 N×V
      tensors inside log_softmax's backward (``helpers.compare.theory``'s formula, which notebook 02
      checks against the measured peak);
    - ``lower_bound``: dE (N, D) and dC (V, D) in the input dtype, which any method must return;
    - ``lse``: the one number per row (fp32) that a cut method keeps between forward and backward.
    """
    b = dtype_bytes(dtype)
    footprint = {"logits": N * V * b}
    if b < 4:
        footprint["logits_fp32"] = N * V * 4
    footprint["naive_peak"] = predicted_peak_bytes("naive", N, V, D, dtype)
    footprint["lower_bound"] = lower_bound_bytes(N, V, D, dtype)
    footprint["lse"] = N * 4
    return footprint


def gigabytes(n_bytes: float) -> float:
    """Decimal GB (1e9 bytes), the unit GPU vendors print on the box."""
    return n_bytes / GB


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def max_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max absolute error, relative L2 error) of ``got`` against ``want``, both in float64."""
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    abs_err = (got64 - want64).abs().max().item() if got64.numel() else 0.0
    return abs_err, relative_error(got64, want64)


def check(name: str, got: torch.Tensor, want: torch.Tensor, *, atol: float | None = None, rtol: float = 0.0,
          rel_l2: float | None = None) -> dict:
    """Compare two tensors, print one line, and return the result as a dict for the results file.

    Right when every given rule holds: ``atol`` (with ``rtol``), every entry within
    atol + rtol * |want| (torch.allclose's rule); ``rel_l2``, the relative L2 error at most that.
    """
    if atol is None and rel_l2 is None:
        raise ValueError("check needs atol or rel_l2: a check with no bound cannot fail")
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        print(f"✗ {name}: expected a tensor of shape {tuple(want.shape)}, got {shape}")
        return {"name": name, "ok": False, "max_abs_error": None, "rel_l2_error": None}
    abs_err, rel = max_errors(got, want)
    ok = math.isfinite(rel)
    if atol is not None:
        ok &= torch.allclose(got.detach().double().cpu(), want.detach().double().cpu(), atol=atol, rtol=rtol)
    if rel_l2 is not None:
        ok &= rel <= rel_l2
    bounds = ", ".join(b for b in (f"atol {atol:g}" if atol is not None else "",
                                   f"bound {rel_l2:g}" if rel_l2 is not None else "") if b)
    print(f"{'✓' if ok else '✗'} {name}: max |error| {abs_err:.2e}, relative L2 error {rel:.2e} ({bounds})")
    return {"name": name, "ok": bool(ok), "max_abs_error": abs_err, "rel_l2_error": rel}


def check_exercise(
    name: str,
    attempt: Callable,
    solution: Callable,
    cases: Sequence[tuple],
    *,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    diagnose: Callable[[torch.Tensor, torch.Tensor], str | None] | None = None,
) -> bool:
    """Run a learner's ``attempt`` against ``solution`` on each case (a tuple of arguments).

    Never raises: a gap left as ``raise NotImplementedError`` is reported as "not filled in yet",
    a learner's bug as what it raised, so a notebook run with the gap open goes on to the next cell.
    A wrong value is explained by ``diagnose(got, want)`` where it recognises the mistake (see
    ``DIAGNOSES``), else by how far off it is.
    """
    for i, args in enumerate(cases):
        want = solution(*args)
        try:
            got = attempt(*args)
        except Exception as exc:  # a learner's bug: say what it was, do not stop the notebook
            if _gap_still_open(exc):
                print(f"… {name}: not filled in yet (the gap still raises NotImplementedError)")
            else:
                print(f"✗ {name}: case {i} raised {type(exc).__name__}: {exc}")
            return False
        wants = want if isinstance(want, tuple) else (want,)
        gots = got if isinstance(got, tuple) else (got,)
        if len(gots) != len(wants):
            print(f"✗ {name}: case {i} returned {len(gots)} values, expected {len(wants)}")
            return False
        for g, w in zip(gots, wants):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape:
                shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                print(f"✗ {name}: case {i} expected a tensor of shape {tuple(w.shape)}, got {shape}")
                return False
            if not torch.allclose(g.double(), w.double(), atol=atol, rtol=rtol):
                err = (g.double() - w.double()).abs().max().item()
                why = diagnose(g.double(), w.double()) if diagnose else None
                print(f"✗ {name}: wrong: case {i} is off by up to {err:.3g}; "
                      + (why or "look at the formula again"))
                return False
    print(f"✓ {name}: right on {'the one case' if len(cases) == 1 else f'all {len(cases)} cases'}")
    return True


class Exercises:
    """The "your turn" cells of a notebook: each one checked on fresh inputs every time it is run,
    and answered by name for the cells after it.

    ``check(name, attempt, check_attempt)`` runs ``check_attempt(attempt)`` on the attempt as the
    caller holds it now, never a stored one: re-running a check cell re-runs the attendee's current
    code, so a wrong answer cannot turn right by running the check again. ``use(name)`` is what the
    later cells call: the attempt that passed its last check, the worked solution otherwise (so
    the notebook always runs to the end). The attendee's own name (``fold_tile``) is never rebound.

    ``solutions=True`` (the teacher's run, the test suite's) checks and uses the worked solutions.
    ``fresh()`` gives each check its inputs: a generator seeded anew at every call.
    """

    def __init__(self, solutions: bool = False, seed: int = 0):
        self.solutions = solutions
        self.right: dict[str, bool] = {}
        self._passed: dict[str, Callable] = {}
        self._seed = seed
        self._draws = 0

    def fresh(self) -> torch.Generator:
        """A generator for one check's inputs, seeded differently at every call."""
        self._draws += 1
        return torch.Generator().manual_seed(self._seed * 1_000_003 + self._draws)

    def check(self, name: str, attempt: Callable, check_attempt: Callable[[Callable], bool]) -> bool:
        """Check ``attempt`` (the solution under ``solutions``) now; record and return whether it is right."""
        if self.solutions:
            attempt = solution(name)
        ok = bool(check_attempt(attempt))
        self.right[name] = ok
        if ok:
            self._passed[name] = attempt
        else:
            self._passed.pop(name, None)
            print("   (later cells use the worked solution until yours is right)")
        return ok

    def use(self, name: str) -> Callable:
        """The function later cells call for exercise ``name``: the attempt that passed, else the solution."""
        return self._passed.get(name) or solution(name)

    def reset(self, name: str) -> None:
        """Forget exercise ``name``'s result: later cells use the worked solution until it passes again."""
        self.right.pop(name, None)
        self._passed.pop(name, None)


def _gap_still_open(error: BaseException) -> bool:
    """Whether ``error`` comes from a gap still left as ``raise NotImplementedError``.

    In PyTorch code it is that error, bare. Inside a Triton function the interpreter re-raises it
    wrapped (InterpreterError, raised from it), and the compiler refuses the statement itself
    (CompilationError, raised from "unsupported AST node type: Raise"), so the whole chain is read.
    Triton's own NotImplementedErrors carry a message ("... is not supported in triton"): a bug.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, NotImplementedError) and not error.args:
            return True
        if "unsupported AST node type: Raise" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


# ---------------------------------------------------------------------------------------------
# The worked solutions of the "your turn" cells, by name
# ---------------------------------------------------------------------------------------------


def _indexed_dot(E, C, x):
    """o_i = C_{x_i} . E_i, (N,) float64: one gathered row of C per token, no (N, V) tensor."""
    return (E.double() * C[x].double()).sum(dim=1)


@triton.jit
def _fold_tile(m, s, z):
    """Each row's running (m, s) after the logit tile z (BLOCK_N, BLOCK_V) of the LSE kernel."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    # Both sums rescaled to the new maximum: s e^{m - m'} + sum_v e^{z_v - m'}.
    s_new = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
    return m_new, s_new


@triton.jit
def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    """out = alpha * x + y over n elements, BLOCK per program: the primer's warm-up."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n  # the last program's block runs past n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, alpha * x + y, mask=mask)


@triton.jit
def _add_dC_tile(dC_ptr, G, e, cols, d, V, D, scale):
    """dC[cols, d] += scale * G^T e: one tile's share, added atomically (every row block adds to it)."""
    dC_tile = tl.dot(tl.trans(G), e) * scale  # (BLOCK_V, BLOCK_N) @ (BLOCK_N, BLOCK_D)
    tl.atomic_add(dC_ptr + cols[:, None] * D + d[None, :], dC_tile, mask=(cols < V)[:, None] & (d < D)[None, :])


@triton.jit
def _keep_tile_row_mass(G, eps):
    """The production rule: keep the tile unless, in every row, its |G| entries sum to less than eps."""
    return tl.max(tl.sum(tl.abs(G), axis=1)) >= eps


def _logit_gradient(S, x):
    """G = (S - onehot(x)) / N, (N, V): the gradient of the mean loss with respect to the logits."""
    return (S - F.one_hot(x, S.shape[1]).to(S.dtype)) / S.shape[0]


def _kahan_add(s, c, t):
    """(s + t, the new compensation), every operation rounded to s's dtype."""
    y = t - c
    new_s = s + y
    return new_s, (new_s - s) - y  # (new_s - s) is what the addition added; minus y, what it lost


@triton.jit
def kahan_step(s, c, t):
    """One compensated addition in Triton, s and c in the accumulator's dtype: (s + t, the new c).

    The Triton twin of the notebook's ``kahan_add`` exercise, kept here so that the page does not
    print its answer before the attendee has written it.
    """
    y = t - c
    new_s = s + y
    return new_s, (new_s - s) - y


_SOLUTIONS = {
    "scaled_add": _scaled_add_kernel,
    "indexed_dot": _indexed_dot,
    "fold_tile": _fold_tile,
    "logit_gradient": _logit_gradient,
    "add_dC_tile": _add_dC_tile,
    "kahan_add": _kahan_add,
    "keep_tile": _keep_tile_row_mass,
}


def solution(name: str) -> Callable:
    """The worked solution of the "your turn" cell ``name``: a function with the attempt's signature
    (for ``fold_tile``, a ``@triton.jit`` function the LSE kernel calls)."""
    if name not in _SOLUTIONS:
        raise KeyError(f"no exercise {name!r}; exercises: {sorted(_SOLUTIONS)}")
    return _SOLUTIONS[name]


def show_solution(name: str) -> str:
    """Print and return the source of exercise ``name``'s worked solution (the teacher's reveal)."""
    fn = solution(name)
    source = inspect.getsource(getattr(fn, "fn", fn))  # a @triton.jit function keeps the Python one in .fn
    print(source)
    return source


# What a wrong answer's numbers say about the mistake, by exercise: diagnose(got, want) -> str | None.


def _diagnose_ratio(got, want, known: dict[str, Callable]) -> str | None:
    for why, mistake in known.items():
        if torch.allclose(got, mistake(want), rtol=1e-3, atol=1e-12):
            return why
    return None


def _diagnose_lse(got, want):
    if not torch.isfinite(got).all():
        return "some rows overflowed to inf or nan: subtract the running maximum before tl.exp (z - m_new)"
    if (got > want).all():
        return ("every LSE is too large: the old s counts its terms relative to the old maximum m; "
                "rescale it to m_new before adding the tile's")
    if (got < want).all():
        return "every LSE is too small: some terms are missing or shrunk (the tile's, or the old s's)"
    return None


def _diagnose_dC(got, want):
    if not torch.isfinite(got).all():
        return "dC holds inf or nan: mask the columns past V and the d past D"
    if got.abs().max() == 0:
        return "dC is all zeros: nothing was added (tl.atomic_add into dC_ptr at [cols, d])"
    return ("the tile's share is dC[cols, d] += scale * G^T e, (BLOCK_V, BLOCK_D): check the transpose, the "
            "scale (1/N) and the pointer offsets (row v of dC starts at v * D)")


DIAGNOSES: dict[str, Callable] = {
    "indexed_dot": lambda got, want: (
        "right formula, too little precision: the spec works in float64 (.double())"
        if torch.allclose(got, want, rtol=1e-4, atol=1e-4) else
        "each row needs the row of C at its own target x_i, not C's rows in order or all of them"),
    "fold_tile": _diagnose_lse,
    "logit_gradient": lambda got, want: _diagnose_ratio(got, want, {
        "N times too large: the loss is a mean over the N rows": lambda w: w * w.shape[0],
        "the sign is flipped": lambda w: -w,
    }) or "compare with dℓ/dz: the softmax, minus 1 at the target, for each row",
    "add_dC_tile": _diagnose_dC,
    "kahan_add": lambda got, want: (
        "the sum drifts like an uncompensated one: c must be what the addition lost, from (new_s - s) and y, "
        "with the sign that y = t - c subtracts next time"),
}


# ---------------------------------------------------------------------------------------------
# Data whose softmax looks like a trained model's
# ---------------------------------------------------------------------------------------------


def entries_per_row(S: torch.Tensor, eps: float = 2.0**-12) -> float:
    """Mean number of softmax entries per row above eps: the paper's sparsity statistic."""
    return (S > eps).sum(dim=1).double().mean().item()


# ---------------------------------------------------------------------------------------------
# Block masks: which tiles of G the gradient filter keeps
# ---------------------------------------------------------------------------------------------


def _abs_tiles(A: torch.Tensor, block_n: int, block_v: int) -> torch.Tensor:
    """|A| (N, V) as tiles: (cdiv(N, block_n), block_n, cdiv(V, block_v), block_v).

    Ragged edge tiles are padded with zeros, which never raise a maximum or a sum of absolute values.
    """
    N, V = A.shape
    nb_n, nb_v = -(-N // block_n), -(-V // block_v)
    padded = A.new_zeros(nb_n * block_n, nb_v * block_v)
    padded[:N, :V] = A.abs()
    return padded.reshape(nb_n, block_n, nb_v, block_v)


def block_max(A: torch.Tensor, block_n: int, block_v: int) -> torch.Tensor:
    """max |A| over each (block_n, block_v) tile of A (N, V): (cdiv(N, block_n), cdiv(V, block_v))."""
    return _abs_tiles(A, block_n, block_v).amax(dim=(1, 3))


def block_mask(G: torch.Tensor, block_n: int, block_v: int, eps: float) -> torch.Tensor:
    """True where a tile of G holds at least one entry with |G| >= eps: the tiles that are computed.

    A tile where every |G| < eps is skipped (the paper's rule): each of its entries is below what a
    low-precision sum of order 1 can register.
    """
    return block_max(G, block_n, block_v) >= eps


def row_mass_mask(G: torch.Tensor, block_n: int, block_v: int, eps: float) -> torch.Tensor:
    """True where a tile of G has a row whose |G| entries in it sum to at least eps: the tiles the
    production kernel computes (its row-mass rule, ``helpers/cce/kernels/gradient_chunk.py``).

    Stricter than ``block_mask``: on a flat softmax every entry is below eps while a row's mass in a
    tile is not, so this rule keeps the tiles the paper's would drop with the whole softmax.
    """
    return _abs_tiles(G, block_n, block_v).sum(dim=3).amax(dim=1) >= eps


def skipped_fraction(mask: torch.Tensor) -> float:
    """Fraction of tiles the filter skips (mask False)."""
    return 1.0 - mask.double().mean().item()


def vocabulary_order(E: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """Vocabulary indices sorted by average logit, largest first: (V,) int64.

    mean_i z_{i, v} = (mean_i E_i) . C_v, so the order costs one (V, D) @ (D,) product and never
    needs the (N, V) logits.
    """
    average_logit = C.double() @ E.double().mean(dim=0)  # (V,)
    return torch.argsort(average_logit, descending=True)


def masks_agree(
    name: str,
    kept: torch.Tensor,
    G: torch.Tensor,
    block_n: int,
    block_v: int,
    eps: float,
    *,
    margin: float = 1e-2,
) -> dict:
    """Does a kernel's record of computed tiles match ``block_mask(G, ...)``? Prints one line.

    A kernel computes G in fp32 from rounded inputs, the spec in float64: a tile whose largest
    |G| lies within ``margin`` (relative) of eps may fall either way, so only the tiles clear of
    the threshold must agree.
    """
    peak = block_max(G, block_n, block_v)
    clear = ((peak - eps).abs() > margin * eps).cpu()
    spec = (peak >= eps).cpu()
    kept = kept.cpu()
    differ = int((kept != spec)[clear].sum())
    borderline = int((~clear).sum())
    ok = differ == 0
    mark = "✓" if ok else "✗"
    print(f"{mark} {name}: {differ} of {kept.numel()} tiles differ from the spec "
          f"({borderline} within {margin:.0%} of eps, allowed either way)")
    return {"name": name, "ok": ok, "tiles_differing": differ, "tiles_borderline": borderline}


def expand_mask(mask: torch.Tensor, block_n: int, block_v: int, N: int, V: int) -> torch.Tensor:
    """A tile mask (cdiv(N, block_n), cdiv(V, block_v)) as an entry mask (N, V)."""
    return mask.repeat_interleave(block_n, dim=0).repeat_interleave(block_v, dim=1)[:N, :V]


# ---------------------------------------------------------------------------------------------
# Tiles and time
# ---------------------------------------------------------------------------------------------


def teaching_block_d(D: int, block_n: int, block_v: int, shared_memory_bytes: int | None) -> int:
    """BLOCK_D, the chunk of D the walkthrough's kernels load per step, for a card with
    ``shared_memory_bytes`` per block (None: the CPU interpreter, no limit, all of D at once).

    The kernels' tiles of E (block_n, BLOCK_D) and C (block_v, BLOCK_D) pass through shared memory
    for ``tl.dot``. Counted at 4 bytes an element (compiled for a T4, Triton holds 16-bit operands
    as fp32 there) they must fit in half the card's shared memory, the rest left for the compiler's
    scratch: on a T4 (64 KB), 16 × 16 tiles take D in chunks of 256. At least 16, tl.dot's minimum.
    """
    block_d = triton.next_power_of_2(D)
    if shared_memory_bytes is None:
        return block_d
    while block_d > 16 and (block_n + block_v) * block_d * 4 > shared_memory_bytes // 2:
        block_d //= 2
    return block_d


class SectionTimer:
    """Seconds per section of a notebook: call it with a section's name at the section's first
    cell, ``stop()`` at the end; ``seconds`` maps each name to its wall time (re-running a section
    adds to it)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def __call__(self, name: str) -> None:
        self.stop()
        self._current = (name, time.perf_counter())

    def stop(self) -> None:
        if self._current is not None:
            name, began = self._current
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began
            self._current = None
