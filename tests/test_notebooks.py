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


def test_suite_runs_headless_on_the_cpu_profile(tmp_path):
    """The README's main command, minus setup: every notebook, executed by papermill."""
    done = subprocess.run(
        [sys.executable, "-m", "helpers", "run", "--profile", "cpu", "--output", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    failed = {r["notebook"]: r["error"] for r in summary["runs"] if r["status"] != "ok"}
    assert done.returncode == 0 and not failed, f"{failed}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert [r["notebook"] for r in summary["runs"]] == [p.stem for p in SOURCES]
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
