"""Kaggle and Colab: stage each notebook for ``kaggle kernels push``, and the badges that open them.

The suite is described once, in ``kaggle-metadata.json`` at the top of the repository (the card).
The Kaggle CLI reads only a file called ``kernel-metadata.json``, one notebook per pushed folder, so
``stage_kaggle`` writes a folder per notebook:

    build/kaggle/
      dataset/                      helpers + peer wheels, dataset-metadata.json (offline installs)
      01_correctness/               01_correctness.ipynb, kernel-metadata.json
      ...
      PUSH.md                       the commands, in order

and checks every folder against the CLI's rules (``validate_kernel_metadata``), which are, from
Kaggle/kaggle-api ``docs/kernels_metadata.md`` and ``kernels_push`` in ``kaggle_api_extended.py``:

- ``id`` is "username/kernel-slug" (or ``id_no``); the slug has at least 5 characters;
- ``title`` has at least 5 characters, and Kaggle makes the kernel's URL from the **title**: if
  ``slugify(title)`` (python-slugify) differs from the slug the CLI only warns, and the kernel is
  created at the title's slug, so the id then names nothing. Titles over 50 characters are refused
  by the server. We reject both;
- ``code_file`` exists, relative to the folder; ``language`` python, r or rmarkdown; ``kernel_type``
  script or notebook;
- ``dataset_sources`` and ``kernel_sources`` are "owner/slug", ``model_sources``
  "owner/model/framework/variation/version";
- booleans default to ``is_private`` true, ``enable_gpu`` false, and ``enable_internet`` **true**
  in the CLI's code though its docs say false: we always write it;
- ``machine_shape``: without it ``enable_gpu`` lands on a P100 (sm_60, no kernels in current torch
  builds); an unknown value is silently turned into that default. We require ``NvidiaTeslaT4``.
- fields the CLI does not know (``accelerator``, say) are ignored without a word: we reject them.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

from helpers.suite.bootstrap import REQUIREMENTS
from helpers.suite.paths import ROOT, find_notebooks

CARD_PATH = ROOT / "kaggle-metadata.json"
KERNEL_METADATA = "kernel-metadata.json"
DATASET_METADATA = "dataset-metadata.json"
T4_SHAPE = "NvidiaTeslaT4"

KNOWN_FIELDS = {
    "id", "id_no", "title", "code_file", "language", "kernel_type", "is_private", "enable_gpu",
    "enable_tpu", "enable_internet", "dataset_sources", "competition_sources", "kernel_sources",
    "model_sources", "keywords", "docker_image", "docker_image_pinning_type", "machine_shape",
}
DATASET_LICENSES = {
    "CC0-1.0", "CC-BY-SA-3.0", "CC-BY-SA-4.0", "CC-BY-NC-SA-4.0", "GPL-2.0", "GPL-3.0", "ODbL-1.0",
    "DbCL-1.0", "copyright-authors", "other", "unknown", "CC-BY-4.0", "CC-BY-NC-4.0", "PDDL",
    "CC-BY-3.0", "apache-2.0", "LGPL-3.0", "AGPL-3.0", "FDL-1.3",
}
MAX_TITLE = 50


def load_suite_card(path: str | Path = CARD_PATH) -> dict:
    return json.loads(Path(path).read_text())


def kaggle_slug(title: str) -> str:
    """The slug Kaggle gives a title: python-slugify's defaults, for the ASCII titles we allow.

    An apostrophe becomes a dash, commas between digits go, every other run of characters outside
    [a-z0-9] becomes one dash, dashes are trimmed at both ends.
    """
    text = unicodedata.normalize("NFKD", title.replace("'", "-")).lower()
    text = re.sub(r"(?<=\d),(?=\d)", "", text)
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def notebook_title(stem: str, card: dict) -> str:
    """'01_correctness' -> '<title_prefix> 01 correctness', unless the card's "titles" names one."""
    if stem in card.get("titles", {}):
        return card["titles"][stem]
    number, _, rest = stem.partition("_")
    return f"{card['title_prefix']} {number} {rest.replace('_', ' ')}"


def kernel_metadata(
    notebook: str | Path,
    username: str,
    card: dict | None = None,
    *,
    internet: bool | None = None,
    dataset_sources: list[str] | None = None,
) -> dict:
    """The kernel-metadata.json for one notebook (``code_file`` is its file name, beside it)."""
    card = card or load_suite_card()
    notebook = Path(notebook)
    title = notebook_title(notebook.stem, card)
    return {
        "id": f"{username}/{kaggle_slug(title)}",
        "title": title,
        "code_file": notebook.name,
        "language": card["language"],
        "kernel_type": card["kernel_type"],
        "is_private": card["is_private"],
        "enable_gpu": card["enable_gpu"],
        "machine_shape": card["machine_shape"],
        "enable_internet": card["enable_internet"] if internet is None else internet,
        "dataset_sources": list(dataset_sources or []),
        "competition_sources": [],
        "kernel_sources": [],
        "model_sources": [],
    }


def _owner_slug_problems(value, what: str, parts: int = 2) -> list[str]:
    if not isinstance(value, str) or value.count("/") != parts - 1 or not all(value.split("/")):
        return [f"{what} {value!r} must be '{'/'.join(['owner', 'slug', 'framework', 'variation', 'version'][:parts])}'"]
    return []


def validate_kernel_metadata(meta: dict, folder: str | Path | None = None) -> list[str]:
    """Every reason ``kaggle kernels push`` would refuse this metadata or do something surprising
    with it; [] when it is fine. With ``folder``, also checks the folder holds exactly its notebook."""
    problems = [f"unknown field {k!r}: the Kaggle CLI ignores it silently" for k in meta if k not in KNOWN_FIELDS]
    kernel_id, title = meta.get("id"), meta.get("title")
    if not kernel_id and not meta.get("id_no"):
        problems.append("one of 'id' ('username/kernel-slug') or 'id_no' is required")
    if kernel_id is not None:
        found = _owner_slug_problems(kernel_id, "id")
        problems += found
        if not found:
            slug = kernel_id.split("/")[1]
            if len(slug) < 5:
                problems.append(f"kernel slug {slug!r} must have at least 5 characters")
            if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", slug):
                problems.append(f"kernel slug {slug!r} must be lowercase letters, digits and single dashes")
            if isinstance(title, str) and kaggle_slug(title) != slug:
                problems.append(f"title {title!r} slugifies to {kaggle_slug(title)!r}, not the id's {slug!r}: "
                                "Kaggle would create the kernel at the title's slug")
    if not isinstance(title, str) or not title:
        problems.append("'title' is required for a new kernel")
    else:
        if not 5 <= len(title) <= MAX_TITLE:
            problems.append(f"title {title!r} has {len(title)} characters; Kaggle takes 5 to {MAX_TITLE}")
        if not title.isascii():
            problems.append(f"title {title!r} must be ASCII (the CLI transliterates other characters)")
    code_file = meta.get("code_file")
    if not code_file:
        problems.append("'code_file' is required")
    elif meta.get("kernel_type") == "notebook" and not str(code_file).endswith(".ipynb"):
        problems.append(f"code_file {code_file!r} of a notebook kernel must be an .ipynb")
    if meta.get("language") not in ("python", "r", "rmarkdown"):
        problems.append(f"language {meta.get('language')!r} must be python, r or rmarkdown")
    if meta.get("kernel_type") not in ("script", "notebook"):
        problems.append(f"kernel_type {meta.get('kernel_type')!r} must be script or notebook")
    for flag in ("is_private", "enable_gpu", "enable_internet"):
        if not isinstance(meta.get(flag), bool):
            problems.append(f"{flag} must be written, as true or false (the CLI's defaults are not its docs')")
    if meta.get("enable_gpu") and meta.get("machine_shape") != T4_SHAPE:
        problems.append(f"machine_shape {meta.get('machine_shape')!r}: a GPU kernel must ask for {T4_SHAPE!r}, "
                        "else Kaggle gives a P100 (sm_60), which current torch builds cannot run")
    for key, parts in (("dataset_sources", 2), ("kernel_sources", 2), ("model_sources", 5), ("competition_sources", 1)):
        sources = meta.get(key, [])
        if not isinstance(sources, list):
            problems.append(f"{key} must be a list")
            continue
        for source in sources:
            problems += _owner_slug_problems(source, key, parts)
    if folder is not None and code_file:
        import nbformat

        folder = Path(folder)
        if not (folder / KERNEL_METADATA).is_file():
            problems.append(f"{folder} has no {KERNEL_METADATA}")
        path = folder / code_file
        if not path.is_file():
            problems.append(f"code_file {code_file!r} not found in {folder}")
        else:
            try:
                nbformat.validate(nbformat.read(path, as_version=4))
            except Exception as e:  # the CLI json-loads it; Kaggle runs it as a notebook
                problems.append(f"{code_file} is not a valid notebook: {str(e).splitlines()[0]}")
        notebooks = sorted(p.name for p in folder.glob("*.ipynb"))
        if notebooks != [Path(code_file).name]:
            problems.append(f"{folder} must hold exactly one notebook, its code_file; it holds {notebooks}")
    return problems


def dataset_metadata(username: str, card: dict | None = None, *, slug: str | None = None,
                     title: str | None = None, wheels: list[str] = ()) -> dict:
    """dataset-metadata.json for the offline wheels (Kaggle/kaggle-api docs/datasets_metadata.md)."""
    card = card or load_suite_card()
    spec = card["dataset"]
    listed = "\n".join(f"- `{w}`" for w in wheels)
    return {
        "title": title or spec["title"],
        "subtitle": spec["subtitle"],
        "id": f"{username}/{slug or spec['slug']}",
        "licenses": [{"name": spec["license"]}],
        "description": (
            f"Wheels for running the {card['name']} notebooks on Kaggle without internet: attach this "
            "dataset and each notebook's first cell installs them from here, without the internet, "
            f"leaving Kaggle's torch as it is.\n\n{listed}\n\nThe peers' wheels (liger-kernel, "
            "cut-cross-entropy) are their authors' releases, unchanged and under their own licences; "
            "keep this dataset private."
        ),
    }


def validate_dataset_metadata(meta: dict) -> list[str]:
    problems = []
    title, subtitle = meta.get("title", ""), meta.get("subtitle")
    if not 6 <= len(title) <= 50:
        problems.append(f"dataset title {title!r} must have 6 to 50 characters")
    if subtitle is not None and not 20 <= len(subtitle) <= 80:
        problems.append(f"dataset subtitle {subtitle!r} must have 20 to 80 characters")
    found = _owner_slug_problems(meta.get("id"), "dataset id")
    problems += found
    if not found and not 3 <= len(meta["id"].split("/")[1]) <= 50:
        problems.append(f"dataset slug in {meta['id']!r} must have 3 to 50 characters")
    licenses = meta.get("licenses", [])
    if len(licenses) != 1 or licenses[0].get("name") not in DATASET_LICENSES:
        problems.append(f"licenses must be exactly one of Kaggle's names, got {licenses}")
    return problems


def stage_kaggle(
    out_dir: str | Path,
    username: str,
    *,
    notebooks: list[str | Path] | None = None,
    internet: bool | None = None,
    dataset: bool = True,
    wheelhouse: str | Path | None = None,
    card: dict | None = None,
) -> list[Path]:
    """Write one push-ready folder per notebook (and, with ``dataset``, the offline dataset).

    ``internet``: None takes the card's ``enable_internet``; False needs the dataset attached.
    Raises ValueError, naming every problem, if any folder would be refused. Returns the kernel
    folders in notebook order; ``out_dir/PUSH.md`` lists the commands to run.
    """
    import nbformat

    card = card or load_suite_card()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if internet is False and not dataset:
        raise ValueError("a kernel without internet needs the offline dataset (dataset=True) to install helpers")
    sources = []
    if dataset:
        dataset_dir = build_offline_dataset(out_dir / "dataset", username, wheelhouse=wheelhouse)
        sources = [json.loads((dataset_dir / DATASET_METADATA).read_text())["id"]]
    paths = [Path(p) for p in notebooks] if notebooks else find_notebooks()
    folders, problems = [], []
    for path in paths:
        folder = out_dir / path.stem
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:  # Kaggle's run starts from a clean notebook
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, folder / path.name)
        meta = kernel_metadata(path, username, card, internet=internet, dataset_sources=sources)
        (folder / KERNEL_METADATA).write_text(json.dumps(meta, indent=2) + "\n")
        problems += [f"{path.stem}: {p}" for p in validate_kernel_metadata(meta, folder)]
        folders.append(folder)
    if problems:
        raise ValueError("Kaggle would refuse or misplace these kernels:\n- " + "\n- ".join(problems))
    (out_dir / "PUSH.md").write_text(push_instructions(out_dir, folders, dataset))
    return folders


def push_instructions(out_dir: Path, folders: list[Path], dataset: bool) -> str:
    lines = ["# Pushing the suite to Kaggle", "",
             "Needs the `kaggle` CLI and an API token. Every push **starts a run** on a T4 x2, and Kaggle",
             "allows only a couple of GPU sessions at once: push one notebook, or wait between pushes.", ""]
    if dataset:
        lines += ["1. The offline wheels (first time `create`, afterwards `version`):", "", "```bash",
                  f"kaggle datasets create -p {out_dir / 'dataset'}",
                  f"# later: kaggle datasets version -p {out_dir / 'dataset'} -m 'new wheels'", "```", ""]
    lines += [f"{2 if dataset else 1}. Each notebook:", "", "```bash"]
    lines += [f"kaggle kernels push -p {f}" for f in folders]
    lines += ["```", "", "Check a kernel landed on a T4 (`kaggle kernels pull <id> -m` shows `machine_shape`)."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The offline dataset: our wheel plus the peers' (pure Python) wheels, for Kaggle without internet.
# ---------------------------------------------------------------------------------------------

PEER_WHEELS = ("liger-kernel", "cut-cross-entropy")
# The cell installs the dataset's wheels with --no-deps: safe only while they need nothing but these.
PLATFORM_PROVIDED = {"torch", "triton"}


def wheel_requirements(wheel: str | Path) -> set[str]:
    """The distribution names a wheel requires (extras left out), from its METADATA."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    found = set()
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            found.add(re.split(r"[<>=!~;\s\[(]", line.split(":", 1)[1].strip(), maxsplit=1)[0].lower())
    return found


def _setuptools_builds_here() -> bool:
    """Whether the installed setuptools can build this package as pyproject.toml asks (>= 77: the
    license as an SPDX string); an older one is left to pip's isolated build, which fetches one."""
    try:
        major = importlib.metadata.version("setuptools").split(".")[0]
    except importlib.metadata.PackageNotFoundError:
        return False
    return major.isdigit() and int(major) >= 77


def build_wheel(out_dir: str | Path, root: Path = ROOT) -> Path:
    """``pip wheel --no-deps`` of the checkout at ``root`` into ``out_dir``; returns the wheel.

    Built from a copy of the package's sources in a temporary folder, so the checkout gains no
    ``build/`` folder.
    """
    import tempfile

    if not (root / "pyproject.toml").is_file():
        raise RuntimeError(f"{root} is not a checkout of this repository: build the wheel from one")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "src"
        shutil.copytree(root / "helpers", source / "helpers", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(root / name, source / name)
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(source), "-w", str(out_dir)]
        if _setuptools_builds_here():
            command.insert(5, "--no-build-isolation")  # no network needed when the build backend is here
        subprocess.run(command, check=True)
    return sorted(out_dir.glob("helpers-*.whl"))[-1]


def build_offline_dataset(
    out_dir: str | Path,
    username: str,
    *,
    slug: str | None = None,
    title: str | None = None,
    peers: tuple[str, ...] = PEER_WHEELS,
    wheelhouse: str | Path | None = None,
) -> Path:
    """Stage a Kaggle dataset folder: helpers' wheel, the peers' wheels, dataset-metadata.json.

    Peer wheels come from ``wheelhouse`` when it holds them, else ``pip download --no-deps``
    (network). Upload with ``kaggle datasets create -p out_dir`` (``datasets version`` after), and
    list ``username/slug`` in each kernel's dataset_sources (``helpers.suite.kaggle.stage_kaggle`` does).
    """
    card = load_suite_card()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.whl"):
        stale.unlink()
    for name in peers:
        prefix = name.replace("-", "_").lower() + "-"
        held = sorted(Path(wheelhouse).glob("*.whl")) if wheelhouse else []
        held = [w for w in held if w.name.lower().startswith(prefix)]
        if held:
            shutil.copy2(held[-1], out_dir / held[-1].name)
        else:
            requirement = next((r for r in REQUIREMENTS.values() if r.startswith(name)), name)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", requirement,
                            "-d", str(out_dir)], check=True)
    for wheel in out_dir.glob("*.whl"):
        extra = wheel_requirements(wheel) - PLATFORM_PROVIDED
        if extra:
            raise RuntimeError(f"{wheel.name} needs {sorted(extra)}, which the cold-start cell would not install "
                               "offline (it installs the dataset's wheels with --no-deps): add their wheels")
    build_wheel(out_dir)
    meta = dataset_metadata(username, card, slug=slug, title=title, wheels=sorted(p.name for p in out_dir.glob("*.whl")))
    problems = validate_dataset_metadata(meta)
    if problems:
        raise ValueError("dataset-metadata.json would be rejected:\n- " + "\n- ".join(problems))
    (out_dir / "dataset-metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


def add_stage_arguments(parser) -> None:
    """The options of ``python -m helpers stage-kaggle`` (and ``python -m helpers.suite.kaggle``)."""
    import os

    parser.add_argument("--username", default=os.environ.get("KAGGLE_USERNAME"),
                        help="your Kaggle user name (default: $KAGGLE_USERNAME)")
    parser.add_argument("--output", default="build/kaggle", help="folder for the staged kernels (default: build/kaggle)")
    parser.add_argument("--offline", action="store_true", help="kernels without internet: install from the dataset")
    parser.add_argument("--no-dataset", action="store_true", help="skip the offline wheels dataset")
    parser.add_argument("--wheelhouse", help="a folder already holding the peers' wheels (else pip downloads them)")
    parser.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 01 02")


def stage_from_args(args) -> int:
    if not args.username:
        raise SystemExit("--username is required (or set KAGGLE_USERNAME)")
    notebooks = find_notebooks(args.only)
    folders = stage_kaggle(args.output, args.username, notebooks=notebooks, internet=False if args.offline else None,
                           dataset=not args.no_dataset, wheelhouse=args.wheelhouse)
    print("\n".join(f"staged {f}" for f in folders))
    print(f"next: {Path(args.output) / 'PUSH.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m helpers.suite.kaggle", description="stage the notebooks for Kaggle")
    add_stage_arguments(parser)
    return stage_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
