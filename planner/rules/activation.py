"""``Activation``: an elementwise activation of a GEMM result becomes a ``map`` in the epilogue of
the GEMM that produces its input (an activation no GEMM produces has no lowering).

``ACTIVATION_EXPR`` writes each kind in the epilogue expression language (``primitives/expr.py``),
with ``{x}`` for the operand; ``GLU`` reuses them on the gate (``planner/rules/glu.py``).
``ACTIVATION_GRAD_EXPR`` writes each kind's derivative, for the backward rules (a GLU MLP's).
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


# d act / dx of each kind (backward rules: GLU's gate gradient, the softcap before a loss)
_GELU_TANH_INNER = "tanh(0.7978845608028654 * ({x} + 0.044715 * {x} ** 3))"
ACTIVATION_GRAD_EXPR = {
    # Φ(x) + x·φ(x)
    "gelu": (
        "0.5 * (1 + erf({x} * 0.7071067811865476))"
        " + {x} * 0.3989422804014327 * exp(-0.5 * {x} ** 2)"
    ),
    # t = tanh(k(x + 0.044715x³)): 0.5(1 + t) + 0.5·x·(1 − t²)·k·(1 + 3·0.044715x²)
    "gelu_tanh": (
        f"0.5 * (1 + {_GELU_TANH_INNER}) + 0.5 * {{x}} * (1 - {_GELU_TANH_INNER} ** 2)"
        " * 0.7978845608028654 * (1 + 0.134145 * {x} ** 2)"
    ),
    "quick_gelu": "sigmoid(1.702 * {x}) * (1 + 1.702 * {x} * (1 - sigmoid(1.702 * {x})))",
    "relu2": "2 * max({x}, 0)",
    "relu": "where({x} > 0, 1, 0)",
    "silu": "sigmoid({x}) * (1 + {x} * (1 - sigmoid({x})))",
    "sigmoid": "sigmoid({x}) * (1 - sigmoid({x}))",
    "tanh": "1 - tanh({x}) ** 2",
    "softcap": "1 - tanh({x} / {cap}) ** 2",
}


def activation_expr(kind: str, x: str, cap: float | None = None) -> str:
    """Activation ``kind`` of epilogue value ``x`` as a ``map`` expression."""
    return ACTIVATION_EXPR[kind].format(x=x, cap=repr(cap))


def glu_expr(act: str, gate: str, up: str) -> str:
    """``act(gate) * up`` as an expression (``gate``/``up``: epilogue values or subexpressions)."""
    return f"({activation_expr(act, gate)}) * {up}"


def activation_grad_expr(kind: str, x: str, cap: float | None = None) -> str:
    """The derivative of activation ``kind`` at epilogue value ``x`` as a ``map`` expression."""
    return ACTIVATION_GRAD_EXPR[kind].format(x=x, cap=repr(cap))


class ActivationRule(Rule):
    op = Activation

    def fuse(self, ep: Epilogue, op: Activation) -> None:
        expr = activation_expr(op.kind, ep.tile(op.x), op.cap)
        ep.define(op.out, {"op": "map", "expr": expr})

    def unlowered(self, st: PlanState, op: Activation) -> str:
        return inputs_not_joined(st, op)
