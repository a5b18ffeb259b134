"""``CapturedBlock``: a block whose reference is a user's own PyTorch function, and
``from_torch``, which captures the function's op graph for the planner.

The user's code is the reference: ``reference()`` calls the function (the sandbox verifies every
Program against it, so verification never depends on the capture being right) and
``reference_source()`` shows its source and the functions it calls from its own file. In float64 —
the sandbox's exact reference — the function runs under ``float64_casts``, which turns the casts
a 16-bit model writes (``x.to(torch.float32)``, ``.float()``, ``.half()``) into float64 ones, so
a Llama RMSNorm's fp32 statistics do not round the float64 reference to fp32.
"""

from __future__ import annotations

import ast
import dis
import inspect
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import PrivateAttr
from torch.overrides import TorchFunctionMode

from ..block import Block, ShapeSets, TensorSpec, Tolerance
from ..ops import Opaque
from . import capture, matcher
from .capture import CaptureError


class CapturedBlock(Block):
    """A block captured from a PyTorch function (``Block.from_torch``): ``graph`` is what the
    recognisers read from it (``Opaque`` where no block op computes a node), ``source`` the
    function's code, and the reference is the function itself."""

    source: str
    _fn: Callable[..., Any] = PrivateAttr()
    _seconds: float = PrivateAttr(0.0)

    @property
    def capture_seconds(self) -> float:
        """How long torch.export took for this block (not part of the block's definition)."""
        return self._seconds

    @property
    def function(self) -> Callable[..., Any]:
        """The captured function: the block's reference."""
        return self._fn

    def reference_source(self) -> str:
        """The user's source: imports, the functions it calls from its own file, the
        function, and a comment naming the inputs and outputs."""
        return self.source

    def outputs_function(self) -> tuple[str, str]:
        """(name, source) of a function of the block's inputs that returns its outputs as a
        dict, as ``vjp`` differentiates a forward block (``blocks/autodiff.py``): the captured
        function itself when it returns a dict (the source is then empty), else a wrapper of
        the source's function that names its tensor or tuple."""
        fn, args = self._fn.__name__, ", ".join(self.inputs)
        with torch.device("meta"):
            result = self._fn(**self._meta_inputs(self.shapes.cpu[0]))
        if isinstance(result, dict):
            return fn, ""
        if isinstance(result, torch.Tensor):
            named = f"{{{self.outputs[0]!r}: {fn}({args})}}"
        else:
            named = f"dict(zip({self.outputs!r}, {fn}({args})))"
        name = f"{fn}_outputs"
        doc = f'"""``{fn}``\'s result by output name."""'
        return name, f"def {name}({args}):\n    {doc}\n    return {named}\n"

    def _meta_inputs(self, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """The inputs as meta tensors at ``sizes`` (float32, or int64 for an index)."""
        return {
            n: torch.empty(
                self.shape_of(n, sizes),
                device="meta",
                dtype=torch.int64 if s.dtype == "int64" else torch.float32,
            )
            for n, s in self.inputs.items()
        }

    def reference(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The user's function on ``inputs``; float64 inputs run it with its casts in float64."""
        args = {name: inputs[name] for name in self.inputs}
        exact = any(t.dtype == torch.float64 for t in args.values())
        if exact:
            with float64_casts():
                result = self._fn(**args)
        else:
            result = self._fn(**args)
        names, values = capture.output_values(result, self.outputs, f"{self.name}()")
        return dict(zip(names, values, strict=True))

    def trace(self, sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """Shapes of the graph's values at ``sizes``: the ops run on meta tensors, an opaque op
        contributes its recorded shape, and the outputs are the function's own on meta tensors."""
        values: dict[str, Any] = self._meta_inputs(sizes)
        for op in self.graph:
            if any(name not in values for name in op.inputs()):
                continue
            if isinstance(op, Opaque):
                shape = opaque_shape(op, sizes)
                if shape is not None:
                    values[op.out] = torch.empty(shape, device="meta")
                continue
            values[op.out] = op.call(values)
        shapes = {n: tuple(v.shape) for n, v in values.items() if isinstance(v, torch.Tensor)}
        with torch.device("meta"):
            outputs = self.reference({n: values[n] for n in self.inputs})
        return shapes | {n: tuple(v.shape) for n, v in outputs.items()}


def opaque_shape(op: Opaque, sizes: dict[str, int]) -> tuple[int, ...] | None:
    """An opaque op's recorded shape at ``sizes`` (``None`` where it is unknown or an expression
    does not read)."""
    if not op.shape:
        return None
    out = []
    for d in op.shape:
        if isinstance(d, int):
            out.append(d)
            continue
        try:
            out.append(_evaluate(ast.parse(d, mode="eval").body, sizes))
        except (SyntaxError, KeyError, ValueError, ZeroDivisionError):
            return None
    return tuple(out)


def _evaluate(node: Any, sizes: dict[str, int]) -> int:
    """A size expression of integers, size names, ``+ - * // %`` and parentheses."""
    ops = {
        ast.Add: int.__add__,
        ast.Sub: int.__sub__,
        ast.Mult: int.__mul__,
        ast.FloorDiv: int.__floordiv__,
        ast.Mod: int.__mod__,
    }
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return sizes[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in ops:
        return ops[type(node.op)](_evaluate(node.left, sizes), _evaluate(node.right, sizes))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, sizes)
    raise ValueError(f"not a size expression: {ast.dump(node)}")


# -- float64 ---------------------------------------------------------------------------------------
_LOW = (torch.float32, torch.float16, torch.bfloat16)
_TO_FLOAT64 = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


class float64_casts(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch's
    """Within it, a cast to float32/float16/bfloat16 (``.to(dtype)``, ``.float()``, ``.half()``,
    ``.type(dtype)``, a ``dtype=`` keyword) is a cast to float64: the function's float64
    reference keeps float64 where the model upcasts a 16-bit tensor to fp32."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func in _TO_FLOAT64:
            return args[0].to(torch.float64)
        if kwargs.get("dtype") in _LOW:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a in _LOW else a for a in args)
        return func(*args, **kwargs)


# -- source ----------------------------------------------------------------------------------------
def function_source(
    fn: Callable[..., Any], inputs: dict[str, TensorSpec], outputs: list[str]
) -> str:
    """What an LLM reads as the block's reference: imports, the module-level constants and
    functions ``fn`` calls from its own file (and theirs, transitively), then
    ``fn``, with a header naming the inputs' shapes and the outputs."""
    callees, constants = _dependencies(fn)
    header = [f"# {fn.__name__}({', '.join(inputs)}) -> {', '.join(outputs)}"]
    for name, spec in inputs.items():
        shape = ", ".join(map(str, spec.shape))
        note = f" — {spec.doc}" if spec.doc else ""
        header.append(f"#   {name}: [{shape}] {spec.dtype}{note}")
    parts = ["\n".join(header), "import math\n\nimport torch\nimport torch.nn.functional as F"]
    if constants:
        parts.append("\n".join(f"{k} = {v!r}" for k, v in constants.items()))
    head = "\n\n".join(p.rstrip() for p in parts)
    functions = "\n\n\n".join(_source(f).rstrip() for f in [*callees, fn])
    return f"{head}\n\n\n{functions}\n"


def _source(fn: Callable[..., Any]) -> str:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise CaptureError(
            f"the source of {fn.__qualname__}() cannot be read (it was not defined in a file): "
            "the block's reference source is the function's code, so define it in a .py file"
        ) from None


def _dependencies(fn: Callable[..., Any]) -> tuple[list[Callable[..., Any]], dict[str, Any]]:
    """The functions of ``fn``'s file it calls (transitively, callees first) and the numbers and
    strings it reads from its module (in its body or its parameters' defaults)."""
    home = _file(fn)
    callees: list[Callable[..., Any]] = []
    constants: dict[str, Any] = {}
    seen: set[Any] = {fn}

    def visit(f: types.FunctionType) -> None:
        for name in _global_names(f):
            obj = f.__globals__.get(name)
            if isinstance(obj, types.FunctionType) and _file(obj) == home and obj not in seen:
                seen.add(obj)
                visit(obj)
                callees.append(obj)
            elif isinstance(obj, int | float | str) and not isinstance(obj, bool):
                constants.setdefault(name, obj)

    visit(fn)
    return callees, constants


def _global_names(f: types.FunctionType) -> list[str]:
    """The global names ``f`` loads (nested functions included), then those its parameters'
    defaults name (``eps=RMS_NORM_EPS``)."""
    names = _loads(f.__code__)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(f)))
    except (OSError, TypeError, SyntaxError):
        return names
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.Lambda)]
    if defs:
        args = defs[0].args
        for default in [*args.defaults, *args.kw_defaults]:
            names += [n.id for n in ast.walk(default) if isinstance(n, ast.Name)] if default else []
    return names


def _loads(code: types.CodeType) -> list[str]:
    names = [i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOADS]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _loads(const)
    return names


_GLOBAL_LOADS = {"LOAD_GLOBAL", "LOAD_NAME"}


def _file(fn: Callable[..., Any]) -> str | None:
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        return None
    return str(Path(path).resolve()) if path else None


# -- capture ---------------------------------------------------------------------------------------
def _with_symbolic_shapes(
    graph: list[Any],
    fn: Callable[..., Any],
    names: list[str],
    inputs: dict[str, TensorSpec],
    sizes: dict[str, int],
    outputs: list[str] | None,
) -> list[Any]:
    """The graph of a dynamic export, whose opaque ops record their shapes over the size names;
    if the function does not export with dynamic sizes, ``graph`` with those shapes unknown."""
    try:
        return matcher.build(capture.export(fn, names, inputs, sizes, outputs, dynamic=True))
    except CaptureError:
        unknown = {"shape": []}
        return [op.model_copy(update=unknown) if isinstance(op, Opaque) else op for op in graph]


def from_torch(
    fn: Callable[..., Any],
    *,
    name: str,
    inputs: dict[str, TensorSpec],
    shapes: ShapeSets,
    outputs: list[str] | None = None,
    description: str | None = None,
    tolerance: Tolerance | None = None,
) -> CapturedBlock:
    """Capture ``fn`` (a plain function of the block's tensors) as a block; see
    ``Block.from_torch``."""
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise CaptureError(f"from_torch takes a Python function, not {type(fn).__name__}")
    names = capture.parameters(fn, inputs)
    ordered = {n: inputs[n] for n in names}
    sizes = capture.trace_sizes(shapes)
    traced = capture.export(fn, names, ordered, sizes, outputs)
    unused = [name for node, name in traced.inputs.items() if not node.users]
    if unused:
        raise CaptureError(
            f"{fn.__qualname__}() does not use its inputs {unused}: a block's inputs are the "
            "tensors it computes from, so remove those parameters (and their inputs entries)"
        )
    graph = matcher.build(traced)
    if any(isinstance(op, Opaque) for op in graph):
        graph = _with_symbolic_shapes(graph, fn, names, ordered, sizes, outputs)
    out_names = [o for o, _ in traced.outputs]
    doc = inspect.getdoc(fn)
    summary = description or (doc.split("\n\n")[0].replace("\n", " ") if doc else "")
    source = function_source(fn, ordered, out_names)
    try:
        block = CapturedBlock(
            name=name,
            description=summary or f"captured from {fn.__qualname__}",
            inputs=ordered,
            graph=graph,
            outputs=out_names,
            shapes=shapes,
            tolerance=tolerance or Tolerance(),
            source=source,
        )
    except ValueError as e:
        raise CaptureError(
            f"{fn.__qualname__}: the captured block is not well formed: {e}"
        ) from None
    block._fn, block._seconds = fn, traced.seconds
    return block
