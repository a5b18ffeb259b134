"""A block the built-in planner can lower only part of, as a block file (``--block-file``) and
a module the tests import: ``Mystery`` is a graph op type with no planner rule (as a captured
block's opaque call would be)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from coda.blocks import Add, Block, Linear, RMSNorm, ShapeSets, TensorSpec
from coda.blocks.ops import GraphOp


def mystery(x: torch.Tensor) -> torch.Tensor:
    """``x · |x|``: an op no planner rule knows."""
    return x * x.abs()


class Mystery(GraphOp):
    """``out = x · |x|``: a graph op type without a planner rule (as a captured block's opaque
    call would be)."""

    op: Literal["test_mystery"] = "test_mystery"
    helper: ClassVar = staticmethod(mystery)
    x: str

    def inputs(self) -> list[str]:
        return [self.x]


def spec(*shape: str, init: str = "activation") -> TensorSpec:
    return TensorSpec(shape=list(shape), init=init)


# y = x Wᵀ; m = mystery(y) (no rule); z = m W2ᵀ (reads the lost m); n = rmsnorm(x) as a block
# output (a norm is lowered only into the GEMMs that read it); out = rmsnorm(x + y) W2ᵀ (lowers)
MIXED = Block(
    name="mixed",
    description="a block of which the planner can lower only part",
    inputs={
        "x": spec("M", "d"),
        "w": spec("d", "d", init="linear_weight"),
        "w2": spec("d", "d", init="linear_weight"),
        "g": spec("d", init="norm_weight"),
    },
    graph=[
        Linear(x="x", weight="w", out="y"),
        Mystery(x="y", out="m"),
        Linear(x="m", weight="w2", out="z"),
        RMSNorm(x="x", weight="g", out="n"),
        Add(a="x", b="y", out="r"),
        RMSNorm(x="r", weight="g", out="h"),
        Linear(x="h", weight="w2", out="out"),
    ],
    outputs=["z", "n", "out"],
    shapes=ShapeSets(cpu=[{"M": 5, "d": 8}, {"M": 7, "d": 12}]),
)
