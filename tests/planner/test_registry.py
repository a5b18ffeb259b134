"""The rule registry: rules are registered by subclassing, one per op type; an op without a rule
is named by ``NoRule``; and a new op is taught to the planner by one rule class, nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Literal

import pytest
import torch

from coda.blocks import Block, Linear, ShapeSets, TensorSpec
from coda.blocks.ops import Add, GraphOp, RMSNorm
from coda.planner import NoRule, Rule, lower, rule_for
from coda.planner.epilogue import Epilogue
from coda.sandbox import SandboxOptions, evaluate


def cube(x: torch.Tensor) -> torch.Tensor:
    """``x³`` elementwise."""
    return x * x * x


class Cube(GraphOp):
    """``out = x³``: an op the built-in rules do not know."""

    op: Literal["test_cube"] = "test_cube"
    helper: ClassVar = staticmethod(cube)
    x: str

    def inputs(self) -> list[str]:
        return [self.x]


CUBED = Block(
    name="gemm_cube",
    description="(x @ w.T)³",
    inputs={
        "x": TensorSpec(shape=["M", "K"]),
        "w": TensorSpec(shape=["N", "K"], init="linear_weight"),
    },
    graph=[Linear(x="x", weight="w", out="y"), Cube(x="y", out="out")],
    outputs=["out"],
    shapes=ShapeSets(cpu=[{"M": 9, "K": 16, "N": 24}]),
)


@pytest.fixture
def registered() -> Iterator[None]:
    """Register ``Cube``'s rule for one test, and take it out again."""

    class CubeRule(Rule):
        op = Cube

        def fuse(self, ep: Epilogue, op: Cube) -> None:
            t = ep.tile(op.x)
            ep.define(op.out, {"op": "map", "expr": f"{t} * {t} * {t}"})

    yield
    del Rule.registry[Cube]


def test_every_rule_module_registers_its_ops() -> None:
    for op in (Linear, RMSNorm, Add):
        rule = rule_for(op)
        assert rule is not None and rule.op is op
    assert rule_for(Cube) is None


def test_an_op_without_a_rule_is_named() -> None:
    with pytest.raises(NoRule, match=r"graph\[1\] test_cube\(out='out'\): no lowering rule"):
        lower(CUBED)


def test_one_rule_class_teaches_the_planner_a_new_op(registered: None) -> None:
    program = lower(CUBED)
    (gemm,) = program.steps
    assert [op.op for op in gemm.epilogue] == ["map", "store"]
    report = evaluate(program, CUBED, SandboxOptions(isolate=False, seeds=[0]))
    assert report.verified, report.render_text()


def test_a_second_rule_for_an_op_is_refused() -> None:
    with pytest.raises(TypeError, match="op Add already has rule AddRule"):

        class OtherAdd(Rule):
            op = Add

    assert type(rule_for(Add)).__name__ == "AddRule"


def test_a_rule_must_name_its_op() -> None:
    with pytest.raises(TypeError, match="rule Nameless sets no `op`"):

        class Nameless(Rule):
            pass
