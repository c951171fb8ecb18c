"""Writing the notebooks' generated parts: the cold-start cell and the Colab/Kaggle badges.

The .py (jupytext percent format) is each notebook's source of truth; after an edit here the paired
.ipynb is synced (``jupytext --sync``), outputs stripped. The cold-start cell comes from
``helpers.suite.bootstrap.COLD_START_CELL``, the badge links from ``helpers.suite.paths``.
``python -m helpers.suite.cells`` rewrites both in every notebook (after the GitHub home changed).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from helpers.suite.bootstrap import COLD_START_CELL, COLD_START_TAG
from helpers.suite.paths import GITHUB_BRANCH, GITHUB_REPO, ROOT, find_notebooks

_CELL_MARKER = re.compile(r"^# %%.*$", re.MULTILINE)


def split_cells(text: str) -> tuple[str, list[str]]:
    """(the header before the first cell marker, [each cell's text from its marker on])."""
    starts = [m.start() for m in _CELL_MARKER.finditer(text)]
    if not starts:
        raise ValueError("not a jupytext percent file: no '# %%' cell marker")
    cells = [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
    return text[: starts[0]], cells


def _is_cold_start(cell: str) -> bool:
    first = cell.splitlines()[0]
    return "[markdown]" not in first and f'"{COLD_START_TAG}"' in first


def install_cold_start_cell(py_path: str | Path, sync: bool = True) -> bool:
    """Insert or update COLD_START_CELL as the first code cell of a jupytext percent notebook.

    It goes after the leading markdown cell(s) (the title), tagged ``cold-start``. Returns whether
    the file changed; with ``sync`` the paired .ipynb is then updated (``jupytext --sync``).
    """
    py_path = Path(py_path)
    text = py_path.read_text()
    header, cells = split_cells(text)
    cells = [c for c in cells if not _is_cold_start(c)]
    position = 0
    while position < len(cells) and "[markdown]" in cells[position].splitlines()[0]:
        position += 1
    # source_hidden: Jupyter shows the cell collapsed (its output, the report, stays visible).
    marker = f'# %% jupyter={{"source_hidden": true}} tags=["{COLD_START_TAG}"]'
    cells.insert(position, f"{marker}\n{COLD_START_CELL}\n\n")
    if position > 0:
        cells[position - 1] = cells[position - 1].rstrip("\n") + "\n\n"
    new = ("".join([header, *cells])).rstrip("\n") + "\n"
    return write_notebook_source(py_path, text, new, sync)


def write_notebook_source(py_path: Path, old: str, new: str, sync: bool) -> bool:
    """Write ``new`` over a notebook's .py when it differs from ``old`` (then, with ``sync``, update
    the paired .ipynb); return whether it changed."""
    if new == old:
        return False
    py_path.write_text(new)
    if sync:
        sync_pair(py_path)
    return True


def sync_pair(py_path: str | Path) -> None:
    """Update the paired .ipynb from the .py (``jupytext --sync``), outputs stay stripped."""
    from jupytext.cli import jupytext as jupytext_cli

    jupytext_cli(["--sync", "--quiet", str(py_path)])


# ---------------------------------------------------------------------------------------------
# Colab and Kaggle badges, from GITHUB_REPO / GITHUB_BRANCH (helpers.suite.paths).
# ---------------------------------------------------------------------------------------------

COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
KAGGLE_BADGE = "https://kaggle.com/static/images/open-in-kaggle.svg"


def notebook_links(notebook: str | Path, repo: str = GITHUB_REPO, branch: str = GITHUB_BRANCH) -> dict[str, str]:
    """{"github", "colab", "kaggle"} URLs that open ``notebook`` (its .ipynb) from the repository."""
    path = Path(notebook).with_suffix(".ipynb")
    if path.is_absolute():  # the suite's notebooks live in notebooks/, wherever this copy sits
        path = path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path("notebooks", path.name)
    github = f"https://github.com/{repo}/blob/{branch}/{path.as_posix()}"
    return {
        "github": github,
        "colab": f"https://colab.research.google.com/github/{repo}/blob/{branch}/{path.as_posix()}",
        "kaggle": f"https://kaggle.com/kernels/welcome?src={github}",
    }


def badges_markdown(notebook: str | Path) -> str:
    links = notebook_links(notebook)
    return (f"[![Open in Colab]({COLAB_BADGE})]({links['colab']}) "
            f"[![Open in Kaggle]({KAGGLE_BADGE})]({links['kaggle']})")


def readme_badge_table(notebooks: list[Path] | None = None) -> str:
    """A README table: each notebook with its Colab and Kaggle badges."""
    rows = ["| notebook | Colab | Kaggle |", "|---|---|---|"]
    for nb in notebooks or find_notebooks():
        links = notebook_links(nb)
        rows.append(f"| `{nb.stem}` | [![Open in Colab]({COLAB_BADGE})]({links['colab']}) "
                    f"| [![Open in Kaggle]({KAGGLE_BADGE})]({links['kaggle']}) |")
    return "\n".join(rows)


def install_badges(py_path: str | Path, sync: bool = True) -> bool:
    """Insert or update the badge line in a percent notebook's first markdown cell, under its title.

    Returns whether the file changed; with ``sync`` the paired .ipynb is then updated.
    """
    py_path = Path(py_path)
    text = py_path.read_text()
    header, cells = split_cells(text)
    index = next((i for i, c in enumerate(cells) if "[markdown]" in c.splitlines()[0]), None)
    if index is None:
        raise ValueError(f"{py_path.name} has no markdown cell for the badges")
    badge_line = "# " + badges_markdown(py_path.resolve())
    lines = [line for line in cells[index].split("\n") if COLAB_BADGE not in line]
    title = next((i for i, line in enumerate(lines) if line.startswith("# #")), 0)
    lines[title + 1:title + 1] = ["#", badge_line]
    cleaned = []  # an update leaves the old badge's blank line doubled: keep one
    for line in lines:
        if not (line == "#" and cleaned and cleaned[-1] == "#"):
            cleaned.append(line)
    cells[index] = "\n".join(cleaned)
    new = "".join([header, *cells])
    return write_notebook_source(py_path, text, new, sync)




def main(argv: list[str] | None = None) -> int:
    for py in find_notebooks(suffix=".py"):
        changed = install_cold_start_cell(py, sync=False) | install_badges(py, sync=False)
        if changed:
            sync_pair(py)
        print(f"{py.name}: {'updated' if changed else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
