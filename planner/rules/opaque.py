"""Opaque ops (nodes of a block captured from PyTorch that no block op computes) are never lowered:
this rule lowers nothing and only says why, so ``NoRule`` names the captured aten op and the
reason it is opaque rather than a general one."""

from __future__ import annotations

from coda.blocks.ops import Opaque

from ..registry import Rule
from ..state import PlanState


class OpaqueRule(Rule):
    op = Opaque

    def unlowered(self, st: PlanState, op: Opaque) -> str:
        return (
            f"it is opaque: the captured {op.target} ({op.reason}). The built-in planner lowers "
            "block ops only: rewrite that part of the function with ops Block.from_torch "
            "recognises, or have a model provider write the Program"
        )
