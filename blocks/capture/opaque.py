"""Opaque ops: a captured node no recogniser reads as a block op becomes an ``Opaque`` graph op
(``blocks/ops.py``) that records the aten target, its call as captured (tensors by value name,
sizes as size expressions), its output shape over the block's size names, and why no block op
computes it. The planner has no rule for it and names it; it never runs."""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
from torch import fx

from . import loss
from .nodes import op_name, rank, scalar, target_name

# Why common aten ops are opaque, beyond "no block op computes it".
_REASONS = {
    "to": "a standalone dtype cast: block ops choose their own precision",
    "_to_copy": "a standalone dtype cast: block ops choose their own precision",
    "type_as": "a standalone dtype cast: block ops choose their own precision",
    "rms_norm": "F.rms_norm without eps uses the dtype's machine epsilon, which differs per "
    "dtype: pass eps explicitly",
    "layer_norm": "a LayerNorm without a weight: no block op computes one",
    "add": "a broadcast or scaled add: the block op adds two same-shape tensors (a bias belongs "
    "to its Linear)",
}


def reason(n: fx.Node) -> str:
    """Why ``n`` is opaque, for the op's ``reason`` and the planner's refusal."""
    name = op_name(n)
    if name == "cross_entropy_loss":
        why = loss.unsupported(n)
        if why:
            return why
    if name in ("add", "sub") and any(scalar(a) is not None for a in n.args):
        return f"{target_name(n)} of a constant: no block op adds one (Scale multiplies by one)"
    if name in _REASONS:
        return _REASONS[name]
    if rank(n) > 2 and name in ("view", "reshape", "unsqueeze", "transpose", "permute", "expand"):
        return (
            f"a {rank(n)}-D view no recogniser absorbs: block values are [M, ...] matrices and "
            "only RoPE and per-head RMSNorm read [M, H, D] views"
        )
    return f"no block op computes {target_name(n)}"


def target_of(n: fx.Node) -> str:
    """The aten target a node calls (``aten.split.Tensor[1]`` for one part of a split)."""
    if n.target is operator.getitem:
        whole, index = n.args
        return f"{target_of(whole)}[{index}]"
    return target_name(n)


def call_text(n: fx.Node, names: dict[fx.Node, str], symbols: dict[Any, str]) -> str:
    """The node's call as captured: ``aten.cumsum.default(x, -1)``."""
    if n.target is operator.getitem:
        whole, index = n.args
        return f"{call_text(whole, names, symbols)}[{index}]"
    args = [_render(a, names, symbols) for a in n.args]
    args += [f"{k}={_render(v, names, symbols)}" for k, v in n.kwargs.items()]
    return f"{target_name(n)}({', '.join(args)})"


def _render(a: Any, names: dict[fx.Node, str], symbols: dict[Any, str]) -> str:
    if isinstance(a, fx.Node):
        if a in names:
            return names[a]
        v = a.meta.get("val")
        if isinstance(v, torch.SymInt | int):
            return size_text(v, symbols)
        return a.name
    if isinstance(a, list | tuple):
        return "[" + ", ".join(_render(x, names, symbols) for x in a) + "]"
    if isinstance(a, torch.dtype):
        return str(a)
    return repr(a)


def size_text(d: Any, symbols: dict[Any, str]) -> str:
    """A size (an int or a SymInt of the export) over the block's size names."""
    if isinstance(d, int):
        return str(d)
    expr = d.node.expr
    rename = {s: _symbol(symbols[s]) for s in expr.free_symbols if s in symbols}
    return str(expr.xreplace(rename))


def _symbol(name: str) -> Any:
    return sympy.Symbol(name, integer=True, positive=True)


def output_shape(n: fx.Node, symbols: dict[Any, str]) -> list[str | int]:
    """The node's output shape, each size an int or an expression over the size names."""
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return []
    out: list[str | int] = []
    for d in v.shape:
        text = size_text(d, symbols)
        out.append(int(text) if text.isdigit() else text)
    return out


def tensor_args(n: fx.Node) -> list[fx.Node]:
    """The tensors a node reads, in argument order (a ``getitem`` reads what its source reads)."""
    if n.target is operator.getitem:
        return tensor_args(n.args[0])
    found: list[fx.Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            if a not in found:
                found.append(a)
        elif isinstance(a, list | tuple):
            for x in a:
                visit(x)

    for a in [*n.args, *n.kwargs.values()]:
        visit(a)
    return found
