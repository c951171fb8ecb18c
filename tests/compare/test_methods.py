"""The registry: one signature, torch's semantics, clear errors, honest availability."""

import math

import pytest
import torch

import helpers
from helpers.compare.methods.baselines import chunk_rows, chunked_loss
from helpers.compare.methods import MethodUnavailable
from helpers.spec import reference_loss

CPU_METHODS = ["naive", "chunked", "liger", "torch_lce", "ours"]


def inputs(N=11, V=97, D=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(N, D, generator=g).to(dtype)
    C = (torch.randn(V, D, generator=g) / 3).to(dtype)
    x = torch.randint(0, V, (N,), generator=g)
    return E, C, x


def test_registry_lists_the_issue_methods():
    for name in ["naive", "torch_compile", "chunked", "liger", "apple_cce", "torch_lce", "ours"]:
        assert name in helpers.METHODS
    with pytest.raises(KeyError, match="no method 'nope'"):
        helpers.get_method("nope")


@pytest.mark.parametrize("name", CPU_METHODS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_matches_torch_cross_entropy(name, reduction):
    E, C, x = inputs()
    x[3] = -100
    got = helpers.get_method(name)(E, C, x, reduction=reduction)
    want = reference_loss(E, C, x, reduction=reduction, dtype=torch.float32)
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CPU_METHODS)
def test_mean_over_zero_kept_tokens_is_nan_with_zero_gradients(name):
    E, C, x = inputs()
    x[:] = -100
    E.requires_grad_(True)
    loss = helpers.get_method(name)(E, C, x)
    assert math.isnan(loss.item())
    loss.backward()
    if name != "torch_lce":  # torch's own chunked path returns NaN here: the gate reports it
        assert torch.count_nonzero(E.grad) == 0


def test_cce_on_cpu_says_why_and_refuses():
    reason = helpers.get_method("apple_cce").why_unavailable("cpu", torch.float32)
    assert reason and "CUDA GPU" in reason
    E, C, x = inputs()
    with pytest.raises(MethodUnavailable, match="CUDA GPU"):
        helpers.get_method("apple_cce")(E, C, x)


def test_triton_methods_refuse_bf16_under_the_interpreter():
    reason = helpers.get_method("liger").why_unavailable("cpu", torch.bfloat16)
    assert reason and "bf16" in reason


def test_chunked_never_holds_more_than_one_chunk_of_logits():
    # 4 rows per chunk of a V=97 vocabulary: the loop runs ceil(11 / 4) = 3 chunks, same answer.
    E, C, x = inputs()
    assert chunk_rows(97, chunk_bytes=4 * 97 * 4) == 4
    E1, C1 = E.clone().requires_grad_(), C.clone().requires_grad_()
    E2, C2 = E.clone().requires_grad_(), C.clone().requires_grad_()
    chunked_loss(E1, C1, x, rows=4, softcap=2.0).backward()
    reference_loss(E2, C2, x, softcap=2.0, dtype=torch.float32).backward()
    torch.testing.assert_close(E1.grad, E2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(C1.grad, C2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda E, C, x: (E[None], C, x), "E must be 2-D"),
        (lambda E, C, x: (E, C[None], x), "C must be 2-D"),
        (lambda E, C, x: (E, C, x[:, None]), "x must be 1-D"),
        (lambda E, C, x: (E, C[:, :-1], x), "share the hidden size D"),
        (lambda E, C, x: (E, C, x[:-1]), "one target per row of E"),
        (lambda E, C, x: (E.double(), C.double(), x), "E must be one of"),
        (lambda E, C, x: (E, C.half(), x), "C must have E's dtype"),
        (lambda E, C, x: (E, C, x.float()), "x must hold integer class indices"),
        (lambda E, C, x: (E, C, torch.where(x == x[0], 97, x)), "x holds target 97"),
        (lambda E, C, x: (E, C, torch.where(x == x[0], -3, x)), "x holds target -3"),
        (lambda E, C, x: ("E", C, x), "E must be a torch.Tensor"),
    ],
)
def test_bad_input_gets_an_error_naming_the_argument(mutate, match):
    E, C, x = mutate(*inputs())
    with pytest.raises((ValueError, TypeError), match=match):
        helpers.get_method("chunked")(E, C, x)


def test_bad_options_get_clear_errors():
    E, C, x = inputs()
    with pytest.raises(ValueError, match="reduction must be one of"):
        helpers.get_method("naive")(E, C, x, reduction="avg")
    with pytest.raises(ValueError, match="softcap must be None or a finite positive number"):
        helpers.get_method("naive")(E, C, x, softcap=-1.0)


def test_non_contiguous_inputs_work():
    E, C, x = inputs(D=48)
    E_t, C_t = E[:, ::2], C[:, ::2]  # strided views
    assert not E_t.is_contiguous()
    for name in CPU_METHODS:
        got = helpers.get_method(name)(E_t, C_t, x)
        torch.testing.assert_close(got, reference_loss(E_t, C_t, x, dtype=torch.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in helpers.METHODS if helpers.get_method(n).supports_bias
                                  and helpers.get_method(n).why_unavailable("cpu", torch.float32) is None])
def test_a_method_that_supports_bias_adds_it_to_the_logits(name):
    E, C, x = inputs()
    bias = torch.randn(C.shape[0], generator=torch.Generator().manual_seed(1))
    got = helpers.get_method(name)(E, C, x, bias=bias, softcap=5.0)
    torch.testing.assert_close(got, reference_loss(E, C, x, bias=bias, softcap=5.0, dtype=torch.float32))


def test_a_method_without_bias_support_refuses_a_bias_and_says_so():
    assert not helpers.get_method("apple_cce").supports_bias  # Apple's kernel has no bias argument
    E, C, x = inputs()
    with pytest.raises(MethodUnavailable, match="chunked: chunked \\(PyTorch\\) takes no bias"):
        helpers.get_method("chunked")(E, C, x, bias=torch.zeros(C.shape[0]))


def test_no_module_outside_the_registry_decides_by_a_method_key():
    """What a method can do is a field of its registry entry (supports_bias, counts_skips, kind, ...):
    a module that compares a method's key with a literal name decides on the name instead. naive as
    the gate's yardstick is a role of the comparison, not a capability, and stays by name."""
    import ast
    from pathlib import Path

    yardstick = {"helpers/compare/gate.py", "helpers/compare/verdicts.py"}
    root = Path(helpers.__file__).resolve().parent.parent
    keys = set(helpers.METHODS)

    def names_a_key(node) -> set[str]:
        if isinstance(node, ast.Constant) and node.value in keys:
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(names_a_key(e) for e in node.elts))
        return set()

    offenders = []
    for path in sorted((root / "helpers").rglob("*.py")):
        where = str(path.relative_to(root))
        if where.startswith("helpers/compare/methods/"):  # the registry and its entries
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            kind = isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "kind"
            if isinstance(node, ast.Compare) and not kind:  # a kind is named "ours" too
                named = set().union(*(names_a_key(n) for n in [node.left, *node.comparators]))
                if named and not (where in yardstick and named == {"naive"}):
                    offenders.append(f"{where}:{node.lineno} compares with {sorted(named)}")
    assert not offenders, "\n".join(offenders)
