"""``Add``: a residual joins the epilogue of the GEMM that produces one of its operands.

With one operand in registers it is ``add_tile`` of the other (a stored tensor), or
``add_col_vector`` when the other is a ``[d]`` vector broadcast over the rows; with both in
registers, or both existing tensors of this GEMM's tile shape, a ``map``. An ``Add`` no GEMM
produces an operand of has no lowering (there is no standalone elementwise pass).

Backward: a forward block ending in the residual ``Add`` of one Linear (an attention output,
optionally through a post-norm) is differentiated by ``linear_backward.residual_linear_backward``.
"""

from __future__ import annotations

from coda.blocks.ops import Add

from ..backward import BackwardBuilder
from ..epilogue import Epilogue
from ..registry import Rule, inputs_not_joined
from ..shapes import binding_shapes
from ..state import PlanState


def is_vector(st: PlanState, value: str) -> bool:
    """``value`` is one-dimensional at every shape set (a bias-like ``[d]`` vector)."""
    return all(len(shapes[value]) == 1 for _, shapes in binding_shapes(st))


class AddRule(Rule):
    op = Add
    backward_of = "a Linear added to the residual, optionally through a post-norm"

    def differentiate(self, b: BackwardBuilder) -> None:
        from .linear_backward import residual_linear_backward

        residual_linear_backward(b)

    def fuse(self, ep: Epilogue, op: Add) -> None:
        a_reg, b_reg = op.a in ep.regs, op.b in ep.regs
        if a_reg != b_reg:
            src, other = (op.a, op.b) if a_reg else (op.b, op.a)
            if is_vector(ep.st, other):  # a [d] vector broadcast over the rows: a bias
                node = {"op": "add_col_vector", "src": ep.regs[src], "vector": other}
            else:
                node = {"op": "add_tile", "src": ep.regs[src], "tensor": other}
            ep.define(op.out, node)
            return
        ep.define(op.out, {"op": "map", "expr": f"{ep.tile(op.a)} + {ep.tile(op.b)}"})

    def unlowered(self, st: PlanState, op: Add) -> str:
        return inputs_not_joined(st, op)
