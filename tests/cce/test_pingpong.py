"""The Hopper G kernel (``helpers/cce/kernels/gradient_chunk_pingpong.py``) and forward
(``lse_forward_pingpong.py``) on a CPU: Gluon kernels do not run under the Triton interpreter, so what
the CPU checks is when the loss may use them. Its sm_90
compile and its barrier protocol: ``tests/test_gpu_scripts.py``; its bits against the Triton kernel's
on an H200: ``scripts/experiments/gluon_g.py``."""

import pytest
import torch

from helpers.cce.kernels import gradient_chunk_pingpong as pingpong
from helpers.cce.kernels.configs import INTERPRETER, TIERS, tier

CUDA = torch.device("cuda")
OK = dict(sorted_vocab=False, split=False, softcap=False, bias=False)


def test_only_the_hopper_tier_asks_for_the_gluon_g_kernel():
    asking = [t.name for t in (INTERPRETER, *TIERS) if t.host.g_pingpong]
    assert asking == ["hopper-227k"]
    assert not tier("hopper-227k").tuned(g_pingpong=False).host.g_pingpong  # the A/B of gluon_g.py


def test_the_gluon_g_kernel_takes_only_sm90_16_bit_plain_chunks():
    if pingpong.GLUON_ERROR:  # an older Triton: never used, and the reason says so
        assert pingpong.pingpong_reason(CUDA, torch.bfloat16, (9, 0), **OK) == pingpong.GLUON_ERROR
        return
    assert pingpong.pingpong_reason(CUDA, torch.bfloat16, (9, 0), **OK) is None
    assert pingpong.pingpong_reason(CUDA, torch.float16, (9, 0), **OK) is None
    refused = {
        "cpu": pingpong.pingpong_reason(torch.device("cpu"), torch.bfloat16, None, **OK),
        "blackwell": pingpong.pingpong_reason(CUDA, torch.bfloat16, (10, 0), **OK),
        "a100": pingpong.pingpong_reason(CUDA, torch.bfloat16, (8, 0), **OK),
        "fp32": pingpong.pingpong_reason(CUDA, torch.float32, (9, 0), **OK),
        "sorted": pingpong.pingpong_reason(CUDA, torch.bfloat16, (9, 0), **{**OK, "sorted_vocab": True}),
        "split": pingpong.pingpong_reason(CUDA, torch.bfloat16, (9, 0), **{**OK, "split": True}),
        "softcap": pingpong.pingpong_reason(CUDA, torch.bfloat16, (9, 0), **{**OK, "softcap": True}),
        "bias": pingpong.pingpong_reason(CUDA, torch.bfloat16, (9, 0), **{**OK, "bias": True}),
    }
    assert all(isinstance(why, str) and why for why in refused.values()), refused


def _cpu_gemm_call():
    """(E, C, stats) of one "gemm" forward and backward on a small CPU problem."""
    from helpers.cce import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    E = torch.randn(40, 24, generator=g, requires_grad=True)
    C = torch.randn(97, 24, generator=g, requires_grad=True)
    x = torch.randint(0, 97, (40,), generator=g)
    stats = {}
    linear_cross_entropy(E, C, x, backward_impl="gemm", stats=stats).backward()
    return E, C, stats


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the Triton interpreter)")
def test_the_cpu_backward_counts_its_g_kernels_and_uses_the_triton_one():
    _, _, stats = _cpu_gemm_call()
    assert stats["g_kernels"]["pingpong"] == 0 and stats["g_kernels"]["triton"] == stats["launches"] > 0


def test_the_gluon_forwards_splits_fill_the_gpu_in_nearly_whole_waves():
    from helpers.cce.kernels.lse_forward_pingpong import pingpong_splits

    for n_blocks, v_tiles, sms in ((128, 1000, 132), (16, 594, 132), (256, 594, 132), (1, 3, 132), (7, 594, 58)):
        s = pingpong_splits(n_blocks, v_tiles, sms)
        assert 1 <= s <= v_tiles
        programs = n_blocks * s
        if s < v_tiles:  # enough tiles to split: at least one wave, the last 95% full
            assert programs >= sms and programs >= 0.95 * -(-programs // sms) * sms, (n_blocks, s)
    assert pingpong_splits(1, 3, 132) == 3  # too few tiles to fill the GPU: one a program


def test_only_the_hopper_tier_asks_for_the_gluon_forward_and_only_up_to_its_d():
    asking = {t.name: t.host.lse_pingpong_max_d for t in (INTERPRETER, *TIERS) if t.host.lse_pingpong_max_d}
    assert asking == {"hopper-227k": 2048}


def test_the_gluon_forward_says_why_it_does_not_run():
    from dataclasses import replace

    from helpers.cce.forward import lse_pingpong_reason
    from helpers.cce.options import resolve_options

    host = tier("hopper-227k").host
    o = resolve_options(torch.bfloat16, vocabulary=300)
    E, C = torch.zeros(64, 1024, dtype=torch.bfloat16), torch.zeros(300, 1024, dtype=torch.bfloat16)
    wide_E, wide_C = torch.zeros(64, 2304, dtype=torch.bfloat16), torch.zeros(300, 2304, dtype=torch.bfloat16)
    reasons = {
        "cpu": lse_pingpong_reason(E, C, None, o, host),
        "wide": lse_pingpong_reason(wide_E, wide_C, None, o, host),
        "off": lse_pingpong_reason(E, C, None, o, replace(host, lse_pingpong_max_d=0)),
        "temperature": lse_pingpong_reason(E, C, None, replace(o, temperature=0.7), host),
        "smoothing": lse_pingpong_reason(E, C, None, replace(o, label_smoothing=0.1), host),
    }
    assert all(isinstance(why, str) and why for why in reasons.values()), reasons
    assert "2048" in reasons["wide"] and "2304" in reasons["wide"]
    assert "sm_90" in reasons["cpu"] or "Gluon" in reasons["cpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests (the Triton interpreter)")
def test_the_loss_says_which_kernel_made_its_lse():
    """``stats["forward"]``: on a CPU the Triton kernel; with the sparse backward's bits, the bits' kernel."""
    from helpers.cce.forward import forward_kernel
    from helpers.cce.options import resolve_options

    E, C, stats = _cpu_gemm_call()
    assert stats["forward"] == "triton", stats
    host, o = tier("hopper-227k").host, resolve_options(torch.float32, vocabulary=C.shape[0])
    assert forward_kernel(E, C, None, o, host, bits=True) == "triton with bits"
    assert forward_kernel(E, C, None, o, host, bits=False) == "triton"  # a CPU: not the Gluon kernel
