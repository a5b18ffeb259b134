"""``Add``: a residual joins the epilogue of the GEMM that produces one of its operands.

With one operand in registers it is ``add_tile`` of the other (a stored tensor); with both in
registers, or both existing tensors of this GEMM's tile shape, a ``map``. An ``Add`` no GEMM
produces an operand of has no lowering (there is no standalone elementwise pass).
"""

from __future__ import annotations

from coda.blocks.ops import Add

from ..epilogue import Epilogue
from ..registry import Rule, inputs_not_joined
from ..state import PlanState


class AddRule(Rule):
    op = Add

    def fuse(self, ep: Epilogue, op: Add) -> None:
        a_reg, b_reg = op.a in ep.regs, op.b in ep.regs
        if a_reg != b_reg:
            src, other = (op.a, op.b) if a_reg else (op.b, op.a)
            ep.define(op.out, {"op": "add_tile", "src": ep.regs[src], "tensor": other})
            return
        ep.define(op.out, {"op": "map", "expr": f"{ep.tile(op.a)} + {ep.tile(op.b)}"})

    def unlowered(self, st: PlanState, op: Add) -> str:
        return inputs_not_joined(st, op)
