"""Bad programs: each is rejected with a specific message naming where and what to change."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import Program, ProgramError, analyze

BLOCK = get_block("llama_mlp")
SIZES = BLOCK.shapes.cpu[1]  # ragged: M=67, d=48, f=80


def base() -> dict[str, Any]:
    return lower(BLOCK).model_dump(mode="json")


def check(data: dict[str, Any], sizes: dict[str, int] = SIZES) -> None:
    analyze(Program.parse(data), sizes)


def gemm(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in data["steps"] if s.get("name") == name)


def mutate(fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    data = copy.deepcopy(base())
    fn(data)
    return data


BAD: dict[str, tuple[Callable[[dict[str, Any]], None], list[str]]] = {
    "unknown op": (
        lambda d: gemm(d, "gate_up")["epilogue"].insert(
            1, {"op": "swiglue", "src": "gu", "out": "q"}
        ),
        [
            "steps.1.gemm.epilogue.1: unknown op 'swiglue': did you mean 'swiglu'? known: ",
        ],
    ),
    "unknown field": (
        lambda d: gemm(d, "down")["epilogue"][0].update(scale=2.0),
        ["steps.2.gemm.epilogue.0.add_tile.scale", "unknown field"],
    ),
    "unknown epilogue value": (
        lambda d: gemm(d, "gate_up")["epilogue"][1].update(src="gu2"),
        [
            "steps[1] (gemm 'gate_up').epilogue[1] (swiglu)",
            "'gu2' is not an epilogue value",
            "did you mean 'gu'",
        ],
    ),
    "unknown tensor": (
        lambda d: gemm(d, "gate_up")["epilogue"][0].update(vector="rstd"),
        ["epilogue[0] (scale_rows)", "'rstd' is not a program tensor", "did you mean 'rstd_h'"],
    ),
    "tensor used before it is produced": (
        lambda d: d["steps"].insert(0, d["steps"].pop(2)),
        [
            "steps[0] (gemm 'down')",
            "operand a 'a' is not a program tensor at this point",
            "only after the step that produces it",
        ],
    ),
    "program tensor used as an epilogue value": (
        lambda d: gemm(d, "down")["epilogue"][0].update(src="x"),
        ["'x' is a program tensor, not an epilogue value", "load_tile"],
    ),
    "gemm inner sizes differ": (
        lambda d: gemm(d, "down").update(b="w_down"),
        [
            "steps[2] (gemm 'down')",
            "A = a is [67, 80] but B = w_down is [48, 80]",
            "inner sizes differ",
            "'w.T'",
        ],
    ),
    "add_tile shape mismatch": (
        lambda d: gemm(d, "down")["epilogue"][0].update(tensor="a"),
        [
            "epilogue[0] (add_tile)",
            "tensor 'a' is [67, 80] but src 'acc' is [67, 48]",
            "exactly src's shape",
        ],
    ),
    "scale_rows with a column-length vector": (
        lambda d: gemm(d, "down")["epilogue"].insert(
            0, {"op": "scale_rows", "src": "acc", "vector": "gamma", "out": "t"}
        ),
        ["vector 'gamma' must be a vector of length 67 (one value per row, M)", "[48] act"],
    ),
    "forbidden expression": (
        lambda d: gemm(d, "down")["epilogue"].insert(
            0, {"op": "map", "expr": "softmax(acc)", "out": "t"}
        ),
        ["steps.2.gemm.epilogue.0.map.expr", "function 'softmax' is not allowed", "allowed:"],
    ),
    "store overwrites an input": (
        lambda d: gemm(d, "down")["epilogue"][1].update(to="x"),
        ["epilogue[1] (store)", "tensor 'x' is a block input", "pick a new name"],
    ),
    "accumulate into nothing": (
        lambda d: gemm(d, "down")["epilogue"][1].update(to="nowhere", mode="accumulate"),
        ["accumulate target 'nowhere' is not a program tensor"],
    ),
    "kernel reads what it writes": (
        lambda d: gemm(d, "down")["epilogue"].append(
            {"op": "add_tile", "src": "acc", "tensor": "out", "out": "t"}
        ),
        ["tensor 'out' is written by this same kernel, which cannot also read it"],
    ),
    "epilogue writes nothing": (
        lambda d: gemm(d, "down").update(epilogue=[{"op": "map", "expr": "acc * 2", "out": "t"}]),
        ["steps[2] (gemm 'down')", "the epilogue writes nothing", "store(...)"],
    ),
    "redefined epilogue value": (
        lambda d: gemm(d, "gate_up")["epilogue"][1].update(out="gu"),
        ["epilogue value 'gu' is already defined", "single-assignment"],
    ),
    "output never written": (
        lambda d: d["outputs"].update(out="y"),
        ["outputs.out", "names 'y', which no step writes"],
    ),
    "output is an input": (
        lambda d: d["outputs"].update(out="x"),
        ["output 'out' is the block input 'x' itself"],
    ),
    "invalid name": (
        lambda d: gemm(d, "down")["epilogue"][0].update(out="2y"),
        ["'2y' is not a valid name"],
    ),
    "bad mainloop config": (
        lambda d: gemm(d, "down").update(config={"block_m": 96}),
        ["steps.2.gemm.config", "block_m", "power of two between 16 and 256"],
    ),
    "duplicate step names": (
        lambda d: gemm(d, "down").update(name="gate_up"),
        ["step names must be unique; repeated: gate_up"],
    ),
    "rstd of the wrong partials": (
        lambda d: (
            gemm(d, "gate_up")["epilogue"].append(
                {"op": "partial_reduce", "src": "acc", "kind": "max", "to": "pm"}
            ),
            d["steps"].append({"kind": "rstd", "src": "pm", "out": "r2"}),
        ),
        ["rstd needs partial sums of squares along rows", "partials(max, axis=row)"],
    ),
    "operand dtypes differ": (
        lambda d: gemm(d, "gate_up")["epilogue"][2].update(dtype="float32"),
        ["operands have different dtypes: 'a' is float32, 'w_down' is act"],
    ),
    "missing size binding": (
        lambda d: d["inputs"]["x"].update(shape=["M", "hidden"]),
        ["inputs.x", "uses size 'hidden', which has no value"],
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_program_is_rejected_specifically(name: str) -> None:
    fn, fragments = BAD[name]
    with pytest.raises(ProgramError) as err:
        check(mutate(fn))
    text = str(err.value)
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in: {text}"


def test_an_unknown_op_lists_the_known_ones_once() -> None:
    """pydantic's own message for an unknown tag lists every kind, and the hint listed them
    again: the message is the hint alone."""
    with pytest.raises(ProgramError) as err:
        check(mutate(BAD["unknown op"][0]))
    text = str(err.value)
    assert text.count("'add_tile'") == 1 and "expected tags" not in text, text


def test_odd_width_for_a_pair() -> None:
    # gate/up interleaved gives 2f columns (always even); a pair op on the down GEMM's d columns
    # is fine at even d and rejected at odd d, naming the width.
    data = base()
    gemm(data, "down")["epilogue"] = [
        {"op": "swiglu", "src": "acc", "out": "s"},
        {"op": "store", "src": "s", "to": "s"},
    ]
    data["outputs"] = {"out": "s"}
    check(data, {"M": 8, "d": 48, "f": 80})
    with pytest.raises(ProgramError) as err:
        check(data, {"M": 8, "d": 45, "f": 80})
    assert "swiglu needs adjacent column pairs, but 'acc' has an odd width 45" in str(err.value)
    assert "the width must be even" in str(err.value)


def test_good_program_passes() -> None:
    for sizes in BLOCK.shapes.cpu:
        check(base(), sizes)
