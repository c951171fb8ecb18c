"""The pretend T4: a bigger GPU answering as a free Kaggle/Colab T4, checked here on a fake H200."""

import os
import subprocess
import sys
import types

import pytest
import torch

import helpers.cce.device as device_module
from helpers.cce.device import PRETEND_ENV, PRETEND_T4_ENV, T4_MEMORY_BYTES, device_info, pretend_t4
from helpers.cce.kernels.configs import select_configs
from helpers.lab.profiles import detect_profile_name

H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=150_000_000_000,
                             shared_memory_per_block_optin=227 * 1024, multi_processor_count=132)


@pytest.fixture
def h200(monkeypatch):
    """torch believes an H200 is attached; returns the calls made to the allocator's cap."""
    caps = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: H200)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: caps.append((f, i)))
    monkeypatch.delenv(PRETEND_T4_ENV, raising=False)
    monkeypatch.delenv(PRETEND_ENV, raising=False)
    return caps


def test_an_h200_is_itself_without_the_variable(h200):
    info = device_info("cuda")
    assert info.name == "NVIDIA H200" and info.capability == (9, 0) and info.has_bf16_matmul
    assert not info.pretend_t4
    assert select_configs(torch.device("cuda")).name == "hopper-227k"
    assert detect_profile_name("cuda") == "gpu"


def test_device_info_is_kept_per_device_and_follows_the_pretend_switch(h200, monkeypatch):
    first = device_info("cuda:0")
    assert device_info("cuda:0") is first  # kept: a call asks several times
    monkeypatch.setenv(PRETEND_ENV, "t4")
    assert device_info("cuda:0").capability == (7, 5)  # a new switch, a new answer
    monkeypatch.delenv(PRETEND_ENV)
    assert device_info("cuda:0") is first
    other = types.SimpleNamespace(**{**vars(H200), "name": "NVIDIA A100", "major": 8})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: other)
    assert device_info("cuda:0").name == "NVIDIA A100"  # another source of properties is asked again


def test_pretend_t4_gives_a_t4s_limits_configs_and_profile(h200):
    pretend_t4()
    info = device_info("cuda")
    assert info.pretend_t4 and info.capability == (7, 5) and not info.has_bf16_matmul
    assert info.total_memory_bytes == T4_MEMORY_BYTES and info.shared_memory_per_block_bytes == 64 * 1024
    assert "as a T4" in info.describe() and "this GPU's speed" in info.describe()
    assert select_configs(torch.device("cuda")).name == "turing-64k"
    assert detect_profile_name("cuda") == "t4"
    # The allocator is capped at a T4's memory, on the current device.
    assert h200 == [(T4_MEMORY_BYTES / H200.total_memory, 0)]


def test_a_pretend_t4_refuses_what_a_t4_cannot_run(h200):
    from helpers import cce
    from helpers.compare.methods import get_method

    pretend_t4()
    assert "sm_75" in cce.why_unavailable("cuda", torch.bfloat16)
    assert cce.why_unavailable("cuda", torch.float16) is None
    reason = get_method("apple_cce").why_unavailable("cuda", torch.float16)
    assert reason and "shared memory" in reason and "64 KB" in reason


def test_the_memory_cap_is_a_fraction_of_the_pretend_t4(h200):
    from helpers.compare.measure import apply_memory_cap

    pretend_t4()
    cap = apply_memory_cap(0.9, device="cuda")
    assert cap.pretend_t4 and cap.usable_bytes == int(0.9 * T4_MEMORY_BYTES)
    assert h200[-1] == (cap.usable_bytes / H200.total_memory, 0)
    assert "pretending to be a T4" in cap.describe()


def test_on_the_cpu_the_variable_selects_the_t4_path(monkeypatch):
    monkeypatch.delenv(PRETEND_ENV, raising=False)
    monkeypatch.setenv(PRETEND_T4_ENV, "1")  # the older switch, still read
    assert detect_profile_name("cpu") == "cpu-t4"
    assert select_configs(torch.device("cpu")).name == "turing-64k"
    assert not device_info("cpu").pretend_t4
    monkeypatch.delenv(PRETEND_T4_ENV)
    assert detect_profile_name("cpu") == "cpu" and select_configs(torch.device("cpu")).name == "interpreter"


def test_the_cpu_t4_profile_is_the_cpu_sizes_in_fp16():
    from helpers.lab.profiles import get_profile

    cpu, t4 = get_profile("cpu"), get_profile("cpu-t4")
    assert t4.dtypes == ("float16",) and t4.device == "cpu"
    assert t4.section("02_memory_sweep")["dtype"] == "float16"
    assert t4.section("03_convergence")["compute_dtype"] == "float16"
    assert t4.section("04_kernel_walkthrough")["dtype"] == "float16"
    assert t4.section("02_memory_sweep")["N"] == cpu.section("02_memory_sweep")["N"]
    assert cpu.section("02_memory_sweep")["dtype"] == "float32"  # the copy left the cpu profile alone


def test_the_runner_refuses_a_profile_that_contradicts_pretend_t4(monkeypatch, tmp_path):
    from helpers.suite.runner import run_suite

    monkeypatch.delenv(PRETEND_T4_ENV, raising=False)
    monkeypatch.delenv(PRETEND_ENV, raising=False)
    with pytest.raises(SystemExit, match="--pretend-t4"):
        run_suite("gpu", tmp_path, pretend_t4=True)


def teardown_function():
    import os

    os.environ.pop(PRETEND_T4_ENV, None)
    os.environ.pop(PRETEND_ENV, None)
    assert device_module.pretending_t4() is False


# --- a pretend T4 holds every Triton kernel to a T4's shared memory -----------------------------


def test_check_fits_t4_raises_what_a_t4_raises():
    from triton.runtime.errors import OutOfResources

    from helpers.cce.device import T4_SHARED_MEMORY_BYTES, check_fits_t4

    fits = types.SimpleNamespace(name="small_kernel", metadata=types.SimpleNamespace(shared=T4_SHARED_MEMORY_BYTES))
    check_fits_t4(fits)  # exactly 64 KB is allowed
    too_big = types.SimpleNamespace(name="big_kernel", metadata=types.SimpleNamespace(shared=66_048))
    with pytest.raises(OutOfResources) as raised:
        check_fits_t4(too_big)
    assert (raised.value.required, raised.value.limit) == (66_048, 65_536)
    assert "big_kernel" in str(raised.value) and "66048" in str(raised.value)


def test_the_hook_checks_every_kernel_load_only_while_pretending(monkeypatch):
    """The decision logic of the hook in front of Triton's kernel loading, on a stand-in for the
    loader (a real load needs a GPU): installed once, silent outside a pretend T4."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.errors import OutOfResources

    from helpers.cce.device import enforce_t4_shared_memory

    loaded = []
    monkeypatch.setattr(CompiledKernel, "_init_handles", lambda self: loaded.append(self.name))
    monkeypatch.delenv(PRETEND_T4_ENV, raising=False)
    monkeypatch.delenv(PRETEND_ENV, raising=False)
    assert enforce_t4_shared_memory() and enforce_t4_shared_memory()  # the second call adds nothing
    loader = CompiledKernel._init_handles
    assert loader._checks_pretend_shared_memory
    assert not getattr(loader.__wrapped__, "_checks_pretend_shared_memory", False)

    big = types.SimpleNamespace(name="big_kernel", metadata=types.SimpleNamespace(shared=98_304))
    small = types.SimpleNamespace(name="small_kernel", metadata=types.SimpleNamespace(shared=16_384))
    loader(big)  # not a pretend T4: Triton's own check (the real card's limit) decides
    assert loaded == ["big_kernel"]
    monkeypatch.setenv(PRETEND_T4_ENV, "1")
    loader(small)
    with pytest.raises(OutOfResources, match="big_kernel"):
        loader(big)
    assert loaded == ["big_kernel", "small_kernel"]  # the big one never reached the card


def test_pretend_t4_installs_the_check(h200, monkeypatch):
    from triton.compiler.compiler import CompiledKernel

    monkeypatch.setattr(CompiledKernel, "_init_handles", lambda self: None)
    pretend_t4()
    assert CompiledKernel._init_handles._checks_pretend_shared_memory


_COMPILE_BIG_KERNEL = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime.errors import OutOfResources
from helpers.cce.device import check_fits_t4

@triton.jit
def matmul_tile(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    # one BLOCK x BLOCK tile of A (BLOCK, BLOCK_K) @ B (BLOCK_K, BLOCK): both operands pass through
    # shared memory, so large tiles ask for more than a T4 has
    i = tl.arange(0, BLOCK)
    k = tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + i[:, None] * BLOCK_K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * BLOCK + i[None, :])
    tl.store(c_ptr + i[:, None] * BLOCK + i[None, :], tl.dot(a, b))

signature = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "BLOCK": "constexpr", "BLOCK_K": "constexpr"}
for capability, block, block_k in ((75, 16, 2048), (75, 16, 128)):
    kernel = triton.compile(
        triton.compiler.ASTSource(fn=matmul_tile, signature=signature, constexprs={"BLOCK": block, "BLOCK_K": block_k}),
        target=GPUTarget("cuda", capability, 32), options={"num_warps": 4, "num_stages": 3})
    try:
        check_fits_t4(kernel)
        print(f"sm_{capability} {block}x{block}x{block_k}: {kernel.metadata.shared} B fits")
    except OutOfResources as error:
        print(f"sm_{capability} {block}x{block}x{block_k}: {kernel.metadata.shared} B raises: {error}")
"""


def test_the_check_fires_on_a_kernel_compiled_for_a_gpu_that_asks_for_more(tmp_path):
    """A real compile (for sm_75, on this CPU) of a kernel whose tiles need more than
    64 KB: check_fits_t4 raises, naming it; one with small tiles passes. In a process of its own:
    compiling needs TRITON_INTERPRET=0 and a kernel defined in a file."""
    script = tmp_path / "compile_big.py"
    script.write_text(_COMPILE_BIG_KERNEL)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout + done.stderr[-3000:]
    assert "raises: out of resource: shared memory of matmul_tile" in lines[0] and "65536" in lines[0]
    assert lines[1].endswith("fits")


def test_the_cpu_tier_is_the_interpreters_unless_named(monkeypatch):
    """``HELPERS_CPU_TIER`` names the CPU's tier (the suite's runner sets the Turing tier's); the theory's
    tier for "no GPU" follows it, and a pretend card's as the kernels do (a CPU pretending to be a T4
    predicted the interpreter's tiles while it ran the T4's: ours' theory 0.46x its measured peak at 128
    tokens in notebook 02); a name that is no tier is refused with the tiers there are."""
    from helpers.cce.kernels.configs import CPU_TIER_ENV, tier_for_capability

    monkeypatch.delenv(PRETEND_ENV, raising=False)
    monkeypatch.delenv(PRETEND_T4_ENV, raising=False)
    monkeypatch.delenv(CPU_TIER_ENV, raising=False)
    assert select_configs(torch.device("cpu")).name == tier_for_capability(None).name == "interpreter"
    monkeypatch.setenv(CPU_TIER_ENV, "turing-64k")
    assert select_configs(torch.device("cpu")).name == tier_for_capability(None).name == "turing-64k"
    monkeypatch.setenv(PRETEND_ENV, "a100-40gb")  # a pretend card's tier wins, for the theory too
    assert select_configs(torch.device("cpu")).name == tier_for_capability(None).name == "ampere-163k"
    monkeypatch.delenv(CPU_TIER_ENV)
    monkeypatch.setenv(PRETEND_ENV, "t4")  # the suite's pretend T4 on a CPU: its theory predicted the
    assert select_configs(torch.device("cpu")).name == tier_for_capability(None).name == "turing-64k"  # interpreter's
    monkeypatch.setenv(CPU_TIER_ENV, "turing-64k")
    monkeypatch.delenv(PRETEND_ENV)
    monkeypatch.setenv(CPU_TIER_ENV, "volta")
    with pytest.raises(ValueError, match="no configuration tier 'volta'.*interpreter"):
        select_configs(torch.device("cpu"))
