"""The notebooks: each .py/.ipynb pair in sync and stripped, papermill-ready, and the whole suite
running end to end on the CPU smoke profile through the headless runner."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

from helpers.cce.kernels.configs import CPU_TIER_ENV
from helpers.suite.runner import CPU_SUITE_TIER

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_notebooks():
    assert len(SOURCES) >= 1


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_pair_in_sync_and_stripped(source):
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{source.name} has no paired {paired.name}: run jupytext --sync {source}"
    ipynb = nbformat.read(paired, as_version=4)
    assert cells(jupytext.read(source)) == cells(ipynb), (
        f"{paired.name} differs from {source.name}: run jupytext --sync {source.relative_to(ROOT)}"
    )
    for c in ipynb.cells:
        if c.cell_type == "code":
            assert not c.outputs and c.execution_count is None, f"{paired.name} has outputs: strip them"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_parameters_cell_names_profile_and_output_dir(source):
    nb = jupytext.read(source)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{source.name} needs exactly one cell tagged 'parameters'"
    assert 'profile = "auto"' in tagged[0].source  # "Run all" must get the full run
    assert "output_dir = " in tagged[0].source


def test_every_ipynb_has_a_source():
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        assert nb.with_suffix(".py").exists(), f"{nb.name} has no .py source"


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--profile", "cpu"], ["--pretend-t4"]], ids=["cpu", "pretend-t4"])
def test_suite_runs_headless_on_the_cpu(mode, tmp_path):
    """The README's main command, minus setup: every notebook, executed by papermill; and every
    notebook's fp16 path, as a T4 runs it (on the CPU: the cpu-t4 profile), so that an fp16-only
    failure cannot land unnoticed."""
    done = subprocess.run(
        [sys.executable, "-m", "helpers", "run", *mode, "--output", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    failed = {r["notebook"]: r["error"] for r in summary["runs"] if r["status"] != "ok"}
    assert done.returncode == 0 and not failed, f"{failed}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert [r["notebook"] for r in summary["runs"]] == [p.stem for p in SOURCES]
    assert summary["profile"] == ("cpu-t4" if mode == ["--pretend-t4"] else "cpu")
    gate = json.loads((tmp_path / "01_correctness" / "gate.json").read_text())
    assert gate["rows"] and any(s["method"] == "chunked" and s["verdict"] == "pass" for s in gate["summary"])
    assert (tmp_path / "01_correctness" / "01_correctness.ipynb").exists()
    # The batch report collects every notebook's report.md, with images that resolve.
    report = (tmp_path / "REPORT.md").read_text()
    assert "ran but wrote no" not in report, report
    for source in SOURCES:
        assert f"## {source.stem}" in report
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", report, flags=re.DOTALL))
    assert images and all((tmp_path / target).is_file() for target in images), images
    assert "data:image/png;base64," in (tmp_path / "REPORT.html").read_text()


@pytest.mark.slow
def test_the_workshop_runs_to_the_end_with_its_gaps_open(tmp_path, monkeypatch):
    """What an attendee's "Run all" does (SOLUTIONS = False, the default): every "your turn" cell
    says it is not filled in yet, later cells use the worked solutions, and every check passes."""
    import papermill

    monkeypatch.setenv("HELPERS_HEADLESS", "1")  # as the runner does: interact can hang nbclient
    monkeypatch.setenv(CPU_TIER_ENV, CPU_SUITE_TIER)  # and its kernels' tier

    out = tmp_path / "out"
    papermill.execute_notebook(
        str(ROOT / "notebooks" / "04_kernel_walkthrough.ipynb"), str(tmp_path / "executed.ipynb"),
        parameters={"profile": "cpu", "output_dir": str(out)}, cwd=str(ROOT / "notebooks"), progress_bar=False,
    )
    results = json.loads((out / "results.json").read_text())
    assert results["exercises"] and not any(results["exercises"].values()), results["exercises"]
    assert all(c["ok"] for c in results["checks"])
    executed = (tmp_path / "executed.ipynb").read_text()
    assert executed.count("not filled in yet (the gap") == len(results["exercises"]) == 7


# A peer that drifts is a finding; ours that drifts is a fault. The drift is forced from outside
# the notebook: a sitecustomize module on the kernel's PYTHONPATH scales one arm's loss by 1.5
# before the notebook runs (the notebook itself has no hook for it).
_DRIFT = """
from dataclasses import replace
from helpers.compare.methods import METHODS
method = METHODS[{arm!r}]
METHODS[{arm!r}] = replace(method, implementation=lambda E, C, x, **kw: 1.5 * method.implementation(E, C, x, **kw))
"""


def _run_convergence_with_drift(arm, tmp_path, monkeypatch):
    import papermill

    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "sitecustomize.py").write_text(_DRIFT.format(arm=arm))
    monkeypatch.setenv("PYTHONPATH", f"{plugin}:{ROOT}")
    monkeypatch.setenv(CPU_TIER_ENV, CPU_SUITE_TIER)  # the runner's kernels' tier
    out = tmp_path / "out"
    error = None
    try:
        papermill.execute_notebook(
            str(ROOT / "notebooks" / "03_convergence.ipynb"), str(tmp_path / "executed.ipynb"),
            parameters={"profile": "cpu", "output_dir": str(out), "finetune_steps": 3, "pretrain_steps": 2},
            cwd=str(ROOT / "notebooks"), progress_bar=False,
        )
    except papermill.PapermillExecutionError as e:
        error = e
    return error, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_a_drifting_peer_is_reported_and_the_notebook_completes(tmp_path, monkeypatch):
    error, results = _run_convergence_with_drift("liger", tmp_path, monkeypatch)
    assert error is None, error
    assert any("Liger drifted" in f for f in results["peer_findings"]), results["peer_findings"]
    assert results["our_faults"] == []
    assert "Liger drifted" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.slow
def test_ours_drifting_fails_the_notebook(tmp_path, monkeypatch):
    error, results = _run_convergence_with_drift("ours", tmp_path, monkeypatch)
    assert error is not None and "drifted" in str(error)
    assert any("ours (Triton CCE) drifted" in f for f in results["our_faults"]), results["our_faults"]
