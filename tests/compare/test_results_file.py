"""The one results format: a meta record, then one result a line; and the formats before it."""

import json

from helpers.compare.results_file import SCHEMA_VERSION, ResultsWriter, read_results, run_meta


def test_a_results_file_reads_back_its_meta_and_results_in_order(tmp_path):
    path = tmp_path / "run" / "bench.jsonl"
    writer = ResultsWriter(path, run_meta("cpu", command=["python", "-m", "helpers", "bench"], gate="pass"))
    writer.append({"case": "a", "ms": 1.5})
    writer.append({"case": "b", "ms": 2.5})
    writer.update_meta(trained_models={"tiny": {"V": 1031}})
    writer.append({"case": "c", "ms": None})
    meta, results = read_results(path)
    assert meta["schema"] == SCHEMA_VERSION and meta["record"] == "meta"
    assert meta["command"] == ["python", "-m", "helpers", "bench"] and meta["gate"] == "pass"
    assert meta["device"]["kind"] == "cpu" and meta["versions"]["torch"]
    assert meta["time"].endswith("+00:00") and meta["trained_models"] == {"tiny": {"V": 1031}}
    assert results == [{"case": "a", "ms": 1.5}, {"case": "b", "ms": 2.5}, {"case": "c", "ms": None}]
    # every line is one JSON object, each saying what it is
    kinds = [json.loads(line)["record"] for line in path.read_text().splitlines()]
    assert kinds == ["meta", "result", "result", "result"]


def test_a_new_writer_starts_the_file_afresh(tmp_path):
    path = tmp_path / "out.jsonl"
    ResultsWriter(path, {"run": 1}).append({"x": 1})
    ResultsWriter(path, {"run": 2}).append({"x": 2})
    meta, results = read_results(path)
    assert meta["run"] == 2 and results == [{"x": 2}]


def test_the_formats_before_schema_1_still_read(tmp_path):
    bench = tmp_path / "bench.jsonl"  # a bench's lines, its meta beside them
    bench.write_text('{"method": "ours"}\n{"method": "liger"}\n')
    bench.with_suffix(".meta.json").write_text('{"torch": "2.9"}')
    assert read_results(bench) == ({"torch": "2.9"}, [{"method": "ours"}, {"method": "liger"}])
    script = tmp_path / "cce_check.json"  # a GPU script's one object
    script.write_text(json.dumps({"meta": {"failed": 0}, "records": [{"case": "x"}]}, indent=1))
    assert read_results(script) == ({"failed": 0}, [{"case": "x"}])
