"""Tensor descriptors (``helpers.cce.descriptors``): the kernels read E and C, and write G, through
the copy engine when the configuration asks (``LaunchConfig.tma``, the Hopper tier), and through
pointers otherwise or when the tensors do not allow it; both ways give the same bits.

On the CPU the interpreter runs the descriptor path as a GPU would (blocks clipped to the tensor,
zeros beyond it), so the two paths are compared here on irregular shapes: partial row blocks, a
partial last vocabulary tile, a D that is no multiple of BLOCK_D. ``tests/cce/test_configs.py``
compiles the descriptor variants for sm_90 and checks their shared memory.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.cce import linear_cross_entropy  # noqa: E402
from helpers.cce.descriptors import operand_descriptors, tma_ready  # noqa: E402
from helpers.cce.kernels.configs import LaunchConfig, tier  # noqa: E402
from helpers.compare.inputs import make_inputs  # noqa: E402
from helpers.spec import reference_loss_and_grads, relative_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, V, D = 37, 301, 40  # 3 row blocks of 16 (the last partial), 10 tiles of 32 (the last partial), D = 2.5 x 16


def _with_tma(configs, on: bool):
    """``configs`` with every forward and G-kernel configuration's ``tma`` set to ``on``."""
    def flip(table):
        return {size: dataclasses.replace(cfg, tma=on) for size, cfg in table.items()}

    return dataclasses.replace(configs, name=f"{configs.name}, tma={on}", forward=flip(configs.forward),
                               forward_sorted=flip(configs.forward_sorted or configs.forward),
                               backward_gemm=flip(configs.backward_gemm))


def _base():
    """The device's tier with the host knobs this file needs (``HostTuning``): the sparse path runs at
    this size (no fallback to "gemm", a pilot launch of 64 positions), and the G kernel takes
    descriptors at any chunk size (G written into dE's and dC's rows)."""
    if DEVICE == "cpu":
        base = tier("interpreter")
    else:
        from helpers.cce.kernels.configs import select_configs
        base = select_configs(torch.device(DEVICE))
    return base.tuned(tma_min_chunk_flop=0.0, pilot_columns=64, dense_fallback=1.0, sparse_min_pairs=0)


def _run(E, C, x, configs, **options):
    E = E.detach().clone().requires_grad_(True)
    C = C.detach().clone().requires_grad_(True)
    loss = linear_cross_entropy(E, C, x, configs=configs, **options)
    loss.backward()
    return loss.detach(), E.grad, C.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", [
    dict(backward_impl="gemm"),
    dict(backward_impl="gemm", softcap=20.0, sort_vocab=True, label_smoothing=0.1),
    dict(backward_impl="sparse", sort_vocab=True, filter_eps=2.0**-10),
    dict(backward_impl="sparse", filter_eps=2.0**-10, reduction="sum"),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_descriptors_and_pointers_give_the_same_bits(dtype, case):
    E, C, x = make_inputs(N, V, D, dtype, DEVICE, regime="realistic", seed=3)
    x[::7] = -100
    assert tma_ready(E) and tma_ready(C)  # so that the descriptor path does run
    base = _base()
    with_tma = _run(E, C, x, _with_tma(base, True), **case)
    pointers = _run(E, C, x, _with_tma(base, False), **case)
    for name, a, b in zip(("loss", "dE", "dC"), with_tma, pointers):
        assert torch.equal(a, b), f"{name} differs between descriptor and pointer reads: {case}"
    # And both are right: against float64 (the sparse path's filter bounds its distance).
    ref = reference_loss_and_grads(E.double(), C.double(), x, **{k: v for k, v in case.items()
                                                                 if k in ("softcap", "label_smoothing", "reduction")})
    # (the sparse path's filter drops mass; tests/cce/test_sparse.py checks it against the filtered
    # float64 gradient)
    tol = 3e-2 if dtype == torch.float16 or case["backward_impl"] == "sparse" else 1e-3
    for name, got, want in zip(("loss", "dE", "dC"), with_tma, ref):
        assert relative_error(got, want) < tol, name


@pytest.mark.parametrize("d, make", [
    (39, lambda E: E),  # row stride 39 x 4 bytes: no multiple of 16
    (D, lambda E: E.t().contiguous().t()),  # column-major: last stride not 1
    (D, lambda E: E.reshape(-1)[1:1 + (N - 1) * D].reshape(N - 1, D)),  # base 4 bytes off
], ids=["odd-row-stride", "column-major", "misaligned-base"])
def test_tensors_the_copy_engine_cannot_read_are_read_through_pointers(d, make):
    E, C, x = make_inputs(N, V, d, torch.float32, DEVICE, regime="uniform", seed=4)
    E_bad = make(E)
    assert not tma_ready(E_bad)
    cfg = LaunchConfig(16, 32, 16, 1, 1, tma=True)
    E_arg, C_arg, desc = operand_descriptors(E_bad, C, cfg, gathered=False)
    assert desc is False and E_arg is E_bad and C_arg is C
    # and the loss and gradients are still right on that path
    x = x[: E_bad.shape[0]]
    got = _run(E_bad, C, x, _with_tma(_base(), True))
    ref = reference_loss_and_grads(E_bad.double(), C.double(), x)
    for name, g, want in zip(("loss", "dE", "dC"), got, ref):
        assert relative_error(g, want) < 1e-4, name


def test_a_gathered_C_stays_a_pointer():
    E, C, _ = make_inputs(N, V, D, torch.float32, DEVICE, regime="uniform", seed=5)
    cfg = LaunchConfig(16, 32, 16, 1, 1, tma=True)
    E_arg, C_arg, desc = operand_descriptors(E, C, cfg, gathered=True)
    assert desc is True and C_arg is C and E_arg is not E
    assert operand_descriptors(E, C, None, gathered=False) == (E, C, False)


def test_the_sorted_walk_takes_its_own_tiles():
    """``CCEConfigs.forward_sorted``: the sparse backward's forward (sorted, gathered C) launches with
    it, and its bits still let the backward match float64 (the same check as the sparse tests)."""
    base = tier("interpreter")
    tall = dataclasses.replace(base, forward_sorted={4: LaunchConfig(32, 16, 16, 1, 1, tma=True),
                                                    2: LaunchConfig(32, 16, 16, 1, 1)})
    assert tall.forward_sorted_for(torch.float32).BLOCK_N == 32
    assert tall.forward_sorted_for(torch.float32) is not tall.for_dtype(torch.float32)[0]
    E, C, x = make_inputs(N, V, D, torch.float32, DEVICE, regime="realistic", seed=6)
    got = _run(E, C, x, tall, backward_impl="sparse", sort_vocab=True, filter_eps=2.0**-12)
    plain = _run(E, C, x, base, backward_impl="sparse", sort_vocab=True, filter_eps=2.0**-12)
    assert torch.allclose(got[0], plain[0], rtol=1e-6)
    for a, b in zip(got[1:], plain[1:]):
        assert relative_error(a, b) < 1e-5
