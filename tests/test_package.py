"""The package's shape: layers that import one way, no cycles, no borrowed private names, the names
a user wants on its face, and an ``import helpers`` that works in any order."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import helpers

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "helpers"
# A module may import its own layer and those below it: suite -> lab -> compare -> (hf) -> cce -> spec.
LAYERS = ["spec", "cce", "hf", "compare", "lab", "suite"]  # hf: the Hugging Face adapter of cce


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in the file, at any depth (a lazy import is an edge too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append((f"relative:{node.module}", [alias.name for alias in node.names]))
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def edges() -> dict[str, set[str]]:
    """helpers module -> the helpers modules it imports (``from helpers.x import y`` counts as x, or
    x.y when y is a module)."""
    graph = {}
    for name, path in MODULES.items():
        targets = set()
        for module, names in imports(path):
            if not module.startswith("helpers"):
                continue
            for n in names or [""]:
                targets.add(f"{module}.{n}" if f"{module}.{n}" in MODULES else module)
        graph[name] = targets - {name}
    return graph


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_relative_imports_are_not_used():
    relative = [name for name, path in MODULES.items() for module, _ in imports(path) if module.startswith("relative:")]
    assert not relative, relative


def test_layers_import_one_way():
    wrong = []
    for module, targets in edges().items():
        mine = layer(module)
        if mine is None:
            continue
        for target in targets:
            theirs = layer(target)
            if target == "helpers" or (theirs is not None and theirs > mine):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = edges()
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph or nxt == "helpers":
                continue  # the package's face imports everything; nothing below may import it back
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_nothing_below_the_face_imports_the_face():
    offenders = [m for m, targets in edges().items() if m != "helpers" and "helpers" in targets
                 and not m.endswith("__main__")]
    assert not offenders, offenders


def test_no_module_imports_a_private_name_of_another():
    offenders = [f"{name}: from {module} import {n}" for name, path in MODULES.items()
                 for module, names in imports(path) if module.startswith("helpers")
                 for n in names if n.startswith("_")]
    assert not offenders, offenders


def test_the_face_has_what_a_user_wants():
    for name in ["linear_cross_entropy", "METHODS", "get_method", "run_gate", "gate_cases", "reference_loss",
                 "reference_loss_and_grads", "relative_error", "validate_inputs"]:
        assert name in helpers.__all__ and hasattr(helpers, name), name
    from helpers.cce import linear_cross_entropy

    assert helpers.linear_cross_entropy is linear_cross_entropy


def environment_writes_at_import(path: Path) -> int:
    """Statements at a module's top level (run on import) that write os.environ."""
    count = 0
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for sub in ast.walk(node):
            writes = (isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Store)
                      and ast.unparse(sub.value) == "os.environ")
            calls = (isinstance(sub, ast.Call) and ast.unparse(sub.func) in
                     ("os.environ.setdefault", "os.environ.update", "os.environ.pop"))
            count += writes or calls
    return count


def test_only_the_env_module_sets_environment_variables_on_import():
    writers = [name for name, path in MODULES.items() if environment_writes_at_import(path)]
    assert writers == ["helpers.env"], writers


_IMPORT_ORDER = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
{first}
import torch
from helpers.cce.options import triton_reason
E = torch.randn(5, 8); C = torch.randn(11, 8); x = torch.randint(0, 11, (5,))
loss = helpers.linear_cross_entropy(E, C, x)
assert triton_reason("cpu", torch.float32) is None and torch.isfinite(loss), loss
print("ok", os.environ["TRITON_INTERPRET"])
"""


@pytest.mark.parametrize("first", ["import helpers\nimport triton", "import torch, triton\nimport helpers"],
                         ids=["helpers first", "torch and triton first"])
def test_import_helpers_works_whether_torch_and_triton_came_first(first):
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", _IMPORT_ORDER.format(first=first)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok 1", done.stdout + done.stderr


def test_notebooks_are_found_in_the_repository_not_the_working_folder(tmp_path, monkeypatch):
    from helpers.suite.paths import NOTEBOOKS, find_notebooks

    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_someone_elses.ipynb").write_text("{}")
    monkeypatch.chdir(tmp_path)
    found = find_notebooks()
    assert found and all(p.parent == NOTEBOOKS for p in found)
    assert "01_someone_elses" not in [p.stem for p in found]
    with pytest.raises(SystemExit, match="starts with"):
        find_notebooks(["99"])


def test_the_library_imports_without_the_comparison_the_gate_or_the_suite():
    """``helpers.cce`` can be copied out alone: importing it (which imports the package first) loads
    the library and the spec, not the registry of peers, the gate, the lab or the suite."""
    import subprocess
    import sys

    code = ("import sys, helpers.cce; print(' '.join(m for m in sys.modules if m.startswith('helpers.') "
            "and m.split('.')[1] in ('compare', 'lab', 'suite', 'hf')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout
    # and the package's face still offers the registry and the gate, loaded on first use
    assert helpers.get_method("naive").name == "naive" and callable(helpers.run_gate)


def test_a_triton_interpreter_that_numpy_breaks_is_named_before_any_kernel_runs():
    from helpers.env import interpreter_problem

    broken = 'scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))'
    fixed = 'scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))'
    why = interpreter_problem("2.5.2", broken)
    assert why and "numpy 2.5.2" in why and "numpy<2.4" in why
    assert interpreter_problem("2.4.0", broken)
    assert interpreter_problem("2.3.5", broken) is None  # a one-element array still converts
    assert interpreter_problem("2.5.2", fixed) is None
    import inspect

    import numpy
    import triton.runtime.interpreter

    assert interpreter_problem(numpy.__version__, inspect.getsource(triton.runtime.interpreter)) is None  # this one runs


if os.environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl

    @triton.jit
    def _twice(v):
        return v * 2

    @triton.jit
    def _quadruple_then(X, N: tl.constexpr, STOP: tl.constexpr):
        offs = tl.arange(0, N)
        v = tl.load(X + offs)
        for _ in range(2):
            v = _twice(v)
        tl.static_assert(not STOP, "stops here")
        tl.store(X + offs, v)


def _loss_and_grads():
    """A kernel-heavy call (forward and backward, soft cap, bias, ignored rows): its outputs' bits."""
    import torch

    from helpers.cce import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    E = torch.randn(37, 24, generator=g).half().requires_grad_()
    C = torch.randn(301, 24, generator=g).half().requires_grad_()
    b = torch.randn(301, generator=g).half().requires_grad_()
    x = torch.randint(0, 301, (37,), generator=g)
    x[::5] = -100
    loss = linear_cross_entropy(E, C, x, bias=b, softcap=4.0, z_loss=1e-3, backward_impl="gemm")
    loss.backward()
    return [t.detach().clone() for t in (loss, E.grad, C.grad, b.grad)]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter's")
def test_the_interpreter_patches_a_helper_once_a_launch_and_gives_the_same_bits(monkeypatch):
    """``helpers.env.patch_device_calls_once``: the kernels' bits are Triton's own interpreter's, a failed
    launch leaves the next one patched afresh, and an interpreter of another shape is left alone."""
    import types

    import torch
    import triton.runtime.interpreter as interpreter

    from helpers.env import patch_device_calls_once

    shim = interpreter._patch_lang
    assert shim.once_a_launch and not patch_device_calls_once(interpreter)  # installed once, on import
    ours = _loss_and_grads()
    monkeypatch.setattr(interpreter, "_patch_lang", shim.original)
    triton_s = _loss_and_grads()
    assert all(torch.equal(a, b) for a, b in zip(ours, triton_s))
    monkeypatch.setattr(interpreter, "_patch_lang", shim)
    x = torch.ones(8)
    with pytest.raises(Exception, match="stops here"):  # a launch that fails inside, after its helper's calls
        _quadruple_then[(1,)](x, N=8, STOP=True)
    _quadruple_then[(1,)](x, N=8, STOP=False)  # the next launch patched afresh
    assert torch.equal(x, torch.full((8,), 4.0))  # the failed launch stored nothing
    assert all(torch.equal(a, b) for a, b in zip(_loss_and_grads(), triton_s))
    other = types.SimpleNamespace(_patch_lang=shim.original, GridExecutor=type("G", (), {"__call__": lambda self: 0}),
                                  InterpretedFunction=interpreter.InterpretedFunction)
    assert not patch_device_calls_once(other) and other._patch_lang is shim.original


@pytest.mark.parametrize("argv, says", [
    (["bench", "--methods", "nope"], "--methods: no method 'nope'; registered: naive"),
    (["gate", "--methods", "ours", "nope"], "--methods: no method 'nope'"),
    (["bench", "--N", "-5"], "argument --N: expected an integer >= 1, got -5"),
    (["bench", "--N", "0"], "argument --N: expected an integer >= 1, got 0"),
    (["bench", "--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
    (["bench", "--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
    (["run", "--timeout", "ten"], "argument --timeout: expected an integer, got 'ten'"),
])
def test_the_command_line_names_a_bad_argument_before_any_work(argv, says, capsys):
    """Each was a traceback, or a run that failed late (a KeyError from the registry; a negative N in
    the bench's table), or was taken (a negative warm-up)."""
    from helpers.__main__ import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code != 0
    assert says in (str(stop.value.code) if isinstance(stop.value.code, str) else capsys.readouterr().err)


def test_a_missing_results_file_is_named(tmp_path, capsys):
    from helpers.__main__ import main

    assert main(["scale-report", str(tmp_path / "missing.jsonl"), "--output-dir", str(tmp_path / "out")]) == 2
    assert "no results file at" in capsys.readouterr().err


def test_get_method_takes_a_name():
    with pytest.raises(TypeError, match="name must be a method's name"):
        helpers.get_method(["ours"])
