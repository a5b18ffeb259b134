"""Honest programs for the adversarial blocks and llama_mlp, and helpers to write programs as JSON.

Each one verifies; the corpus edits them into cheats and the fuzzers mutate them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coda.blocks import get_block, load_block_file

HERE = Path(__file__).parent
BLOCK_FILE = str(HERE / "blocks.py")
ROGUE = str(HERE / "rogue.py")
BLOCKS = {b.name: b for b in load_block_file(BLOCK_FILE)} | {"llama_mlp": get_block("llama_mlp")}

Json = dict[str, Any]


def gemm(a: str, b: str, *epilogue: Json, name: str | None = None) -> Json:
    step = {"kind": "gemm", "a": a, "b": b, "epilogue": list(epilogue)}
    return step | ({"name": name} if name else {})


def op(name: str, /, **fields: Any) -> Json:
    return {"op": name, **fields}


def program(block: str, steps: list[Json], prep: list[Json] | None = None) -> Json:
    return {
        "block": block,
        "inputs": BLOCKS[block].program_inputs(),
        "prep": prep or [],
        "steps": steps,
        "outputs": {"out": "out"},
    }


# -- honest programs -------------------------------------------------------------------------------
LLAMA = program(
    "llama_mlp",
    prep=[
        {"kind": "interleave_rows", "first": "w_gate", "second": "w_up", "out": "w_gu"},
        {"kind": "fold_norm_weight", "weight": "w_gu", "gamma": "gamma", "out": "w_gu_g"},
    ],
    steps=[
        {"kind": "rstd", "src": "x", "eps": 1e-5, "out": "r"},
        gemm(
            "x",
            "w_gu_g.T",
            op("scale_rows", src="acc", vector="r", out="gu"),
            op("swiglu", src="gu", out="a"),
            op("store", src="a", to="a"),
            name="gate_up",
        ),
        gemm(
            "a",
            "w_down.T",
            op("add_tile", src="acc", tensor="x", out="o"),
            op("store", src="o", to="out"),
            name="down",
        ),
    ],
)
PROJ_NORM_PROJ = program(
    "proj_norm_proj",
    prep=[{"kind": "fold_norm_weight", "weight": "w2", "gamma": "gamma", "out": "w2g"}],
    steps=[
        gemm(
            "x",
            "w1.T",
            op("store", src="acc", to="y"),
            op("partial_reduce", src="acc", kind="sumsq", axis="row", to="y_sumsq"),
            name="proj1",
        ),
        {"kind": "rstd", "src": "y_sumsq", "eps": 1e-6, "out": "r"},
        gemm(
            "y",
            "w2g.T",
            op("scale_rows", src="acc", vector="r", out="o"),
            op("store", src="o", to="out"),
            name="proj2",
        ),
    ],
)
TWO_BRANCH = program(
    "two_branch",
    steps=[
        gemm("x", "w1.T", op("store", src="acc", to="out"), name="branch1"),
        gemm("x", "w2.T", op("store", src="acc", to="out", mode="accumulate"), name="branch2"),
    ],
)
WEAK_BIAS = program(
    "weak_bias",
    steps=[
        gemm(
            "x",
            "w.T",
            op("add_tile", src="acc", tensor="x", out="s"),
            op("map", expr="s * 0", out="zero"),
            op("add_col_vector", src="zero", vector="b", out="bias"),
            op("map", expr="s + 0.001 * bias", out="o"),
            op("store", src="o", to="out"),
        )
    ],
)
HONEST = {"llama_mlp": LLAMA, "proj_norm_proj": PROJ_NORM_PROJ, "two_branch": TWO_BRANCH}
HONEST["weak_bias"] = WEAK_BIAS
