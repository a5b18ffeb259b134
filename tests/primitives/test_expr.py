"""The expression language: what parses, what is rejected (and how it says so)."""

from __future__ import annotations

import pytest
import torch

from coda.primitives import ProgramError
from coda.primitives.expr import parse


@pytest.mark.parametrize(
    "source",
    [
        "silu(g) * u",
        "-x + 2.5",
        "x ** 2",
        "x ** -1",
        "where(x > 0, x, 0.01 * x)",
        "max(min(x, 1), -1)",
        "rsqrt(x * x + 1e-6)",
        "tanh(sqrt(abs(x)))",
        "exp(log(x + 3)) / 2",
    ],
)
def test_accepts(source: str) -> None:
    expr = parse(source)
    assert expr.variables() <= {"g", "u", "x"}
    code = expr.to_triton(lambda n: f"v_{n}")
    assert "torch" not in code


@pytest.mark.parametrize(
    "source,fragment",
    [
        ("softmax(x)", "function 'softmax' is not allowed"),
        ("x.exp()", "only plain function names can be called"),
        ("x.real", "attribute access '.real'"),
        ("x[0]", "subscripting"),
        ("x ** y", "integer exponent"),
        ("x ** 5", "integer exponent"),
        ("x > 0", "only as the first argument of where"),
        ("where(x, 1, 0)", "must be a comparison"),
        ("exp(x, 2)", "exp takes 1 argument"),
        ("__import__('os')", "function '__import__' is not allowed"),
        ("'abc'", "only numbers are allowed"),
        ("lambda: 1", "Lambda"),
        ("x +", "not valid syntax"),
        ("", "empty"),
        ("exp", "is a function; call it"),
        ("x // 2", "FloorDiv"),
        ("where(0 < x < 1, x, 0)", "one comparison"),
        ("exp(x=1)", "positional arguments only"),
    ],
)
def test_rejects_with_a_specific_message(source: str, fragment: str) -> None:
    with pytest.raises(ProgramError) as err:
        parse(source)
    assert fragment in str(err.value)
    if "not allowed" in fragment:
        assert "allowed:" in str(err.value)  # says what is allowed


def test_torch_evaluation_matches_triton_semantics_of_tanh() -> None:
    # Triton has no tanh the interpreter also runs: it is emitted as 2·sigmoid(2x) − 1.
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    emitted = 2 * torch.sigmoid(2 * x) - 1
    assert torch.allclose(parse("tanh(x)").evaluate(lambda _: x, torch.float64), emitted)


def test_erf_is_tl_erf_and_torch_erf() -> None:
    # Triton's core tl.erf runs on GPUs and in the interpreter (the sandbox runs it in
    # tests/planner/test_activations.py, exact GELU).
    x = torch.linspace(-4, 4, 65, dtype=torch.float64)
    assert parse("erf(x)").to_triton(lambda name: f"v_{name}") == "tl.erf(v_x)"
    assert torch.equal(parse("erf(x)").evaluate(lambda _: x, torch.float64), torch.erf(x))
