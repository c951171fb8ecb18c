"""Fast CPU tests of helpers/lab/teaching.py, the pieces behind the kernel walkthrough (notebook 04)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from helpers.compare.heads import GEMMA2, QWEN3
from helpers.compare.inputs import make_inputs
from helpers.lab.teaching import (
    DIAGNOSES,
    block_mask,
    check,
    check_exercise,
    gigabytes,
    masks_agree,
    memory_footprint,
    row_mass_mask,
    show_solution,
    skipped_fraction,
    solution,
    vocabulary_order,
)


# --- memory arithmetic ------------------------------------------------------------------------


def test_qwen3_fp32_logits_are_9_96_gb():
    f = memory_footprint(16_384, QWEN3.V, QWEN3.D, "float32")
    assert f["logits"] == 16_384 * 151_936 * 4 == 9_957_277_696
    assert round(gigabytes(f["logits"]), 2) == 9.96
    assert f["lower_bound"] == (16_384 + 151_936) * 1_024 * 4
    assert round(gigabytes(f["lower_bound"]), 2) == 0.69  # the notebook's prose says so
    assert f["lse"] == 16_384 * 4
    assert "logits_fp32" not in f  # fp32 logits are their own fp32 copy: not a second tensor


def test_the_naive_peak_is_12_bytes_per_logit_in_every_dtype():
    for dtype in ("float32", "bfloat16", "float16"):
        f = memory_footprint(16_384, QWEN3.V, QWEN3.D, dtype)
        assert f["naive_peak"] == 12 * 16_384 * 151_936
    assert round(gigabytes(f["naive_peak"]), 1) == 29.9  # past a T4's 16 GB at the notebook's defaults


def test_bf16_halves_logits_but_not_the_fp32_copy():
    f = memory_footprint(8_192, GEMMA2.V, GEMMA2.D, torch.bfloat16)
    assert f["logits"] * 2 == f["logits_fp32"]
    # The Gemma-2-2B head's lower bound: 1,161 MiB.
    assert round(f["lower_bound"] / 1024**2) == 1_161


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype"):
        memory_footprint(1, 1, 1, "int8")


# --- checks -----------------------------------------------------------------------------------


def test_check_says_right_and_wrong(capsys):
    want = torch.tensor([1.0, 2.0, 3.0])
    assert check("same", want + 1e-7, want, atol=1e-6)["ok"]
    assert "✓" in capsys.readouterr().out
    result = check("off", want + 1e-3, want, atol=1e-6)
    assert not result["ok"] and result["max_abs_error"] == pytest.approx(1e-3, rel=1e-3)
    assert "✗" in capsys.readouterr().out
    assert not check("shape", want[:2], want, atol=1.0)["ok"]


def _dot_truth(E, C, x):
    return (E.double() @ C.double().T)[torch.arange(len(x)), x]


def _cases():
    g = torch.Generator().manual_seed(0)
    E, C = torch.randn(6, 5, generator=g), torch.randn(9, 5, generator=g)
    return [(E, C, torch.randint(0, 9, (6,), generator=g))]


def test_check_exercise_right(capsys):
    def attempt(E, C, x):
        return (E.double() * C[x].double()).sum(1)

    assert check_exercise("dot", attempt, _dot_truth, _cases(), atol=1e-9)
    assert "right" in capsys.readouterr().out


def test_check_exercise_wrong(capsys):
    def attempt(E, C, x):
        return (E.double() * C[:6].double()).sum(1)  # ignores the targets

    assert not check_exercise("dot", attempt, _dot_truth, _cases(), atol=1e-9)
    assert "off by" in capsys.readouterr().out


def test_check_exercise_gap_left_open_does_not_raise(capsys):
    def attempt(E, C, x):
        raise NotImplementedError

    assert not check_exercise("dot", attempt, _dot_truth, _cases())
    assert "not filled in yet" in capsys.readouterr().out

    def returns_nothing(E, C, x):
        return None

    assert not check_exercise("dot", returns_nothing, _dot_truth, _cases())
    assert "expected a tensor" in capsys.readouterr().out


def test_check_exercise_says_one_case_in_words(capsys):
    assert check_exercise("dot", _dot_truth, _dot_truth, _cases())
    assert "right on the one case" in capsys.readouterr().out
    assert check_exercise("dot", _dot_truth, _dot_truth, _cases() * 2)
    assert "right on all 2 cases" in capsys.readouterr().out


@triton.jit
def _gap(m, s, z):
    raise NotImplementedError


@triton.jit
def _fold_kernel(m_ptr, s_ptr, z_ptr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, FOLD: tl.constexpr):
    """Fold one (BLOCK_N, BLOCK_V) tile z into the pairs (m, s), as notebook 04's LSE kernel does."""
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    z = tl.load(z_ptr + rows[:, None] * BLOCK_V + cols[None, :])
    m, s = FOLD(tl.load(m_ptr + rows), tl.load(s_ptr + rows), z)
    tl.store(m_ptr + rows, m)
    tl.store(s_ptr + rows, s)


def _fold(fold, m, s, z):
    m, s = m.clone(), s.clone()
    _fold_kernel[(1,)](m, s, z, BLOCK_N=z.shape[0], BLOCK_V=z.shape[1], FOLD=fold)
    return m, s


def _fold_truth(m, s, z):  # the pair of the two blocks together, from the definition
    m_new = torch.maximum(m, z.max(dim=1).values)
    return m_new, torch.exp(torch.logaddexp(m + torch.log(s), torch.logsumexp(z, dim=1)) - m_new)


def _fold_cases():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, generator=g) * 50, torch.rand(16, generator=g) + 1, torch.randn(16, 32, generator=g) * 50)]


def test_a_triton_gap_under_the_interpreter_is_not_filled_in_yet(capsys):
    # The interpreter re-raises the gap's NotImplementedError wrapped in its own InterpreterError.
    assert not check_exercise("fold", lambda *case: _fold(_gap, *case), _fold_truth, _fold_cases())
    assert "not filled in yet" in capsys.readouterr().out


@triton.jit
def _fold_without_rescaling(m, s, z):
    m_new = tl.maximum(m, tl.max(z, axis=1))
    return m_new, s + tl.sum(tl.exp(z - m_new[:, None]), axis=1)  # s still relative to the old m


def test_a_wrong_triton_line_is_off(capsys):
    assert not check_exercise("fold", lambda *case: _fold(_fold_without_rescaling, *case), _fold_truth,
                              _fold_cases(), atol=0.0, rtol=1e-5)
    assert "off by" in capsys.readouterr().out


def test_a_triton_gap_refused_by_the_compiler_is_not_filled_in_yet(tmp_path):
    """On a GPU the compiler refuses the gap's `raise` statement; compiled here for an H100, in a
    process of its own: a real compile needs TRITON_INTERPRET=0 and kernels defined in a file."""
    script = tmp_path / "compile_gap.py"
    script.write_text(textwrap.dedent("""
        import triton, triton.language as tl
        from helpers.lab.teaching import check_exercise

        @triton.jit
        def gap(m, s, z):
            raise NotImplementedError

        @triton.jit
        def kernel(m_ptr, FOLD: tl.constexpr):
            m = tl.load(m_ptr + tl.arange(0, 16))
            m, s = FOLD(m, m, m)
            tl.store(m_ptr + tl.arange(0, 16), s)

        def attempt():
            triton.compile(triton.compiler.ASTSource(fn=kernel, signature={"m_ptr": "*fp32", "FOLD": "constexpr"},
                                                     constexprs={"FOLD": gap}),
                           target=triton.backends.compiler.GPUTarget("cuda", 90, 32))

        check_exercise("fold", attempt, lambda: None, [()])
    """))
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert "not filled in yet" in done.stdout, done.stdout + done.stderr[-3000:]


def test_tritons_own_not_implemented_errors_are_bugs_not_gaps(capsys):
    def attempt(E, C, x):
        raise NotImplementedError("__setitem__ is not supported in triton")

    assert not check_exercise("dot", attempt, _dot_truth, _cases())
    assert "raised NotImplementedError: __setitem__" in capsys.readouterr().out


def test_every_worked_solution_is_right():
    assert check_exercise("indexed dot", solution("indexed_dot"), _dot_truth, _cases(), atol=1e-12)
    assert check_exercise("fold", lambda *case: _fold(solution("fold_tile"), *case), _fold_truth, _fold_cases(),
                          atol=0.0, rtol=1e-5)

    def gradient_truth(S, x):  # autograd; log S are logits whose softmax is S
        z = S.log().requires_grad_(True)
        F.cross_entropy(z, x).backward()
        return z.grad

    E, C, x = _cases()[0]
    S = torch.softmax(E.double() @ C.double().T, dim=1)
    assert check_exercise("G", solution("logit_gradient"), gradient_truth, [(S, x)], atol=0.0, rtol=1e-9)

    def bf16_sum(terms, add):  # every operation rounded to bf16
        s = c = torch.zeros(terms.shape[1], dtype=torch.bfloat16)
        for t in terms.to(torch.bfloat16):
            s, c = add(s, c, t)
        return s.double()

    terms = torch.rand(1000, 8, generator=torch.Generator().manual_seed(0)) * 0.01 + 0.1
    exact = terms.to(torch.bfloat16).double().sum(dim=0)
    assert torch.allclose(bf16_sum(terms, solution("kahan_add")), exact, atol=0.0, rtol=2.0**-8)
    plain = bf16_sum(terms, lambda s, c, t: (s + t, c))  # no compensation: far off
    assert not torch.allclose(plain, exact, atol=0.0, rtol=2.0**-8)


def test_solution_names_the_exercises_when_asked_for_another():
    with pytest.raises(KeyError, match="indexed_dot"):
        solution("merge_lse")


def test_check_exercise_compares_tuples():
    def truth(a):
        return a, 2 * a

    assert check_exercise("pair", lambda a: (a, a + a), truth, [(torch.ones(3),)])
    assert not check_exercise("pair", lambda a: (a, a), truth, [(torch.ones(3),)])
    assert not check_exercise("pair", lambda a: a, truth, [(torch.ones(3),)])


# --- realistic data ---------------------------------------------------------------------------


# --- block masks ------------------------------------------------------------------------------


def test_block_mask_on_a_hand_made_gradient():
    G = torch.zeros(5, 7)  # ragged: 3 row blocks of 2, 2 vocabulary blocks of 4
    G[0, 0] = -0.5
    G[4, 6] = 1e-3
    mask = block_mask(G, 2, 4, eps=1e-2)
    assert mask.tolist() == [[True, False], [False, False], [False, False]]
    assert skipped_fraction(mask) == pytest.approx(5 / 6)
    assert block_mask(G, 2, 4, eps=1e-4).tolist() == [[True, False], [False, False], [False, True]]


def test_row_mass_mask_bounds_each_rows_sum_in_a_tile():
    G = torch.zeros(4, 8)  # 2 row blocks of 2, 2 vocabulary blocks of 4
    G[0, :4] = 0.3e-2  # each entry under eps = 1e-2, the row's mass in the tile (1.2e-2) over it
    G[3, 4:] = 0.2e-2  # mass 0.8e-2: under eps as well
    assert block_mask(G, 2, 4, 1e-2).tolist() == [[False, False], [False, False]]
    assert row_mass_mask(G, 2, 4, 1e-2).tolist() == [[True, False], [False, False]]


def test_on_a_flat_softmax_the_paper_drops_nearly_everything_and_the_row_mass_rule_nothing():
    N, V, eps = 32, 32_768, 2.0**-12
    x = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(0))
    G = torch.full((N, V), 1.0 / V, dtype=torch.float64) - F.one_hot(x, V).double()  # every S = 1/V < eps
    assert skipped_fraction(block_mask(G, 16, 64, eps)) > 0.95  # all but the targets' tiles
    assert skipped_fraction(row_mass_mask(G, 16, 64, eps)) == 0.0  # 64 / V = 2^-9 per row and tile


def test_masks_agree_tolerates_only_borderline_tiles():
    G = torch.zeros(4, 4)
    G[0, 0], G[2, 2] = 1.0, 1.0005e-2
    spec = block_mask(G, 2, 2, 1e-2)
    assert masks_agree("same", spec, G, 2, 2, 1e-2)["ok"]
    flipped_borderline = spec.clone()
    flipped_borderline[1, 1] = False  # max |G| within 1% of eps: either way is fine
    assert masks_agree("borderline", flipped_borderline, G, 2, 2, 1e-2)["ok"]
    flipped_clear = spec.clone()
    flipped_clear[0, 0] = False
    assert not masks_agree("clear", flipped_clear, G, 2, 2, 1e-2)["ok"]


def test_vocabulary_order_is_by_average_logit():
    g = torch.Generator().manual_seed(0)
    E, C = torch.randn(10, 4, generator=g), torch.randn(30, 4, generator=g)
    order = vocabulary_order(E, C)
    average = (E.double() @ C.double().T).mean(dim=0)
    assert torch.equal(order, torch.argsort(average, descending=True))


def test_sorting_skips_more_tiles_on_realistic_data():
    E, C, x = make_inputs(64, 8_192, 32, regime="realistic", seed=0)
    G = torch.softmax(E.double() @ C.double().T, dim=1) - F.one_hot(x, 8_192).double()
    unsorted = skipped_fraction(block_mask(G, 16, 64, 2.0**-12))
    sorted_ = skipped_fraction(block_mask(G[:, vocabulary_order(E, C)], 16, 64, 2.0**-12))
    assert sorted_ > unsorted + 0.2


# --- the exercise machinery: no false passes --------------------------------------------------


def test_a_wrong_answer_stays_wrong_when_only_the_check_is_run_again(capsys):
    """Exercise 2's machinery as the notebook runs it: the attendee's fold (wrong) checked inside a
    Triton kernel, then the check alone run again: still wrong, on fresh inputs, and later cells
    keep the worked solution. Then a right answer passes and is the one used."""
    from helpers.lab.teaching import Exercises

    exercises = Exercises(solutions=False)
    seen = []

    def check_fold(fold):  # fresh inputs at every run, as the notebook's checks draw them
        g = exercises.fresh()
        case = (torch.randn(16, generator=g) * 50, torch.rand(16, generator=g) + 1, torch.randn(16, 32, generator=g) * 50)
        seen.append(case[0])
        return check_exercise("the merge", lambda *c: _fold(fold, *c), _fold_truth, [case], atol=0.0, rtol=1e-5,
                              diagnose=DIAGNOSES["fold_tile"])

    fold_tile = _fold_without_rescaling  # the attendee's wrong attempt
    assert not exercises.check("fold_tile", fold_tile, check_fold)
    assert exercises.use("fold_tile") is solution("fold_tile")
    capsys.readouterr()
    assert not exercises.check("fold_tile", fold_tile, check_fold)  # the check cell alone, again
    out = capsys.readouterr().out
    assert "✗" in out and "wrong" in out and "right" not in out.split("✗")[1].split("\n")[0].replace("wrong", "")
    assert not exercises.right["fold_tile"] and exercises.use("fold_tile") is solution("fold_tile")
    assert not torch.equal(seen[0], seen[1])  # fresh inputs
    assert exercises.check("fold_tile", solution("fold_tile"), check_fold)
    assert exercises.right["fold_tile"]


def test_the_notebook_never_rebinds_an_attempt_to_the_solution():
    """The false pass came from ``fold_tile = your_turn(...)``: the name the attendee writes was
    rebound to the worked solution. Every check cell now leaves the attendee's name alone."""
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "notebooks" / "04_kernel_walkthrough.py").read_text()
    assert "your_turn" not in source
    for name in ("scaled_add_kernel", "indexed_dot_spec", "fold_tile", "logit_gradient", "add_dC_tile", "kahan_add",
                 "keep_tile_row_mass"):
        assert f"\n{name} = " not in source, name
    assert source.count("exercises.check(") == 7


def test_solutions_mode_checks_the_worked_solution_and_a_wrong_answer_is_explained(capsys):
    from helpers.lab.teaching import Exercises

    def gradient_truth(S, x):
        z = S.log().requires_grad_(True)
        F.cross_entropy(z, x).backward()
        return z.grad

    E, C, x = _cases()[0]
    S = torch.softmax(E.double() @ C.double().T, dim=1)

    def check_gradient(attempt):
        return check_exercise("G", attempt, gradient_truth, [(S, x)], atol=0.0, rtol=1e-9,
                              diagnose=DIAGNOSES["logit_gradient"])

    def without_the_mean(S, x):
        return S - F.one_hot(x, S.shape[1]).double()

    assert not Exercises(False).check("logit_gradient", without_the_mean, check_gradient)
    assert "N times too large" in capsys.readouterr().out
    assert Exercises(True).check("logit_gradient", without_the_mean, check_gradient)  # the teacher's run


def test_show_solution_prints_a_triton_solutions_source(capsys):
    source = show_solution("add_dC_tile")
    assert "tl.atomic_add" in source and "tl.atomic_add" in capsys.readouterr().out


def test_reset_forgets_a_result():
    from helpers.lab.teaching import Exercises

    exercises = Exercises()
    mine = lambda E, C, x: _dot_truth(E, C, x)  # noqa: E731
    assert exercises.check("indexed_dot", mine, lambda f: check_exercise("dot", f, _dot_truth, _cases()))
    assert exercises.use("indexed_dot") is mine
    exercises.reset("indexed_dot")
    assert "indexed_dot" not in exercises.right and exercises.use("indexed_dot") is solution("indexed_dot")


# --- tiles that fit the card ------------------------------------------------------------------


def test_teaching_block_d_fits_half_the_shared_memory():
    from helpers.lab.teaching import teaching_block_d

    assert teaching_block_d(40, 16, 64, None) == 64  # the interpreter: all of D
    assert teaching_block_d(1_024, 16, 16, 64 * 1024) == 256  # a T4 at the payoff's D
    assert teaching_block_d(1_024, 64, 64, 64 * 1024) == 64
    assert teaching_block_d(120, 64, 64, 227 * 1024) == 128  # an H200: all of D
    assert teaching_block_d(4_096, 128, 128, 1024) == 16  # never below tl.dot's minimum


_COMPILE_FOR_A_T4 = """
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from helpers.lab.profiles import get_profile
from helpers.lab.teaching import solution, teaching_block_d
from walkthrough_kernels import backward_kernel, indexed_dot_kernel, keep_tile, lse_kernel

cfg = get_profile("t4").section("04_kernel_walkthrough")
D = 1_024  # the payoff's head, the largest D the notebook runs
block_n, block_v = cfg["BLOCK_N"], cfg["BLOCK_V"]
block_d = teaching_block_d(D, block_n, block_v, 64 * 1024)
tiles = {"BLOCK_N": block_n, "BLOCK_V": block_v, "BLOCK_D": block_d, "DOT_PRECISION": None}
t = "fp16"
kernels = {
    "indexed_dot_kernel": (indexed_dot_kernel, {"E_ptr": "*" + t, "C_ptr": "*" + t, "x_ptr": "*i64", "o_ptr": "*fp32",
                           "N": "i32", "D": "i32", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr"},
                           {"BLOCK_N": block_n, "BLOCK_D": triton.next_power_of_2(D)}),
    "lse_kernel": (lse_kernel, {"E_ptr": "*" + t, "C_ptr": "*" + t, "lse_ptr": "*fp32", "N": "i32", "V": "i32", "D": "i32",
                   **dict.fromkeys([*tiles, "FOLD"], "constexpr")}, {**tiles, "FOLD": solution("fold_tile")}),
    "backward_kernel": (backward_kernel, {"E_ptr": "*" + t, "C_ptr": "*" + t, "x_ptr": "*i64", "lse_ptr": "*fp32",
                        "dE_ptr": "*fp32", "dC_ptr": "*fp32", "tile_kept_ptr": "*i1", "N": "i32", "V": "i32", "D": "i32",
                        "grad_scale": "fp32", "eps": "fp32",
                        **dict.fromkeys([*tiles, "SCALE_BEFORE_CAST", "KEEP_TILE", "ADD_DC"], "constexpr")},
                        {**tiles, "SCALE_BEFORE_CAST": False, "KEEP_TILE": keep_tile, "ADD_DC": solution("add_dC_tile")}),
}
shared = {}
for name, (fn, signature, constexprs) in kernels.items():
    compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 75, 32), options={"num_warps": 4, "num_stages": 3})
    shared[name] = compiled.metadata.shared
print(json.dumps({"triton": triton.__version__, "tiles": tiles, "shared": shared}))
"""


def _walkthrough_kernels() -> str:
    """The notebook's own @triton.jit functions, as the source of a module (its gaps left open)."""
    import ast
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "notebooks" / "04_kernel_walkthrough.py").read_text()
    tree = ast.parse(source)
    kernels = [ast.get_source_segment(source, node, padded=False) for node in tree.body
               if isinstance(node, ast.FunctionDef) and any("triton.jit" in ast.unparse(d) for d in node.decorator_list)]
    return "import triton\nimport triton.language as tl\n\n\n" + "\n\n\n".join(
        "@triton.jit\n" + k for k in kernels)


def test_the_walkthrough_kernels_fit_a_t4_compiled_for_sm_75(tmp_path):
    """The notebook's kernels, compiled for a T4 (sm_75) on this CPU with the installed Triton, at
    the payoff's D = 1,024 in fp16 with the T4 profile's tiles and teaching_block_d's chunk: each
    within a T4's 64 KB of shared memory per block (kept whole, D = 1,024 asked for 128 KB)."""
    (tmp_path / "walkthrough_kernels.py").write_text(_walkthrough_kernels())
    (tmp_path / "compile_for_t4.py").write_text(_COMPILE_FOR_A_T4)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, str(tmp_path / "compile_for_t4.py")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert set(found["shared"]) == {"indexed_dot_kernel", "lse_kernel", "backward_kernel"}
    assert all(0 <= b <= 64 * 1024 for b in found["shared"].values()), found
