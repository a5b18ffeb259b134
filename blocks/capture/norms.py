"""Recognisers of normalisations: ``RMSNorm`` (``F.rms_norm``; Hugging Face's Llama pattern, its
statistics in fp32 and the cast back before the weight; Gemma's ``x̂ · (1 + w)`` cast after; OLMo 2's
``(w · x̂)`` cast after), ``HeadRMSNorm`` (the same over the ``D`` axis of an ``[M, H, D]`` view) and
``LayerNorm`` (``F.layer_norm`` with a weight, with or without a bias).

``rms_parts`` reads the RMSNorm patterns into ``(x, weight, eps, offset, cast)``; the two
recognisers differ only in the rank of ``x``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import fx

from ..ops import HeadRMSNorm, LayerNorm, RMSNorm
from .nodes import (
    Found,
    Ref,
    arg,
    cast_source,
    commuted,
    dtype,
    is_op,
    last_dim,
    rank,
    same_base,
    scalar,
    see_through,
    shape,
    upcast_of,
)

if TYPE_CHECKING:
    from .matcher import Matcher

Parts = tuple[fx.Node, fx.Node, float, float, str]


def rms_norm(m: Matcher, n: fx.Node) -> Found | None:
    """An RMSNorm of a 2-D tensor."""
    parts = rms_parts(n)
    if parts is None or rank(parts[0]) != 2:
        return None
    x, w, eps, offset, cast = parts
    return Found(
        RMSNorm, "norm", {"x": Ref(x), "weight": Ref(w)}, eps=eps, offset=offset, cast=cast
    )


def head_rms_norm(m: Matcher, n: fx.Node) -> Found | None:
    """An RMSNorm over the last axis of an ``[M, H, D]`` view of an ``[M, H·D]`` value (Qwen3's
    ``q_norm(q_proj(h).view(M, -1, D))``): a ``HeadRMSNorm`` of the flat value."""
    parts = rms_parts(n)
    if parts is None or rank(parts[0]) != 3 or not m.can_heads(parts[0]):
        return None
    x, w, eps, offset, cast = parts
    return Found(
        HeadRMSNorm,
        "head_norm",
        {"x": Ref(x, heads=True), "weight": Ref(w)},
        eps=eps,
        offset=offset,
        cast=cast,
    )


def layer_norm(m: Matcher, n: fx.Node) -> Found | None:
    """``aten.layer_norm`` over the last axis of a 2-D tensor, with a weight."""
    if not is_op(n, "layer_norm") or rank(n.args[0]) != 2:
        return None
    normalized, w, b = arg(n, 1, "normalized_shape"), arg(n, 2, "weight"), arg(n, 3, "bias")
    eps = scalar(arg(n, 4, "eps", 1e-5))
    if len(normalized) != 1 or not isinstance(w, fx.Node) or eps is None or eps <= 0:
        return None
    tensors = {"x": Ref(n.args[0]), "weight": Ref(w)}
    if isinstance(b, fx.Node):
        tensors["bias"] = Ref(b)
    return Found(LayerNorm, "norm", tensors, eps=eps)


def rms_parts(n: fx.Node) -> Parts | None:
    """``(x, weight, eps, offset, cast)`` of an RMSNorm rooted at ``n``, or ``None``."""
    n = see_through(n)
    return _aten_rms_norm(n) or _cast_before_weight(n) or _cast_after_weight(n)


def _aten_rms_norm(n: fx.Node) -> Parts | None:
    """``F.rms_norm(x, (D,), w, eps)``: statistics in fp32, cast back, then the weight (the Llama
    order). Without ``eps`` it is the dtype's machine epsilon, which no block op has."""
    if not is_op(n, "rms_norm"):
        return None
    w, eps = arg(n, 2, "weight"), scalar(arg(n, 3, "eps"))
    if len(arg(n, 1, "normalized_shape")) != 1 or not isinstance(w, fx.Node) or not eps:
        return None
    return n.args[0], w, eps, 0.0, "before_weight"


def _cast_before_weight(n: fx.Node) -> Parts | None:
    """``w * x̂.to(x.dtype)`` (``LlamaRMSNorm``; ``(offset + w) * …`` with an offset)."""
    if not is_op(n, "mul"):
        return None
    for a, b in commuted(n):
        core = _core(cast_source(a) or a)
        if core is None or dtype(a) != dtype(core[0]):
            continue
        x, _normed, eps = core
        weight = _weight(b, x)
        if weight is not None:
            return x, weight[0], eps, weight[1], "before_weight"
    return None


def _cast_after_weight(n: fx.Node) -> Parts | None:
    """``(x̂ * w').to(x.dtype)`` with ``w'`` the weight, upcast, or ``offset + w`` (Gemma's ``1 +
    w``, OLMo 2's plain ``w``), formed in fp32 and cast once."""
    product = see_through(n.args[0]) if is_op(n, "to", "_to_copy", "type_as") else None
    if product is None or not is_op(product, "mul") or dtype(product) == dtype(n):
        return None
    for a, b in commuted(product):
        core = _core(a)
        if core is None or dtype(n) != dtype(core[0]):
            continue
        x, _normed, eps = core
        weight = _weight(b, x)
        if weight is not None:
            return x, weight[0], eps, weight[1], "after_weight"
    return None


def _core(n: Any) -> tuple[fx.Node, fx.Node, float] | None:
    """``(x, x̂, eps)`` for ``x̂ = X * rsqrt(mean(X², -1, keepdim) + eps)`` with ``X`` x upcast
    to fp32 (or ``X / sqrt(…)``); ``x`` the tensor before the upcast."""
    n = see_through(n)
    if is_op(n, "mul"):
        pairs = [(a, _rsqrt_arg(b)) for a, b in commuted(n)]
    elif is_op(n, "div"):
        a, b = see_through(n.args[0]), see_through(n.args[1])
        pairs = [(a, see_through(b.args[0]) if is_op(b, "sqrt") else None)]
    else:
        return None
    for big, inner in pairs:
        stat = _mean_square_plus_eps(inner)
        if stat is None or not same_base(big, stat[0]):
            continue
        x = upcast_of(big)
        if x is not None and shape(big) == shape(x):
            return x, n, stat[1]
    return None


def _rsqrt_arg(n: Any) -> Any:
    return see_through(n.args[0]) if is_op(n, "rsqrt") else None


def _mean_square_plus_eps(n: Any) -> tuple[fx.Node, float] | None:
    """``(X, eps)`` for ``mean(X², -1, keepdim=True) + eps``."""
    if not is_op(n, "add"):
        return None
    for a, b in commuted(n):
        eps = scalar(b)
        if eps is None or eps <= 0 or not is_op(a, "mean"):
            continue
        if not last_dim(a, arg(a, 1, "dim")) or not arg(a, 2, "keepdim", False):
            continue
        squared = _square_of(see_through(a.args[0]))
        if squared is not None:
            return squared, eps
    return None


def _square_of(n: Any) -> Any:
    """``X`` for ``X ** 2``, ``X * X`` or ``X.square()``."""
    if is_op(n, "pow") and scalar(n.args[1]) == 2.0:
        return see_through(n.args[0])
    if is_op(n, "square"):
        return see_through(n.args[0])
    if is_op(n, "mul") and same_base(n.args[0], n.args[1]):
        return see_through(n.args[0])
    return None


def _weight(n: Any, x: fx.Node) -> tuple[fx.Node, float] | None:
    """``(w, offset)`` for a 1-D weight over x's last axis: ``w``, ``w.float()``, ``offset + w``
    (either order, the weight upcast or not)."""
    n = see_through(n)
    offset = 0.0
    if is_op(n, "add"):
        for a, b in commuted(n):
            c = scalar(b)
            if c is not None and isinstance(a, fx.Node):
                n, offset = a, c
                break
        else:
            return None
    w = upcast_of(n) if dtype(n) != dtype(x) else n
    if w is None or not isinstance(w, fx.Node) or rank(w) != 1:
        return None
    if shape(w)[0] != shape(x)[-1]:
        return None
    return w, offset
