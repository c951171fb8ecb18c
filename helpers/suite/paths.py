"""Where the suite lives: the one place that names the repository root, the notebooks folder and
the GitHub home.

The notebooks ship with the repository, not with the package: ``find_notebooks`` looks in this
checkout's ``notebooks/`` (wherever the command runs from), never in the current folder's. The
GitHub home is a placeholder until the repository is published; after changing it, run
``python -m helpers.suite.cells`` to rewrite every notebook's cold-start cell and badges, and
update the README's badge table (``helpers.suite.cells.readme_badge_table``). Standard library
only: the notebooks' cold-start cell copies ``HELPERS_SOURCE`` before ``helpers`` is installed.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: helpers/suite/paths.py -> ../../
NOTEBOOKS = ROOT / "notebooks"
NOTEBOOK_PATTERN = "[0-9][0-9]_*"  # 01_correctness, 02_memory_sweep, ...

GITHUB_REPO = "mecs-workbench/memory-efficient-cross-entropy"
GITHUB_BRANCH = "main"
# An archive URL needs no git binary on the platform (pip builds the sdist from it).
HELPERS_SOURCE = f"https://github.com/{GITHUB_REPO}/archive/refs/heads/{GITHUB_BRANCH}.zip"


def find_notebooks(only: list[str] | None = None, suffix: str = ".ipynb") -> list[Path]:
    """The suite's notebooks (``suffix`` ".ipynb" or ".py") in order; ``only`` keeps those whose
    name starts with one of its entries. Raises SystemExit, saying why, when none is found."""
    if not NOTEBOOKS.is_dir():
        raise SystemExit(
            f"no notebooks folder at {NOTEBOOKS}: the notebooks ship with the repository, not with an "
            "installed wheel; run from a clone of it"
        )
    found = sorted(NOTEBOOKS.glob(NOTEBOOK_PATTERN + suffix))
    if only:
        found = [p for p in found if any(p.stem.startswith(o) for o in only)]
        if not found:
            raise SystemExit(f"no notebook in {NOTEBOOKS} starts with any of {only}")
    if not found:
        raise SystemExit(f"no notebooks found in {NOTEBOOKS}")
    return found


__all__ = ["ROOT", "NOTEBOOKS", "GITHUB_REPO", "GITHUB_BRANCH", "HELPERS_SOURCE", "find_notebooks"]
