"""The headless runner's parameters: what papermill injects into each notebook."""

import json
import os
from pathlib import Path

import jupytext
import nbformat

from helpers.suite.paths import find_notebooks
from helpers.suite.runner import SUITE_PARAMETERS, notebook_parameters, run_notebook


def test_the_workshop_runs_with_its_solutions_and_the_others_get_only_what_they_declare(tmp_path):
    workshop, gate = find_notebooks(["04"])[0], find_notebooks(["01"])[0]
    assert notebook_parameters(workshop, "cpu", tmp_path) == {"profile": "cpu", "output_dir": str(tmp_path),
                                                              "SOLUTIONS": True}
    assert notebook_parameters(gate, "cpu", tmp_path) == {"profile": "cpu", "output_dir": str(tmp_path)}
    assert SUITE_PARAMETERS == {"SOLUTIONS": True}


def test_quick_goes_to_the_notebooks_that_offer_a_short_run():
    gate, workshop = find_notebooks(["01"])[0], find_notebooks(["04"])[0]
    assert notebook_parameters(gate, "gpu", Path("o"), quick=True)["quick"] is True
    assert "quick" not in notebook_parameters(gate, "gpu", Path("o"))
    assert "quick" not in notebook_parameters(workshop, "gpu", Path("o"), quick=True)  # already short


def _notebook(path: Path, parameters: str) -> Path:
    nb = jupytext.reads(
        f'# %% tags=["parameters"]\n{parameters}\n\n'
        "# %%\nimport json, pathlib\n"
        "pathlib.Path(output_dir, 'seen.json').write_text(json.dumps({'SOLUTIONS': globals().get('SOLUTIONS')}))\n",
        fmt="py:percent",
    )
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_papermill_receives_solutions_only_where_the_parameters_cell_declares_it(tmp_path):
    declares = _notebook(tmp_path / "91_declares.ipynb", 'profile = "auto"\noutput_dir = "x"\nSOLUTIONS = False')
    does_not = _notebook(tmp_path / "92_does_not.ipynb", 'profile = "auto"\noutput_dir = "x"')
    for path, seen in ((declares, True), (does_not, None)):
        run = run_notebook(path, "cpu", tmp_path / "out")
        assert run.status == "ok", run.error
        assert json.loads((tmp_path / "out" / path.stem / "seen.json").read_text()) == {"SOLUTIONS": seen}


def test_a_parameter_from_the_command_line_overrides_the_suites_where_declared(tmp_path):
    from helpers.__main__ import main  # noqa: F401  (the option parses)
    from helpers.suite.runner import parse_parameters

    assert parse_parameters([["SOLUTIONS", "False"], ["label", "run one"], ["steps", "3"]]) == {
        "SOLUTIONS": False, "label": "run one", "steps": 3}
    # A shell's or JSON's spelling too: the string "false" would be truthy and show the solutions.
    assert parse_parameters([["SOLUTIONS", "false"], ["quick", "TRUE"]]) == {"SOLUTIONS": False, "quick": True}
    workshop, gate = find_notebooks(["04"])[0], find_notebooks(["01"])[0]
    attendee = notebook_parameters(workshop, "cpu", tmp_path, parameters={"SOLUTIONS": False})
    assert attendee["SOLUTIONS"] is False
    assert "SOLUTIONS" not in notebook_parameters(gate, "cpu", tmp_path, parameters={"SOLUTIONS": False})


def test_the_cpu_suite_runs_the_turing_tiles_and_leaves_the_tests_tier_as_it_was(tmp_path, monkeypatch):
    """On a CPU the runner's notebooks take the Turing tier's tiles (fewer programs for the interpreter);
    the variable lives only while they run, and a value already set wins."""
    import torch

    from helpers.cce.kernels.configs import CPU_TIER_ENV, select_configs
    from helpers.suite import runner

    seen = []

    def fake_run(path, profile, output, *args):
        seen.append((os.environ.get(CPU_TIER_ENV), select_configs(torch.device("cpu")).name))
        return runner.NotebookRun(path.stem, "ok", 0.0, str(output))

    monkeypatch.setattr(runner, "run_notebook", fake_run)
    monkeypatch.setattr(runner, "build_report", lambda output: output / "REPORT.md")
    monkeypatch.delenv(CPU_TIER_ENV, raising=False)
    runner.run_suite("cpu", tmp_path, only=["01"])
    assert seen == [(runner.CPU_SUITE_TIER, runner.CPU_SUITE_TIER)]
    assert CPU_TIER_ENV not in os.environ and select_configs(torch.device("cpu")).name == "interpreter"
    monkeypatch.setenv(CPU_TIER_ENV, "interpreter")
    runner.run_suite("cpu", tmp_path, only=["01"])
    assert seen[-1] == ("interpreter", "interpreter") and os.environ[CPU_TIER_ENV] == "interpreter"
