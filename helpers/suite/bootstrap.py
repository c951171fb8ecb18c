"""Cold start: make ``helpers`` importable in a fresh notebook, then say what this machine can run.

Every notebook's first code cell is ``COLD_START_CELL``. It must run before ``helpers`` exists, so
it is self-contained: the functions it needs are defined in this module (stdlib only, at the top)
and the cell's text is assembled from their source, so the cell and these tested functions are one
code, never two copies. What it does:

- the suite already installed (a checkout, CI, ``python -m helpers run``): nothing but the report;
- Kaggle: ``pip install --no-deps`` the ``helpers-*.whl`` of an attached dataset (offline; see
  ``build_offline_dataset``), else from ``HELPERS_SOURCE`` (internet on);
- Colab, or a machine that is not a checkout: from ``HELPERS_SOURCE``; a checkout: ``-e`` it;
- then only the missing dependencies: the peers from the dataset's wheels (``--no-deps``: they
  need only torch and triton, checked when the dataset is built), the rest by name with the present
  torch (and triton) pinned in the same command, so pip cannot replace the platform's CUDA build:
  it fails instead.

``HELPERS_BOOTSTRAP_DRY_RUN=1`` prints the pip commands instead of running them;
``HELPERS_WHEELHOUSE=/dir`` adds a folder to search for wheels (an air-gapped workshop box).

The install URL comes from ``helpers.suite.paths`` (the GitHub home); ``helpers.suite.cells``
writes the cell into the notebooks, ``helpers.suite.kaggle`` builds the offline dataset.
``python -m helpers.suite.bootstrap report`` prints what this machine can run.
"""

from __future__ import annotations

import glob
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from helpers.lab.profiles import detect_platform  # also the profiles' (a cell function, kept stdlib-only)
from helpers.suite.paths import HELPERS_SOURCE

# What a notebook imports besides torch, helpers and IPython (the kernel itself): {module: pip
# requirement}, as in requirements.txt (tests/suite/test_bootstrap.py checks); jupytext and papermill are
# the runner's business, not a notebook's. triton is asked for only on Linux, where its wheels are.
REQUIREMENTS = {
    "numpy": "numpy",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "ipywidgets": "ipywidgets>=8",
    "triton": "triton>=3.0",
    "liger_kernel": "liger-kernel>=0.5",
    "cut_cross_entropy": "cut-cross-entropy>=24.12",
    "transformers": "transformers>=5.0",
}
# Where an attached Kaggle dataset is mounted.
WHEEL_DIRS = ["/kaggle/input"]

COLD_START_TAG = "cold-start"


# ---------------------------------------------------------------------------------------------
# The cell's functions: stdlib only, no module-level names but the constants above. Their source
# *is* the cell (see COLD_START_CELL), so keep them short and readable on their own.
# ---------------------------------------------------------------------------------------------


def importable(module):
    """Whether ``module`` can be imported; for ``helpers``, whether it is this suite's package."""
    spec = importlib.util.find_spec(module)
    if spec is None or module != "helpers":
        return spec is not None
    return any(os.path.exists(os.path.join(p, "suite", "bootstrap.py")) for p in spec.submodule_search_locations or [])


def find_wheels(dirs):
    """Every .whl in the first folder (searched two levels down) that holds a helpers wheel."""
    for top in dirs:
        found = sorted(w for depth in ("", "*", "*/*") for w in glob.glob(os.path.join(top, depth, "helpers-*.whl")))
        if found:
            return sorted(glob.glob(os.path.join(os.path.dirname(found[-1]), "*.whl")))
    return []


def find_checkout(start):
    """The source checkout of this repository that ``start`` (the notebook's folder) sits in, if any."""
    for folder in [start, os.path.dirname(start)]:
        pyproject = os.path.join(folder, "pyproject.toml")
        if os.path.isfile(pyproject):
            with open(pyproject) as f:
                if 'name = "helpers"' in f.read():
                    return folder
    return None


def cold_start_plan(where, have, versions, wheels=(), checkout=None, system="Linux"):
    """[(why, pip arguments)]: what makes the suite importable here; [] when it already is.

    where: "kaggle", "colab" or "local"; have: the importable modules among "helpers", "torch" and
    REQUIREMENTS; versions: {"torch": ..., "triton": ...} as installed; wheels: .whl files found
    offline (find_wheels); checkout: the checkout the notebook sits in (find_checkout).
    """
    if "torch" not in have:
        raise RuntimeError("PyTorch is not installed. This cell never chooses a torch build: install the one "
                           "for this machine (https://pytorch.org/get-started/locally/), then run it again.")
    steps = []
    helpers_wheels = [w for w in wheels if os.path.basename(w).startswith("helpers-")]
    if "helpers" not in have:
        if helpers_wheels:
            steps.append(("install helpers from the attached wheel", ["install", "--no-deps", helpers_wheels[-1]]))
        elif checkout and where == "local":
            steps.append(("install this checkout, editable", ["install", "--no-deps", "-e", checkout]))
        else:
            steps.append((f"install helpers from {HELPERS_SOURCE}", ["install", "--no-deps", HELPERS_SOURCE]))
    missing = [req for module, req in REQUIREMENTS.items()
               if module not in have and (module != "triton" or system == "Linux")]
    # Pinned in the same command, the present torch (and triton) stay: pip fails rather than swap them.
    pins = [f"{name}=={versions[name]}" for name in ("torch", "triton") if name in versions]
    wheel_names = {os.path.basename(w).split("-")[0].lower() for w in wheels}
    offline = [r for r in missing if re.split("[<>=]", r)[0].replace("-", "_").lower() in wheel_names]
    online = [r for r in missing if r not in offline]
    if offline:  # pure-Python wheels needing only torch and triton (checked when the dataset is built)
        folder = os.path.dirname(wheels[0])
        steps.append((f"install {', '.join(offline)} from the attached wheels",
                      ["install", "--no-deps", "--no-index", "--find-links", folder, *offline]))
    if online:
        steps.append((f"install {', '.join(online)} (torch kept as it is)", ["install", *online, *pins]))
    return steps


def cold_start(environ=os.environ, modules=sys.modules, run=subprocess.run):
    """Plan for this machine, run the plan (or print it under HELPERS_BOOTSTRAP_DRY_RUN=1), report."""
    where = detect_platform(environ, modules)
    have = {m for m in ["helpers", "torch", *REQUIREMENTS] if importable(m)}
    versions = {}
    for name in ["torch", "triton"]:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    extra = [environ["HELPERS_WHEELHOUSE"]] if environ.get("HELPERS_WHEELHOUSE") else []
    wheels = find_wheels(extra + WHEEL_DIRS)
    steps = cold_start_plan(where, have, versions, wheels, find_checkout(os.getcwd()), platform.system())
    dry_run = environ.get("HELPERS_BOOTSTRAP_DRY_RUN") == "1"
    for why, args in steps:
        print(f"cold start ({where}): {why}\n  {'[dry run] ' if dry_run else ''}pip {shlex.join(args)}")
        if not dry_run:
            done = run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{why} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}\nOn Kaggle, turn "
                                   "Internet on or attach the dataset that `python -m helpers stage-kaggle` builds.")
    importlib.invalidate_caches()
    if not importable("triton") and not dry_run:
        raise RuntimeError(f"Triton is not installed here ({platform.system()}), and every kernel in this suite is "
                           "Triton, whose wheels are Linux-only. On macOS or Windows, open the notebook in Colab or "
                           "Kaggle (the badges at the top) or run it on Linux (WSL 2 works).")
    if importable("helpers"):
        import helpers.suite.bootstrap

        print(helpers.suite.bootstrap.environment_report(where))
    else:
        print("helpers is not installed yet (dry run): the report follows a real install.")


_CELL_FUNCTIONS = [detect_platform, importable, find_wheels, find_checkout, cold_start_plan, cold_start]


def _cold_start_cell() -> str:
    header = [
        "# Cold start: make `helpers` importable here, then report what this machine can run.",
        "# Where the suite is installed (a checkout, CI, papermill) it only reports. On Kaggle and Colab",
        "# it pip-installs the suite without touching the preinstalled torch: from an attached dataset's",
        "# wheel (Kaggle offline) or from GitHub. HELPERS_BOOTSTRAP_DRY_RUN=1 prints pip commands instead.",
        "# Generated from helpers/suite/bootstrap.py (COLD_START_CELL): edit it there, not here.",
        "import glob, importlib, importlib.metadata, importlib.util, os, platform, re, shlex, subprocess, sys",
        "",
        f"HELPERS_SOURCE = {json.dumps(HELPERS_SOURCE)}",
        "REQUIREMENTS = {",
        *(f"    {json.dumps(k)}: {json.dumps(v)}," for k, v in REQUIREMENTS.items()),
        "}",
        f"WHEEL_DIRS = {json.dumps(WHEEL_DIRS)}",
    ]
    body = ["\n" + inspect.getsource(f).rstrip() for f in _CELL_FUNCTIONS]
    return "\n".join(header + body + ["", "", "cold_start()"])


COLD_START_CELL = _cold_start_cell()


# ---------------------------------------------------------------------------------------------
# After the install: what this machine can run (helpers and torch are importable from here on).
# ---------------------------------------------------------------------------------------------

_PLATFORM_NAMES = {"kaggle": "Kaggle", "colab": "Colab", "local": "local"}
_DTYPES = ("float32", "float16", "bfloat16")


def environment_report(where: str | None = None) -> str:
    """The GPU found, its dtype support and shared memory, versions, and which methods run here and why not."""
    import torch

    from helpers.compare.methods import METHODS, primary_methods
    from helpers.cce.device import default_device, device_info
    from helpers.lab.profiles import detect_profile_name

    where = where or detect_platform(os.environ, sys.modules)
    run_type = os.environ.get("KAGGLE_KERNEL_RUN_TYPE")
    device = default_device()
    info = device_info(device)
    count = torch.cuda.device_count() if info.is_cuda else 0
    lines = [f"platform: {_PLATFORM_NAMES[where]}" + (f" ({run_type})" if where == "kaggle" and run_type else "")]
    lines.append(f"device:   {info.describe()}" + (f" × {count}" if count > 1 else ""))
    if info.is_cuda:
        sm = f"sm_{info.capability[0]}{info.capability[1]}"
        if info.has_bf16_matmul:
            tensor_cores = "fp16 and bf16 tensor cores (Ampere or newer)"
        elif info.capability >= (7, 0):
            tensor_cores = f"fp16 tensor cores, no bf16 ones ({sm} < sm_80): bf16 is emulated and slow, the suite uses fp16"
        else:
            tensor_cores = (f"no tensor cores ({sm}), and current PyTorch builds may have no kernels for it: "
                            "on Kaggle choose the accelerator 'GPU T4 x2'")
        lines.append(f"dtypes:   {tensor_cores}")
        lines.append(f"shared memory per block: {info.shared_memory_per_block_bytes // 1024} KiB (what a kernel may ask for)")
    else:
        lines.append("dtypes:   CPU: Triton kernels run under the interpreter, where bf16 is computed wrongly")
    lines.append(f"profile:  'auto' runs '{detect_profile_name(device)}' here")
    lines.append("versions: " + ", ".join(f"{name} {installed_version(name)}" for name in
                                           ("torch", "triton", "liger-kernel", "cut-cross-entropy", "helpers")))
    reasons: list[str] = []
    width = max(len(n) for n in primary_methods())
    lines.append(f"\n{'method':<{width}}  " + "  ".join(f"{d:<9}" for d in _DTYPES))
    for name in primary_methods():
        method = METHODS[name]
        cells = []
        for dtype in _DTYPES:
            reason = method.why_unavailable(device, getattr(torch, dtype))
            if reason is None:
                cells.append("runs")
            else:
                if reason not in reasons:
                    reasons.append(reason)
                cells.append(f"no [{reasons.index(reason) + 1}]")
        lines.append(f"{name:<{width}}  " + "  ".join(f"{c:<9}" for c in cells))
    lines += [f"  [{i}] {r}" for i, r in enumerate(reasons, 1)]
    return "\n".join(lines)


def installed_version(distribution: str) -> str:
    """The installed version of a distribution, or "not installed"."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m helpers.suite.bootstrap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("report", help="print what this machine can run")
    sub.add_parser("cell", help="print the cold-start cell")
    args = parser.parse_args(argv)
    print(environment_report() if args.command == "report" else COLD_START_CELL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
