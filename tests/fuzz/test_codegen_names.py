"""Generated-code names must be injective: two different program names never share a Triton
identifier (found by reasoning about the naming scheme, then by these differential tests — each
failed before the fix, silently computing with the wrong tensor or refusing to import)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coda.primitives import Program
from coda.primitives.errors import ProgramError
from coda.sandbox import assert_close
from tests.helpers import make_inputs, run_both


def _gemm(inputs: dict[str, Any], epilogue: list[dict[str, Any]]) -> Program:
    return Program.parse(
        {
            "block": "names",
            "inputs": {"a": ["M", "N"], "b": ["N", "N"], **inputs},
            "steps": [{"kind": "gemm", "name": "k", "a": "a", "b": "b.T", "epilogue": epilogue}],
            "outputs": {"y": "y"},
        }
    )


CASES = {
    # "a" is renamed a_tensor (the mainloop owns a_ptr): a tensor really named a_tensor collided
    "a and a_tensor": _gemm(
        {"a_tensor": ["M", "N"]},
        [
            {"op": "add_tile", "src": "acc", "tensor": "a", "out": "y1"},
            {"op": "add_tile", "src": "y1", "tensor": "a_tensor", "out": "y2"},
            {"op": "store", "src": "y2", "to": "y"},
        ],
    ),
    # a vector's stride is stride_<name>: a vector named am duplicated the mainloop's stride_am
    "vector named am": _gemm(
        {"am": ["M"]},
        [
            {"op": "scale_rows", "src": "acc", "vector": "am", "out": "y1"},
            {"op": "store", "src": "y1", "to": "y"},
        ],
    ),
    # a tile's strides are stride_<name>_m/_n: a vector named x_m shared stride_x_m with tile x
    "tile x and vector x_m": _gemm(
        {"x": ["M", "N"], "x_m": ["M"]},
        [
            {"op": "add_tile", "src": "acc", "tensor": "x", "out": "y1"},
            {"op": "scale_rows", "src": "y1", "vector": "x_m", "out": "y2"},
            {"op": "store", "src": "y2", "to": "y"},
        ],
    ),
    # epilogue values are v_<name>: a tensor named v_z is loaded into v_z_tile, which is also
    # the variable of an epilogue value named z_tile (and the second read reuses the load)
    "tensor v_z and value z_tile": _gemm(
        {"v_z": ["M", "N"]},
        [
            {"op": "add_tile", "src": "acc", "tensor": "v_z", "out": "z_tile"},
            {"op": "add_tile", "src": "z_tile", "tensor": "v_z", "out": "y1"},
            {"op": "store", "src": "y1", "to": "y"},
        ],
    ),
    # a tensor's tile is loaded into <name>_tile: tensor v's tile was v_tile, which is also the
    # variable of an epilogue value named tile (v_<name>)
    "tensor v and value tile": _gemm(
        {"v": ["M", "N"]},
        [
            {"op": "add_tile", "src": "acc", "tensor": "v", "out": "tile"},
            {"op": "map", "expr": "tile * 2", "out": "y1"},
            {"op": "add_tile", "src": "y1", "tensor": "v", "out": "y2"},
            {"op": "store", "src": "y2", "to": "y"},
        ],
    ),
    # the same for partials (p_<tensor>): tensor p's pointer p_ptr was overwritten by the partials
    # of a tensor named ptr before p was loaded
    "tensor p and partials into ptr": _gemm(
        {"p": ["M", "N"]},
        [
            {"op": "partial_reduce", "src": "acc", "kind": "sum", "to": "ptr"},
            {"op": "add_tile", "src": "acc", "tensor": "p", "out": "y1"},
            {"op": "store", "src": "y1", "to": "y"},
        ],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_the_reference_whatever_the_names(name: str) -> None:
    program = CASES[name]
    inputs = make_inputs(program, {"M": 37, "N": 40}, torch.float32)
    got, ref, _ = run_both(program, inputs)
    assert_close(got["y"], ref["y"], atol=2e-5, rtol=2e-5, what=name)


@pytest.mark.parametrize("name", ["ｏ", "é", "x\u200b", "ℌ"])
def test_names_are_ascii(name: str) -> None:
    """Python folds identifiers by NFKC ('ｏ' is 'o' in generated code): a non-ASCII name would
    share a variable with its ASCII twin, so names are ASCII only, and the error says so."""
    with pytest.raises(ProgramError, match=r"ASCII letters A-Z and a-z.*\[A-Za-z_\]"):
        _gemm(
            {"o": ["M", "N"], name: ["M", "N"]},
            [
                {"op": "add_tile", "src": "acc", "tensor": "o", "out": "y1"},
                {"op": "store", "src": "y1", "to": "y"},
            ],
        )
