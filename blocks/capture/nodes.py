"""Reading an exported aten graph: what a node computes, its shape and dtype at capture, and the
casts and identities a recogniser looks through.

Shapes are the concrete sizes the graph was traced at (``Traced.sizes``): recognisers compare
them (a ``[M, H, D]`` view of an ``[M, H·D]`` value, a chunk of an even width); the symbolic
shapes are only written out for opaque ops.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

UPCASTS = (torch.float32, torch.float64)
# Ops that return their input unchanged: the same values, shape and dtype.
_IDENTITIES = {"clone", "contiguous", "alias", "detach", "lift_fresh_copy"}
_CASTS = {"to", "_to_copy", "type_as"}


def op_name(n: Any) -> str:
    """``"linear"`` for ``aten.linear.default``, ``"getitem"`` for ``operator.getitem``, ``""``
    for anything that is not a call."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return ""
    if n.target is operator.getitem:
        return "getitem"
    packet = getattr(n.target, "_overloadpacket", None)
    return getattr(packet, "__name__", "") or getattr(n.target, "__name__", "")


def target_name(n: fx.Node) -> str:
    """The node's target as written in messages: ``aten.cumsum.default``."""
    if n.target is operator.getitem:
        return "getitem"
    return str(n.target)


def is_op(n: Any, *names: str) -> bool:
    return op_name(n) in names


def val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def is_tensor(n: Any) -> bool:
    return isinstance(val(n), torch.Tensor)


def _hint(d: Any) -> int:
    if isinstance(d, int):
        return d
    hint = d.node.hint
    if hint is None:
        raise ValueError(f"size {d} has no value at capture")
    return int(hint)


def shape(n: Any) -> tuple[int, ...]:
    """The node's shape at the capture sizes (``()`` for a non-tensor)."""
    v = val(n)
    return tuple(_hint(d) for d in v.shape) if isinstance(v, torch.Tensor) else ()


def rank(n: Any) -> int:
    v = val(n)
    return v.dim() if isinstance(v, torch.Tensor) else -1


def dtype(n: Any) -> torch.dtype | None:
    v = val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def arg(n: fx.Node, i: int, key: str, default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``key``) of a call, ``default`` when it was not given."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(key, default)


def scalar(x: Any) -> float | None:
    """A Python number argument as a float (``None`` for a tensor, a node or a bool)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x)


def last_dim(n: fx.Node, dim: Any) -> bool:
    """``dim`` names the last dimension of ``n``'s input tensor (``-1`` or ``rank - 1``)."""
    dims = dim if isinstance(dim, list | tuple) else [dim]
    r = rank(n.args[0])
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] in (-1, r - 1)


def cast_source(n: Any) -> Any:
    """For a dtype cast (``to``, ``_to_copy``, ``type_as``, ``.float()``), the tensor it casts;
    else ``None``."""
    if is_op(n, *_CASTS) and isinstance(n.args[0], fx.Node):
        return n.args[0]
    return None


def see_through(n: Any) -> Any:
    """``n`` with identities looked through: ``clone``/``contiguous``, a cast or view to the same
    dtype and shape, dropout outside training (``F.dropout(x, p, training=False)``)."""
    while isinstance(n, fx.Node):
        src = n.args[0] if n.args else None
        if is_op(n, "dropout") and not arg(n, 2, "train", True):
            n = src
            continue
        same = isinstance(src, fx.Node) and dtype(src) == dtype(n) and shape(src) == shape(n)
        if same and (is_op(n, *_IDENTITIES, *_CASTS, "view", "reshape", "_unsafe_view")):
            n = src
        else:
            return n
    return n


def upcast_of(n: Any) -> Any:
    """The tensor ``n`` upcasts to float32 (or float64): ``x`` for ``x.float()``, and ``n``
    itself when it is already float32 or float64; else ``None``."""
    n = see_through(n)
    src = cast_source(n)
    if src is not None and dtype(n) in UPCASTS:
        return see_through(src)
    return n if dtype(n) in UPCASTS else None


def operands(n: fx.Node) -> tuple[Any, Any]:
    """The two operands of a binary op (``mul``, ``add``), each looked through identities."""
    return see_through(n.args[0]), see_through(n.args[1]) if len(n.args) > 1 else None


def commuted(n: fx.Node) -> list[tuple[Any, Any]]:
    """Both orders of a commutative binary op's operands."""
    a, b = operands(n)
    return [(a, b), (b, a)]


def same_base(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same tensor, up to identities and an upcast (Gemma's ``x.float()``
    written twice is two nodes of one value)."""
    return upcast_of(a) is not None and upcast_of(a) is upcast_of(b)


class Ref:
    """A tensor a recognised op reads: ``node`` itself, or (``heads``) the ``[M, H·D]`` value
    whose ``[M, H, D]`` view ``node`` is."""

    __slots__ = ("heads", "node")

    def __init__(self, node: fx.Node, heads: bool = False) -> None:
        self.node, self.heads = node, heads


class Found:
    """A recognised block op rooted at a node: its class, the stem of its value's name, the
    tensor fields (``Ref``s) and the other fields."""

    __slots__ = ("op", "params", "stem", "tensors")

    def __init__(self, op: type, stem: str, tensors: dict[str, Ref], **params: Any) -> None:
        self.op, self.stem, self.tensors, self.params = op, stem, tensors, params
