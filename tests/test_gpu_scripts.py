"""The GPU scripts behind the closing notes' figures run on a CPU with ``--tiny``.

They are how every GPU number in docs/PERFORMANCE.md was produced (``scripts/gpu/`` and
``scripts/experiments/``); a script that no longer runs would only be found on the next GPU run,
whose minutes are scarce. ``--tiny`` shrinks every shape so the Triton kernels run under the
interpreter: this checks the scripts' code paths and their results file, not any figure (timings
under the interpreter mean nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cce.kernels.configs import CPU_TIER_ENV
from helpers.compare.results_file import read_results
from helpers.suite.runner import CPU_SUITE_TIER

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
# speed_v3.py: the sections whose code the others do not run ("trained" runs the accuracy check and
# the time measure of "accuracy" and "time" on one shape; "profile" needs CUDA for what it measures).
@pytest.mark.parametrize("script", ["gpu/cce_check.py", "gpu/vocab_parallel.py", "experiments/tune.py",
                                    "experiments/speed_v3.py --sections trained checks", "experiments/host_path.py",
                                    "gpu/schedule_check.py", "gpu/distill_check.py", "gpu/graph_check.py",
                                    "gpu/rl_step.py", "gpu/accumulation_check.py", "gpu/liger_parity.py",
                                    "experiments/split_product.py", "experiments/confident_rows.py",
                                    "experiments/loss_time.py", "experiments/nontarget_cost.py",
                                    "experiments/host_warmup.py", "experiments/softcap_precision.py",
                                    "experiments/jsd_precision.py", "experiments/lse_rounding.py",
                                    "experiments/exp_precision.py", "experiments/registers.py",
                                    "experiments/cublas_pieces.py", "experiments/forward_dE.py --sections built precision"])
def test_gpu_script_runs_tiny_on_cpu(script, tmp_path):
    out = tmp_path / "result.jsonl"
    # The Turing tier's tiles, as the CPU suite's notebooks take them (``helpers.suite.runner``): fewer
    # programs for the interpreter (speed_v3.py's sections in 29 s against 120), the same code paths.
    # No TRITON_INTERPRET: each script sets it itself on a CPU (``_common``, before triton is imported),
    # as it must for a user who runs it there with --tiny.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", CPU_TIER_ENV: CPU_SUITE_TIER}
    env.pop("OUT", None)
    env.pop("TRITON_INTERPRET", None)
    name, *options = script.split()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *options, "--tiny", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    meta, records = read_results(out)
    assert meta["schema"] == 1 and meta["failed"] == 0 and meta["device"]["kind"] == "cpu"
    assert records, "no case ran"
    errors = [r for r in records if r.get("status") == "error"]
    assert not errors, errors


@pytest.mark.slow
def test_the_distillation_kernels_compile_for_every_tier_within_its_shared_memory():
    """The interpreter runs kernels that the compiler refuses (a global read that is not a constexpr
    once was one): ``distill_check.py --compile-only`` compiles both for each tier's GPU."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "distill_check.py"), "--compile-only"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["status"] == "ok" and len(result["compiled"]) == 32, result


def test_the_gluon_g_kernel_compiles_for_hopper_within_its_shared_memory():
    """The Hopper tier's G kernel (``helpers/cce/kernels/gradient_chunk_pingpong.py``, through ``scripts/experiments/gluon_g.py``) cannot
    run here: Gluon has no interpreter. What a CPU can prove is that it compiles for sm_90 with this
    Triton, fits 227 KB of shared memory per block and spills no registers."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "experiments" / "gluon_g.py"), "--compile-only"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["status"] == "ok", result
    assert 0 < result["shared_bytes"] <= 227 * 1024, result
    assert "0 bytes spill stores" in result["ptxas"], result
    assert result["wgmma"] > 0 and result["tma"] > 0 and result["setmaxnreg"] > 0, result


def test_the_gluon_forward_compiles_for_hopper_within_its_shared_memory():
    """The Hopper tier's Gluon forward (``helpers/cce/kernels/lse_forward_pingpong.py``) in both launch
    orders: it compiles for sm_90, fits 227 KB of shared memory per block and spills no registers.
    Its barrier protocol is the G kernel's (the test below)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "experiments" / "gluon_forward.py"), "--compile-only"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{"):done.stdout.rindex("}") + 1])
    for order in ("rule", "split_fastest"):
        r = result[order]
        assert r["status"] == "ok" and 0 < r["shared_bytes"] <= 227 * 1024, r
        assert "0 bytes spill stores" in r["ptxas"] and r["wgmma"] > 0 and r["tma"] > 0, r


def test_the_gluon_g_kernels_barrier_protocol_reads_each_step_it_waited_for():
    """The G kernel's producer and two consumers share one ring of buffers: a mistake in its phase
    arithmetic shows on a GPU as wrong G or a hang. ``--check-protocol`` plays the protocol out in
    Python over 540 (tiles, D steps, ring depth, interleaving) cases; without the turn barriers
    (the kernel's first schedule) some must fail, so the check is not vacuous."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "experiments" / "gluon_g.py"), "--check-protocol"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{"):done.stdout.rindex("}") + 1])
    assert result["status"] == "ok" and not result["failures"], result
    assert result["failing_without_turns"] > 0, result


def test_cce_checks_drawn_heads_keep_their_bounds():
    """``cce_check.py --sections random``: the same heads for the same seed, within the ranges its doc
    gives, and with ``--random-sparse`` large enough for the sparse backward (else it runs "gemm")."""
    import importlib.util

    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    try:
        spec = importlib.util.spec_from_file_location("cce_check_script", ROOT / "scripts" / "gpu" / "cce_check.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts" / "gpu"))
    from helpers.cce.kernels.configs import HostTuning

    drawn = module.random_cases(200, 3, False, ["bf16", "fp16"])
    assert drawn == module.random_cases(200, 3, False, ["bf16", "fp16"])
    assert drawn != module.random_cases(200, 4, False, ["bf16", "fp16"])
    for _, N, V, D, dtype_name, spec_name, variant, regime in drawn:
        assert 1 <= N <= 16_384 and 2 <= V <= 262_144 and 8 <= D <= 4_096 and N * V * D <= 1.5e13
        assert spec_name in module.SPECS and spec_name != "all_ignored" and variant in module.VARIANTS
        assert not (module.SPECS[spec_name].get("ignore") == "some" and N < 7)
    assert {c[7] for c in drawn} == {"uniform", "realistic", "trained"}
    assert {c[6] for c in drawn} == {"default", "gemm", "sparse", "atomic", "filter_off"}
    assert any(c[3] % 8 for c in drawn)  # D not a multiple of 8 (no copy-engine reads) among them
    pairs = HostTuning().sparse_min_pairs
    for _, N, V, D, _, spec_name, variant, regime in module.random_cases(100, 3, False, ["bf16"], sparse=True):
        assert N * V / 256 >= pairs and N * V * D <= 5e13
        assert regime in ("realistic", "trained") and variant in ("default", "sparse")
        assert not module.SPECS[spec_name].get("label_smoothing")  # the sparse backward needs every pair there
    for _, N, V, D, *_rest, regime in module.random_cases(50, 3, True, ["fp16"], sparse=True):
        assert N <= 40 and V <= 400 and D <= 40 and regime != "trained"
