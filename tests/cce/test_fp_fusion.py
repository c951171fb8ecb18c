"""Which kernel launches let the compiler contract a multiply and an add into one FMA.

Every kernel that forms logits (it takes ``DOT_PRECISION`` or ``inv_temperature``) is launched with
``enable_fp_fusion`` off for fp32 inputs and on for 16-bit ones (``helpers.cce.options.fp_fusion``):
contracted differently in the forward and the backward, fp32 gradients at a cold temperature erred
2-12x the naive path's on Hopper GPUs, and the interpreter, which ignores the option, cannot show it.
So the launches are checked here by what they were given, on every path: the cross-entropy's
backwards, its forward-gradients schedule, the per-token outputs and distillation.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.cce import linear_cross_entropy, linear_cross_entropy_outputs, linear_kl_div  # noqa: E402
from helpers.cce.kernels.lse_forward import lse_forward_kernel  # noqa: E402
from helpers.cce.options import resolve_configs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def record_launches(monkeypatch) -> list[tuple[str, list[str], dict]]:
    """(kernel name, its argument names, the launch's keyword arguments) of every Triton launch from now on."""
    seen = []
    kind = type(lse_forward_kernel)  # the interpreter's function or the JIT's
    run = kind.run

    def spy(self, *args, **kwargs):
        seen.append((self.__name__, list(getattr(self, "arg_names", [])), kwargs))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(kind, "run", spy)
    return seen


@pytest.fixture
def launches(monkeypatch):
    return record_launches(monkeypatch)


def _inputs(dtype, N=24, V=80, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = (torch.randn(N, D, generator=g) / 2).to(DEVICE, dtype).requires_grad_()
    C = (torch.randn(V, D, generator=g) / 2).to(DEVICE, dtype).requires_grad_()
    x = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    return E, C, x


def _cross_entropy(path):
    def call(E, C, x):
        if path == "outputs":
            out = linear_cross_entropy_outputs(E, C, x, temperature=0.5)
            return out.logprob.sum() + out.entropy.sum()
        if path == "forward_grads":
            return linear_cross_entropy(E, C, x, temperature=0.5, memory_budget=2**40)
        if path == "sparse":  # forced past its dense fallback, so that its own kernels run
            configs = resolve_configs(None, torch.device(DEVICE)).tuned(dense_fallback=1.01, sparse_min_pairs=0)
            return linear_cross_entropy(E, C, x, backward_impl=path, filter_eps=2.0**-12, configs=configs)
        return linear_cross_entropy(E, C, x, temperature=0.5, backward_impl=path)
    return call


def _distill(E, C, x):
    return linear_kl_div(E, C, E.detach() * 1.5, C.detach(), temperature=0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["gemm", "sparse", "atomic", "forward_grads", "outputs", "distill"])
def test_fp32_logits_compile_without_contraction(launches, path, dtype):
    E, C, x = _inputs(dtype)
    loss = (_distill if path == "distill" else _cross_entropy(path))(E, C, x)
    loss.backward()
    forming = [(name, kwargs.get("enable_fp_fusion")) for name, names, kwargs in launches
               if "DOT_PRECISION" in names or "inv_temperature" in names]
    assert forming, f"no kernel forming logits ran on the {path} path"
    wanted = dtype != torch.float32
    assert all(fusion is wanted for _, fusion in forming), (
        f"{path}, {dtype}: launched with enable_fp_fusion other than {wanted}: "
        f"{sorted({(n, f) for n, f in forming if f is not wanted})}")
