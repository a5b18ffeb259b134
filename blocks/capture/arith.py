"""Recognisers of arithmetic with a block op of its own: ``Add`` (two same-shape tensors: a
residual connection) and ``Scale`` (a tensor times, or divided by, a Python number)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import fx

from ..ops import Add, Scale
from .nodes import Found, Ref, dtype, is_op, is_tensor, scalar, see_through, shape

if TYPE_CHECKING:
    from .matcher import Matcher


def add(m: Matcher, n: fx.Node) -> Found | None:
    if not is_op(n, "add") or len(n.args) != 2 or n.kwargs.get("alpha", 1) != 1:
        return None
    a, b = see_through(n.args[0]), see_through(n.args[1])
    if not (is_tensor(a) and is_tensor(b)) or shape(a) != shape(b) or dtype(a) != dtype(b):
        return None
    return Found(Add, "add", {"a": Ref(a), "b": Ref(b)})


def scale(m: Matcher, n: fx.Node) -> Found | None:
    if not is_op(n, "mul", "div") or len(n.args) != 2 or n.kwargs.get("rounding_mode"):
        return None
    x, c = see_through(n.args[0]), scalar(n.args[1])
    if is_op(n, "mul") and c is None:
        x, c = see_through(n.args[1]), scalar(n.args[0])
    if c is None or not is_tensor(x) or (is_op(n, "div") and c == 0):
        return None
    factor = 1.0 / c if is_op(n, "div") else c
    return Found(Scale, "scale", {"x": Ref(x)}, factor=factor)
