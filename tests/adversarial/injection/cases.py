"""The payloads and where each one goes. ``{canary}`` in a payload is replaced by the path of a
file unique to the test; code that ran would create it.

* ``REJECTED``: (field, where to put it, payload, message fragment) — refused at validate.
* ``COMMENTS``: (block, path of a text field in the planner's Program for it) — a payload appended
  as a Python comment to an honest value; the Program keeps the canonical value and runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from tests.adversarial.programs import LLAMA

Json = dict[str, Any]
CODE = 'open({canary!r}, "w").write("x")'
COMMENT = ' # """;' + CODE + ';"""'


def _llama() -> Json:
    return copy.deepcopy(LLAMA)


def _down(program: Json) -> Json:
    return program["steps"][2]


def map_expr(payload: str) -> Json:
    """``o2 = map(payload)`` after the residual add of step "down", stored as the output."""
    p = _llama()
    epilogue = _down(p)["epilogue"]
    epilogue.insert(1, {"op": "map", "expr": payload, "out": "o2"})
    epilogue[-1]["src"] = "o2"
    return p


def pairwise(field: str) -> Callable[[str], Json]:
    def build(payload: str) -> Json:
        p = _llama()
        gate_up = p["steps"][1]["epilogue"]
        exprs = {"expr0": "silu(x0) * x1", field: payload}
        gate_up[1] = {"op": "pairwise", "src": "gu", **exprs, "out": "a"}
        return p

    return build


def aux_step(kind: str, field: str, **fields: Any) -> Callable[[str], Json]:
    """An extra step of ``kind`` whose ``field`` carries the payload (the rest is well-formed)."""

    def build(payload: str) -> Json:
        p = _llama()
        p["steps"].append({"kind": kind, **fields, field: payload})
        return p

    return build


def prep_step(kind: str, field: str, **fields: Any) -> Callable[[str], Json]:
    def build(payload: str) -> Json:
        p = _llama()
        p["prep"].append({"kind": kind, **fields, field: payload})
        return p

    return build


def rope_op(payload: str) -> Json:
    p = _llama()
    _down(p)["epilogue"].insert(
        1,
        {"op": "rope", "src": "o", "cos": "x", "sin": "x", "out": "o2", "rotary_cols": payload},
    )
    return p


def view(field: str) -> Callable[[Any], Json]:
    def build(payload: Any) -> Json:
        p = _llama()
        p["outputs"]["out"] = {"tensor": "out", "dim": 0, field: payload}
        return p

    return build


def tensor_name(payload: str) -> Json:
    p = _llama()
    p["inputs"][payload] = ["M", "d"]
    return p


def step_name(payload: str) -> Json:
    p = _llama()
    _down(p)["name"] = payload
    return p


def value_name(payload: str) -> Json:
    p = _llama()
    _down(p)["epilogue"][0]["out"] = payload
    _down(p)["epilogue"][1]["src"] = payload
    return p


def output_name(payload: str) -> Json:
    p = _llama()
    p["outputs"] = {payload: "out"}
    return p


def operand(payload: str) -> Json:
    p = _llama()
    _down(p)["a"] = payload
    return p


def block_name(payload: str) -> Json:
    p = _llama()
    p["block"] = payload
    return p


def input_dtype(payload: str) -> Json:
    p = _llama()
    p["inputs"]["x"] = {"shape": ["M", "d"], "dtype": payload}
    return p


def store_dtype(payload: str) -> Json:
    p = _llama()
    _down(p)["epilogue"][-1]["dtype"] = payload
    return p


def shape_entry(payload: str) -> Json:
    p = _llama()
    p["inputs"]["x"] = [payload, "d"]
    return p


def config_field(payload: str) -> Json:
    p = _llama()
    _down(p)["config"] = {"num_warps": payload}
    return p


_SIZE = "size expression"
_EXPR = "expression"
_NAME = "is not a valid name"
_ARITH = "expression 'o"

REJECTED: list[tuple[str, Callable[[Any], Json], Any, str]] = [
    # map expressions
    (
        "map expr",
        map_expr,
        '__import__("os").system("touch {canary}")',
        "only plain function names",
    ),
    ("map expr", map_expr, "open(o)", "function 'open' is not allowed"),
    ("map expr", map_expr, CODE, "only plain function names can be called"),
    ("map expr", map_expr, "o.__class__", "attribute access '.__class__'"),
    ("map expr", map_expr, "(lambda: o)()", "only plain function names can be called"),
    ("map expr", map_expr, "o if " + CODE + " else o", "IfExp is not allowed"),
    ("map expr", map_expr, "[o][0]", "subscripting is not allowed"),
    ("map expr", map_expr, "f'{{o}}'", "JoinedStr is not allowed"),
    ("map expr", map_expr, "o\nimport os", "is not valid syntax"),
    ("map expr", map_expr, "o; " + CODE, "is not valid syntax"),
    ("map expr", map_expr, 'exec("import os")', "function 'exec' is not allowed"),
    ("map expr", map_expr, "(o := 1)", "NamedExpr is not allowed"),
    ("map expr", map_expr, "\uff4f", "U+FF4F at column 1 is not ASCII"),  # NFKC: "o"
    # pairwise expressions
    ("pairwise expr0", pairwise("expr0"), "x0.__globals__", "attribute access '.__globals__'"),
    ("pairwise expr1", pairwise("expr1"), "x1 + " + CODE, "only plain function names"),
    ("pairwise expr1", pairwise("expr1"), "'x1'", "the constant 'x1' (only numbers"),
    # size expressions, one field each
    ("rope rotary_cols", rope_op, '__import__("os")', "Call is not allowed"),
    (
        "rope_rows rotary_cols",
        aux_step("rope_rows", "rotary_cols", src="x", cos="x", sin="x", out="y"),
        "d.__class__",
        "Attribute is not allowed",
    ),
    (
        "rope_rows divide_by",
        aux_step("rope_rows", "divide_by", src="x", cos="x", sin="x", out="y"),
        "d; " + CODE,
        "is not valid syntax",
    ),
    (
        "sum_partials divide_by",
        aux_step("sum_partials", "divide_by", src="r", out="y"),
        CODE,
        "Call is not allowed",
    ),
    (
        "unpair_rows head_dim",
        aux_step("unpair_rows", "head_dim", src="x", out="y"),
        "'D'",
        "Constant is not allowed",
    ),
    (
        "unpair_rows rows",
        aux_step("unpair_rows", "rows", src="x", out="y", head_dim="d"),
        "[d][0]",
        "Subscript is not allowed",
    ),
    (
        "rope_pairs head_dim",
        prep_step("rope_pairs", "head_dim", weight="w_up", out="w2"),
        "lambda: d",
        "Lambda is not allowed",
    ),
    ("view start", view("start"), "d if " + CODE + " else 0", "IfExp is not allowed"),
    ("view stop", view("stop"), "d\nimport os", "is not valid syntax"),
    ("view start", view("start"), "\uff44", "is not ASCII"),  # fullwidth 'd'
    # names
    ("tensor name", tensor_name, 'x"""\n' + CODE, _NAME),
    ("tensor name", tensor_name, "\uff58", "ASCII letters A-Z and a-z"),
    ("step name", step_name, 'down"""; ' + CODE + '; """', _NAME),
    ("value name", value_name, "o;" + CODE, _NAME),
    ("value name", value_name, "o)\n" + CODE, _NAME),
    ("output name", output_name, "out'):\n    " + CODE, _NAME),
    ("operand", operand, "a; " + CODE + ".T", _NAME),
    ("shape entry", shape_entry, "M); " + CODE + " #", "shape"),
    ("view tensor", view("tensor"), "out\n" + CODE, _NAME),
    # the block name
    ("block name", block_name, 'llama_mlp"""\n' + CODE + '\n"""', "is not a valid block name"),
    ("block name", block_name, "llama_mlp'); " + CODE + " #", "is not a valid block name"),
    # dtype strings and other literals
    ("input dtype", input_dtype, 'float32")\n' + CODE, "Input should be 'act'"),
    ("store dtype", store_dtype, "tl.float32); " + CODE, "Input should be"),
    ("view dim", view("dim"), "0; " + CODE, "Input should be 0 or 1"),
    ("view step", view("step"), "1) or " + CODE, "Input should be 1 or 2"),
    ("config num_warps", config_field, "8); " + CODE, "valid integer"),
]

# (block, path in the planner's Program, canonical value): a comment appended there is dropped.
COMMENTS: list[tuple[str, tuple, str]] = [
    ("gemm_partial_swiglu_bwd", ("steps", 0, "epilogue", 3, "expr"), "z_tile * dz"),
    ("gemm_partial_swiglu_bwd", ("steps", 0, "epilogue", 1, "expr1"), "acc * silu(x0)"),
    ("llama_attn_in_bwd", ("steps", 1, "epilogue", 2, "rotary_cols"), "Nq + Nkv"),
    ("llama_attn_in_bwd", ("steps", 2, "divide_by"), "d"),
    ("llama_attn_in_bwd", ("steps", 6, "head_dim"), "D"),
    ("llama_attn_in_bwd", ("steps", 6, "rows"), "Nq + Nkv"),
    ("llama_attn_in_bwd", ("steps", 6, "parts", 1, "rows"), "Nkv"),
    ("llama_mlp_bwd", ("outputs", "dw_up", "start"), "1"),
    ("qwen2_attn_in_bwd", ("steps", 6, "parts", 0, "rows"), "Nq"),
    ("llama_attn_in", ("prep", 0, "head_dim"), "D"),
]


def at(data: Any, path: tuple) -> Any:
    for key in path[:-1]:
        data = data[key]
    return data
