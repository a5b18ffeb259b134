"""Recognisers of ``Linear``: ``F.linear``/``nn.Linear`` (``aten.linear``, with or without a
bias), and the same written as a matrix product with a transposed weight, ``x @ w.t()``
(``.T``, ``transpose(0, 1)``, ``permute(1, 0)``), plus a bias added after it or given to
``torch.addmm(b, x, w.t())``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import fx

from ..ops import Linear
from .nodes import Found, Ref, arg, commuted, is_op, rank, see_through, shape

if TYPE_CHECKING:
    from .matcher import Matcher


def linear(m: Matcher, n: fx.Node) -> Found | None:
    """``x @ w.T (+ b)`` of a 2-D ``x``, ``w`` ``[out, in]`` and ``b`` ``[out]``."""
    parts = _aten_linear(n) or _matmul_transposed(n) or _addmm(n) or _bias_added(n)
    if parts is None:
        return None
    x, w, b = parts
    if rank(x) != 2 or rank(w) != 2 or shape(x)[-1] != shape(w)[1]:
        return None
    tensors = {"x": Ref(x), "weight": Ref(w)}
    if b is not None:
        if rank(b) != 1 or shape(b)[0] != shape(w)[0]:
            return None
        tensors["bias"] = Ref(b)
    return Found(Linear, "linear", tensors)


Parts = tuple[fx.Node, fx.Node, fx.Node | None]


def _aten_linear(n: fx.Node) -> Parts | None:
    if not is_op(n, "linear"):
        return None
    b = arg(n, 2, "bias")
    return see_through(n.args[0]), see_through(n.args[1]), b if isinstance(b, fx.Node) else None


def _matmul_transposed(n: fx.Node) -> Parts | None:
    """``x @ wᵀ``: ``matmul``/``mm`` whose second operand is the transpose of a 2-D weight."""
    if not is_op(n, "matmul", "mm"):
        return None
    w = _transposed(see_through(n.args[1]))
    return (see_through(n.args[0]), w, None) if w is not None else None


def _addmm(n: fx.Node) -> Parts | None:
    """``torch.addmm(b, x, w.t())`` with ``beta = alpha = 1``."""
    if not is_op(n, "addmm") or n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
        return None
    w = _transposed(see_through(n.args[2]))
    b = see_through(n.args[0])
    if w is None or not isinstance(b, fx.Node):
        return None
    return see_through(n.args[1]), w, b


def _transposed(n: Any) -> Any:
    """``w`` for ``w.t()``, ``w.T``, ``w.transpose(0, 1)`` or ``w.permute(1, 0)`` of a 2-D ``w``."""
    if rank(n) != 2:
        return None
    if is_op(n, "t", "numpy_T"):
        return see_through(n.args[0])
    if is_op(n, "transpose") and sorted(d % 2 for d in n.args[1:3]) == [0, 1]:
        return see_through(n.args[0])
    if is_op(n, "permute") and [d % 2 for d in n.args[1]] == [1, 0]:
        return see_through(n.args[0])
    return None


def _bias_added(n: fx.Node) -> Parts | None:
    """``(x @ wᵀ) + b`` with the product used only here (else it would be computed twice)."""
    if not is_op(n, "add") or len(n.args) != 2 or n.kwargs.get("alpha", 1) != 1:
        return None
    for a, b in commuted(n):
        product = _aten_linear(a) if is_op(a, "linear") else _matmul_transposed(a)
        if product is None or product[2] is not None or len(a.users) != 1:
            continue
        if isinstance(b, fx.Node) and rank(b) == 1:
            return product[0], product[1], b
    return None
