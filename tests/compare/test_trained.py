"""helpers.compare.trained: the "trained" regime, a language model trained on the stdlib at any (V, D)."""

import math

import pytest
import torch

from helpers.compare import trained
from helpers.compare.inputs import make_inputs

V, D = 3000, 24  # V below the small corpus's types: the rare ones fold into <unk>


def test_the_model_learned_something(softmax_stats):
    """Trained, not initialized: the training loss fell by nats, and on positions it never trained on
    (the validation split) the model's loss is far below log V, a uniform guess's."""
    facts = trained.describe(V, D)
    assert facts["final_train_loss"] < facts["first_loss"] - 2, facts
    E, C, x = make_inputs(512, V, D, regime="trained")
    assert softmax_stats(E, C, x)["mean_loss"] < math.log(V) - 2


def test_inputs_are_shaped_typed_repeatable_and_the_seed_moves_them():
    E, C, x = make_inputs(300, V, D, torch.float16, regime="trained", seed=3, requires_grad=True)
    assert E.shape == (300, D) and C.shape == (V, D) and x.shape == (300,)
    assert E.dtype == C.dtype == torch.float16 and x.dtype == torch.int64
    assert E.requires_grad and C.requires_grad and E.is_leaf and C.is_leaf
    assert 0 <= int(x.min()) and int(x.max()) < V
    again = make_inputs(300, V, D, torch.float16, regime="trained", seed=3)
    assert all(torch.equal(a, b) for a, b in zip((E, C, x), again))
    other = make_inputs(300, V, D, torch.float16, regime="trained", seed=4)
    assert torch.equal(other[1], C) and not torch.equal(other[2], x)


def test_ids_are_shuffled_not_in_frequency_order():
    """The corpus numbers types by frequency; the regime must not hand a tile filter that order."""
    _, _, x = make_inputs(4000, V, D, regime="trained")
    low = (x < V // 10).float().mean()
    assert 0.02 < low < 0.5, low  # by frequency order nearly every token would be below V / 10


def test_a_vocabulary_larger_than_the_corpus_leaves_ids_unseen():
    facts = trained.describe(20_000, 16)
    assert facts["corpus_types"] < 20_000
    E, C, x = make_inputs(64, 20_000, 16, regime="trained")
    assert C.shape == (20_000, 16) and int(x.max()) < 20_000


@pytest.mark.parametrize("kw, name", [(dict(N=0), "N"), (dict(N=10**9), "N"), (dict(V=1), "V"), (dict(D=1.5), "D")])
def test_bad_sizes_say_which_argument(kw, name):
    args = dict(N=16, V=V, D=D) | kw
    with pytest.raises(ValueError, match=f"^{name} must be"):
        trained.trained_inputs(args["N"], args["V"], args["D"])
