"""A tier without tensor-core products (``LaunchConfig.tensor_cores``: the Turing tier, where Triton from 3.3
compiles a 16-bit tl.dot as fp32 FMAs) runs every 16-bit product of ours as ``DOT_PRECISION="fma"``: the
operands upcast to fp32, then an fp32 product. That is what a real T4 computes, and what a pretend T4 on a
bigger GPU must pay. Checked here: every launch that takes a product gets it on every path, only for 16-bit
inputs and only on such a tier; and the loss and both gradients stay within the gate's bound against
float64 (the product is more precise, not less: the 16-bit operands are exact in fp32).
"""

import os
from dataclasses import fields, replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.cce import linear_cross_entropy, linear_cross_entropy_outputs, linear_kl_div  # noqa: E402
from helpers.cce.kernels.configs import CCEConfigs, LaunchConfig, tier  # noqa: E402
from helpers.cce.options import resolve_configs  # noqa: E402
from helpers.compare.verdicts import gate_bound  # noqa: E402
from helpers.spec import reference_loss, relative_error  # noqa: E402
from tests.cce.test_fp_fusion import _inputs, record_launches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter computes bfloat16 wrongly (the loss refuses it on the CPU).
HALVES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


def without_tensor_cores(configs: CCEConfigs) -> CCEConfigs:
    """``configs`` with every launch configuration's products on CUDA cores, as the Turing tier's."""
    changed = {}
    for f in fields(configs):
        value = getattr(configs, f.name)
        if isinstance(value, LaunchConfig):
            changed[f.name] = replace(value, tensor_cores=False)
        elif isinstance(value, dict) and all(isinstance(v, LaunchConfig) for v in value.values()):
            changed[f.name] = {k: replace(v, tensor_cores=False) for k, v in value.items()}
    return replace(configs, name=configs.name + "-fma", **changed)


def _tier(fma: bool, **host) -> CCEConfigs:
    """On a GPU two shipped tiers: the Turing one and the A100's (Triton kernels only: the Hopper tier's 16-bit
    G kernel and forward are Gluon kernels, on tensor cores by construction); under the interpreter its own
    tier, with and without tensor cores."""
    if DEVICE == "cuda":
        chosen = tier("turing-64k" if fma else "ampere-163k")
    else:
        chosen = resolve_configs(None, torch.device(DEVICE))
        chosen = without_tensor_cores(chosen) if fma else chosen
    return chosen.tuned(**host) if host else chosen


@pytest.fixture
def launches(monkeypatch):
    return record_launches(monkeypatch)


def _run(path, E, C, x, fma):
    if path == "outputs":
        out = linear_cross_entropy_outputs(E, C, x, configs=_tier(fma))
        return out.logprob.sum() + out.entropy.sum()
    if path == "distill":
        return linear_kl_div(E, C, E.detach() * 1.5, C.detach(), configs=_tier(fma))
    # The recompute design whatever the tier's default budget (a T4's, 1 GiB, would run the three-product
    # schedule, whose products are cuBLAS's and whose kernels take none).
    if path == "sparse":  # forced past its dense fallback, so that its own kernels run
        return linear_cross_entropy(E, C, x, backward_impl=path, filter_eps=2.0**-12, memory_budget="min",
                                    configs=_tier(fma, dense_fallback=1.01, sparse_min_pairs=0))
    return linear_cross_entropy(E, C, x, backward_impl=path, configs=_tier(fma), memory_budget="min")


@pytest.mark.parametrize("fma", [True, False], ids=["no-tensor-cores", "tensor-cores"])
@pytest.mark.parametrize("dtype", [*HALVES, torch.float32])
@pytest.mark.parametrize("path", ["gemm", "sparse", "atomic", "outputs", "distill"])
def test_every_product_takes_the_tiers_dot(launches, path, dtype, fma):
    E, C, x = _inputs(dtype)
    _run(path, E, C, x, fma).backward()
    products = [(name, kwargs.get("DOT_PRECISION")) for name, names, kwargs in launches if "DOT_PRECISION" in names]
    assert products, f"no kernel with a product ran on the {path} path"
    wanted = "ieee" if dtype == torch.float32 else ("fma" if fma else "tf32")
    assert all(p == wanted for _, p in products), (
        f"{path}, {dtype}: launched with DOT_PRECISION other than {wanted!r}: "
        f"{sorted({(n, p) for n, p in products if p != wanted})}")


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("path", ["gemm", "sparse", "atomic"])
def test_fma_products_pass_the_gate(path, dtype):
    E, C, x = _inputs(dtype, N=40, V=150, D=48, seed=1)
    e, c = E.detach().double().requires_grad_(), C.detach().double().requires_grad_()
    exact = reference_loss(e, c, x)
    exact.backward()
    naive_E, naive_C = E.detach().clone().requires_grad_(), C.detach().clone().requires_grad_()
    naive = torch.nn.functional.cross_entropy((naive_E @ naive_C.T).float(), x)
    naive.backward()
    loss = _run(path, E, C, x, fma=True)
    loss.backward()
    name = str(dtype).removeprefix("torch.")
    for quantity, ours, theirs, reference in (
            ("loss", loss.detach(), naive.detach(), exact.detach()),
            ("dE", E.grad, naive_E.grad, e.grad), ("dC", C.grad, naive_C.grad, c.grad)):
        error = relative_error(ours, reference)
        bound = gate_bound(name, quantity, relative_error(theirs, reference))
        assert error <= bound, f"{path}, {name}: {quantity} errs {error:.3g} against float64, over the gate's {bound:.3g}"
