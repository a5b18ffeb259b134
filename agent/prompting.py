"""What the model reads: the system prompt, the task prompt, and ``describe_primitive``'s answers.

The primitive catalogue is generated from the IR itself — every class in ``EpilogueOp.registry``,
``AuxStep.registry`` and ``PrepStep.registry``, with its docstring and its JSON form (each field's
type, limits and default) read from its JSON schema — so a primitive added to ``primitives/``
appears here with no edit, and the prompt cannot drift from the schema the sandbox validates
against. The system prompt is the one place the model reads a Program's fields: the
``submit_program`` tool's input schema only says that ``program`` is an object (``tools.py``), so
the same facts are not sent twice on every turn. Templates live in ``coda.prompts``.

For a block the built-in planner cannot lower whole, the task also lists every op it left (with
its reason) and the partial Program of the rest, as a starting point (``planner_note``); for a
block it lowers whole, the model gets no part of the planner's Program.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from coda import prompts
from coda.blocks import Add, Block, Linear, RMSNorm, ShapeSets, TensorSpec
from coda.planner import lower, refusal
from coda.primitives import backend
from coda.primitives.aux.layout import RowPart
from coda.primitives.base import AuxStep, EpilogueOp, PrepStep
from coda.primitives.errors import did_you_mean
from coda.primitives.ir import (
    GemmEpilogue,
    MainloopConfig,
    Operand,
    OutputView,
    Program,
    TensorDecl,
)
from coda.sandbox.stages import SandboxOptions


@dataclass(frozen=True)
class PrimitiveDoc:
    """One documented node: a primitive (epilogue op, aux or prep step) or a structural model."""

    name: str
    family: str  # "epilogue op", "aux step", "prep step" or "structure"
    model: type[BaseModel]
    tag: str | None = None  # the discriminator field ("op" or "kind") a JSON node must carry
    port: str | None = None

    @property
    def doc(self) -> str:
        return inspect.cleandoc(self.model.__doc__ or "(undocumented)")

    def schema(self) -> dict[str, Any]:
        return self.model.model_json_schema()

    def signature(self) -> str:
        """The node's JSON form, e.g. ``{"op": "store", "src": string, "to": string, "mode"?:
        "write" | "accumulate" = "write"}``: the tag, the required fields, then the optional ones
        (``?``) with their defaults, each with its type and limits from the JSON schema."""
        schema = self.schema()
        required = set(schema.get("required", []))
        properties = schema.get("properties", {})
        parts = [f'"{self.tag}": "{self.name}"'] if self.tag else []
        for field, prop in properties.items():
            if field in required:
                parts.append(f'"{field}": {_field_text(prop)}')
        for field, prop in properties.items():
            if field not in required and field != self.tag:
                parts.append(f'"{field}"?: {_field_text(prop, optional=True)}')
        return "{" + ", ".join(parts) + "}"

    def heading(self) -> str:
        return f"### `{self.name}` — {self.family}"

    def markdown(self) -> str:
        return f"{self.heading()}\n\n`{self.signature()}`\n\n{self.doc}"


def _field_text(prop: dict[str, Any], optional: bool = False) -> str:
    """A field's type and limits, and its default when it has a non-null one (an optional field
    that defaults to null is simply left out, so only its other types are shown)."""
    default = prop.get("default")
    if optional and default is None:
        prop = _without_null(prop)
    text = _type_text(prop)
    limits = _limits(prop)
    if limits:
        text += f" ({limits})"
    if optional and default is not None:
        text += f" = {json.dumps(default, ensure_ascii=False)}"
    return text


def _without_null(prop: dict[str, Any]) -> dict[str, Any]:
    choices = [p for p in prop.get("anyOf", []) if p.get("type") != "null"]
    if not choices or len(choices) == len(prop["anyOf"]):
        return prop
    rest = {k: v for k, v in prop.items() if k != "anyOf"}
    return {**rest, **choices[0]} if len(choices) == 1 else {**rest, "anyOf": choices}


def _type_text(prop: dict[str, Any]) -> str:
    if "const" in prop:
        return json.dumps(prop["const"])
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "discriminator" in prop:
        return _tagged_union(prop["discriminator"])
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return " | ".join(_type_text(p) for p in prop[key])
    kind = prop.get("type")
    if kind == "array":
        return f"list of {_type_text(prop.get('items', {}))}"
    if kind == "object":
        values = prop.get("additionalProperties")
        return f"object of {_type_text(values)}" if isinstance(values, dict) else "object"
    return str(kind or "any")


def _tagged_union(discriminator: dict[str, Any]) -> str:
    """A union tagged by ``op`` or ``kind``, named by the catalogue families it admits."""
    names = set(discriminator.get("mapping", {}))
    families = []
    if names & set(EpilogueOp.registry):
        families.append("epilogue op")
    if "gemm" in names:
        families.append("gemm")
    if names & set(AuxStep.registry):
        families.append("aux step")
    if names & set(PrepStep.registry):
        families.append("prep step")
    return " | ".join(families) or f'node tagged by "{discriminator["propertyName"]}"'


def _limits(prop: dict[str, Any]) -> str:
    marks = {
        "exclusiveMinimum": ">",
        "minimum": "≥",
        "exclusiveMaximum": "<",
        "maximum": "≤",
        "minItems": "at least",
        "maxItems": "at most",
        "minProperties": "at least",
    }
    return ", ".join(f"{sign} {prop[k]}" for k, sign in marks.items() if k in prop)


# -- the catalogue ---------------------------------------------------------------------------------
def primitives() -> list[PrimitiveDoc]:
    """Every registered epilogue op, aux step and prep step, in registration order."""
    docs = [
        PrimitiveDoc(name, "epilogue op", cls, tag="op", port=cls.port.value)
        for name, cls in EpilogueOp.registry.items()
    ]
    docs += [PrimitiveDoc(n, "aux step", c, tag="kind") for n, c in AuxStep.registry.items()]
    docs += [PrimitiveDoc(n, "prep step", c, tag="kind") for n, c in PrepStep.registry.items()]
    return docs


def structure() -> list[PrimitiveDoc]:
    """The models a Program is built from, outermost first."""
    return [
        PrimitiveDoc("Program", "structure", Program),
        PrimitiveDoc("TensorDecl", "structure", TensorDecl),
        PrimitiveDoc("OutputView", "structure", OutputView),
        PrimitiveDoc("gemm", "structure", GemmEpilogue, tag="kind"),
        PrimitiveDoc("Operand", "structure", Operand),
        PrimitiveDoc("MainloopConfig", "structure", MainloopConfig),
        PrimitiveDoc("RowPart", "structure", RowPart),
    ]


class UnknownPrimitive(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def lookup(name: str) -> PrimitiveDoc:
    """The documented node called ``name``; ``UnknownPrimitive`` says what exists."""
    docs = {d.name: d for d in [*primitives(), *structure()]}
    if name not in docs:
        raise UnknownPrimitive(f"no primitive named {name!r}: {did_you_mean(name, docs)}")
    return docs[name]


def describe_primitive(name: str) -> str:
    """A primitive's documentation and its full JSON schema (``describe_primitive``'s answer)."""
    doc = lookup(name)
    schema = {k: v for k, v in doc.schema().items() if k != "description"}  # the doc, above
    return f"{doc.markdown()}\n\nJSON schema:\n{compact_json(schema)}"


def catalogue() -> str:
    return "\n\n".join(d.markdown() for d in primitives())


# -- prompts ---------------------------------------------------------------------------------------
def _example_block() -> Block:
    return Block(
        name="norm_proj_residual",
        description="out = x + rmsnorm(x, gamma) @ w.T",
        inputs={
            "x": TensorSpec(shape=["M", "d"]),
            "gamma": TensorSpec(shape=["d"], init="norm_weight"),
            "w": TensorSpec(shape=["d", "d"], init="linear_weight"),
        },
        graph=[
            RMSNorm(x="x", weight="gamma", eps=1e-5, out="h"),
            Linear(x="h", weight="w", out="y"),
            Add(a="x", b="y", out="out"),
        ],
        outputs=["out"],
        shapes=ShapeSets(cpu=[{"M": 8, "d": 16}]),
    )


def system_prompt() -> str:
    """The system prompt: how to work, the algebra, the structure, the generated catalogue and a
    worked example (lowered by the built-in planner, so it is a Program that verifies)."""
    return prompts.render(
        "system",
        structure="\n\n".join(d.markdown() for d in structure()),
        catalogue=catalogue(),
        example=compact_json(example_program()),
    )


def example_program() -> dict[str, Any]:
    """The worked example as an author would write it: tags, shorthands, no default fields."""
    return authored(lower(_example_block()))


def authored(program: Program) -> dict[str, Any]:
    """``program`` as an author would write it: tags, shorthands, no default fields."""
    data = program.model_dump(mode="json", exclude_defaults=True)
    data["inputs"] = {n: d.shape for n, d in program.inputs.items()}
    if program.prep:  # no prep is the default, left out of ``data``
        data["prep"] = [
            {"kind": p.kind, **d} for p, d in zip(program.prep, data["prep"], strict=True)
        ]
    steps = []
    for step, d in zip(program.steps, data["steps"], strict=True):
        d = {"kind": step.kind, **d}
        if step.kind == "gemm":
            d.update(a=step.a.text(), b=step.b.text())
            d["epilogue"] = [
                {"op": op.op, **e} for op, e in zip(step.epilogue, d["epilogue"], strict=True)
            ]
        steps.append(d)
    data["steps"] = steps
    return data


def compact_json(value: Any, indent: int = 0, width: int = 100) -> str:
    """JSON that puts each node on one line when it fits in ``width`` columns."""
    text = json.dumps(value, ensure_ascii=False)
    if len(text) + indent <= width or not isinstance(value, dict | list):
        return text
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [
            f"{pad}{json.dumps(k)}: {compact_json(v, indent + 2, width)}" for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + compact_json(v, indent + 2, width) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def task_prompt(block: Block, options: SandboxOptions | None = None) -> str:
    """The task: the block's reference source, the Program header to copy, shapes and device."""
    options = options or SandboxOptions()
    header = {
        "block": block.name,
        "inputs": block.program_inputs(),
        "outputs": {o: o for o in block.outputs},
    }
    tol = block.tolerance
    return prompts.render(
        "task",
        name=block.name,
        description=block.description,
        source=block.reference_source().rstrip(),
        header=compact_json(header),
        shapes="\n".join(f"- {json.dumps(s)}" for s in options.verify_shapes(block)),
        dtypes=", ".join(options.verify_dtypes()),
        seeds=", ".join(map(str, options.seeds)),
        tolerance=(
            f"Each output passes when max|out − ref64| ≤ {tol.ratio:g} × (PyTorch's own error in "
            f"that dtype) + floor × max|ref64| (floor {json.dumps(tol.floor)}), its relative "
            f"error is within {json.dumps(tol.rel)}, and it has no NaN or Inf."
        ),
        device=_device_note(),
        planner=planner_note(block),
    )


def planner_note(block: Block) -> str:
    """The task's section on what the built-in planner could not lower: every op it left, with
    why, and the partial Program of the rest to start from. Empty when it lowers the whole block
    (the model then writes its own Program)."""
    result = refusal(block)
    if result is None:
        return ""
    lines = [
        "",
        "## What the built-in planner could not lower",
        "",
        "CODA's rewrite rules do not lower these ops of the block (`graph[i]` is the i-th line, "
        "from 0, of the block function's body above):",
        "",
        *(f"- {u.line()}" for u in result.unlowered),
        "",
    ]
    partial = result.partial
    if partial is None:
        lines.append("They lowered nothing else into a Program: write the whole Program.")
        return "\n".join(lines) + "\n"
    computes = ", ".join(f"`{v}`" for v in partial.computes)
    lines += [
        f"They lowered the other ops into this partial Program, which computes {computes} (the "
        "block outputs it reaches and the values the ops above read). Start from it: keep its "
        "steps, add steps for what the ops above compute (in an epilogue of a GEMM, or an aux "
        "step), and map `outputs` to the block's outputs as the header says.",
        "",
        "```json",
        compact_json(authored(partial.program)),
        "```",
    ]
    return "\n".join(lines) + "\n"


def _device_note() -> str:
    if backend.INTERPRET:
        return (
            f"Kernels run on {backend.describe()}. Timings are NOT measured on this device: once a "
            "program verifies there is nothing to improve here, so call `finish`."
        )
    return (
        f"Kernels run on {backend.describe()}. The profile stage measures median times at the "
        "block's benchmark shapes; among verified programs, faster is better."
    )
