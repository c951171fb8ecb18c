"""Fast CPU tests of helpers/lab/teaching.py, the pieces behind the kernel walkthrough (notebook 04)."""

import pytest
import torch
import torch.nn.functional as F

from helpers.compare.inputs import make_inputs
from helpers.lab.teaching import (
    block_mask,
    check,
    check_exercise,
    entries_per_row,
    gigabytes,
    masks_agree,
    memory_footprint,
    skipped_fraction,
    vocabulary_order,
)


# --- memory arithmetic ------------------------------------------------------------------------


def test_qwen3_fp32_logits_are_9_96_gb():
    f = memory_footprint(16_384, 151_936, 1_024, "float32")
    assert f["logits"] == 16_384 * 151_936 * 4 == 9_957_277_696
    assert round(gigabytes(f["logits"]), 2) == 9.96
    assert f["lower_bound"] == (16_384 + 151_936) * 1_024 * 4
    assert f["lse"] == 16_384 * 4


def test_bf16_halves_logits_but_not_the_fp32_copy():
    f = memory_footprint(8_192, 256_000, 2_304, torch.bfloat16)
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
