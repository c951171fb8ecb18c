"""Kaggle staging: every staged folder passes the Kaggle CLI's rules for kernel-metadata.json, the
validator catches each way a folder goes wrong, and the Colab/Kaggle badges point at the notebooks."""

import copy
import json
import os
import shutil
import zipfile
from pathlib import Path

import nbformat
import jupytext
import pytest

from helpers.suite.cells import COLAB_BADGE, badges_markdown, install_badges, notebook_links, readme_badge_table
from helpers.suite.kaggle import (
    DATASET_METADATA,
    KERNEL_METADATA,
    dataset_metadata,
    kaggle_slug,
    kernel_metadata,
    load_suite_card,
    stage_kaggle,
    validate_dataset_metadata,
    validate_kernel_metadata,
)
from helpers.suite.paths import GITHUB_BRANCH, GITHUB_REPO, find_notebooks

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = find_notebooks()


def fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A stand-in wheel: only its METADATA, which is what staging reads."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
            f"Requires-Dist: {r}\n" for r in requires)
        archive.writestr(f"{name}-{version}.dist-info/METADATA", metadata)
    return path


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    out = tmp_path_factory.mktemp("kaggle")
    return out, stage_kaggle(out, "alice", dataset=False)


@pytest.mark.parametrize(
    "title, slug",
    [
        ("My Awesome Kernel", "my-awesome-kernel"),  # the CLI docs' own example
        ("Memory-efficient CE 01 correctness", "memory-efficient-ce-01-correctness"),
        ("  Don't  stop -- now! ", "don-t-stop-now"),  # python-slugify: an apostrophe becomes a dash
        ("Vocab 151,936 (Qwen3)", "vocab-151936-qwen3"),  # commas between digits are dropped
    ],
)
def test_slug_follows_python_slugify(title, slug):
    assert kaggle_slug(title) == slug


def test_card_describes_the_suite_for_a_t4():
    card = load_suite_card()
    assert card["machine_shape"] == "NvidiaTeslaT4" and card["enable_gpu"] is True
    assert card["kernel_type"] == "notebook" and isinstance(card["enable_internet"], bool)


def test_every_notebook_is_staged_in_its_own_valid_folder(staged):
    out, folders = staged
    assert [f.name for f in folders] == [p.stem for p in NOTEBOOKS]
    ids = set()
    for folder in folders:
        meta = json.loads((folder / KERNEL_METADATA).read_text())
        assert validate_kernel_metadata(meta, folder) == [], folder.name
        assert meta["code_file"] == f"{folder.name}.ipynb" and meta["machine_shape"] == "NvidiaTeslaT4"
        assert meta["id"].split("/")[1] == kaggle_slug(meta["title"])
        nb = nbformat.read(folder / meta["code_file"], as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
        ids.add(meta["id"])
    assert len(ids) == len(folders)
    push = (out / "PUSH.md").read_text()
    assert all(f"kaggle kernels push -p {f}" in push for f in folders)


def test_stage_with_the_offline_dataset(tmp_path):
    """Builds the real helpers wheel (a few seconds); the peers' wheels come from a wheelhouse."""
    wheelhouse = tmp_path / "wheelhouse"
    fake_wheel(wheelhouse, "liger_kernel", "0.8.5", ["torch>=2.1.2", "triton>=2.3.1", "pytest; extra == 'dev'"])
    fake_wheel(wheelhouse, "cut_cross_entropy", "25.1.1", ["torch>=2.4", "triton>=3.0"])
    folders = stage_kaggle(tmp_path / "out", "alice", notebooks=NOTEBOOKS[:1], internet=False, wheelhouse=wheelhouse)
    dataset = tmp_path / "out" / "dataset"
    wheels = sorted(p.name for p in dataset.glob("*.whl"))
    assert [w.split("-")[0] for w in wheels] == ["cut_cross_entropy", "helpers", "liger_kernel"]
    meta = json.loads((dataset / DATASET_METADATA).read_text())
    assert validate_dataset_metadata(meta) == []
    kernel = json.loads((folders[0] / KERNEL_METADATA).read_text())
    assert kernel["enable_internet"] is False and kernel["dataset_sources"] == [meta["id"]]
    assert validate_kernel_metadata(kernel, folders[0]) == []


def test_a_peer_wheel_needing_more_than_torch_and_triton_is_refused(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    fake_wheel(wheelhouse, "liger_kernel", "9.0", ["torch", "triton", "transformers>=4"])
    fake_wheel(wheelhouse, "cut_cross_entropy", "25.1.1", ["torch", "triton"])
    with pytest.raises(RuntimeError, match="transformers"):
        stage_kaggle(tmp_path / "out", "alice", notebooks=NOTEBOOKS[:1], wheelhouse=wheelhouse)


def test_offline_kernels_need_the_dataset(tmp_path):
    with pytest.raises(ValueError, match="needs the offline dataset"):
        stage_kaggle(tmp_path, "alice", internet=False, dataset=False)


def test_a_title_too_long_for_kaggle_stops_staging(tmp_path):
    card = load_suite_card()
    card["titles"] = {NOTEBOOKS[0].stem: "A title that goes on and on well past fifty characters"}
    with pytest.raises(ValueError, match="5 to 50"):
        stage_kaggle(tmp_path, "alice", notebooks=NOTEBOOKS[:1], dataset=False, card=card)


GOOD = kernel_metadata(NOTEBOOKS[0], "alice")


def _set(**changes):
    meta = copy.deepcopy(GOOD)
    for key, value in changes.items():
        if value is KeyError:
            meta.pop(key)
        else:
            meta[key] = value
    return meta


@pytest.mark.parametrize(
    "meta, complaint",
    [
        (_set(title="Some other title"), "slugifies to"),
        (_set(id="alice"), "'owner/slug'"),
        (_set(id="alice/ab", title="Ab cd"), "at least 5 characters"),
        (_set(id="alice/Memory_CE", title="Memory_CE"), "lowercase letters"),
        (_set(id=KeyError), "'id'"),
        (_set(title=KeyError), "'title' is required"),
        (_set(title="x" * 51, id="alice/" + "x" * 51), "5 to 50"),
        (_set(title="Mémoire CE 01", id="alice/memoire-ce-01"), "ASCII"),
        (_set(enable_internet=KeyError), "enable_internet must be written"),
        (_set(is_private="true"), "is_private must be written"),
        (_set(machine_shape=KeyError), "P100"),
        (_set(machine_shape="NvidiaL4"), "P100"),
        (_set(accelerator="NvidiaTeslaT4"), "unknown field 'accelerator'"),
        (_set(code_file="01_correctness.py"), "must be an .ipynb"),
        (_set(code_file=KeyError), "'code_file' is required"),
        (_set(language="julia"), "language"),
        (_set(kernel_type="kernel"), "kernel_type"),
        (_set(dataset_sources=["just-a-slug"]), "dataset_sources"),
        (_set(dataset_sources="alice/wheels"), "must be a list"),
        (_set(model_sources=["alice/model"]), "model_sources"),
    ],
)
def test_validator_catches_each_bad_field(meta, complaint):
    problems = validate_kernel_metadata(meta)
    assert any(complaint in p for p in problems), problems


def test_validator_accepts_the_good_one_and_checks_the_folder(tmp_path):
    assert validate_kernel_metadata(GOOD) == []
    folder = tmp_path / "k"
    folder.mkdir()
    (folder / KERNEL_METADATA).write_text(json.dumps(GOOD))
    assert any("not found" in p for p in validate_kernel_metadata(GOOD, folder))
    shutil.copy(NOTEBOOKS[0], folder / GOOD["code_file"])
    assert validate_kernel_metadata(GOOD, folder) == []
    (folder / "other.ipynb").write_text((folder / GOOD["code_file"]).read_text())
    assert any("exactly one notebook" in p for p in validate_kernel_metadata(GOOD, folder))
    (folder / "other.ipynb").unlink()
    (folder / GOOD["code_file"]).write_text("not json")
    assert any("not a valid notebook" in p for p in validate_kernel_metadata(GOOD, folder))


def test_dataset_metadata_rules():
    good = dataset_metadata("alice", wheels=["helpers-0.1.0-py3-none-any.whl"])
    assert validate_dataset_metadata(good) == []
    assert validate_dataset_metadata({**good, "title": "short"})
    assert validate_dataset_metadata({**good, "subtitle": "too short"})
    assert validate_dataset_metadata({**good, "id": "alice/ab"})
    assert validate_dataset_metadata({**good, "licenses": [{"name": "MIT"}]})


def test_badge_links_come_from_the_one_repository_constant():
    links = notebook_links("notebooks/01_correctness.py")
    path = "notebooks/01_correctness.ipynb"
    assert links["colab"] == f"https://colab.research.google.com/github/{GITHUB_REPO}/blob/{GITHUB_BRANCH}/{path}"
    assert links["kaggle"] == f"https://kaggle.com/kernels/welcome?src=https://github.com/{GITHUB_REPO}/blob/{GITHUB_BRANCH}/{path}"
    assert notebook_links(ROOT / path) == links  # absolute paths inside the checkout
    table = readme_badge_table()
    assert all(f"`{nb.stem}`" in table for nb in NOTEBOOKS) and table.count(COLAB_BADGE) == len(NOTEBOOKS)


def test_install_badges_under_the_title_once(tmp_path):
    py = tmp_path / NOTEBOOKS[0].with_suffix(".py").name  # same name, without the badges
    py.write_text('# ---\n# jupyter:\n#   jupytext:\n#     formats: ipynb,py:percent\n# ---\n\n'
                  '# %% [markdown]\n# # 01 · Example\n#\n# Prose.\n\n# %%\nprint("hello")\n')
    jupytext.write(jupytext.read(py), py.with_suffix(".ipynb"))
    os.utime(py.with_suffix(".ipynb"), (1e9, 1e9))  # older than the edit, as a committed pair is
    os.utime(py, (1e9, 1e9))
    assert install_badges(py) is True
    assert install_badges(py) is False  # idempotent
    text = py.read_text()
    assert text.count(COLAB_BADGE) == 1
    lines = text.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("# # "))
    assert lines[title + 1] == "#" and lines[title + 2] == "# " + badges_markdown(NOTEBOOKS[0])
    assert lines[title + 3] == "#"
    paired = nbformat.read(py.with_suffix(".ipynb"), as_version=4)
    assert COLAB_BADGE in paired.cells[0].source  # the .ipynb was synced


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_has_its_badges(notebook):
    assert badges_markdown(notebook) in notebook.with_suffix(".py").read_text()


@pytest.mark.parametrize("version, isolated", [("75.8.0", True), ("77.0.3", False), ("80.1", False), (None, True)])
def test_the_wheel_builds_with_the_setuptools_here_only_when_it_reads_the_spdx_license(version, isolated, monkeypatch,
                                                                                      tmp_path):
    """pyproject.toml's license is an SPDX string, which setuptools reads from 77: an older one (or none)
    must not build it in place (``--no-build-isolation``); pip's isolated build fetches a newer one."""
    import importlib.metadata
    import subprocess

    import helpers.suite.kaggle as kaggle

    def fake_version(name):
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    commands = []

    def fake_run(command, check):
        commands.append(command)
        (tmp_path / "helpers-0.1.0-py3-none-any.whl").write_bytes(b"")

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    monkeypatch.setattr(subprocess, "run", fake_run)
    kaggle.build_wheel(tmp_path)
    assert ("--no-build-isolation" not in commands[0]) == isolated
