"""The adversarial corpus: programs that try to pass without computing the block.

Each case is one cheat, written as a small edit of an honest program (which verifies: see the
controls), and is rejected at the stage that must catch it, for the reason that names it. Cheats
the IR can express are caught by validate or semantics before anything runs; the ones it cannot
express use rogue primitives (``rogue.py``: right semantics, wrong Triton), loaded as a plugin, and
are caught by verify — by the NaN-poisoned outputs, the output checks, the input-unchanged check
or the input screen — or, for a wild store, by the worker's isolation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from coda.primitives import plugin_scope
from coda.sandbox import Report, SandboxOptions, evaluate
from tests.adversarial.programs import (
    BLOCK_FILE,
    BLOCKS,
    HONEST,
    LLAMA,
    PROJ_NORM_PROJ,
    ROGUE,
    TWO_BRANCH,
    WEAK_BIAS,
    Json,
    gemm,
    op,
    program,
)

# The Inf cheat divides by zero inside the interpreter (numpy says so): expected, not noise.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


@pytest.fixture(autouse=True)
def _scoped_plugins():
    """The rogue primitives this module loads never outlive it (other tests check the registry)."""
    with plugin_scope():
        yield


def edit(base: Json, change: Callable[[Json], None]) -> Json:
    data = copy.deepcopy(base)
    change(data)
    return data


def step(data: Json, name: str) -> Json:
    return next(s for s in data["steps"] if s.get("name") == name)


def replace_op(name: str, index: int, new: Json) -> Callable[[Json], None]:
    return lambda d: step(d, name)["epilogue"].__setitem__(index, new)


def insert_op(name: str, index: int, new: Json, *, then_store: str) -> Callable[[Json], None]:
    """Insert ``new`` before ``index`` and make the step's final store write ``then_store``."""

    def change(data: Json) -> None:
        epilogue = step(data, name)["epilogue"]
        epilogue.insert(index, new)
        epilogue[-1]["src"] = then_store

    return change


def rename_op(name: str, index: int, new_op: str, **extra: Any) -> Callable[[Json], None]:
    return lambda d: step(d, name)["epilogue"][index].update(op=new_op, **extra)


# -- the corpus ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cheat:
    base: Json
    change: Callable[[Json], None]
    stage: str
    cause: str
    fragments: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)
    ragged_only: bool = False  # the cheat shows only where shapes are not tile multiples


CHEATS: dict[str, Cheat] = {
    # ---- expressible in the IR: rejected before any kernel exists ----
    "skipped residual": Cheat(
        LLAMA,
        replace_op("down", 0, op("map", expr="acc", out="o")),
        "semantics",
        "program",
        ("output 'out' does not match the block's reference in float64",),
    ),
    "skipped scale (rmsnorm's r)": Cheat(
        LLAMA,
        replace_op("gate_up", 0, op("map", expr="acc", out="gu")),
        "semantics",
        "program",
        ("does not match the block's reference", "check each step against the reference"),
    ),
    "wrong pair order (up, gate)": Cheat(
        LLAMA,
        lambda d: d["prep"][0].update(first="w_up", second="w_gate"),
        "semantics",
        "program",
        ("does not match the block's reference", "pair order"),
    ),
    "all-zero output": Cheat(
        LLAMA,
        replace_op("down", 0, op("map", expr="acc * 0", out="o")),
        "semantics",
        "program",
        ("relative error 1",),
    ),
    "constant output": Cheat(
        LLAMA,
        replace_op("down", 0, op("map", expr="acc * 0 + 1", out="o")),
        "semantics",
        "program",
        ("does not match the block's reference",),
    ),
    "Inf/NaN output": Cheat(
        LLAMA,
        insert_op("down", 1, op("map", expr="o / 0", out="o_inf"), then_store="o_inf"),
        "semantics",
        "program",
        ("NaN/Inf values in float64", "divides by zero"),
    ),
    "output is an input": Cheat(
        LLAMA,
        lambda d: d["outputs"].update(out="x"),
        "validate",
        "program",
        ("output 'out' is the block input 'x' itself",),
    ),
    "reference smuggled in as an input": Cheat(
        LLAMA,
        lambda d: d["inputs"].update(expected={"shape": ["M", "d"], "dtype": "act"}),
        "validate",
        "program",
        ("['expected'] are not inputs of block 'llama_mlp'",),
    ),
    "output never written": Cheat(
        LLAMA,
        lambda d: d["outputs"].update(out="out_unwritten"),
        "validate",
        "program",
        ("names 'out_unwritten', which no step writes",),
    ),
    "write into an input": Cheat(
        LLAMA,
        replace_op("down", 1, op("store", src="o", to="x")),
        "validate",
        "program",
        ("tensor 'x' is a block input",),
    ),
    "accumulate into an input": Cheat(
        LLAMA,
        replace_op("down", 1, op("store", src="o", to="x", mode="accumulate")),
        "validate",
        "program",
        ("cannot accumulate into block input 'x'",),
    ),
    "branch accumulated twice": Cheat(
        TWO_BRANCH,
        lambda d: d["steps"].append(
            gemm("x", "w2.T", op("store", src="acc", to="out", mode="accumulate"), name="again")
        ),
        "semantics",
        "program",
        ("does not match the block's reference",),
    ),
    # ---- not expressible in the IR: rogue primitives, caught by verify ----
    "edge tiles left unwritten": Cheat(
        LLAMA,
        rename_op("down", 1, "store_skip_edges"),
        "verify",
        "mismatch",
        ("NaN", "never written", "ragged edge"),
        ragged_only=True,
    ),
    "all-zero kernel output": Cheat(
        LLAMA,
        rename_op("down", 1, "store_zeros"),
        "verify",
        "mismatch",
        ("the output is constant (0) but the reference varies",),
    ),
    "Inf/NaN kernel output": Cheat(
        LLAMA,
        rename_op("down", 1, "store_divided_by_zero"),
        "verify",
        "mismatch",
        ("NaN and", "Inf values"),
    ),
    "input mutated in place": Cheat(
        LLAMA,
        rename_op("down", 1, "store_and_scribble", victim="x"),
        "verify",
        "input_modified",
        ("the program modified its input 'x'", "inputs are read-only"),
    ),
    "reads past the edge on ragged shapes": Cheat(
        PROJ_NORM_PROJ,
        rename_op("proj1", 1, "partial_reduce_unmasked"),
        "verify",
        "mismatch",
        ("elements exceed the allowed error",),
        ragged_only=True,
    ),
    "accumulation that overwrites": Cheat(
        TWO_BRANCH,
        rename_op("branch2", 0, "store_overwrite"),
        "verify",
        "mismatch",
        ("elements exceed the allowed error",),
    ),
    "pairs swapped in the kernel": Cheat(
        LLAMA,
        rename_op("gate_up", 1, "swiglu_swapped"),
        "verify",
        "mismatch",
        ("elements exceed the allowed error",),
    ),
    "scale skipped in the kernel": Cheat(
        LLAMA,
        rename_op("gate_up", 0, "scale_rows_ignored"),
        "verify",
        "mismatch",
        ("elements exceed the allowed error",),
    ),
    "residual skipped in the kernel": Cheat(
        LLAMA,
        rename_op("down", 0, "add_tile_ignored"),
        "verify",
        "mismatch",
        ("elements exceed the allowed error",),
    ),
    "weak input ignored under a loose dtype": Cheat(
        WEAK_BIAS,
        lambda d: d["steps"][0]["epilogue"][2].update(op="add_col_vector_ignored"),
        "verify",
        "screen",
        (
            "output 'out' does not follow input 'b'",
            "the program's output by 0",
            "check the ops that read 'b'",
        ),
        options={"dtypes": ["float16"]},  # like bf16 on a GPU: the error hides in the tolerance
    ),
    "emitter raises": Cheat(
        LLAMA,
        rename_op("down", 0, "add_tile_raises"),
        "compile",
        "exception",
        ("KeyError while running the compile stage", "a bug in this emitter"),
    ),
    "emitter writes invalid Python": Cheat(
        LLAMA,
        rename_op("down", 0, "add_tile_bad_syntax"),
        "compile",
        "exception",
        ("SyntaxError while running the compile stage",),
    ),
}


def run(data: Json, block: str, isolate: bool = False, **options: Any) -> Report:
    """The sandbox with the rogue plugin, at a tile multiple and the smallest ragged shape, one
    seed and (unless a case says otherwise) float32: the cheats fail there exactly as with the
    defaults, which verify at more shapes, both CPU dtypes and two seeds."""
    shapes = [BLOCKS[block].shapes.cpu[0], BLOCKS[block].shapes.cpu[-1]]
    options = {"seeds": [0], "dtypes": ["float32"], "shapes": shapes, **options}
    opts = SandboxOptions(isolate=isolate, plugins=[ROGUE], **options)
    return evaluate(data, BLOCKS[block], opts, block_file=BLOCK_FILE)


@pytest.mark.parametrize("block", sorted(HONEST))
def test_the_honest_programs_verify(block: str) -> None:
    report = run(HONEST[block], block)
    assert report.verified, report.render_text()
    assert "every output follows each of" in report.stage("verify").message


@pytest.mark.parametrize("name", list(CHEATS))
def test_every_cheat_is_rejected_at_its_stage_for_its_reason(name: str) -> None:
    cheat = CHEATS[name]
    data = edit(cheat.base, cheat.change)
    report = run(data, data["block"], **cheat.options)
    assert not report.verified
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == (cheat.stage, cheat.cause), report.render_text()
    for fragment in cheat.fragments:
        assert fragment in failed.message, failed.message
    if cheat.ragged_only:
        bad = {tuple(c.sizes.values()) for c in report.checks if not c.passed}
        assert bad and (64, 64) not in {s[:2] for s in bad}, bad


def test_the_screen_catches_what_the_output_checks_let_through() -> None:
    cheat = CHEATS["weak input ignored under a loose dtype"]
    report = run(edit(cheat.base, cheat.change), "weak_bias", **cheat.options)
    assert report.checks and all(c.passed for c in report.checks)  # float16 checks all pass
    assert report.failed_stage.cause == "screen"


def test_rogue_primitives_load_in_the_worker() -> None:
    """The same cheat, isolated: the worker loads the plugin and parses its ops."""
    data = edit(LLAMA, rename_op("down", 1, "store_skip_edges"))
    report = run(data, "llama_mlp", isolate=True)
    assert (report.failed_stage.stage, report.failed_stage.cause) == ("verify", "mismatch")
    assert "never written" in report.failed_stage.message


def test_a_wild_store_crashes_only_its_worker() -> None:
    data = edit(LLAMA, rename_op("down", 1, "store_far_away"))
    report = run(data, "llama_mlp", isolate=True)
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("verify", "crash"), report.render_text()
    assert "the worker died during verify: killed by SIG" in failed.message


@pytest.mark.parametrize(
    "block,fragment",
    [
        ("deaf", "redrawing input 's' leaves every output unchanged"),
        ("faint_bias", "redrawing input 'b' moves the outputs by only 1"),
        ("in_place", "its reference modifies its input 'x' in place (4096 elements changed"),
        ("noisy", "its reference gives different outputs on the same inputs"),
    ],
)
def test_a_degenerate_block_is_named_as_the_fault(block: str, fragment: str) -> None:
    steps = [gemm("x", "w.T", op("store", src="acc", to="out"))]
    if block == "faint_bias":
        steps = copy.deepcopy(WEAK_BIAS["steps"])
        steps[0]["epilogue"][3]["expr"] = "s + 0.000001 * bias"
    report = run(program(block, steps), block)
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("semantics", "block"), report.render_text()
    assert fragment in failed.message
    assert "This is a fault of the block, not of the program" in failed.message
