"""Recognisers of elementwise activations and gated units, table-driven.

``ACTIVATIONS`` maps an op's pattern to ``Activation`` kinds: ``gelu`` (erf, or ``tanh``
approximation), ``silu`` (also written ``x * sigmoid(x)``), ``relu``, ``relu2`` (``relu(x)²``),
``sigmoid``, ``tanh``, QuickGELU ``x * sigmoid(1.702 x)`` and the softcap ``tanh(x / c) * c``.
Last, ``_by_value`` reads any other spelling of a kind (GPT-2's ``gelu_new`` formula ``0.5 · x ·
(1 + tanh(√(2/π) · (x + 0.044715 x³)))``, a hand-written sigmoid): an elementwise chain of one
tensor is evaluated in float64 at probe points and compared with each kind.
``glu`` reads ``act(a) * b`` as ``GLU`` (``SwiGLU`` for silu, as the Llama blocks use).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from .. import functional as fn
from ..ops import GLU, Activation, SwiGLU
from .nodes import (
    Found,
    Ref,
    arg,
    cast_source,
    commuted,
    dtype,
    is_op,
    op_name,
    scalar,
    see_through,
    shape,
)

if TYPE_CHECKING:
    from .matcher import Matcher

# (x, kind, cap) of an activation rooted at a node
Act = tuple[fx.Node, str, float | None]

# aten ops that are one activation each: op name -> kind
_UNARY = {"silu": "silu", "relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh"}


def _unary(n: Any) -> Act | None:
    if is_op(n, *_UNARY):
        return see_through(n.args[0]), _UNARY[op_name(n)], None
    return None


def _gelu(n: Any) -> Act | None:
    if not is_op(n, "gelu"):
        return None
    approximate = arg(n, 1, "approximate", "none")
    kind = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return (see_through(n.args[0]), kind, None) if kind else None


def _relu2(n: Any) -> Act | None:
    """``relu(x) ** 2``, ``relu(x).square()`` or ``relu(x) * relu(x)``."""
    if not _squares(n):
        return None
    inner = see_through(n.args[0])
    return (see_through(inner.args[0]), "relu2", None) if is_op(inner, "relu") else None


def _squares(n: Any) -> bool:
    """``n`` squares its first operand."""
    if is_op(n, "pow"):
        return scalar(n.args[1]) == 2.0
    if is_op(n, "mul"):
        return see_through(n.args[0]) is see_through(n.args[1])
    return is_op(n, "square")


def _sigmoid_product(n: Any) -> Act | None:
    """``x * sigmoid(x)`` (silu) and ``x * sigmoid(1.702 * x)`` (QuickGELU)."""
    if not is_op(n, "mul"):
        return None
    for x, s in commuted(n):
        if not is_op(s, "sigmoid") or not isinstance(x, fx.Node):
            continue
        inner = see_through(s.args[0])
        if inner is x:
            return x, "silu", None
        if is_op(inner, "mul"):
            for y, c in commuted(inner):
                if y is x and scalar(c) == 1.702:
                    return x, "quick_gelu", None
    return None


def _softcap(n: Any) -> Act | None:
    """``tanh(x / c) * c`` or ``tanh(x * (1/c)) * c`` (Gemma 2's logit and attention
    softcapping)."""
    if not is_op(n, "mul"):
        return None
    for t, c in commuted(n):
        cap = scalar(c)
        if cap is None or cap <= 0 or not is_op(t, "tanh"):
            continue
        inner = see_through(t.args[0])
        if is_op(inner, "div") and scalar(inner.args[1]) == cap:
            return see_through(inner.args[0]), "softcap", cap
        if is_op(inner, "mul"):  # tanh(x * (1 / c)) * c
            for x, k in commuted(inner):
                if scalar(k) is not None and math.isclose(scalar(k) * cap, 1.0, rel_tol=1e-12):
                    return x, "softcap", cap
    return None


# Elementwise aten ops a hand-written activation is made of, as float64 functions.
_ELEMENTWISE: dict[str, Callable[..., torch.Tensor]] = {
    "mul": torch.mul,
    "add": torch.add,
    "sub": torch.sub,
    "rsub": torch.rsub,
    "div": torch.div,
    "pow": torch.pow,
    "neg": torch.neg,
    "exp": torch.exp,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "erf": torch.erf,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal,
    "relu": torch.relu,
    "square": torch.square,
}
_CHAIN_LIMIT = 40  # nodes: an activation is a short chain
_PROBE = torch.linspace(-8.0, 8.0, 161, dtype=torch.float64)
_KINDS = ("gelu", "gelu_tanh", "silu", "relu", "relu2", "sigmoid", "tanh", "quick_gelu")


def _by_value(n: Any) -> Act | None:
    """An elementwise chain of one tensor ``x`` (constants aside) that equals an activation kind
    at every probe point, in float64 (its casts are dropped)."""
    chain = _chain(n)
    if chain is None:
        return None
    x, nodes = chain
    if shape(x) != shape(n) or dtype(x) != dtype(n):
        return None
    values: dict[fx.Node, torch.Tensor] = {x: _PROBE}
    for node in nodes:
        values[node] = _apply(node, values)
    got = values[n]
    for kind in _KINDS:
        if torch.allclose(got, fn.activation(_PROBE, kind), rtol=1e-10, atol=1e-12):
            return x, kind, None
    return None


def _chain(root: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(x, nodes)``: the one tensor a chain of elementwise ops rooted at ``root`` reads, and the
    chain's nodes in evaluation order; ``None`` if it reads two tensors or anything else."""
    leaves: set[fx.Node] = set()
    order: list[fx.Node] = []

    def visit(n: fx.Node) -> bool:
        if n in order:
            return True
        if op_name(n) not in _ELEMENTWISE and cast_source(n) is None:
            leaves.add(n)
            return len(leaves) == 1
        if len(order) >= _CHAIN_LIMIT:
            return False
        source = cast_source(n)
        if source is not None:  # a cast: its value passes through in float64
            if not visit(see_through(source)):
                return False
            order.append(n)
            return True
        if n.kwargs:
            return False
        for a in n.args:
            if isinstance(a, fx.Node):
                if not visit(see_through(a)):
                    return False
            elif scalar(a) is None:
                return False
        order.append(n)
        return True

    root = see_through(root)
    if not isinstance(root, fx.Node) or op_name(root) not in _ELEMENTWISE:
        return None
    if not visit(root) or len(leaves) != 1:
        return None
    return leaves.pop(), order


def _apply(n: fx.Node, values: dict[fx.Node, torch.Tensor]) -> torch.Tensor:
    """One chain node in float64 (a cast passes its value through)."""
    source = cast_source(n)
    if source is not None:
        return values[see_through(source)]
    args = [values[see_through(a)] if isinstance(a, fx.Node) else a for a in n.args]
    return _ELEMENTWISE[op_name(n)](*args).to(torch.float64)


ACTIVATIONS: list[Callable[[Any], Act | None]] = [
    _unary,
    _gelu,
    _relu2,
    _sigmoid_product,
    _softcap,
    _by_value,
]


def activation_of(n: Any) -> Act | None:
    """The activation rooted at ``n`` (the first pattern of ``ACTIVATIONS`` that matches)."""
    n = see_through(n)
    for pattern in ACTIVATIONS:
        found = pattern(n)
        if found is not None and found[1] is not None:
            return found
    return None


def activation(m: Matcher, n: fx.Node) -> Found | None:
    found = activation_of(n)
    if found is None:
        return None
    x, kind, cap = found
    params: dict[str, Any] = {"kind": kind} | ({"cap": cap} if cap is not None else {})
    return Found(Activation, kind, {"x": Ref(x)}, **params)


def glu(m: Matcher, n: fx.Node) -> Found | None:
    """``act(gate) * up`` of two same-shape tensors (either order)."""
    if not is_op(n, "mul"):
        return None
    for a, up in commuted(n):
        found = activation_of(a) if isinstance(up, fx.Node) else None
        if found is None or found[1] == "softcap" or shape(found[0]) != shape(up):
            continue
        gate, kind, _ = found
        if kind == "silu":
            return Found(SwiGLU, "swiglu", {"gate": Ref(gate), "up": Ref(up)})
        return Found(GLU, "glu", {"gate": Ref(gate), "up": Ref(up)}, act=kind)
    return None
