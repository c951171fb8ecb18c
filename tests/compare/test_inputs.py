"""The input regimes: uniform is dense, realistic looks like a trained model's softmax."""

import pytest
import torch

from helpers.compare.inputs import make_inputs


def test_realistic_softmax_is_sparse_with_a_trained_models_loss(softmax_stats):
    E, C, x = make_inputs(128, 32768, 48, regime="realistic", seed=1)
    stats = softmax_stats(E, C, x)
    assert 20 <= stats["entries_above_threshold_per_row"] <= 100  # paper's Fig. 3: ~50 of 256k
    assert 1.0 <= stats["mean_loss"] <= 3.0
    curve = stats["sorted_probability_curve"]
    assert torch.all(curve[:-1] >= curve[1:]) and abs(float(curve.sum()) - 1) < 1e-4


def test_realistic_significant_entries_are_shared_across_rows():
    # The frequent tokens are the same for every row: sorting the vocabulary can gather them.
    E, C, x = make_inputs(64, 8192, 32, regime="realistic", seed=2)
    p = torch.softmax(E @ C.T, dim=1)
    hits = (p > 2.0**-12).float().sum(0)
    top = hits.sort(descending=True).values
    # An eighth of the vocabulary holds nearly all significant entries (scattered at random, each
    # row's ~40 would touch most of the vocabulary across 64 rows).
    assert top[: 8192 // 8].sum() > 0.9 * hits.sum()


def test_uniform_is_dense_and_seeded(softmax_stats):
    E, C, x = make_inputs(64, 4099, 32, seed=3)
    assert softmax_stats(E, C, x)["entries_above_threshold_per_row"] > 300
    E2, C2, x2 = make_inputs(64, 4099, 32, seed=3)
    assert torch.equal(E, E2) and torch.equal(C, C2) and torch.equal(x, x2)


def test_bad_regime_is_named():
    with pytest.raises(ValueError, match="regime must be one of"):
        make_inputs(4, 10, 4, regime="zipf")
