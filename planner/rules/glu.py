"""``GLU``: ``act(gate) ⊙ up`` for any activation (GeGLU with ``gelu_tanh``).

* **pairwise interleave** (``swiglu.gate_up_pair``, used by the Linear rule): gate and up
  projections of one input become one GEMM over ``interleave_rows(gate, up)`` with ``pairwise``
  (``act(x0) * x1``, biases added to ``x0``/``x1``) in its epilogue, like SwiGLU.
* **two GEMMs**: gate and up of different inputs (or biased ones that are also block outputs):
  the gate's GEMM stores it and the up GEMM's epilogue reads it back (``load_tile``) and takes
  the product in a ``map``.
"""

from __future__ import annotations

from coda.blocks.ops import GLU

from ..epilogue import Epilogue
from ..registry import Rule, inputs_not_joined
from ..state import PlanState
from .activation import activation_expr


def glu_expr(act: str, gate: str, up: str) -> str:
    """``act(gate) * up`` as an expression (``gate``/``up``: epilogue values or subexpressions)."""
    return f"({activation_expr(act, gate)}) * {up}"


class GLURule(Rule):
    op = GLU

    def fuse(self, ep: Epilogue, op: GLU) -> None:
        expr = glu_expr(op.act, ep.tile(op.gate), ep.tile(op.up))
        ep.define(op.out, {"op": "map", "expr": expr})

    def unlowered(self, st: PlanState, op: GLU) -> str:
        return inputs_not_joined(st, op)
