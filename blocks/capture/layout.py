"""Layout: the views between ``[M, H·D]`` and ``[M, H, D]`` (or ``[H, M, D]``, its
``transpose(0, 1)``) that the head-wise recognisers (``RoPE``, ``HeadRMSNorm``) absorb, and
``Chunk`` (``chunk``/``split`` of a concatenated projection into equal parts along the last axis,
Phi-3's ``gate_up_proj``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import fx

from ..ops import Chunk
from .nodes import Found, Ref, arg, is_op, rank, see_through, shape

if TYPE_CHECKING:
    from .matcher import Matcher

_VIEWS = ("view", "reshape", "_unsafe_view", "flatten")


def flattened_heads(n: Any) -> Any:
    """The ``[M, H, D]`` tensor ``n`` flattens back to ``[M, H·D]``, or ``None``."""
    if not is_op(n, *_VIEWS) or rank(n) != 2:
        return None
    src = see_through(n.args[0])
    if rank(src) == 3 and _split_last(shape(n), shape(src)):
        return src
    return None


def heads_source(n: Any) -> Any:
    """The ``[M, H·D]`` tensor whose ``[M, H, D]`` view ``n`` is, or ``None``."""
    if not is_op(n, *_VIEWS) or rank(n) != 3:
        return None
    src = see_through(n.args[0])
    if rank(src) == 2 and _split_last(shape(src), shape(n)):
        return src
    return None


def swapped(n: Any) -> Any:
    """The 3-D tensor whose ``transpose(0, 1)`` (or ``permute(1, 0, 2)``) ``n`` is, or ``None``:
    ``[M, H, D]`` ↔ ``[H, M, D]``."""
    if rank(n) != 3:
        return None
    if is_op(n, "transpose") and sorted(d % 3 for d in n.args[1:3]) == [0, 1]:
        return see_through(n.args[0])
    if is_op(n, "permute") and [d % 3 for d in n.args[1]] == [1, 0, 2]:
        return see_through(n.args[0])
    return None


def _split_last(flat: tuple[int, ...], heads: tuple[int, ...]) -> bool:
    return flat[0] == heads[0] and flat[1] == heads[1] * heads[2]


def chunk(m: Matcher, n: fx.Node) -> Found | None:
    """``x.chunk(k, -1)[i]`` or ``x.split(w, -1)[i]`` with ``k`` equal parts."""
    if not is_op(n, "getitem"):
        return None
    whole, index = n.args
    if not is_op(whole, "chunk", "split", "split_with_sizes", "unsafe_split", "unsafe_chunk"):
        return None
    x = see_through(whole.args[0])
    dim = arg(whole, 2, "dim", 0)
    if rank(x) != 2 or dim not in (-1, 1):
        return None
    parts = len(whole.meta["val"])
    widths = {shape_of_part(p) for p in whole.meta["val"]}
    width = shape(x)[-1]
    if parts < 2 or len(widths) != 1 or widths.pop() * parts != width:
        return None
    return Found(Chunk, "chunk", {"x": Ref(x)}, chunks=parts, index=index)


def shape_of_part(t: Any) -> int:
    d = t.shape[-1]
    return d if isinstance(d, int) else int(d.node.hint)
