"""The LSE grid: how many vocabulary splits (``lse_splits``) and in which order (``split_major``).

Pure arithmetic, checked against the choices measured best on an H200 (132 SMs, 50-60 MB of L2;
``docs/measurements/h200-2026-12-01e/tune_order2.json``) and against the two rules it states.
"""

import pytest
import triton

from helpers.cce import forward
from helpers.cce.forward import lse_splits

SMS, L2 = 132, 50 * 2**20


@pytest.mark.parametrize("name, N, block_n, D, want", [
    ("Gemma-2-2B head, forward", 8192, 128, 2304, 2),  # 13.2 ms; 9 splits (the old rule) 15.9
    ("Gemma-2-2B head, sorted forward", 8192, 256, 2304, 4),  # 15.7 ms; 17 splits 17.5
    ("Qwen3 head N=16,384, sorted", 16384, 256, 1024, 2),  # 9.4 ms; 9 splits 10.4
    ("Qwen3 head N=131,072, forward", 131072, 128, 1024, 1),  # 65 ms, as any of 1-2
    ("Qwen3 head N=131,072, sorted", 131072, 256, 1024, 2),  # 77 ms; 1 split (66 MB of E strips) 101
])
def test_the_measured_best_choices(name, N, block_n, D, want):
    assert lse_splits(triton.cdiv(N, block_n), SMS, L2, block_n * D * 2) == want, name


@pytest.mark.parametrize("n_blocks", [1, 3, 8, 64, 133, 157, 1000, 4096])
@pytest.mark.parametrize("strip_mb", [0.25, 0.5, 1.2, 4.0])
def test_the_choice_fills_the_gpu_and_fits_l2(n_blocks, strip_mb):
    strip = int(strip_mb * 2**20)
    s = lse_splits(n_blocks, SMS, L2, strip)
    programs = n_blocks * s
    assert programs >= 0.9 * SMS
    assert programs >= 0.85 * triton.cdiv(programs, SMS) * SMS
    assert min(n_blocks, triton.cdiv(SMS, s)) * strip <= 0.8 * L2 or s == 1024
    if s > 1:  # and it is the fewest: one split less breaks a rule
        fewer = n_blocks * (s - 1)
        fills = fewer >= 0.9 * SMS and fewer >= 0.85 * triton.cdiv(fewer, SMS) * SMS
        fits = min(n_blocks, triton.cdiv(SMS, s - 1)) * strip <= 0.8 * L2
        assert not (fills and fits)


def test_unknown_l2_only_fills_the_gpu():
    assert lse_splits(64, SMS, None, 10**12) == 2


def test_the_grid_is_split_major_within_cudas_y_limit():
    assert forward.grid_order(64, 2) == (2, 64)
    assert forward.grid_order(forward.MAX_GRID_Y + 1, 2) == (forward.MAX_GRID_Y + 1, 2)
