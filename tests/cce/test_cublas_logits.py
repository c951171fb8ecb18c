"""The recompute design with its logits made by cuBLAS (``helpers.cce.cublas_logits``), as a tier whose
Triton products are FMAs runs it (the T4's, ``HostTuning.logits_in_cublas_bytes``; ``memory_budget="min"``
throughout, since a T4's default budget runs the three-product schedule where it fits): the forward's LSE kernel
and the backward's G kernel read the logits instead of rebuilding them. Checked: both kernels take that path
(only for 16-bit inputs, and only where cuBLAS gives their product in fp32), over several
vocabulary chunks; loss, dE and dC within the gate's bound against float64 with every loss option; "auto"
runs the dense backward there; the per-token outputs keep the Triton forward.
"""

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.cce import linear_cross_entropy, linear_cross_entropy_outputs  # noqa: E402
from helpers.cce.cublas_logits import chunk_columns  # noqa: E402
from helpers.cce.kernels.configs import MiB, tier  # noqa: E402
from helpers.cce.options import resolve_configs  # noqa: E402
from helpers.compare.verdicts import gate_bound  # noqa: E402
from helpers.spec import reference_loss, relative_error  # noqa: E402
from tests.cce.test_fp_fusion import record_launches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALVES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]
N, V, D = 40, 300, 32
# G chunks of 16 rows and 128 columns, their fp32 logits in pieces of 64 columns (16 x 64 x 4 bytes); the
# forward's chunks as many columns as fit those bytes, at least one of its tiles.
PIECES = {"gemm_chunks": (16, 128), "logits_in_cublas_bytes": 16 * 64 * 4}


def _configs(**host):
    """The Turing tier on a GPU (cuBLAS's logits as it ships them), the interpreter's tier with them on the CPU;
    a forward chunk of 128 columns (a whole number of either's forward tiles: 3 chunks over these 300), with no
    floor from the host's time a piece (``chunk_columns``: at these shapes it would make one piece of all)."""
    base = tier("turing-64k") if DEVICE == "cuda" else resolve_configs(None, torch.device(DEVICE))
    return base.tuned(**{"logits_in_cublas_bytes": N * 128 * 2, "g_chunk_host_us": 0.0, **host})


def _inputs(dtype, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    E = (torch.randn(N, D, generator=g) * scale).to(DEVICE, dtype).requires_grad_()
    C = (torch.randn(V, D, generator=g) * scale).to(DEVICE, dtype).requires_grad_()
    x = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    return E, C, x


def _given(launches, kernel):
    return [kw.get("Z_GIVEN", False) for name, _, kw in launches if name == kernel]


@pytest.mark.parametrize("dtype", HALVES)
def test_both_kernels_read_cublas_logits_over_several_chunks(monkeypatch, dtype):
    launches = record_launches(monkeypatch)
    E, C, x = _inputs(dtype)
    stats = {}
    linear_cross_entropy(E, C, x, memory_budget="min", configs=_configs(**PIECES), backward_impl="gemm",
                         stats=stats).backward()
    forward, backward = _given(launches, "lse_forward_kernel"), _given(launches, "gradient_chunk_kernel")
    assert len(forward) >= 2 and all(forward), forward  # one launch a chunk, each reading its logits
    # Each G chunk of 128 columns in pieces of 64: more G launches than chunks.
    assert len(backward) > stats["launches"] >= 2 and all(backward), (backward, stats["launches"])
    assert stats["g_kernels"]["cublas"] == stats["launches"] and stats["g_kernels"]["triton"] == 0, stats


def test_a_piece_holds_the_bytes_unless_the_host_would_outrun_it():
    """``chunk_columns`` at the Turing tier's figures: the bytes' columns where a piece of them keeps the GPU
    busy for the host's time a piece, more where not (whole tiles either way), V's tiles at most."""
    t4 = tier("turing-64k")
    host, block_v = t4.host, t4.forward[2].BLOCK_V

    def busy_us(n, cols, d):  # the piece's product and its fp32 logits written and read, at the tier's rates
        return 1e6 * n * cols * (2 * d / (host.matmul_tflops_16bit * 1e12) + 8 / (host.bandwidth_gbs * 1e9))

    assert host.logits_in_cublas_bytes == 16 * MiB and host.g_chunk_host_us == 300.0
    # The Gemma-2-2B head at 8,192 tokens: 16 MiB is 512 columns, ~400 us of a T4: the bytes decide.
    assert chunk_columns(8192, 256_000, 2304, torch.float16, block_v, host) == 512
    assert busy_us(8192, 512, 2304) > 300
    # The Qwen3 head at 16,384 tokens: 16 MiB is 256 columns, ~240 us: the host's floor decides, whole tiles.
    cols = chunk_columns(16384, 151_936, 1024, torch.float16, block_v, host)
    assert cols > 256 and cols % block_v == 0 and busy_us(16384, cols, 1024) >= 300 > busy_us(16384, cols - block_v, 1024)
    assert chunk_columns(16384, 151_936, 1024, torch.float16, block_v, replace(host, g_chunk_host_us=0.0)) == 256
    # A tiny head: one piece of all of V's tiles, never more.
    assert chunk_columns(40, 300, 32, torch.float16, block_v, host) == -(-300 // block_v) * block_v


def test_fp32_and_a_torch_without_fp32_products_keep_the_triton_products(monkeypatch):
    launches = record_launches(monkeypatch)
    E, C, x = _inputs(torch.float32)
    linear_cross_entropy(E, C, x, memory_budget="min", configs=_configs(), backward_impl="gemm").backward()
    assert not any(_given(launches, "lse_forward_kernel") + _given(launches, "gradient_chunk_kernel"))
    launches.clear()
    # cuBLAS's logits only in fp32: where this torch's product of 16-bit operands is rounded to their dtype
    # ("rounded", ``product_mode``), not from cuBLAS.
    E, C, x = _inputs(torch.float16)
    linear_cross_entropy(E, C, x, memory_budget="min", configs=_configs(product_mode="rounded"),
                         backward_impl="gemm").backward()
    given = _given(launches, "lse_forward_kernel") + _given(launches, "gradient_chunk_kernel")
    assert given and not any(given)


OPTIONS = [{}, {"softcap": 3.0}, {"bias": True}, {"label_smoothing": 0.1, "z_loss": 1e-3}, {"temperature": 0.7},
           {"ignore": True}, {"reduction": "sum", "softcap": 5.0, "bias": True}, {"weight": True, "ignore": True},
           {"full_c": True, "full_e": True, "strided": True}]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_cublas_logits_pass_the_gate(dtype, options):
    options = dict(options)
    E, C, x = _inputs(dtype, seed=1)
    bias = (torch.randn(V, generator=torch.Generator().manual_seed(2)) / 4).to(DEVICE, dtype).requires_grad_() \
        if options.pop("bias", False) else None
    weight = torch.rand(V, generator=torch.Generator().manual_seed(3)).to(DEVICE) + 0.5 \
        if options.pop("weight", False) else None
    if options.pop("ignore", False):
        x = x.clone()
        x[::3] = -100
    ours_only = {key: options.pop(key) for key in ("full_c", "full_e") if key in options}
    if options.pop("strided", False):  # E's rows a column slice of a wider tensor: row stride 2 D
        wide = torch.zeros(N, 2 * D, dtype=dtype, device=DEVICE)
        wide[:, D:] = E.detach()
        E = wide[:, D:].requires_grad_()
        E.retain_grad()
    e, c = E.detach().double().requires_grad_(), C.detach().double().requires_grad_()
    b = bias.detach().double().requires_grad_() if bias is not None else None
    if weight is not None:
        options["weight"] = weight
    exact = reference_loss(e, c, x, bias=b, **{**options, "weight": None if weight is None else weight.double()})
    exact.backward()
    # The naive path: logits in the dtype, then fp32 (the gate's yardstick).
    nE, nC = E.detach().clone().requires_grad_(), C.detach().clone().requires_grad_()
    nb = bias.detach().clone().requires_grad_() if bias is not None else None
    naive = _naive(nE, nC, x, nb, **options)
    naive.backward()
    loss = linear_cross_entropy(E, C, x, memory_budget="min", bias=bias, configs=_configs(**PIECES), **options,
                                **ours_only)
    loss.backward()
    name = str(dtype).removeprefix("torch.")
    checks = [("loss", loss.detach(), naive.detach(), exact.detach()), ("dE", E.grad, nE.grad, e.grad),
              ("dC", C.grad, nC.grad, c.grad)]
    for quantity, ours, theirs, reference in checks:
        error = relative_error(ours, reference)
        bound = gate_bound(name, quantity, relative_error(theirs, reference))
        assert error <= bound, f"{options}, {name}: {quantity} errs {error:.3g} against float64, over {bound:.3g}"


def _naive(E, C, x, bias=None, softcap=None, temperature=1.0, label_smoothing=0.0, z_loss=0.0, reduction="mean",
           weight=None):
    z = E @ C.T if bias is None else torch.addmm(bias, E, C.T)
    z = z.float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    loss = torch.nn.functional.cross_entropy(z, x, reduction=reduction, label_smoothing=label_smoothing,
                                             weight=weight)
    if z_loss:
        kept = x != -100
        square = torch.where(kept, torch.logsumexp(z, dim=1) ** 2, 0.0) * z_loss
        loss = loss + (square.sum() if reduction == "sum" else square.sum() / kept.sum())
    return loss


def test_auto_runs_the_dense_backward_and_says_why():
    E, C, x = _inputs(torch.float16)
    stats = {}
    linear_cross_entropy(E, C, x, memory_budget="min", configs=_configs(), stats=stats).backward()
    assert stats["backward"] == "gemm" and "cuBLAS" in str(stats.get("auto")), stats


def test_the_per_token_outputs_keep_the_triton_forward(monkeypatch):
    """Their row statistics (entropy, the largest logit) walk the vocabulary in the Triton kernel: not on
    cuBLAS's logits yet (a T4's outputs pay its FMA products there)."""
    launches = record_launches(monkeypatch)
    E, C, x = _inputs(torch.float16, seed=3)
    linear_cross_entropy_outputs(E, C, x, configs=_configs())
    given = _given(launches, "lse_forward_kernel")
    assert given and not any(given)
