"""The scale report: a bench results file read back as a table and a figure of time against N, with
ours held to the four-product floor (4 products of 2·N·V·D FLOP at the measured matmul rate)."""

from dataclasses import asdict

import pytest
import torch

from helpers.compare.bench import BenchRecord, run_bench
from helpers.compare.heads import QWEN3
from helpers.compare.results_file import ResultsWriter, read_results
from helpers.lab.scale import four_product_floor_ms, read_scale, scale_table, write_scale_report

V, D = QWEN3.V, QWEN3.D
NS = [1_024, 4_096, 16_384, 65_536, 131_072]
RATE = 400.0  # TFLOP/s
PRETEND_A100 = {"kind": "cuda", "name": "NVIDIA H200 as an A100-40GB", "capability": [8, 0], "pretend": "a100-40gb",
                "description": "NVIDIA H200 as an A100-40GB (sm_80, ...)"}


def floor(N):
    return 8 * N * V * D / (RATE * 1e12) * 1e3


def fake_bench(path, meta_rate=True):
    """A Qwen3 bench as a pretend A100 writes it: ours at 80% of the floor's speed, Liger at 50%,
    torch.compile out of memory from 65,536, Apple CCE timed although it failed the gate; a Gemma
    point and an fp16 point the report must leave out."""
    meta = {"device": PRETEND_A100, **({"matmul_tflops": {"bfloat16": RATE, "float16": None}} if meta_rate else {})}
    store = ResultsWriter(path, meta)
    for N in NS:
        for method, share in (("ours", 0.8), ("liger", 0.5), ("torch_compile", 0.9), ("apple_cce", 0.6)):
            record = BenchRecord("qwen3-0.6b", "uniform", "bfloat16", method, N, V, D, "ok", "pass",
                                 fwd_bwd_ms=floor(N) / share)
            record.tflops = 6 * N * V * D / (record.fwd_bwd_ms * 1e-3) / 1e12
            record.fraction_of_matmul_peak = record.tflops / RATE
            if method == "torch_compile" and N >= 65_536:
                record = BenchRecord("qwen3-0.6b", "uniform", "bfloat16", method, N, V, D, "oom", "pass",
                                     note="OutOfMemoryError: CUDA out of memory")
            if method == "apple_cce":
                record.gate = "fail (timed anyway)"
            store.append(asdict(record))
    store.append(asdict(BenchRecord("gemma2-2b", "uniform", "bfloat16", "ours", 8_192, 256_000, 2_304, "ok",
                                    "pass", fwd_bwd_ms=50.0)))
    store.append(asdict(BenchRecord("qwen3-0.6b", "uniform", "float16", "ours", 1_024, V, D, "ok", "pass",
                                    fwd_bwd_ms=9.0)))
    return path


def test_the_floor_is_four_products_at_the_matmul_rate():
    assert four_product_floor_ms(1_024, V, D, RATE) == pytest.approx(4 * 2 * 1_024 * V * D / 400e12 * 1e3)
    assert four_product_floor_ms(2_048, V, D, RATE) == pytest.approx(2 * four_product_floor_ms(1_024, V, D, RATE))


def test_the_table_has_a_row_per_N_and_a_column_per_method(tmp_path):
    s = read_scale(fake_bench(tmp_path / "bench.jsonl"))
    assert (s.regime, s.dtype, s.Ns, s.matmul_tflops) == ("uniform", "bfloat16", NS, RATE)
    assert s.methods == ["ours", "liger", "torch_compile", "apple_cce"] and s.ours == ["ours"]
    assert s.fraction_of_floor("ours", 16_384) == pytest.approx(0.8)
    assert s.rate_tflops("ours", 16_384) == pytest.approx(0.8 * RATE)
    md = scale_table(s)
    rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    header, body = rows[0], rows[1:]
    assert [r.split(" | ")[0] for r in body] == [f"| {N:,}" for N in NS]  # 1k to 131k, no Gemma or fp16 row
    for heading in ("ours (Triton CCE) ms", "Liger ms", "torch.compile ms", "Apple CCE ms", "floor ms",
                    "ours (Triton CCE) TFLOP/s", "ours (Triton CCE): floor / time"):
        assert heading in header
    assert body[0].endswith(f"| {floor(1_024):.2f} | 320 | 80% |")
    assert "| out of memory |" in body[3] and " † |" in body[0]
    assert "- torch.compile, out of memory: OutOfMemoryError" in md and "† failed the accuracy gate" in md
    assert "Qwen3-0.6B head (V = 151,936, D = 1,024), bfloat16, uniform" in md
    assert "pretend A100-40GB" in md and "400 TFLOP/s, measured by the bench" in md
    assert "At N = 131,072, ours (Triton CCE) takes" in md and "80% of the four-product floor's speed" in md
    assert "Liger 1.60× ours' time" in md and "torch.compile out of memory" in md


def test_the_report_writes_the_table_and_the_figure(tmp_path):
    from helpers.__main__ import main

    bench = fake_bench(tmp_path / "bench.jsonl")
    table, figure = write_scale_report(bench, tmp_path / "a")
    assert table.read_text() == scale_table(read_scale(bench))
    assert figure.read_bytes().startswith(b"\x89PNG") and figure.stat().st_size > 10_000
    assert main(["scale-report", str(bench), "--output-dir", str(tmp_path / "b"), "--dtype", "float16"]) == 0
    assert "| 1,024 | 9.00 |" in (tmp_path / "b" / "scale.md").read_text()
    assert (tmp_path / "b" / "scale.png").is_file()
    assert main(["scale-report", str(bench), "--output-dir", str(tmp_path / "c"), "--regime", "trained"]) == 2
    with pytest.raises(ValueError, match=r"holds \[\('uniform', 'bfloat16'\), \('uniform', 'float16'\)\]"):
        read_scale(bench, regime="trained")


def test_a_file_without_the_rate_gives_it_back_from_its_points(tmp_path):
    """Bench files before the meta record held the matmul rate (docs/measurements up to 2026-12-02)."""
    s = read_scale(fake_bench(tmp_path / "bench.jsonl", meta_rate=False))
    assert s.matmul_tflops == pytest.approx(RATE) and "read back from its points" in s.rate_source
    assert read_scale(tmp_path / "bench.jsonl", matmul_tflops=800.0).fraction_of_floor("ours", 1_024) == \
        pytest.approx(0.4)


def test_a_cpu_bench_reads_back_without_a_floor(tmp_path):
    """A real (tiny) bench on the CPU: the rate is on record as unmeasured, so no floor; the report
    still has a row per N and a figure, marked as a CPU's."""
    out = tmp_path / "bench.jsonl"
    run_bench(["naive", "chunked"], ["tiny"], dtypes=(torch.float32,), Ns=[64, 256], output=out, warmup=0,
              repeats=1, device="cpu", progress=False)
    meta, _ = read_results(out)
    assert meta["matmul_tflops"] == {"float32": None}
    table, figure = write_scale_report(out, tmp_path / "scale", shape="tiny")
    md = table.read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| N | naive ms | chunked (PyTorch) ms |" and [r.split(" | ")[0] for r in rows[1:]] == ["| 64", "| 256"]
    assert "not measured" in md and "Measured on a CPU" in md and "Ours has no timed point" in md
    assert figure.is_file()
