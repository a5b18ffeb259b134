"""Refusals that name every op: the planner lowers past an op it cannot lower, lists every op left
(each with its index, type, output and reason; an op that only reads a lost value says which op
could not produce it), and hands back the partial Program of what it did lower, which the sandbox
checks against the block with the values that Program computes as its outputs."""

from __future__ import annotations

import pytest

from coda.blocks import Block, Linear, RMSNorm, ShapeSets
from coda.blocks.ops import Concat, RoPEPairs
from coda.planner import NoRule, NoRules, lower, lower_partial
from coda.sandbox import SandboxOptions, evaluate

from .mystery_block import MIXED
from .mystery_block import spec as _spec

FAST = SandboxOptions(isolate=False, seeds=[0])


def test_every_op_left_is_listed_with_its_reason() -> None:
    with pytest.raises(NoRules) as err:
        lower(MIXED)
    e = err.value
    assert [(u.index, u.op.op, u.op.out, u.after) for u in e.unlowered] == [
        (1, "test_mystery", "m", None),
        (2, "linear", "z", 1),
        (3, "rmsnorm", "n", None),
    ]
    lines = str(e).splitlines()
    assert lines[0] == "3 graph ops are not lowered:"
    assert lines[1].startswith(
        "  graph[1] test_mystery(out='m'): no lowering rule — no rule for op 'test_mystery'"
    )
    assert lines[2] == (
        "  graph[2] linear(out='z'): not judged — it reads 'm', which graph[1] could not produce"
    )
    assert lines[3] == (
        "  graph[3] rmsnorm(out='n'): no lowering rule — its output 'n' feeds a block output; an "
        "RMSNorm is lowered only into the GEMMs that consume it (row-scale commutation)"
    )
    # existing callers read NoRule's fields: the first op a rule could not lower
    assert isinstance(e, NoRule) and (e.index, e.op.out) == (1, "m")
    data = e.to_json()
    assert [u["index"] for u in data["unlowered"]] == [1, 2, 3]
    assert data["unlowered"][1]["after"] == 1 and "after" not in data["unlowered"][0]
    assert data["partial_program"]["computes"] == ["out", "y"]


def test_the_partial_program_verifies_against_the_values_it_computes() -> None:
    result = lower_partial(MIXED)
    assert result.program is None and result.partial is not None
    partial = result.partial
    # the block output it reaches, then the value the unlowered mystery op reads
    assert partial.computes == ["out", "y"] and partial.block.outputs == ["out", "y"]
    # the header stays the block's: the rest of the block is written on top of this Program
    assert partial.program.block == MIXED.name
    data = partial.program.model_dump(mode="json")
    assert data["inputs"] == MIXED.program_inputs()
    # every input moves `out` or `y` here, so the whole sandbox passes, input screens included
    report = evaluate(partial.program, partial.block, FAST)
    assert report.verified, report.render_text()


def test_one_op_left_keeps_the_single_line_message() -> None:
    block = MIXED.model_copy(update={"graph": MIXED.graph[:2], "outputs": ["m"]})
    with pytest.raises(NoRules) as err:
        lower(block)
    assert str(err.value) == (
        "graph[1] test_mystery(out='m'): no lowering rule — no rule for op 'test_mystery': the "
        "planner has no rewrite rule for this op type (write the Program with an LLM provider, or "
        "teach the planner with a Rule in planner/rules/)"
    )
    assert err.value.partial is not None and err.value.partial.computes == ["y"]


def test_an_op_that_fails_halfway_leaves_nothing_behind() -> None:
    """The Linear of the norm adds the norm's rstd step before it finds that nothing reads its
    output; undoing it keeps the partial Program free of a step nothing uses."""
    block = Block(
        name="dead_branch",
        description="",
        inputs={
            "x": _spec("M", "d"),
            "g": _spec("d", init="norm_weight"),
            "w": _spec("d", "d", init="linear_weight"),
        },
        graph=[
            RMSNorm(x="x", weight="g", out="h"),
            Linear(x="h", weight="w", out="unused"),
            Linear(x="x", weight="w", out="out"),
        ],
        outputs=["out"],
        shapes=ShapeSets(cpu=[{"M": 5, "d": 8}]),
    )
    result = lower_partial(block)
    (left,) = result.unlowered
    assert left.index == 1 and "nothing uses 'unused'" in left.reason
    assert result.partial is not None
    assert [s.kind for s in result.partial.program.steps] == ["gemm"]
    assert result.partial.program.prep == []


def test_an_error_raised_for_another_op_lists_both() -> None:
    """A fused QKV group whose concat cannot be lowered: the concat is named with its reason, and
    each Linear of the group is lowered only together with it."""
    block = Block(
        name="biased_qkv",
        description="",
        inputs={
            "x": _spec("M", "d"),
            "wq": _spec("d", "d", init="linear_weight"),
            "wk": _spec("d", "d", init="linear_weight"),
            "bk": _spec("d"),
        },
        graph=[
            Linear(x="x", weight="wq", out="q"),
            Linear(x="x", weight="wk", bias="bk", out="k"),
            Concat(parts=["q", "k"], out="qk"),
        ],
        outputs=["qk"],
        shapes=ShapeSets(cpu=[{"M": 5, "d": 8}]),
    )
    with pytest.raises(NoRules) as err:
        lower(block)
    left = {u.index: u for u in err.value.unlowered}
    assert sorted(left) == [0, 1, 2]
    assert "its parts ['k'] are biased Linears" in left[2].reason and left[2].after is None
    assert left[0].after == left[1].after == 2
    assert "lowered only together with graph[2]" in left[0].reason
    assert err.value.partial is None  # nothing was lowered


def test_a_lost_value_is_followed_through_the_ops_that_read_it() -> None:
    """An RMSNorm of a lost value and the Linear of that norm are both not judged, each naming
    the op whose output it lacks."""
    block = Block(
        name="lost_norm",
        description="",
        inputs={
            "x": _spec("M", "d"),
            "g": _spec("d", init="norm_weight"),
            "w": _spec("d", "d", init="linear_weight"),
            "cos": _spec("M", "d"),
            "sin": _spec("M", "d"),
        },
        graph=[
            RoPEPairs(x="x", cos="cos", sin="sin", out="xr"),
            RMSNorm(x="xr", weight="g", out="h"),
            Linear(x="h", weight="w", out="out"),
        ],
        outputs=["out"],
        shapes=ShapeSets(cpu=[{"M": 5, "d": 8}]),
    )
    result = lower_partial(block)
    assert [(u.index, u.after) for u in result.unlowered] == [(0, None), (1, 0), (2, 1)]
    assert result.unlowered[2].reason == "it reads 'h', which graph[1] could not produce"
    assert result.partial is None


def test_a_block_the_rules_lower_whole_has_nothing_left() -> None:
    block = MIXED.model_copy(
        update={"graph": [MIXED.graph[0], *MIXED.graph[4:]], "outputs": ["out"]}
    )
    result = lower_partial(block)
    assert result.unlowered == () and result.partial is None
    assert result.program == lower(block)
