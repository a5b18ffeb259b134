"""``GLU``: ``act(gate) ⊙ up`` for any activation (GeGLU with ``gelu_tanh``).

* **pairwise interleave** (``swiglu.gate_up_pair``, used by the Linear rule): gate and up
  projections of one input become one GEMM over ``interleave_rows(gate, up)`` with ``pairwise``
  (``act(x0) * x1``, biases added to ``x0``/``x1``) in its epilogue, like SwiGLU.
* **two GEMMs**: gate and up of different inputs (or biased ones that are also block outputs):
  the gate's GEMM stores it and the up GEMM's epilogue reads it back (``load_tile``) and takes
  the product in a ``map``.
* **backward** of a GLU MLP (GeGLU: Gemma): SwiGLU's schedule (``swiglu.mlp_backward``) with
  ``dg = da · u · act'(g)`` and ``du = da · act(g)`` (``activation.ACTIVATION_GRAD_EXPR``).
"""

from __future__ import annotations

from coda.blocks.ops import GLU

from ..backward import BackwardBuilder
from ..epilogue import Epilogue
from ..registry import Rule, inputs_not_joined
from ..state import PlanState
from .activation import glu_expr
from .swiglu import mlp_backward


class GLURule(Rule):
    op = GLU
    backward_of = "an RMSNorm followed by a GLU MLP (any activation) with residual"
    differentiates_biases = True  # biased gate/up/down projections

    def fuse(self, ep: Epilogue, op: GLU) -> None:
        expr = glu_expr(op.act, ep.tile(op.gate), ep.tile(op.up))
        ep.define(op.out, {"op": "map", "expr": expr})

    def unlowered(self, st: PlanState, op: GLU) -> str:
        return inputs_not_joined(st, op)

    def differentiate(self, b: BackwardBuilder) -> None:
        mlp_backward(b)
