"""Bugs the fuzzers found, one test each (every one failed before its fix).

Most were crashes of the validate stage on a ``map`` expression — an exception that was not a
``ProgramError``, so the agent would have read Python's words instead of the sandbox's; the last
one was in the fuzzer's own strategies, which must generate a case from whatever earlier edits
left behind.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.primitives import ProgramError
from coda.primitives.expr import MAX_DEPTH, parse
from coda.sandbox import SandboxOptions, evaluate
from tests.adversarial.programs import BLOCKS, LLAMA
from tests.fuzz.strategies import _insert_node, _splice_map, edits


@pytest.mark.parametrize(
    "source,fragment",
    [
        # RecursionError: a long flat chain is a left-deep tree, converted recursively
        ("+".join(["x"] * 600), f"nests deeper than {MAX_DEPTH} levels"),
        ("-" * 1500 + "x", f"nests deeper than {MAX_DEPTH} levels"),
        ("exp(" * 80 + "x" + ")" * 80, f"nests deeper than {MAX_DEPTH} levels"),
        # OverflowError: an integer literal too large for a float
        ("1" + "0" * 400 + " * x", "is not a finite float32 number"),
        # TypeError: '-' folded into a non-numeric exponent
        ("x ** -'a'", "'**' needs an integer exponent"),
        ("x ** -None", "'**' needs an integer exponent"),
        # Not crashes but wrong: 1e999 is inf (printed as the undefined name `inf` in the kernel)
        # and 1e300 is finite in the float64 reference but inf in the fp32 kernel.
        ("1e999 * x", "is not a finite float32 number"),
        ("x * 1e300", "is not a finite float32 number"),
        # UnicodeEncodeError / ValueError out of ast.parse: text Python cannot compile
        ("x + \ud800", "is not valid text"),
        ("x\x00", "is not valid text"),
    ],
)
def test_expression_edges_are_program_errors(source: str, fragment: str) -> None:
    with pytest.raises(ProgramError) as err:
        parse(source)
    assert fragment in str(err.value)


def test_depth_limit_leaves_room_for_real_expressions() -> None:
    nested = "exp(" * (MAX_DEPTH - 2) + "x" + ")" * (MAX_DEPTH - 2)
    assert parse(nested).variables() == {"x"}
    assert parse("x * 3.4e38 + 1e-45").variables() == {"x"}


def test_a_deep_expression_fails_validate_with_its_location() -> None:
    data = copy.deepcopy(LLAMA)
    down = data["steps"][2]["epilogue"]
    down.insert(1, {"op": "map", "expr": "+".join(["o"] * 600), "out": "o2"})
    down[-1]["src"] = "o2"
    report = evaluate(data, BLOCKS["llama_mlp"], SandboxOptions(isolate=False))
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("validate", "program")
    assert "steps.2.gemm.epilogue.1.map.expr" in failed.message


@pytest.mark.parametrize(
    "data",
    ["\ud800", '{"block": "\udfff"}', {"block": "\ud800"}, {("a", 1): 2}, {1: {"b"}}],
    ids=["surrogate", "surrogate-in-json", "surrogate-in-dict", "tuple-key", "set-value"],
)
def test_input_that_is_not_json_is_rejected_not_raised(data: object) -> None:
    # UnicodeEncodeError / TypeError: the program hash encoded raw text as strict UTF-8 and
    # assumed a dict could be dumped as JSON
    report = evaluate(data, BLOCKS["llama_mlp"], SandboxOptions(isolate=False))
    assert (report.failed_stage.stage, report.failed_stage.cause) == ("validate", "program")
    assert len(report.program_hash) == 12


# -- the strategies themselves ---------------------------------------------------------------------
# `scripts/fuzz.py --seed 4242` stopped with a TypeError raised while *generating* a case: an edit
# had replaced `steps` with a JSON value (None), and a later edit in the same case iterated over it
# to find the epilogues it splices a map into or inserts a node into.
DAMAGED = [
    {"steps": None},
    {"steps": 7},
    {"steps": "gemm"},
    {"steps": [None, {"kind": "gemm", "epilogue": None}, {"kind": "gemm", "epilogue": "x"}]},
    {"steps": [{"kind": "gemm", "epilogue": {"op": "store"}}], "prep": None},
    {},
]


@pytest.mark.parametrize("damaged", DAMAGED, ids=[str(i) for i in range(len(DAMAGED))])
@settings(max_examples=25, deadline=None, database=None)
@given(data=st.data())
def test_edits_of_an_already_damaged_program_still_generate(damaged: dict, data) -> None:  # noqa: ANN001
    program = copy.deepcopy(damaged)
    data.draw(_splice_map(program))
    data.draw(_insert_node(program, ["x", "acc"]))
    data.draw(edits(program, BLOCKS["llama_mlp"]))
