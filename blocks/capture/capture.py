"""The torch.export step of ``Block.from_torch``: trace a plain PyTorch function into an aten graph.

Why torch.export (its default, non-strict training IR) rather than torch.fx's symbolic tracing:
the aten graph has one canonical spelling per op (``F.linear``, ``nn.Linear`` and ``x.linear``
are all ``aten.linear``; ``x.float()`` and ``x.to(torch.float32)`` are both ``aten.to.dtype``),
keeps the composite ops a block op stands for intact (``aten.linear``, ``aten.rms_norm``,
``aten.layer_norm``, ``aten.gelu``, ``aten.silu``), and gives every node its shape and dtype, so
a recogniser can tell a ``[M, H, D]`` view of an ``[M, H·D]`` projection from any other view;
torch.fx would leave ``call_method``/``call_module`` spellings that need many patterns per op.

The function is traced on meta tensors (nothing is allocated or computed) at one of the block's
own shape sets (the one whose smallest size is largest: sizes 0 and 1 would be specialised
away). Recognisers compare the concrete sizes of that trace, so the first export is static;
only a graph with opaque ops is exported again with every named size dynamic, for their output
shapes over the size names (dynamic shapes make an attention input's export ten times slower:
its head views have the export reason about every size). Activations and weights are traced in
bfloat16, so that the function's own casts (``x.to(torch.float32)`` … ``.to(input_dtype)``)
appear in the graph: they decide between the Llama and the Gemma RMSNorm (where the weight
multiplies, before or after the cast back). Nothing global is cached or changed: each capture
exports anew.
"""

from __future__ import annotations

import inspect
import linecache
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.export import Dim

from ..block import ShapeSets, TensorSpec

TRACE_DTYPES = {"act": torch.bfloat16, "float32": torch.float32, "int64": torch.int64}


class CaptureError(ValueError):
    """A function ``Block.from_torch`` cannot capture; the message says what failed and what to
    change."""


@dataclass
class Traced:
    """An exported function: its aten graph, the value names of its inputs and outputs, and the
    sizes it was traced at.

    ``symbols`` maps each size symbol of the export to the block's size name it stands for."""

    graph: fx.Graph
    inputs: dict[fx.Node, str]
    outputs: list[tuple[str, fx.Node]]
    sizes: dict[str, int]
    symbols: dict[Any, str]
    seconds: float


def parameters(fn: Callable[..., Any], inputs: dict[str, TensorSpec]) -> list[str]:
    """The function's parameter names, checked against the block's ``inputs``."""
    where = _name(fn)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as e:
        raise CaptureError(
            f"{where}: cannot read its signature ({e}): pass a plain function"
        ) from None
    names: list[str] = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise CaptureError(
                f"{where} takes *{p.name}: name every tensor as its own parameter, one per input"
            )
        if p.name in inputs:
            names.append(p.name)
        elif p.default is p.empty:
            raise CaptureError(
                f"{where}'s parameter {p.name!r} has no entry in inputs: add "
                f"inputs[{p.name!r}] = TensorSpec(shape=[...]) or give it a default"
            )
    extra = sorted(set(inputs) - set(names))
    if extra:
        raise CaptureError(
            f"inputs {extra} are not parameters of {where}: every input is passed to the function "
            "by name, so remove them or add the parameters"
        )
    return names


def trace_sizes(shapes: ShapeSets) -> dict[str, int]:
    """The shape set to trace at: the one whose smallest size is largest (sizes 0 and 1 would be
    specialised by torch.export), the first among equals."""
    sets = shapes.cpu + shapes.gpu
    return max(sets, key=lambda s: min(s.values(), default=2))


def export(
    fn: Callable[..., Any],
    names: list[str],
    inputs: dict[str, TensorSpec],
    sizes: dict[str, int],
    outputs: list[str] | None,
    dynamic: bool = False,
) -> Traced:
    """Export ``fn`` on meta tensors at ``sizes``; its outputs named ``outputs`` (or the keys of
    the dict it returns, or ``out`` for a single tensor). ``dynamic``: every named size is a
    symbol (``Traced.symbols``), else the graph is specialised to ``sizes``."""
    examples, shapes = [], []
    for name in names:
        spec = inputs[name]
        shape = [d if isinstance(d, int) else sizes[d] for d in spec.shape]
        examples.append(torch.empty(shape, dtype=TRACE_DTYPES[spec.dtype], device="meta"))
        shapes.append({i: Dim.AUTO for i, d in enumerate(spec.shape) if isinstance(d, str)})
    named: list[str] = []
    module = _Wrapper(fn, names, outputs, named)
    start = time.perf_counter()
    try:
        exported = torch.export.export(
            module,
            tuple(examples),
            dynamic_shapes=(tuple(shapes),) if dynamic else None,
            strict=False,
        )
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.export raises many types; each is reported
        raise CaptureError(_export_failure(fn, e, names, inputs, sizes)) from None
    seconds = time.perf_counter() - start
    graph = exported.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in graph.nodes if n.op == "output"]
    results = list(output.args[0])
    return Traced(
        graph=graph,
        inputs=dict(zip(placeholders, names, strict=True)),
        outputs=list(zip(named, results, strict=True)),
        sizes=sizes,
        symbols=_symbols(placeholders, names, inputs),
        seconds=seconds,
    )


class _Wrapper(torch.nn.Module):
    """``fn`` as the module torch.export takes: positional tensors in, a tuple of tensors out in
    ``outputs`` order (``named`` receives the names once the result's structure is seen)."""

    def __init__(
        self, fn: Callable[..., Any], names: list[str], outputs: list[str] | None, named: list[str]
    ) -> None:
        super().__init__()
        self.fn, self.names, self.outputs, self.named = fn, names, outputs, named

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        result = self.fn(**dict(zip(self.names, tensors, strict=True)))
        names, values = output_values(result, self.outputs, _name(self.fn))
        self.named[:] = names
        return tuple(values)


def output_values(
    result: Any, outputs: list[str] | None, where: str
) -> tuple[list[str], list[torch.Tensor]]:
    """The function's result as (names, tensors): a tensor, a tuple/list, or a dict of tensors."""
    if isinstance(result, dict):
        names = list(outputs) if outputs is not None else list(result)
        if set(names) != set(result):
            raise CaptureError(
                f"{where} returns a dict with keys {sorted(result)} but outputs names "
                f"{sorted(names)}: make them the same (or leave outputs out)"
            )
        values = [result[k] for k in names]
    elif isinstance(result, torch.Tensor):
        names, values = list(outputs) if outputs is not None else ["out"], [result]
    elif isinstance(result, tuple | list):
        values = list(result)
        if outputs is None or len(outputs) != len(values):
            raise CaptureError(
                f"{where} returns {len(values)} tensors: name each of them, in order, with "
                f"outputs=[...] (got {outputs!r})"
            )
        names = list(outputs)
    else:
        raise CaptureError(
            f"{where} returns a {type(result).__name__}: return a tensor, a tuple of tensors "
            "or a dict of tensors"
        )
    if len(names) != len(values):
        raise CaptureError(
            f"{where} returns one tensor but outputs names {len(names)}: give one name"
        )
    bad = [n for n, v in zip(names, values, strict=True) if not isinstance(v, torch.Tensor)]
    if bad:
        raise CaptureError(f"{where}: outputs {bad} are not tensors: return tensors only")
    return names, values


def _symbols(
    placeholders: list[fx.Node], names: list[str], inputs: dict[str, TensorSpec]
) -> dict[Any, str]:
    """Each size symbol of the export -> the size name the inputs give that dimension."""
    found: dict[Any, str] = {}
    for node, name in zip(placeholders, names, strict=True):
        traced = node.meta["val"].shape
        for size, dim in zip(inputs[name].shape, traced, strict=True):
            if isinstance(size, str) and isinstance(dim, torch.SymInt):
                found.setdefault(dim.node.expr, size)
    return found


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__qualname__', repr(fn))}()"


def _export_failure(
    fn: Callable[..., Any],
    error: BaseException,
    names: list[str],
    inputs: dict[str, TensorSpec],
    sizes: dict[str, int],
) -> str:
    """What went wrong exporting ``fn``, where in its file, and what to change."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    where, code = _user_frame(fn, error)
    line = f" at {where} (`{code}`)" if where else ""
    kind = type(error).__name__
    if "DataDependent" in kind or "data-dependent" in str(error) or "data dependent" in str(error):
        hint = (
            "the function branches on (or reads) tensor values: a block computes the same ops "
            "for every input, so replace the `if`/`.item()` on tensor data with torch.where or "
            "arithmetic"
        )
    else:
        hint = (
            "rewrite that line with standard torch operations, and check that each input's "
            "declared shape (rank and size names) matches how the function uses it"
        )
    used = [n for n in names if code and _mentions(code, n)]
    shown = used or names
    described = "; ".join(
        f"{n} {inputs[n].shape} traced as "
        f"{[d if isinstance(d, int) else sizes[d] for d in inputs[n].shape]}"
        for n in shown
    )
    which = "inputs on that line" if used else "inputs"
    return (
        f"torch.export could not trace {_name(fn)}{line}: {kind}: {first} — {hint}. "
        f"{which.capitalize()}: {described}"
    )


def _user_frame(fn: Callable[..., Any], error: BaseException) -> tuple[str, str]:
    """``file:line`` and the code of the deepest frame of the error in ``fn``'s file."""
    try:
        path = str(Path(inspect.getsourcefile(fn) or "").resolve())
    except TypeError:
        return "", ""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if _same(f.filename, path)]
    if not frames:
        return "", ""
    f = frames[-1]
    code = (f.line or linecache.getline(f.filename, f.lineno or 0)).strip()
    return f"{f.filename}:{f.lineno}", code


def _same(filename: str, path: str) -> bool:
    try:
        return str(Path(filename).resolve()) == path
    except OSError:
        return False


def _mentions(code: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", code) is not None
