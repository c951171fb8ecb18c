"""helpers.compare.sweep and .theory on the CPU: the theory against hand arithmetic, the article and the meter; the
runner's OOM handling, skip-after-OOM, error recording and resume (keyed by library versions); the
files and the figure. What the notebook reads from a sweep (pivot, verdicts, headline, facts, how
many tokens fit) is in test_sweep_reading.py."""

import json

import pytest
import torch

from helpers.cce import linear_cross_entropy
from helpers.cce.kernels.configs import INTERPRETER
from helpers.compare.inputs import make_inputs
from helpers.compare.heads import QWEN3
from helpers.compare.measure import MemoryCap, loss_step, peak_memory
from helpers.compare.methods.baselines import chunked_loss, naive_loss
from helpers.compare.methods import Method
from helpers.compare.sweep import ARTICLE_N, ARTICLE_T4_PEAK_GB, load_points, run_sweep
from helpers.compare.sweep_results import describe_methods, results_pivot, write_results
from helpers.compare.theory import (
    T4_CAPABILITY,
    first_oom_n,
    input_bytes,
    lower_bound_bytes,
    predicted_peak_bytes,
    sizes_that_fit,
)

V_QWEN, D_QWEN = QWEN3.V, QWEN3.D
NO_CAP = MemoryCap("cpu", None, None, None)


# ---------------------------------------------------------------------------------------------
# Theory
# ---------------------------------------------------------------------------------------------


def test_theory_at_the_qwen3_head_by_hand():
    N, V, D = 1024, V_QWEN, D_QWEN
    # dE: 1024·1024·2 = 2,097,152; dC: 151,936·1024·2 = 311,164,928
    assert lower_bound_bytes(N, V, D, torch.float16) == 313_262_080
    # three fp32 N×V tensors: 12 · 1024 · 151,936
    assert predicted_peak_bytes("naive", N, V, D, torch.float16) == 1_866_989_568
    assert predicted_peak_bytes("naive", N, V, D, torch.bfloat16) == 1_866_989_568
    # fp16 logits 1024·151,936·2 = 311,164,928, plus dE and dC
    assert predicted_peak_bytes("torch_compile", N, V, D, "float16") == 311_164_928 + 313_262_080
    # Liger: chunk rows = next_pow2(ceil(1024 / ceil(151,936 / 1024))) = next_pow2(7) = 8, so an
    # (8, V) fp16 block: 2,430,976; its fp32 loss vector: 4,096. On a T4 each chunk's dC goes
    # through a (V, D) fp16 matmul result and its fp32 copy: 151,936·1024·6 = 933,494,784.
    liger_sm80 = 313_262_080 + 2_430_976 + 4_096
    assert predicted_peak_bytes("liger", N, V, D, "bfloat16", (9, 0)) == liger_sm80
    assert predicted_peak_bytes("liger", N, V, D, "float16", T4_CAPABILITY) == liger_sm80 + 933_494_784
    # chunked at N = 4096, fp16: 441 rows a chunk (256 MiB / (4·151,936)), three fp32 (441, V)
    # blocks = 804,045,312; dE 8,388,608; fp32 dC and fp32 copy of C 2·622,329,856;
    # fp32 rows of E 441·1024·4 = 1,806,336.
    assert predicted_peak_bytes("chunked", 4096, V, D, "float16") == (
        804_045_312 + 8_388_608 + 2 * 622_329_856 + 1_806_336
    )
    assert predicted_peak_bytes("apple_cce", N, V, D, "bfloat16") == 313_262_080
    # ours: all 1,024 rows in one chunk; the first G chunks in dC's rows not yet written, the tail in
    # a buffer of 9,984 columns (the share of LB that dE's fp32 accumulator, 1024·1024·4 = 4,194,304,
    # leaves under 8%: 1024·9,984·2 = 20,447,232); per-row state 24·1024 = 24,576.
    assert predicted_peak_bytes("ours", N, V, D, "bfloat16", (9, 0)) == (
        313_262_080 + 4_194_304 + 20_447_232 + 24_576)
    # fp32 inputs: no accumulator (dE accumulates itself); G in dC's rows, then the tail in a buffer
    # of 12,224 columns (8% of LB, in the fp32 tier's 64-column tiles): 1024·12,224·4 = 50,069,504.
    assert predicted_peak_bytes("ours", N, V, D, "float32", (9, 0)) == 2 * 313_262_080 + 50_069_504 + 24_576
    assert predicted_peak_bytes("no_such_method", N, V, D, "bfloat16") is None


def test_theory_explains_the_articles_t4_table():
    # The article measured absolute memory in its trainer; minus (theory + inputs) every one of
    # its fifteen numbers must leave the same constant (what else was resident: ~1.59 GB).
    residuals = []
    for method, row in ARTICLE_T4_PEAK_GB.items():
        for N, gb in zip(ARTICLE_N, row):
            if gb is not None:
                ours = predicted_peak_bytes(method, N, V_QWEN, D_QWEN, "float16", T4_CAPABILITY)
                residuals.append(gb - (ours + input_bytes(N, V_QWEN, D_QWEN, "float16")) / 1e9)
    assert len(residuals) == 15
    assert max(residuals) - min(residuals) < 0.02
    assert 1.5 < min(residuals) < 1.7


# Measured earlier on an H200, Qwen3 head in bf16 (sm_90), peak MiB above the inputs, by method and N.
H200_BF16_PEAK_MIB = {
    "naive": {1024: 1782, 4096: 7122, 16384: 28488, 65536: 113952},
    "torch_compile": {1024: 596, 4096: 1493, 16384: 5077, 65536: 19417, 131072: 38537},
    "liger": {1024: 301, 4096: 314, 16384: 366, 65536: 573, 131072: 850},
    "apple_cce": {1024: 300, 4096: 307, 16384: 331, 65536: 427, 131072: 555},
}


@pytest.mark.parametrize("method", sorted(H200_BF16_PEAK_MIB))
def test_theory_matches_the_h200_measurements(method):
    for N, mib in H200_BF16_PEAK_MIB[method].items():
        predicted = predicted_peak_bytes(method, N, V_QWEN, D_QWEN, "bfloat16", (9, 0)) / 1024**2
        assert abs(predicted / mib - 1) < 0.01, (method, N, predicted, mib)


# Ours (helpers.cce, the "gemm" backward with G in dE's and dC's rows not yet written), bf16 on the
# H200 (sm_90), `python -m helpers bench`, 2026-12-01 (docs/measurements/h200-2026-12-01f): peak of
# forward+backward above the inputs, MB (10^6 B). N = 1,024: 2026-12-03 (h200-2026-12-03c), the tail of
# the G chunks in a buffer under 8% of LB (318.0 with every chunk in place; 351.0 with G in a
# max(32 MiB, LB / 32) buffer before that).
H200_BF16_OURS_PEAK_MB = {(1024, V_QWEN, D_QWEN): 337.9, (16_384, V_QWEN, D_QWEN): 412.2,
                          (131_072, V_QWEN, D_QWEN): 656.2, (8192, 256_000, 2304): 1293.1}


def test_ours_theory_matches_the_h200_measurements():
    for (N, V, D), mb in H200_BF16_OURS_PEAK_MB.items():
        predicted = predicted_peak_bytes("ours", N, V, D, "bfloat16", (9, 0)) / 1e6
        assert abs(mb / predicted - 1) < 0.01, (N, V, D, predicted, mb)


def test_theory_predicts_the_articles_oom_wall_on_a_t4_with_the_guardrail():
    t4 = MemoryCap("cuda", int(0.9 * 15 * 1024**3), 15 * 1024**3, 0.9)
    assert first_oom_n("naive", ARTICLE_N, V_QWEN, D_QWEN, "float16", t4, T4_CAPABILITY) == 8192
    assert first_oom_n("torch_compile", ARTICLE_N, V_QWEN, D_QWEN, "float16", t4, T4_CAPABILITY) is None
    assert first_oom_n("liger", ARTICLE_N, V_QWEN, D_QWEN, "float16", t4, T4_CAPABILITY) is None
    assert sizes_that_fit([1024, 10**8], V_QWEN, D_QWEN, "float16", t4) == [1024]


# naive and Liger multiply in fp16 with torch's CPU matmul, which on some processors converts its
# operands to fp32 in scratch (60-90% over the theory at this tiny head, none on others): that is the
# BLAS's memory, not the method's, so those two are checked in fp32 only. chunked and ours multiply
# in fp32 on the CPU whatever the input dtype.
@pytest.mark.parametrize("method,dtype", [
    ("naive", torch.float32), ("liger", torch.float32),
    ("chunked", torch.float32), ("chunked", torch.float16), ("ours", torch.float32), ("ours", torch.float16),
])
def test_theory_matches_the_cpu_meter(method, dtype):
    N, V, D = 48, 257, 24
    E, C, x = make_inputs(N, V, D, dtype, "cpu", requires_grad=True)
    step = loss_step(method, E, C, x)
    step()
    _, measured = peak_memory(step, device="cpu")
    predicted = predicted_peak_bytes(method, N, V, D, dtype)  # capability None: the CPU's paths
    assert abs(measured / predicted - 1) < 0.02, (measured, predicted)


def test_chunked_theory_with_several_chunks_matches_the_meter():
    N, V, D, rows = 100, 509, 16, 16  # seven chunks, the last one ragged
    E, C, x = make_inputs(N, V, D, torch.float16, "cpu", requires_grad=True)

    def step():
        return torch.autograd.grad(chunked_loss(E, C, x, rows=rows), (E, C))

    step()
    _, measured = peak_memory(step, device="cpu")
    predicted = predicted_peak_bytes("chunked", N, V, D, torch.float16, rows=rows)
    assert abs(measured / predicted - 1) < 0.03, (measured, predicted)


@pytest.mark.parametrize("N, V, D, chunks", [
    (100, 1031, 64, (32, 128)),  # 4 row chunks (the last ragged) x 9 vocabulary chunks, G scratch
    (256, 300, 64, (256, 64)),  # V_c = D: each G chunk lives in dE, 11% of the peak
], ids=["G_scratch", "G_in_dE"])
def test_ours_theory_with_chunks_matches_the_meter(N, V, D, chunks):
    # D large enough that the O(N) per-row vectors the formula leaves out stay under 1%.
    configs = INTERPRETER.tuned(gemm_chunks=chunks)
    E, C, x = make_inputs(N, V, D, torch.float16, "cpu", requires_grad=True)

    def step():
        return torch.autograd.grad(linear_cross_entropy(E, C, x, configs=configs), (E, C))

    step()
    _, measured = peak_memory(step, device="cpu")
    predicted = predicted_peak_bytes("ours", N, V, D, torch.float16, configs=configs)
    assert abs(measured / predicted - 1) < 0.03, (measured, predicted)
    if chunks[1] <= D:  # the formula must know where G lives: counting it would be off by > 5%
        assert (predicted + chunks[0] * chunks[1] * 2) / measured - 1 > 0.05


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------


def _method(name, implementation):
    return Method(name, name, "a test method", implementation, lambda device, dtype, softcap: None)


@pytest.fixture
def flat(temporary_method):
    """A method whose memory barely grows with N: chunked with 16-row chunks."""
    return temporary_method(
        _method("flat_chunked", lambda E, C, x, **kw: chunked_loss(E, C, x, rows=16, **kw))
    ).name


def _sweep(tmp_path, methods, Ns, cap=NO_CAP, **kw):
    return run_sweep(methods, Ns, V=257, D=16, dtype=torch.float32, store=tmp_path / "points.jsonl",
                     memory_cap=cap, device="cpu", warmup=0, repeats=1, progress=False, **kw)


def test_runner_records_oom_skips_larger_n_and_carries_on(tmp_path, flat):
    # A simulated 0.2 MB card: naive needs 12·N·257 bytes, over 0.2 MB from N = 65.
    cap = MemoryCap("cpu", 200_000, None, None)
    Ns = [16, 32, 128, 256]
    records = _sweep(tmp_path, ["naive", flat], Ns, cap)
    status = {(r["method"], r["N"]): r["status"] for r in records}
    assert [status["naive", n] for n in Ns] == ["ok", "ok", "oom", "skipped after OOM"]
    assert [status[flat, n] for n in Ns] == ["ok"] * 4
    oom = next(r for r in records if r["status"] == "oom")
    assert "MemoryBudgetExceeded" in oom["error"]
    skipped = next(r for r in records if r["status"] == "skipped after OOM")
    assert "N=128" in skipped["error"]
    assert len(load_points(tmp_path / "points.jsonl")) == 8
    said = describe_methods(records, V=257)
    assert "grows with the logits" in said["naive"] and "hit the wall at N=128" in said["naive"]
    assert "grows with N·D (the gradients), not N·V" in said[flat] and "no OOM up to N=256" in said[flat]


def test_runner_records_a_real_oom_error(tmp_path, temporary_method):
    # What a capped CUDA allocator raises, without a GPU: torch.OutOfMemoryError from N = 128 on.
    def implementation(E, C, x, **kw):
        if E.shape[0] >= 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.96 GiB")
        return naive_loss(E, C, x, **kw)

    name = temporary_method(_method("oom_at_128", implementation)).name
    records = _sweep(tmp_path, [name], [64, 128, 256])
    assert [r["status"] for r in records] == ["ok", "oom", "skipped after OOM"]
    assert "OutOfMemoryError" in records[1]["error"]


def test_runner_records_other_errors_and_retries_them_on_resume(tmp_path, temporary_method, flat):
    broken = {"on": True}

    def implementation(E, C, x, **kw):
        if broken["on"] and E.shape[0] == 128:
            raise ValueError("a kernel bug at this shape")
        return naive_loss(E, C, x, **kw)

    name = temporary_method(_method("flaky", implementation)).name
    records = _sweep(tmp_path, [name, flat], [32, 128, 256])
    assert [r["status"] for r in records if r["method"] == name] == ["ok", "error", "ok"]
    assert "a kernel bug" in describe_methods(records, V=257)[name]
    broken["on"] = False
    again = _sweep(tmp_path, [name, flat], [32, 128, 256])
    assert [r["status"] for r in again if r["method"] == name] == ["ok", "ok", "ok"]


def test_resume_skips_points_already_measured(tmp_path, temporary_method):
    calls = []

    def counting(E, C, x, **kw):
        calls.append(E.shape[0])
        return naive_loss(E, C, x, **kw)

    name = temporary_method(_method("counting", counting)).name
    first = _sweep(tmp_path, [name], [64, 128])
    measured = len(calls)
    assert measured > 0
    second = _sweep(tmp_path, [name], [64, 128, 256])
    assert set(calls[measured:]) == {256}  # only the new point ran
    assert [r["peak_bytes"] for r in second[:2]] == [r["peak_bytes"] for r in first]
    # Another configuration (here the memory cap) is a different point: measured again.
    _sweep(tmp_path, [name], [64], MemoryCap("cpu", 10**9, None, None))
    assert calls[-1] == 64
    keys = load_points(tmp_path / "points.jsonl")
    assert len(keys) == 4


def test_a_resume_reuses_points_of_the_same_versions_only_and_says_so(tmp_path, temporary_method, monkeypatch,
                                                                        capsys):
    from helpers.compare import sweep

    calls = []

    def counting(E, C, x, **kw):
        calls.append(E.shape[0])
        return naive_loss(E, C, x, **kw)

    name = temporary_method(_method("counting", counting)).name
    first = _sweep(tmp_path, [name], [32, 64])
    assert not any(r["reused"] for r in first) and first[0]["versions"] == sweep.library_versions()
    assert "reused" not in capsys.readouterr().out
    measured = len(calls)
    again = _sweep(tmp_path, [name], [32, 64])
    assert len(calls) == measured and all(r["reused"] for r in again)
    assert "2 of 2 points reused" in capsys.readouterr().out
    # An upgrade (here: another version string) makes every stored point stale: measured again, said so.
    real = sweep.library_versions()
    monkeypatch.setattr(sweep, "library_versions", lambda: "torch=9.9 helpers=9.9+code.0")
    upgraded = _sweep(tmp_path, [name], [32, 64])
    assert len(calls) > measured and not any(r["reused"] for r in upgraded)
    said = capsys.readouterr().out
    assert "2 points in" in said and "other versions" in said and real in said


def test_points_stored_without_versions_are_measured_again(tmp_path, flat):
    _sweep(tmp_path, [flat], [32])
    store = tmp_path / "points.jsonl"
    old = json.loads(store.read_text().splitlines()[0])
    del old["versions"]  # a point stored before the key had versions
    store.write_text(json.dumps(old) + "\n")
    records = _sweep(tmp_path, [flat], [32])
    assert not records[0]["reused"]
    assert json.loads(store.read_text().splitlines()[-1])["versions"]


def test_library_versions_change_with_our_code(tmp_path, monkeypatch):
    from helpers.compare import sweep

    for name in ("cce/kernels/a.py", "compare/methods/__init__.py", "compare/measure.py", "compare/inputs.py",
                 "spec.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    monkeypatch.setattr(sweep, "PACKAGE_ROOT", tmp_path)
    before = sweep.library_versions.__wrapped__()
    assert f"torch={torch.__version__}" in before and "liger-kernel=" in before and "+code." in before
    assert sweep.library_versions.__wrapped__() == before
    (tmp_path / "cce/kernels/a.py").write_text("# a kernel, edited\n")
    assert sweep.library_versions.__wrapped__() != before


def test_the_inductor_online_softmax_warning_stays_out_of_the_sweep(tmp_path, temporary_method):
    import warnings

    def warning(E, C, x, **kw):
        warnings.warn("Online softmax is disabled on the fly since Inductor decides to split the reduction.")
        warnings.warn("another warning, which a reader should see")
        return naive_loss(E, C, x, **kw)

    name = temporary_method(_method("warns", warning)).name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _sweep(tmp_path, [name], [16])
    messages = [str(w.message) for w in caught]
    assert not any("Online softmax" in m for m in messages)
    assert any("another warning" in m for m in messages)


def test_a_torn_last_line_does_not_stop_a_resume(tmp_path, flat):
    _sweep(tmp_path, [flat], [64])
    with (tmp_path / "points.jsonl").open("a") as f:
        f.write('{"method": "flat_chu')  # a run killed mid-write
    assert [r["status"] for r in _sweep(tmp_path, [flat], [64, 128])] == ["ok", "ok"]


# ---------------------------------------------------------------------------------------------
# Table, files, figure
# ---------------------------------------------------------------------------------------------


def test_table_files_and_figure(tmp_path, flat):
    from helpers.lab.plots import plot_memory_sweep

    cap = MemoryCap("cpu", 200_000, None, None)
    records = _sweep(tmp_path, ["naive", flat], [16, 32, 128], cap)
    table = results_pivot(records)
    assert "| naive | 0.0" in table and table.splitlines()[-1].endswith("| **OOM** |") and "Peak MB" in table
    csv_path, json_path = write_results(records, tmp_path, "memory_sweep", {"device": "cpu"})
    assert len(csv_path.read_text().splitlines()) == 1 + len(records)
    assert json.loads(json_path.read_text())["meta"] == {"device": "cpu"}
    fig = plot_memory_sweep(records, path=tmp_path / "sweep.png", title="test",
                            room_bytes={n: 200_000 for n in (16, 32, 128)}, unit=("MB", 1e6),
                            latency_caveat="CPU")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert len(fig.axes) == 2
