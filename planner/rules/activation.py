"""``Activation``: an elementwise activation of a GEMM result becomes a ``map`` in the epilogue of
the GEMM that produces its input (an activation no GEMM produces has no lowering).

``ACTIVATION_EXPR`` writes each kind in the epilogue expression language (``primitives/expr.py``),
with ``{x}`` for the operand; ``GLU`` reuses them on the gate (``planner/rules/glu.py``).
"""

from __future__ import annotations

from coda.blocks.ops import Activation

from ..epilogue import Epilogue
from ..registry import Rule, inputs_not_joined
from ..state import PlanState

ACTIVATION_EXPR = {
    "gelu": "0.5 * {x} * (1 + erf({x} * 0.7071067811865476))",  # exact: x·Φ(x)
    # Hugging Face's gelu_pytorch_tanh: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    "gelu_tanh": "0.5 * {x} * (1 + tanh(0.7978845608028654 * ({x} + 0.044715 * {x} ** 3)))",
    "quick_gelu": "{x} * sigmoid(1.702 * {x})",
    "relu2": "max({x}, 0) ** 2",
    "relu": "max({x}, 0)",
    "silu": "silu({x})",
    "sigmoid": "sigmoid({x})",
    "tanh": "tanh({x})",
    "softcap": "{cap} * tanh({x} / {cap})",
}


def activation_expr(kind: str, x: str, cap: float | None = None) -> str:
    """Activation ``kind`` of epilogue value ``x`` as a ``map`` expression."""
    return ACTIVATION_EXPR[kind].format(x=x, cap=repr(cap))


class ActivationRule(Rule):
    op = Activation

    def fuse(self, ep: Epilogue, op: Activation) -> None:
        expr = activation_expr(op.kind, ep.tile(op.x), op.cap)
        ep.define(op.out, {"op": "map", "expr": expr})

    def unlowered(self, st: PlanState, op: Activation) -> str:
        return inputs_not_joined(st, op)
