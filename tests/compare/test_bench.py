"""The benchmark command: gate first, measure, write as it goes, never time a failing method."""

import torch

from helpers.cce import linear_cross_entropy

from helpers.compare.bench import bench_table, run_bench
from helpers.compare.methods.baselines import naive_loss
from helpers.compare.methods import Method
from helpers.compare.results_file import read_results
from helpers.compare.units import lower_bound_bytes


def test_bench_measures_gated_methods_and_writes_as_it_goes(tmp_path):
    out = tmp_path / "bench.jsonl"
    regimes = ["uniform", "realistic", "trained"]
    records = run_bench(["naive", "chunked", "apple_cce"], ["tiny"], regimes, (torch.float32,),
                        Ns=[64], output=out, warmup=0, repeats=2, device="cpu", progress=False)
    by = {(r.method, r.regime): r for r in records}
    assert by[("apple_cce", "uniform")].status == "unavailable" and "CUDA GPU" in by[("apple_cce", "uniform")].note
    for regime in regimes:
        r = by[("chunked", regime)]
        assert r.status == "ok" and r.gate == "pass" and r.fwd_bwd_ms > 0 and r.peak_mb > 0
        assert r.lower_bound_mb == lower_bound_bytes(64, 1031, 40, torch.float32) / 1e6
        assert r.peak_over_lb >= 1.0  # the step's own gradients are part of its peak
    meta, results = read_results(out)
    assert len(results) == len(records) == 9 and results[0]["method"] == "naive"
    assert meta["bench"]["regimes"] == regimes and meta["gate"] and meta["device"]["kind"] == "cpu"
    assert "| tiny | realistic | float32 | 64 | chunked |" in bench_table(records)
    # the trained regime's model is described in the meta record: what was timed on
    model = meta["trained_models"]["tiny"]
    assert (model["V"], model["D"]) == (1031, 40) and model["final_train_loss"] < model["first_loss"]


def test_an_unknown_regime_is_refused_before_anything_runs():
    import pytest

    with pytest.raises(ValueError, match="regime must be one of"):
        run_bench(["naive"], ["tiny"], ["peaked"], device="cpu", progress=False)


def test_a_method_that_fails_the_gate_is_not_timed(temporary_method):
    def too_steep(E, C, x, **kw):
        return naive_loss(E, C, x, **kw) * 1.02

    temporary_method(Method("too_steep", "too_steep", "wrong by 2%", too_steep, lambda d, t, s: None))
    skipped = run_bench(["too_steep"], ["tiny"], dtypes=(torch.float32,), Ns=[64], warmup=0, repeats=1,
                        device="cpu", progress=False)
    assert [r.status for r in skipped] == ["failed gate"] and skipped[0].fwd_bwd_ms is None
    # The row says why it was not timed: the failed cases and the worst error over its bound.
    assert skipped[0].note.startswith("failed ") and "x its bound" in skipped[0].note, skipped[0].note
    timed = run_bench(["too_steep"], ["tiny"], dtypes=(torch.float32,), Ns=[64], warmup=0, repeats=1,
                      time_failed=True, device="cpu", progress=False)
    assert timed[0].status == "ok" and timed[0].gate == "fail (timed anyway)"


def test_bench_says_which_backward_ran(temporary_method):
    """A method whose backward can take another path says which it took: the sparse preset at the
    tiny shape runs "gemm" (too few pairs), and with that rule lifted (a tier whose host knobs let
    any size run sparse) it runs sparse and counts."""
    import dataclasses

    from helpers.cce.options import resolve_configs
    from helpers.compare.bench import backward_note
    from helpers.compare.inputs import make_inputs
    from helpers.compare.methods import get_method

    fell_back = run_bench(["ours_sparse"], ["tiny"], ["realistic"], (torch.float16,), Ns=[64], warmup=0, repeats=1,
                          device="cpu", progress=False)[0]
    assert fell_back.status == "ok" and fell_back.note.startswith("ran the gemm backward: N x tiles")
    assert "| ours_sparse |" in bench_table([fell_back])
    configs = resolve_configs(None, torch.device("cpu")).tuned(sparse_min_pairs=0, dense_fallback=1.0)
    preset = get_method("ours_sparse")
    temporary_method(dataclasses.replace(preset, name="ours_sparse_any_size", implementation=lambda E, C, x, **kw:
                                         linear_cross_entropy(E, C, x, backward_impl="sparse", sort_vocab=True,
                                                              configs=configs, **kw)))
    E, C, x = make_inputs(48, 700, 24, torch.float16, "cpu", regime="realistic", seed=0)
    note = backward_note("ours_sparse_any_size", E.requires_grad_(True), C.requires_grad_(True), x)
    assert note.startswith("sparse: marked"), note
    assert backward_note("ours_gemm", E, C, x) == ""  # a method with one backward has nothing to say
    assert backward_note("ours", E, C, x).startswith("ran the gemm backward: auto, N x tiles")  # "auto": why



def test_bench_says_how_many_timed_calls_replayed_a_graph(temporary_method, simulated_graphs, monkeypatch):
    """A method whose calls replay from our CUDA graphs (simulated on the CPU, ``tests/conftest.py``) is
    gated on the replay (``gate_calls``) and its note says per kind how many timed calls replayed one; where
    no call could take a graph, nothing is said. ``ours_graphs`` says why it cannot run on the CPU."""
    import dataclasses

    from helpers.cce.options import resolve_configs
    from helpers.compare import bench
    from helpers.compare.methods import get_method

    monkeypatch.setattr(bench, "GATE_SHAPES_CPU", [(16, 97, 8)])  # the gate's cases small: the note is the point
    monkeypatch.setattr(bench, "GATE_REALISTIC_CPU", [])
    graphed = resolve_configs(None, torch.device("cpu")).tuned(graphs_below_us=1e12)
    temporary_method(dataclasses.replace(get_method("ours_gemm"), name="ours_graphed_here", gate_calls=3,
                                         implementation=lambda E, C, x, **kw: linear_cross_entropy(
                                             E, C, x, backward_impl="gemm", configs=graphed, **kw)))
    rec, = run_bench(["ours_graphed_here"], ["tiny"], ["uniform"], (torch.float32,), Ns=[16], warmup=2, repeats=2,
                     device="cpu", progress=False)
    assert rec.status == "ok" and rec.gate == "pass", rec
    assert "replayed from CUDA graphs: forward 2 of 2, backward 2 of 2 timed calls" in rec.note, rec.note
    assert bench.graphs_note(bench.graphs_summary(), bench.graphs_summary()) == ""
    assert "CUDA graphs need a CUDA GPU" in get_method("ours_graphs").why_unavailable("cpu", torch.float32)


def test_a_host_bound_point_is_timed_again_after_the_others_and_the_faster_round_stands(tmp_path, monkeypatch):
    """A point's host may run slow for a while (an H200's first point at 1,024 tokens: 3.30 ms a call
    against 2.01 seconds later): points under ``retime_below_ms`` get a second round after all points,
    newest first, every method alike; the record keeps both rounds, the file is updated in place."""
    from helpers.compare import bench
    from helpers.compare.measure import LatencyStats

    def timings(*fwd_bwd_ms):
        """A latency that runs the call once and returns the next of ``fwd_bwd_ms`` for a forward+backward
        (1 ms for a forward alone); the order of the calls it saw in ``seen``."""
        left = list(fwd_bwd_ms)

        def fake_latency(fn, *, warmup=2, repeats=7, device=None):
            fn()
            ms = 1.0 if fn.__name__ == "forward" else left.pop(0)
            return LatencyStats(median_ms=ms, p10_ms=ms, p90_ms=ms, repeats=repeats)

        return fake_latency

    out = tmp_path / "bench.jsonl"
    # Round 1: naive 9 ms (its host slow), chunked 4, exact 30 (not host-bound); round 2, newest first:
    # chunked 5, naive 4.
    monkeypatch.setattr(bench, "latency", timings(9.0, 4.0, 30.0, 5.0, 4.0))
    naive, chunked, slow = run_bench(["naive", "chunked", "exact"], ["tiny"], ["uniform"], (torch.float32,),
                                     Ns=[64], output=out, warmup=0, repeats=2, device="cpu", progress=False,
                                     retime_below_ms=10.0)
    assert naive.fwd_bwd_rounds_ms == [9.0, 4.0] and naive.fwd_bwd_ms == 4.0
    assert "two rounds, 9.00 and 4.00 ms" in naive.note
    assert chunked.fwd_bwd_rounds_ms == [4.0, 5.0] and chunked.fwd_bwd_ms == 4.0  # the faster round stands
    assert slow.fwd_bwd_rounds_ms is None and slow.fwd_bwd_ms == 30.0  # past the threshold: one round
    assert naive.tflops == 6 * 64 * 1031 * 40 / 4e-3 / 1e12
    assert "| 4.0 (4.0-4.0), rounds 9.00 / 4.00 |" in bench_table([naive])
    _, results = read_results(out)
    assert [r["fwd_bwd_ms"] for r in results] == [4.0, 4.0, 30.0]
    assert results[0]["fwd_bwd_rounds_ms"] == [9.0, 4.0] and results[0]["tflops"] == naive.tflops
    # The CPU's default: no second round.
    monkeypatch.setattr(bench, "latency", timings(3.0))
    plain = run_bench(["naive"], ["tiny"], ["uniform"], (torch.float32,), Ns=[64], warmup=0, repeats=1,
                      device="cpu", progress=False)[0]
    assert plain.fwd_bwd_rounds_ms is None and plain.fwd_bwd_ms == 3.0 and "two rounds" not in plain.note
