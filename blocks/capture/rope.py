"""The RoPE recogniser: Hugging Face's ``apply_rotary_pos_emb`` on an ``[M, H, D]`` view of an
``[M, H·D]`` projection, ``q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)`` with
``rotate_half(q) = cat((-q[..., D/2:], q[..., :D/2]), -1)`` and cos/sin ``[M, D]`` (or on its
``[H, M, D]`` transpose with the tables unsqueezed at 0): a ``RoPE`` of the flat projection (the
view back to ``[M, H·D]`` is absorbed by the layout step)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from torch import fx

from ..ops import RoPE
from .nodes import Found, Ref, arg, commuted, is_op, rank, see_through, shape

if TYPE_CHECKING:
    from .matcher import Matcher


def rope(m: Matcher, n: fx.Node) -> Found | None:
    """``q·cos + rotate_half(q)·sin`` rooted at the 3-D ``add``."""
    if not is_op(n, "add") or rank(n) != 3 or n.kwargs.get("alpha", 1) != 1:
        return None
    for p, r in commuted(n):
        if not is_op(p, "mul") or not is_op(r, "mul"):
            continue
        for q, cos in commuted(p):
            if rank(q) != 3 or not m.can_heads(q):
                continue
            rows_first = m.rows_first(q)
            table = _table(cos, q, rows_first)
            if table is None:
                continue
            for rotated, sin in commuted(r):
                sin_table = _table(sin, q, rows_first)
                if sin_table is not None and _rotates_half(rotated, q):
                    tensors = {"x": Ref(q, heads=True), "cos": Ref(table), "sin": Ref(sin_table)}
                    return Found(RoPE, "rope", tensors)
    return None


def _table(n: Any, q: Any, rows_first: bool) -> Any:
    """The ``[M, D]`` table ``t`` broadcast against ``q``: ``t.unsqueeze(1)`` (or ``t[:, None]``)
    for ``q`` ``[M, H, D]``, ``t.unsqueeze(0)`` for ``q`` ``[H, M, D]``."""
    axis = 1 if rows_first else 0
    if not is_op(n, "unsqueeze", "view", "reshape") or rank(n) != 3 or shape(n)[axis] != 1:
        return None
    if is_op(n, "unsqueeze") and n.args[1] not in ((1, -2) if rows_first else (0, -3)):
        return None
    t = _full_slices(see_through(n.args[0]))
    rows = shape(q)[0] if rows_first else shape(q)[1]
    if rank(t) != 2 or shape(t) != (rows, shape(q)[2]):
        return None
    return t


def _full_slices(n: Any) -> Any:
    """``n`` with whole-axis slices (``t[:, ...]``) looked through."""
    while is_op(n, "slice") and shape(n) == shape(n.args[0]):
        n = see_through(n.args[0])
    return n


def _rotates_half(n: Any, q: fx.Node) -> bool:
    """``n`` is ``cat((-q[..., D/2:], q[..., :D/2]), -1)``."""
    if not is_op(n, "cat") or arg(n, 1, "dim", 0) not in (-1, 2):
        return False
    parts = [see_through(p) for p in n.args[0]]
    if len(parts) != 2 or not is_op(parts[0], "neg"):
        return False
    second_half, first_half = see_through(parts[0].args[0]), parts[1]
    head = shape(q)[2]
    if head % 2:
        return False
    return _half(second_half, q, head // 2, first=False) and _half(first_half, q, head // 2, True)


def _half(n: Any, q: fx.Node, half: int, first: bool) -> bool:
    """``n`` is ``q[..., :half]`` (``first``) or ``q[..., half:]`` along the last axis."""
    if (
        not is_op(n, "slice")
        or see_through(n.args[0]) is not q
        or arg(n, 1, "dim", 0) not in (-1, 2)
    ):
        return False
    start, end = arg(n, 2, "start"), arg(n, 3, "end")
    if shape(n)[2] != half:
        return False
    if first:
        return start in (None, 0)
    return end is None or (isinstance(end, int) and end >= sys.maxsize)
