"""Blocks for the adversarial corpus, as a block file (the sandbox worker imports it by path).

* ``proj_norm_proj`` — ``out = rmsnorm(x @ w1ᵀ)·γ @ w2ᵀ``: the norm's statistics come from the
  first GEMM's epilogue (partial sums of squares), so a reduction that reads past the tile's edge
  is wrong exactly at ragged shapes.
* ``two_branch`` — ``out = x @ w1ᵀ + x @ w2ᵀ``: naturally two GEMMs, the second accumulating.
* ``weak_bias`` — ``out = x + x @ wᵀ + 0.001·b``: ``b`` matters (its effect, ~1e-3 of the output,
  is 10× above the screen's floor) but hides under float16's tolerance.
* ``faint_bias`` — the same with ``1e-6·b``: too faint for any check to see (a degenerate block).
* ``deaf`` — ``out = x @ wᵀ`` whose graph reads ``s`` and ignores it (a degenerate block).
* ``in_place`` — ``out = x' + x' @ wᵀ`` with ``x' = x + 1`` written into ``x`` by the reference
  (a block whose reference changes its input).
* ``noisy`` — ``out = x + x @ wᵀ + 0.001·noise``, the noise drawn anew on every call (a block
  whose reference is not a function of its inputs).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from coda.blocks import Add, Block, Linear, RMSNorm, ShapeSets, TensorSpec
from coda.blocks.ops import GraphOp

RAGGED = [{"M": 64, "d": 64}, {"M": 37, "d": 45}, {"M": 5, "d": 24}]  # tile multiples first


def add_scaled(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``a + alpha * b`` (a bias scaled down)."""
    return a + alpha * b


def ignore_second(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Returns ``a``; reads ``b`` only to multiply it by zero."""
    return a + 0.0 * b


class AddScaled(GraphOp):
    op: Literal["add_scaled"] = "add_scaled"
    helper: ClassVar = staticmethod(add_scaled)
    a: str
    b: str
    alpha: float

    def inputs(self) -> list[str]:
        return [self.a, self.b]

    def kwargs(self) -> dict[str, Any]:
        return {"alpha": self.alpha}


class IgnoreSecond(GraphOp):
    op: Literal["ignore_second"] = "ignore_second"
    helper: ClassVar = staticmethod(ignore_second)
    a: str
    b: str

    def inputs(self) -> list[str]:
        return [self.a, self.b]


def _act(*shape: str) -> TensorSpec:
    return TensorSpec(shape=list(shape))


def _weight(*shape: str) -> TensorSpec:
    return TensorSpec(shape=list(shape), init="linear_weight")


proj_norm_proj = Block(
    name="proj_norm_proj",
    description="out = rmsnorm(x @ w1.T) * gamma @ w2.T",
    inputs={
        "x": _act("M", "d"),
        "w1": _weight("d", "d"),
        "gamma": TensorSpec(shape=["d"], init="norm_weight"),
        "w2": _weight("d", "d"),
    },
    graph=[
        Linear(x="x", weight="w1", out="y"),
        RMSNorm(x="y", weight="gamma", eps=1e-6, out="h"),
        Linear(x="h", weight="w2", out="out"),
    ],
    outputs=["out"],
    shapes=ShapeSets(cpu=RAGGED),
)

two_branch = Block(
    name="two_branch",
    description="out = x @ w1.T + x @ w2.T",
    inputs={"x": _act("M", "d"), "w1": _weight("d", "d"), "w2": _weight("d", "d")},
    graph=[
        Linear(x="x", weight="w1", out="y1"),
        Linear(x="x", weight="w2", out="y2"),
        Add(a="y1", b="y2", out="out"),
    ],
    outputs=["out"],
    shapes=ShapeSets(cpu=RAGGED),
)


def _biased(name: str, alpha: float) -> Block:
    return Block(
        name=name,
        description=f"out = x + x @ w.T + {alpha:g} * b",
        inputs={"x": _act("M", "d"), "w": _weight("d", "d"), "b": _act("d")},
        graph=[
            Linear(x="x", weight="w", out="y"),
            Add(a="x", b="y", out="z"),
            AddScaled(a="z", b="b", alpha=alpha, out="out"),
        ],
        outputs=["out"],
        shapes=ShapeSets(cpu=RAGGED),
    )


weak_bias = _biased("weak_bias", 1e-3)
faint_bias = _biased("faint_bias", 1e-6)

deaf = Block(
    name="deaf",
    description="out = x @ w.T (s is read and ignored)",
    inputs={"x": _act("M", "d"), "w": _weight("d", "d"), "s": _act("d")},
    graph=[Linear(x="x", weight="w", out="y"), IgnoreSecond(a="y", b="s", out="out")],
    outputs=["out"],
    shapes=ShapeSets(cpu=RAGGED),
)


def _add_one_in_place(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x.add_(1.0)
    return x + F.linear(x, w)


def _with_noise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x + F.linear(x, w) + 1e-3 * torch.randn_like(x)


in_place, noisy = (
    Block.from_torch(
        fn,
        name=name,
        inputs={"x": _act("M", "d"), "w": _weight("d", "d")},
        shapes=ShapeSets(cpu=RAGGED),
    )  # fmt: skip
    for fn, name in ((_add_one_in_place, "in_place"), (_with_noise, "noisy"))
)
