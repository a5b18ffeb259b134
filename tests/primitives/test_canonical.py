"""Canonical text: a validated Program keeps expressions and size expressions as re-printed from
their parsed trees — never the submitted characters — and the printed form parses back to the same
tree (with the same value)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import Program, ProgramError
from coda.primitives.expr import canonical, parse
from coda.primitives.sizes import canonical_size_expr, check_size_expr, evaluate
from tests.fuzz.strategies import expressions


@pytest.mark.parametrize(
    "source,printed",
    [
        ("silu(g)*u", "silu(g) * u"),
        ("o # \"\"\";open('/tmp/x','w')", "o"),  # a comment is not part of the expression
        ("(((x)))", "x"),
        ("a-(b-c)", "a - (b - c)"),
        ("(a-b)-c", "a - b - c"),
        ("a/(b*c)", "a / (b * c)"),
        ("-x**2", "-x ** 2"),  # Python's precedence: -(x ** 2)
        ("(-x)**2", "(-x) ** 2"),
        ("(a+b)**-2", "(a + b) ** -2"),
        ("--x", "-(-x)"),
        ("+x", "x"),
        ("where(x>=0 , x,0.01*x)", "where(x >= 0, x, 0.01 * x)"),
        ("max(min(x,1),-1)", "max(min(x, 1), -1)"),
        ("2.0 * x + 1e-5", "2 * x + 1e-05"),
        ("\tx\n", "x"),
    ],
)
def test_expressions_print_canonically(source: str, printed: str) -> None:
    assert canonical(source) == printed
    assert parse(printed).tree == parse(source).tree


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(expressions(["acc", "x", "g_1"]))
def test_expression_printing_round_trips(source: str) -> None:
    try:
        tree = parse(source).tree
    except ProgramError:
        return  # outside the grammar: rejected, nothing to print
    printed = canonical(source)
    assert parse(printed).tree == tree
    assert canonical(printed) == printed  # a fixed point


@pytest.mark.parametrize(
    "source,printed",
    [
        ("Nq+Nkv", "Nq + Nkv"),
        ('d # """; import os', "d"),
        ("(a-b)-(c-d)", "a - b - (c - d)"),
        ("2*(a+b)*3", "2 * (a + b) * 3"),
        ("a*(b-c)", "a * (b - c)"),
        ("-(-a)", "-(-a)"),
        ("  7 ", "7"),
    ],
)
def test_size_expressions_print_canonically(source: str, printed: str) -> None:
    assert canonical_size_expr(source) == printed
    sizes = {"a": 11, "b": 2, "c": 3, "d": 5, "Nq": 7, "Nkv": 2}
    assert evaluate(printed, sizes) == evaluate(source, sizes)


@pytest.mark.parametrize(
    "source,what",
    [
        ("-" * 100_000 + "d", "is 100001 characters long, over the 500 allowed"),
        ("*".join(["d"] * 20_000), "is 39999 characters long, over the 500 allowed"),
        ("-" * 80 + "d", "nests deeper than 64 levels"),
        ("*".join(["d"] * 100), "nests deeper than 64 levels"),
    ],
    ids=["long-negation", "long-product", "deep-negation", "deep-product"],
)
def test_a_size_expression_too_long_or_too_deep_is_a_program_error(source: str, what: str) -> None:
    with pytest.raises(ProgramError, match=what):
        canonical_size_expr(source)
    step = {"kind": "sum_partials", "src": "rstd_h", "out": "zz", "divide_by": source}
    data = lower(get_block("llama_mlp")).model_dump(mode="json")
    with pytest.raises(ProgramError, match=what):  # not a MemoryError or RecursionError
        Program.parse({**data, "steps": [*data["steps"], step]})


_SIZE_LEAVES = st.one_of(st.sampled_from(["a", "b", "Nq"]), st.integers(0, 99).map(str))


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        _SIZE_LEAVES,
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from(["+", "-", "*"]), inner).map(
                lambda t: f"({t[0]}{t[1]}{t[2]})"
            ),
            inner.map(lambda x: f"-({x})"),
        ),
        max_leaves=8,
    )
)
def test_size_printing_round_trips(source: str) -> None:
    printed = check_size_expr(source)
    assert canonical_size_expr(printed) == printed
    sizes = {"a": 7, "b": 3, "Nq": 5}
    assert evaluate(printed, sizes) == evaluate(source, sizes)


def test_a_program_holds_only_canonical_text() -> None:
    program = Program.parse(
        {
            "block": "canon",
            "inputs": {"x": ["M", "K"], "w": ["N", "K"]},
            "steps": [
                {
                    "kind": "gemm",
                    "a": "x",
                    "b": "w.T",
                    "epilogue": [
                        {"op": "map", "expr": "acc*2 # '''\"\"\" comment", "out": "y"},
                        {"op": "store", "src": "y", "to": "out"},
                    ],
                }
            ],
            "outputs": {"out": {"tensor": "out", "dim": 1, "start": "0 # x", "stop": "N#y"}},
        }
    )
    text = program.canonical_json() + program.to_python()
    assert "#" not in text and "comment" not in text
    assert program.steps[0].epilogue[0].expr == "acc * 2"
    assert (program.outputs["out"].start, program.outputs["out"].stop) == ("0", "N")


def test_a_size_s_own_name_evaluates_without_parsing_and_unknown_names_still_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Host code evaluates bare size names on every call (a head width ``"D"``): ``evaluate``
    returns the binding's value without parsing or walking the expression; an expression, or a
    name the binding lacks, takes the full path (values, and the error naming the size)."""
    from coda.primitives import sizes

    sizes_bound = {"D": 64, "Nq": 256}
    assert evaluate("Nq + D", sizes_bound) == 320
    walked = []
    eval_node = sizes._eval
    monkeypatch.setattr(sizes, "_eval", lambda *a: walked.append(1) or eval_node(*a))
    assert evaluate("D", sizes_bound) == 64 and walked == []
    assert evaluate("2 * D", sizes_bound) == 128 and walked
    with pytest.raises(ProgramError, match="uses size 'Nkv', which this program does not bind"):
        evaluate("Nkv", sizes_bound)
