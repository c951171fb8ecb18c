"""Docstrings and comments that cite a test file cite one that exists.

A test file that moves (into a layer's folder, under a new name) leaves behind every docstring
that pointed to it; this finds them. Scans ``helpers/`` and ``scripts/`` (their ``.py`` and
``.sh`` files) for ``tests/...py`` paths, in comments, docstrings and strings alike.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_PATH = re.compile(r"(?<![\w/.])tests/[\w/]*?\w+\.py\b")


# Stale when this test was written (2026-12-02), in files of other open branches: the integrator
# fixes each citation and deletes its entry here; the list is to end empty.


def cited_test_paths(text: str) -> list[str]:
    return TEST_PATH.findall(text)


def test_the_scan_finds_paths_in_prose_and_in_node_ids():
    text = "see tests/cce/test_cce.py::test_x and (tests/test_hf.py), not mytests/x.py or a/tests/y.py"
    assert cited_test_paths(text) == ["tests/cce/test_cce.py", "tests/test_hf.py"]


def missing_citations() -> set[str]:
    """'file: cited path' for each cited test file that does not exist."""
    files = [p for folder in ("helpers", "scripts") for p in sorted((ROOT / folder).rglob("*"))
             if p.suffix in (".py", ".sh")]
    assert files
    return {f"{path.relative_to(ROOT)}: {cited}"
            for path in files
            for cited in cited_test_paths(path.read_text())
            if not (ROOT / cited).is_file()}


def test_every_test_file_cited_in_helpers_and_scripts_exists():
    missing = sorted(missing_citations())
    assert not missing, "cited test files that do not exist:\n" + "\n".join(missing)


def test_no_merge_conflict_markers_are_left_in_the_text():
    """A merge whose conflict was committed unresolved leaves <<<<<<< / >>>>>>> lines behind, which
    nothing else reads as wrong in prose."""
    marker = re.compile(r"^(<{7}|>{7}) ", re.MULTILINE)
    folders = ("helpers", "scripts", "notebooks", "docs", "tests")
    files = [ROOT / "README.md", *(p for folder in folders for p in (ROOT / folder).rglob("*")
                                   if p.suffix in (".py", ".md", ".sh", ".ipynb") and p.is_file())]
    left = [str(p.relative_to(ROOT)) for p in files if marker.search(p.read_text(errors="ignore"))]
    assert not left, left
