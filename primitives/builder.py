"""A fluent Python builder for Programs, and ``Program.to_python()`` that prints builder calls.

Builder methods are generated from the registries, so every primitive, prep step and aux step is
available by its JSON name the moment its module exists::

    b = ProgramBuilder("llama_mlp", inputs={"x": ["M", "d"], ...})
    b.interleave_rows(first="w_gate", second="w_up", out="w_gu")     # prep steps
    b.rstd(src="x", eps=1e-5, out="r")                                 # aux steps
    g = b.gemm("x", "w_gu.T", name="gate_up")                          # a GemmEpilogue
    g.scale_rows(src="acc", vector="r", out="z").swiglu(src="z", out="h").store(src="h", to="h")
    b.output("out", "out")
    program = b.build()

The builder records plain dicts and ``build()`` validates them with ``Program.parse`` — the same
path JSON takes — so the two forms give identical Programs and identical error messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import AuxStep, EpilogueOp, PrepStep
from .errors import did_you_mean
from .ir import GemmEpilogue, MainloopConfig, Program


def _node_call(
    cls: type, tag_field: str, tag: str, sink: Callable[[dict[str, Any]], None], chain: Any
) -> Callable[..., Any]:
    fields = [f for f in cls.model_fields if f != tag_field]

    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > len(fields):
            raise TypeError(f"{tag}() takes at most {len(fields)} positional arguments ({fields})")
        node = {tag_field: tag, **dict(zip(fields, args, strict=False)), **kwargs}
        sink(node)
        return chain

    call.__name__ = tag
    call.__doc__ = cls.__doc__
    return call


class EpilogueBuilder:
    """Appends epilogue ops to one ``gemm`` step; every method returns the builder (chainable)."""

    acc = "acc"

    def __init__(self, step: dict[str, Any]) -> None:
        self._step = step

    def __getattr__(self, op: str) -> Callable[..., EpilogueBuilder]:
        if op.startswith("_") or op not in EpilogueOp.registry:
            raise AttributeError(f"no epilogue op {op!r}: {did_you_mean(op, EpilogueOp.registry)}")
        return _node_call(EpilogueOp.registry[op], "op", op, self._step["epilogue"].append, self)


class ProgramBuilder:
    """Builds a ``Program``: prep and aux steps by name, ``gemm(...)`` for fused kernels."""

    def __init__(self, block: str, inputs: dict[str, Any]) -> None:
        self._data: dict[str, Any] = {
            "block": block,
            "inputs": dict(inputs),
            "prep": [],
            "steps": [],
            "outputs": {},
        }

    def __getattr__(self, kind: str) -> Callable[..., ProgramBuilder]:
        if kind.startswith("_"):
            raise AttributeError(kind)
        if kind in PrepStep.registry:
            return _node_call(
                PrepStep.registry[kind], "kind", kind, self._data["prep"].append, self
            )
        if kind in AuxStep.registry:
            return _node_call(
                AuxStep.registry[kind], "kind", kind, self._data["steps"].append, self
            )
        known = [*PrepStep.registry, *AuxStep.registry, "gemm", "output"]
        raise AttributeError(f"no prep or aux step {kind!r}: {did_you_mean(kind, known)}")

    def gemm(
        self,
        a: str | dict[str, Any],
        b: str | dict[str, Any],
        *,
        name: str | None = None,
        config: str | dict[str, Any] | MainloopConfig = "auto",
    ) -> EpilogueBuilder:
        """Start a fused kernel ``acc = a @ b`` (``"w.T"`` transposes); add its epilogue ops."""
        if isinstance(config, MainloopConfig):
            config = config.model_dump()
        step: dict[str, Any] = {"kind": "gemm", "a": a, "b": b, "epilogue": [], "config": config}
        if name is not None:
            step["name"] = name
        self._data["steps"].append(step)
        return EpilogueBuilder(step)

    def output(self, name: str, tensor: str | dict[str, Any]) -> ProgramBuilder:
        """Declare that program tensor ``tensor`` (or a view ``{"tensor": ..., "dim": ...,
        "start": ..., "stop": ..., "step": ...}``) is the block's output ``name``."""
        self._data["outputs"][name] = tensor
        return self

    def build(self) -> Program:
        return Program.parse(self._data)


# -- printing --------------------------------------------------------------------------------------
def _kwargs(node: Any, skip: str) -> str:
    data = node.model_dump(mode="json", exclude_defaults=True)
    data.pop(skip, None)
    return ", ".join(f"{k}={v!r}" for k, v in data.items())


def gemm_to_python(step: GemmEpilogue, var: str = "g", builder: str = "b") -> list[str]:
    """The builder lines of one gemm step."""
    head = [repr(step.a.text()), repr(step.b.text())]
    if step.name is not None:
        head.append(f"name={step.name!r}")
    if step.config != "auto":
        head.append(f"config={step.config.model_dump()!r}")
    lines = [f"{var} = {builder}.gemm({', '.join(head)})"]
    lines += [f"{var}.{op.op}({_kwargs(op, 'op')})" for op in step.epilogue]
    return lines


def program_to_python(program: Program) -> str:
    inputs = {
        name: decl.shape if decl.dtype == "act" else decl.model_dump(mode="json")
        for name, decl in program.inputs.items()
    }
    lines = [
        "from coda.primitives import ProgramBuilder",
        "",
        f"b = ProgramBuilder({program.block!r}, inputs={inputs!r})",
    ]
    lines += [f"b.{p.kind}({_kwargs(p, 'kind')})" for p in program.prep]
    for step in program.steps:
        if isinstance(step, GemmEpilogue):
            lines += gemm_to_python(step)
        else:
            lines.append(f"b.{step.kind}({_kwargs(step, 'kind')})")
    for k, v in program.outputs.items():
        value = v if isinstance(v, str) else v.model_dump(mode="json", exclude_defaults=True)
        lines.append(f"b.output({k!r}, {value!r})")
    lines.append("program = b.build()")
    return "\n".join(lines) + "\n"
