"""Run the notebook suite headless with papermill: ``python -m helpers run``.

Each notebook gets two parameters, ``profile`` and ``output_dir`` (``<output>/<notebook stem>``),
plus ``quick`` (under ``--quick``) and those of ``SUITE_PARAMETERS`` where its parameters cell
declares them; everything else it derives from the profile. The executed notebook lands next to its results, so
one folder holds the whole run:

    results/
      summary.json                       status, seconds and files of every notebook
      01_correctness/01_correctness.ipynb, gate.json, ...
      02_memory_sweep/...

A notebook that raises is recorded as failed and the others still run; the command exits non-zero
when any failed.

On a CPU without a pretend card the notebooks' kernels take the Turing tier's tiles under the
interpreter (``CPU_SUITE_TIER``, through ``HELPERS_CPU_TIER`` in their processes; a value already in
the environment wins): the smoke run in about two thirds of the time, with the tests' own tier left to
the tests.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from helpers.cce.device import PRETEND_ENV, card_spec, device_info, why_cannot_pretend
from helpers.cce.kernels.configs import CPU_TIER_ENV, select_configs
from helpers.lab.profiles import get_profile, profile_for_card
from helpers.lab.widgets import HEADLESS_ENV
from helpers.suite.bootstrap import installed_version
from helpers.suite.paths import find_notebooks
from helpers.suite.report import build_report


# Set wherever a notebook's parameters cell declares them: a headless run checks the workshop (04)
# with its worked solutions in place, where "Run all" leaves the exercises' gaps to the attendee.
SUITE_PARAMETERS = {"SOLUTIONS": True}
# The configuration tier of the CPU suite's kernels (module doc): fewer, larger programs for the interpreter.
CPU_SUITE_TIER = "turing-64k"


@dataclass
class NotebookRun:
    notebook: str
    status: str  # "ok" or "failed"
    seconds: float
    output_dir: str
    files: list[str] = field(default_factory=list)
    error: str = ""


def notebook_parameters(path: Path, profile: str, out_dir: Path, quick: bool = False,
                        parameters: dict | None = None) -> dict:
    """What papermill injects into ``path``: profile, output_dir, and the ``SUITE_PARAMETERS`` it
    declares, overridden by ``parameters`` (``-p NAME VALUE``; e.g. ``SOLUTIONS False`` runs the
    workshop as an attendee's "Run all"). papermill would inject an undeclared one too, with only a
    logged warning, as a stray variable; reading the parameters cell keeps each notebook's
    namespace to what it asked for."""
    import papermill

    declared = papermill.inspect_notebook(str(path))
    wanted = {**SUITE_PARAMETERS, **({"quick": True} if quick else {}), **(parameters or {})}
    suite = {name: value for name, value in wanted.items() if name in declared}
    return {"profile": profile, "output_dir": str(out_dir), **suite}


def run_notebook(path: Path, profile: str, output: Path, timeout_s: int | None = None,
                 quick: bool = False, parameters: dict | None = None) -> NotebookRun:
    import papermill

    out_dir = output / path.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("facts.json", "report.md"):  # an earlier run's, which this run's must not pass for
        (out_dir / stale).unlink(missing_ok=True)
    started = time.perf_counter()
    error = ""
    try:
        papermill.execute_notebook(
            str(path),
            str(out_dir / path.name),
            parameters=notebook_parameters(path, profile, out_dir, quick, parameters),
            cwd=str(path.parent),
            progress_bar=False,
            execution_timeout=timeout_s,
        )
    except Exception as e:  # PapermillExecutionError carries the failing cell's error
        error = _short_error(e)
    files = sorted(str(p.relative_to(output)) for p in out_dir.rglob("*") if p.is_file())
    return NotebookRun(
        path.stem, "failed" if error else "ok", round(time.perf_counter() - started, 1), str(out_dir), files, error
    )


def parse_parameters(pairs: list[list[str]] | None) -> dict:
    """``-p NAME VALUE`` pairs as a dict, each VALUE read as a Python literal where it is one
    (``False``, ``3``, ``'text'``), true and false in any case as booleans (a shell's, JSON's: as a
    string "false" would be truthy, and ``-p SOLUTIONS false`` would show the solutions), else kept as
    the string."""
    parsed = {}
    for name, value in pairs or []:
        if value.lower() in ("true", "false"):
            parsed[name] = value.lower() == "true"
            continue
        try:
            parsed[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed[name] = value
    return parsed


def _short_error(e: Exception) -> str:
    ename, evalue = getattr(e, "ename", type(e).__name__), getattr(e, "evalue", str(e))
    return f"{ename}: {evalue}".strip()[:2000]


def run_suite(
    profile: str = "auto",
    output: str | Path = "results",
    only: list[str] | None = None,
    timeout_s: int | None = None,
    pretend_t4: bool = False,
    quick: bool = False,
    parameters: dict | None = None,
    pretend: str | None = None,
) -> list[NotebookRun]:
    """Execute every notebook (or those in ``only``) and write ``summary.json``; see module doc.

    ``pretend``: a card of ``helpers.cce.device.CARDS`` ("t4", "a100-40gb", "a100-80gb", "l4"):
    every notebook runs as that card would see it: the card's profile ("t4" for the T4, "gpu" for the
    others; on a CPU "cpu-t4" or "cpu"), its memory cap, shared memory, compute capability and
    configuration tier in each notebook's process. ``pretend_t4``: ``pretend="t4"``. ``quick``: each
    notebook's short run (its profile section's ``"quick"``). ``parameters``: more parameters, each
    given to the notebooks whose parameters cell declares it.
    """
    from tqdm.auto import tqdm

    if pretend_t4:
        if pretend not in (None, "t4"):
            raise SystemExit(f"--pretend-t4 and --pretend {pretend} contradict each other")
        pretend = "t4"
    if pretend:
        card = card_spec(pretend)
        allowed = ("auto", profile_for_card(card), profile_for_card(card, on_gpu=False))
        if profile not in allowed:
            flag = "--pretend-t4" if pretend_t4 else f"--pretend {card.key}"
            raise SystemExit(f"{flag} runs {card.a_label}'s profile ({' or '.join(allowed[1:])}); leave --profile "
                             f"at auto, not {profile!r}")
        if torch.cuda.is_available():  # refused here, not in each notebook's process
            why = why_cannot_pretend(card, torch.cuda.get_device_properties(torch.cuda.current_device()))
            if why:
                raise SystemExit(why)
        os.environ[PRETEND_ENV] = card.key  # inherited by every notebook's kernel process
    os.environ[HEADLESS_ENV] = "1"  # no one to move a slider: widgets stay out (helpers.lab.widgets)
    resolved = get_profile(profile).name  # the notebooks apply quick themselves
    output = Path(output).resolve()
    output.mkdir(parents=True, exist_ok=True)
    notebooks = find_notebooks(only)
    info = device_info()
    cpu_tier_before = os.environ.get(CPU_TIER_ENV)
    if not pretend and info.kind == "cpu" and cpu_tier_before is None:
        os.environ[CPU_TIER_ENV] = CPU_SUITE_TIER  # inherited by every notebook's kernel process
    tier_note = (f", kernels: the {select_configs(torch.device('cpu')).name} tier under the interpreter"
                 if info.kind == "cpu" else "")
    print(f"profile {resolved}{' (quick)' if quick else ''} on {info.describe()}{tier_note}; "
          f"{len(notebooks)} notebooks -> {output}")
    runs = []
    bar = tqdm(notebooks, desc="suite", unit="notebook")
    try:
        for path in bar:
            bar.set_postfix_str(path.stem)
            runs.append(run_notebook(path, resolved, output, timeout_s, quick, parameters))
            _write_summary(output, resolved + ("-quick" if quick else ""), info, runs)
    finally:
        if cpu_tier_before is None:
            os.environ.pop(CPU_TIER_ENV, None)
    print(summary_table(runs))
    print(f"report: {build_report(output)} (and REPORT.html beside it)")
    return runs


# Every package whose code runs in a notebook of the suite, for the REPORT's versions line.
VERSIONED = ("triton", "liger-kernel", "cut-cross-entropy", "transformers", "numpy", "matplotlib", "papermill",
             "jupytext")


def helpers_version() -> str:
    """This package's version (installed, or the checkout's ``pyproject.toml``), and the commit of the
    checkout it runs from where there is one, with "-dirty" where the checkout has changes (a run
    from a checkout on PYTHONPATH is not "installed", but it is a version)."""
    import re
    import subprocess

    root = Path(__file__).resolve().parents[2]
    version = installed_version("helpers")
    pyproject = root / "pyproject.toml"
    if version == "not installed" and pyproject.is_file():
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.MULTILINE)
        version = found.group(1) if found else version
    try:
        commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{version} ({commit})" if commit else version


def run_stamp(profile: str, info) -> dict:
    """What must match for one run's results to stand beside another's in a REPORT: the device,
    the profile and every version."""
    return {"profile": profile, "device": info.describe(), "python": platform.python_version(),
            "torch": torch.__version__, "versions": {"helpers": helpers_version(),
                                                     **{d: installed_version(d) for d in VERSIONED}}}


def _write_summary(output: Path, profile: str, info, runs: list[NotebookRun]) -> None:
    stamp = run_stamp(profile, info)
    payload = {
        "profile": profile,
        "device": info.as_dict(),
        "python": stamp["python"],
        "torch": stamp["torch"],
        "finished": time.strftime("%Y-%m-%d %H:%M"),
        "versions": stamp["versions"],
        "stamp": stamp,
        "runs": [asdict(r) for r in runs],
    }
    (output / "summary.json").write_text(json.dumps(payload, indent=1))
    # Each notebook's facts carry the stamp of the run that made them: a later run into the same
    # folder may read them only where its own stamp is the same (helpers.suite.report.load_facts).
    for run in runs:
        facts = output / run.notebook / "facts.json"
        if facts.is_file():
            data = json.loads(facts.read_text())
            if "stamp" not in data:
                data["stamp"] = {**stamp, "finished": payload["finished"]}
                facts.write_text(json.dumps(data, indent=1))


def summary_table(runs: list[NotebookRun]) -> str:
    lines = [f"{'notebook':<28} {'status':<7} {'seconds':>8}  files / error"]
    for r in runs:
        detail = r.error.splitlines()[0] if r.error else f"{len(r.files)} files in {r.output_dir}"
        lines.append(f"{r.notebook:<28} {r.status:<7} {r.seconds:>8.1f}  {detail}")
    failed = sum(r.status != "ok" for r in runs)
    lines.append(f"{len(runs) - failed} passed, {failed} failed")
    return "\n".join(lines)
