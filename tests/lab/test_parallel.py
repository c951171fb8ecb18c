"""``helpers.lab.parallel``: two gloo processes on the CPU, as notebook 07 starts them.

``launch`` brings every rank's records back to the caller, rank by rank; ``check`` passes on an
honest split (V = 97, odd: slices of 49 and 48 rows) and fails on a split whose rows are shifted by
one, which the loss cannot see (the slices still tile the vocabulary); a rank that raises makes
``launch`` raise, with the rank's error and the records written before it. The loss itself is
``tests/cce/test_parallel.py``'s; the timing worker runs in ``scripts/gpu/vocab_parallel.py --tiny``
(``tests/test_gpu_scripts.py``) and in notebook 07.
"""

import pytest
import torch
import torch.distributed as dist

from helpers.compare.results_file import read_results
from helpers.lab import parallel

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

SHAPE = (19, 97, 16)
CASES = ["smoothed, capped, ignored", "targets on rank 0 only"]


def test_shard_tiles_the_vocabulary():
    for V, world in [(97, 2), (151_936, 8), (5, 4)]:
        slices = [parallel.shard(V, world, r) for r in range(world)]
        assert [s for s, _ in slices] == [sum(n for _, n in slices[:r]) for r in range(world)]
        assert sum(n for _, n in slices) == V and max(n for _, n in slices) - min(n for _, n in slices) <= 1


def test_launch_checks_on_two_gloo_processes_and_returns_every_record(tmp_path):
    records = parallel.launch(parallel.check_worker, 2, [SHAPE], "float32", CASES, folder=tmp_path, backend="gloo")
    assert [(r["rank"], r["case"]) for r in records] == [(rank, case) for rank in range(2) for case in CASES]
    assert all(r["status"] == "ok" for r in records), records
    assert [r["V_r"] for r in records[::2]] == [49, 48]
    owned = {(r["rank"], r["case"]): r["owned"] for r in records}
    assert owned[(1, "targets on rank 0 only")] == 0 < owned[(1, "smoothed, capped, ignored")]
    # Written as they came, one results file a rank, a meta record first.
    meta, written = read_results(parallel.rank_results(tmp_path, 1))
    assert meta["rank"] == 1 and meta["backend"] == "gloo" and written == records[2:]


def test_a_split_with_its_rows_shifted_fails_the_check():
    records = parallel.launch(parallel.check_worker, 2, [SHAPE], "float32", CASES[:1], 1, backend="gloo")
    assert [r["status"] for r in records] == ["FAIL", "FAIL"]
    assert all(r["dE_vs_single"] > 0.1 and r["dC_r_vs_float64"] > 0.1 for r in records), records


def failing_worker(rank, world, device, results):
    results.append(dict(rank=rank, case="before", status="ok"))
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()


def test_a_rank_that_raises_makes_launch_raise_and_keeps_the_records(tmp_path):
    with pytest.raises(RuntimeError, match="rank 1 gives up"):
        parallel.launch(failing_worker, 2, folder=tmp_path, backend="gloo", timeout_s=30)
    _, written = read_results(parallel.rank_results(tmp_path, 1))
    assert [r["status"] for r in written] == ["ok", "error"]


def test_memory_per_rank_counts_the_widest_slice():
    bytes_ = parallel.memory_per_rank(131_072, 151_936, 1_024, 2, torch.bfloat16.itemsize)
    assert bytes_["C_r and dC_r (each)"] * 2 == bytes_["C and dC on one device (each)"]
    assert bytes_["the rank's logit slice, never built (N x V_r)"] == 131_072 * 75_968 * 2
    assert parallel.memory_per_rank(8, 5, 1, 2, 4)["C_r and dC_r (each)"] == 3 * 4
