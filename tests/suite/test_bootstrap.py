"""The cold-start cell: its decisions on Kaggle (online, offline), Colab and a local machine, the
cell's own text run in a fresh interpreter, its place in every notebook, and the two environment
files naming everything the package and the notebooks import."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

import helpers.suite.bootstrap as bootstrap
from helpers.suite.bootstrap import (
    COLD_START_CELL,
    HELPERS_SOURCE,
    REQUIREMENTS,
    cold_start_plan,
    detect_platform,
    find_checkout,
    find_wheels,
)
from helpers.suite.cells import install_cold_start_cell

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
EVERYTHING = {"helpers", "torch", *REQUIREMENTS}
VERSIONS = {"torch": "2.6.0+cu124", "triton": "3.2.0"}
PEERS = {"liger_kernel", "cut_cross_entropy"}


def first_code_cell(py_path: str | Path) -> str:
    """The source of the first code cell of a percent notebook, as jupytext reads it."""
    import jupytext

    notebook = jupytext.read(py_path)
    return next(c.source for c in notebook.cells if c.cell_type == "code")


def test_platform_detection():
    assert detect_platform({"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, {}) == "kaggle"
    assert detect_platform({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, {"google.colab": object()}) == "kaggle"
    assert detect_platform({}, {"google.colab": object()}) == "colab"
    assert detect_platform({"HOME": "/root"}, {"os": os}) == "local"


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_find_wheels_takes_the_folder_holding_ours(tmp_path):
    _touch(tmp_path / "other-dataset" / "numpy-2.0-py3-none-any.whl")
    ours = _touch(tmp_path / "mecs-wheels" / "v1" / "helpers-0.1.0-py3-none-any.whl")
    peer = _touch(tmp_path / "mecs-wheels" / "v1" / "liger_kernel-0.8.5-py3-none-any.whl")
    assert find_wheels([str(tmp_path / "nowhere"), str(tmp_path)]) == sorted([str(ours), str(peer)])
    assert find_wheels([str(tmp_path / "other-dataset")]) == []


def test_find_checkout(tmp_path):
    assert find_checkout(str(ROOT / "notebooks")) == str(ROOT)
    assert find_checkout(str(tmp_path)) is None


def test_installed_suite_needs_nothing():
    for where in ("kaggle", "colab", "local"):
        assert cold_start_plan(where, EVERYTHING, VERSIONS) == []


def _commands(plan):
    return [args for _, args in plan]


def _never_moves_torch(plan):
    for args in _commands(plan):
        assert args[0] == "install"
        assert not {"-U", "--upgrade", "--force-reinstall", "--ignore-installed"} & set(args)
        torch_args = [a for a in args if re.match(r"torch\b", a)]
        assert torch_args in ([], [f"torch=={VERSIONS['torch']}"]), args


def test_kaggle_online_installs_ours_without_deps_then_only_the_missing_by_name():
    plan = cold_start_plan("kaggle", EVERYTHING - {"helpers"} - PEERS, VERSIONS)
    ours, missing = _commands(plan)
    assert ours == ["install", "--no-deps", HELPERS_SOURCE]
    assert missing == ["install", REQUIREMENTS["liger_kernel"], REQUIREMENTS["cut_cross_entropy"],
                       "torch==2.6.0+cu124", "triton==3.2.0"]
    _never_moves_torch(plan)


def test_kaggle_offline_installs_from_the_attached_dataset():
    folder = "/kaggle/input/mecs-wheels"
    wheels = [f"{folder}/cut_cross_entropy-25.1.1-py3-none-any.whl", f"{folder}/helpers-0.1.0-py3-none-any.whl",
              f"{folder}/liger_kernel-0.8.5-py3-none-any.whl"]
    plan = cold_start_plan("kaggle", EVERYTHING - {"helpers", "ipywidgets"} - PEERS, VERSIONS, wheels)
    ours, offline, online = _commands(plan)
    assert ours == ["install", "--no-deps", wheels[1]]
    assert offline[:5] == ["install", "--no-deps", "--no-index", "--find-links", folder]
    assert offline[5:] == [REQUIREMENTS["liger_kernel"], REQUIREMENTS["cut_cross_entropy"]]
    assert online[:2] == ["install", REQUIREMENTS["ipywidgets"]]  # not in the dataset: from the index
    _never_moves_torch(plan)


def test_colab_installs_from_github():
    plan = cold_start_plan("colab", EVERYTHING - {"helpers"} - PEERS, VERSIONS)
    assert _commands(plan)[0] == ["install", "--no-deps", HELPERS_SOURCE]
    _never_moves_torch(plan)


def test_local_checkout_is_installed_editable_and_triton_only_on_linux():
    plan = cold_start_plan("local", EVERYTHING - {"helpers", "triton"}, {"torch": "2.13.0"}, checkout="/src/repo",
                           system="Darwin")
    assert _commands(plan) == [["install", "--no-deps", "-e", "/src/repo"]]


def test_no_torch_is_never_chosen_for_the_platform():
    with pytest.raises(RuntimeError, match="never chooses a torch build"):
        cold_start_plan("kaggle", EVERYTHING - {"torch"}, {})


def test_cold_start_runs_the_plan_and_reports(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(bootstrap, "importable", lambda m: m not in PEERS)
    monkeypatch.setattr(bootstrap, "environment_report", lambda where: f"REPORT for {where}")

    def recorder(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    bootstrap.cold_start(environ={"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, modules={}, run=recorder)
    assert len(calls) == 1 and calls[0][:4] == [sys.executable, "-m", "pip", "install"]
    assert "REPORT for kaggle" in capsys.readouterr().out


def test_a_failed_install_says_what_to_do(monkeypatch):
    monkeypatch.setattr(bootstrap, "importable", lambda m: m != "helpers")
    failing = lambda command, **kwargs: subprocess.CompletedProcess(command, 1, "", "no network")  # noqa: E731
    with pytest.raises(RuntimeError, match="(?s)no network.*attach the dataset"):
        bootstrap.cold_start(environ={"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, modules={}, run=failing)


# ---------------------------------------------------------------------------------------------
# The cell's own text, in a fresh interpreter: what a notebook actually runs.
# ---------------------------------------------------------------------------------------------

# Runs the cell as a notebook would, after hiding the modules named in argv[2] from
# importlib.util.find_spec (how the cell looks for them) and, with argv[3] == "colab", faking
# google.colab. The cell must not need helpers to be importable to run.
RUN_CELL = """
import importlib.util, sys, types
hidden = set(filter(None, sys.argv[2].split(",")))
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name.split(".")[0] in hidden else real(name, package)
if sys.argv[3] == "colab":
    sys.modules["google.colab"] = types.ModuleType("google.colab")
exec(compile(open(sys.argv[1]).read(), "cold-start cell", "exec"), {"__name__": "__main__"})
"""


def run_cell(tmp_path, hidden=(), platform="", **env):
    cell = tmp_path / "cell.py"
    cell.write_text(COLD_START_CELL)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KAGGLE_", "HELPERS_"))}
    done = subprocess.run(
        [sys.executable, "-c", RUN_CELL, str(cell), ",".join(hidden), platform],
        cwd=tmp_path,  # not inside the checkout
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_cell_only_reports_where_the_suite_is_installed(tmp_path):
    out = run_cell(tmp_path)
    assert "pip" not in out and "cold start" not in out
    assert "platform: local" in out and "device:" in out and "shared memory" not in out  # a CPU here
    for name in ("naive", "chunked", "liger", "apple_cce"):
        assert re.search(rf"^{name}\s+(runs|no)", out, re.MULTILINE), out
    assert "[1]" in out  # the reasons a method cannot run here are spelled out


def test_cell_on_kaggle_online(tmp_path):
    out = run_cell(tmp_path, hidden=["helpers", *PEERS], KAGGLE_KERNEL_RUN_TYPE="Interactive",
                   HELPERS_BOOTSTRAP_DRY_RUN="1")
    assert f"[dry run] pip install --no-deps {HELPERS_SOURCE}" in out
    assert "[dry run] pip install 'liger-kernel>=0.5' 'cut-cross-entropy>=24.12' torch==" in out
    assert "cold start (kaggle)" in out and "report follows a real install" in out


def test_cell_on_kaggle_offline_with_the_dataset(tmp_path):
    dataset = tmp_path / "input" / "mecs-wheels"
    ours = _touch(dataset / "helpers-0.1.0-py3-none-any.whl")
    _touch(dataset / "liger_kernel-0.8.5-py3-none-any.whl")
    _touch(dataset / "cut_cross_entropy-25.1.1-py3-none-any.whl")
    out = run_cell(tmp_path, hidden=["helpers", *PEERS], KAGGLE_KERNEL_RUN_TYPE="Batch",
                   HELPERS_BOOTSTRAP_DRY_RUN="1", HELPERS_WHEELHOUSE=str(tmp_path / "input"))
    assert f"[dry run] pip install --no-deps {ours}" in out
    assert f"[dry run] pip install --no-deps --no-index --find-links {dataset} 'liger-kernel>=0.5' 'cut-cross-entropy>=24.12'\n" in out
    assert HELPERS_SOURCE not in out


def test_cell_on_colab(tmp_path):
    out = run_cell(tmp_path, hidden=["helpers", "cut_cross_entropy"], platform="colab", HELPERS_BOOTSTRAP_DRY_RUN="1")
    assert "cold start (colab)" in out and f"--no-deps {HELPERS_SOURCE}" in out
    assert "'cut-cross-entropy>=24.12' torch==" in out and "liger" not in out


# ---------------------------------------------------------------------------------------------
# The cell in the notebooks
# ---------------------------------------------------------------------------------------------


def test_install_cold_start_cell_after_the_title(tmp_path):
    py = tmp_path / "01_example.py"  # a notebook without the cell (the suite's all have it)
    py.write_text('# ---\n# jupyter:\n#   jupytext:\n#     formats: ipynb,py:percent\n# ---\n\n'
                  '# %% [markdown]\n# # 01 · Example\n#\n# Prose.\n\n# %%\nprint("hello")\n')
    jupytext.write(jupytext.read(py), py.with_suffix(".ipynb"))
    os.utime(py.with_suffix(".ipynb"), (1e9, 1e9))  # older than the edit, as a committed pair is
    os.utime(py, (1e9, 1e9))
    assert install_cold_start_cell(py) is True
    assert install_cold_start_cell(py) is False  # idempotent
    nb = jupytext.read(py)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    assert nb.cells[1].source == COLD_START_CELL == first_code_cell(py)
    assert "cold-start" in nb.cells[1].metadata["tags"]
    assert sum(COLD_START_CELL in c.source for c in nb.cells) == 1
    paired = nbformat.read(py.with_suffix(".ipynb"), as_version=4)
    assert [c.source for c in paired.cells] == [c.source for c in nb.cells]  # the .ipynb was synced
    # an outdated cell is replaced, not added to
    py.write_text(py.read_text().replace("# Cold start: make", "# Old cold start: make"))
    assert install_cold_start_cell(py, sync=False) is True
    assert first_code_cell(py) == COLD_START_CELL and "Old cold start" not in py.read_text()


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_notebook_starts_with_the_current_cell(source):
    assert first_code_cell(source) == COLD_START_CELL, "run: python -m helpers.suite.cells"


# ---------------------------------------------------------------------------------------------
# The environment files name every third-party import of the package and the notebooks
# ---------------------------------------------------------------------------------------------

# import name -> the distribution names that provide it
DISTRIBUTIONS = {
    "torch": {"torch", "pytorch"},
    "IPython": {"ipython", "ipykernel"},
    "liger_kernel": {"liger-kernel"},
    "cut_cross_entropy": {"cut-cross-entropy"},
}
FIRST_PARTY = {"helpers"}


def _optional(node: ast.Try) -> bool:
    names = {getattr(h.type, "id", None) for h in node.handlers}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def _imports(path: Path) -> set[str]:
    """Top-level modules imported, leaving out imports guarded by `except ImportError`."""
    found = set()

    def visit(node):
        if isinstance(node, ast.Try) and _optional(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def third_party_imports() -> set[str]:
    files = [*(ROOT / "helpers").rglob("*.py"), *SOURCES]
    names = set().union(*(_imports(f) for f in files))
    return {n for n in names if n not in sys.stdlib_module_names and n not in FIRST_PARTY}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\s\[]", requirement.strip(), maxsplit=1)[0].lower()


def requirements_txt() -> set[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return {_name(line) for line in lines if line.strip() and not line.startswith("#")}


def environment_yml() -> set[str]:
    spec = yaml.safe_load((ROOT / "environment.yml").read_text())
    names = set()
    for entry in spec["dependencies"]:
        if isinstance(entry, dict):
            names.update(_name(r) for r in entry["pip"])
        else:
            names.add(_name(entry))
    return names


def test_the_scan_finds_what_we_know_is_there():
    found = third_party_imports()
    assert {"torch", "triton", "matplotlib", "liger_kernel", "cut_cross_entropy"} <= found


@pytest.mark.parametrize("listed", [requirements_txt, environment_yml], ids=["requirements.txt", "environment.yml"])
def test_environment_names_every_import(listed):
    names = listed()
    missing = [m for m in sorted(third_party_imports())
               if not DISTRIBUTIONS.get(m, {m.lower()}) & names
               and not (m == "torch" and listed is requirements_txt)]
    assert not missing, f"{listed.__name__} lacks {missing}"


def test_requirements_txt_leaves_torch_to_the_platform():
    assert not {"torch", "pytorch"} & requirements_txt()
    assert "pytorch" in environment_yml()


def test_the_cell_installs_what_requirements_txt_names():
    lines = {re.split(r"\s*;", line)[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    assert set(REQUIREMENTS.values()) <= lines


# ---------------------------------------------------------------------------------------------
# The report, on GPUs this CPU machine can only pretend to be
# ---------------------------------------------------------------------------------------------


def _pretend_gpu(monkeypatch, name, capability, smem):
    import types

    import torch

    props = types.SimpleNamespace(name=name, major=capability[0], minor=capability[1], total_memory=15 * 1024**3,
                                  shared_memory_per_block_optin=smem, multi_processor_count=40)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_report_on_a_kaggle_t4(monkeypatch):
    _pretend_gpu(monkeypatch, "Tesla T4", (7, 5), 64 * 1024)
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    report = bootstrap.environment_report()
    assert report.startswith("platform: Kaggle (Batch)") and "Tesla T4" in report and "× 2" in report
    assert "no bf16 ones (sm_75 < sm_80)" in report and "shared memory per block: 64 KiB" in report
    assert "'auto' runs 't4'" in report
    cce = next(line for line in report.splitlines() if line.startswith("apple_cce "))
    assert "runs" not in cce
    assert re.search(r"Apple CCE's backward kernel needs about \d+ KB of shared memory per block; this Tesla T4 offers 64 KB", report)


def test_report_on_a_p100_says_to_choose_the_t4(monkeypatch):
    _pretend_gpu(monkeypatch, "Tesla P100-PCIE-16GB", (6, 0), 48 * 1024)
    assert "choose the accelerator 'GPU T4 x2'" in bootstrap.environment_report("kaggle")


def test_no_triton_stops_with_where_to_run_instead(monkeypatch):
    # macOS or Windows: nothing installs triton, and helpers cannot be imported without it.
    monkeypatch.setattr(bootstrap, "importable", lambda m: m not in {"triton", *PEERS})
    monkeypatch.setattr(bootstrap.platform, "system", lambda: "Darwin")
    ok = lambda command, **kwargs: subprocess.CompletedProcess(command, 0, "", "")  # noqa: E731
    with pytest.raises(RuntimeError, match="(?s)Triton is not installed here \\(Darwin\\).*Colab or Kaggle"):
        bootstrap.cold_start(environ={}, modules={}, run=ok)
