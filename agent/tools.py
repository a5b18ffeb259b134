"""The agent's three tools: their specs, and how a call's arguments are checked.

Each tool is a pydantic model: its docstring is the tool description the model reads, its fields the
input schema. ``submit_program``'s schema is ``{"program": <Program JSON schema>}`` with the
Program's ``$defs`` hoisted to the top level, so every ``$ref`` resolves inside the tool schema.

``parse_call`` turns a ``ToolCallPart`` into a typed request, or into a ``RetryPromptPart`` that
tells the model what was wrong with the call (bad JSON, unknown tool, missing field): errors are
data, never exceptions. Running the request (the sandbox, the catalogue) is the loop's job.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from coda.primitives.errors import did_you_mean
from coda.primitives.ir import Program, format_validation_error

from .providers.base import RetryPromptPart, ToolCallPart, ToolSpec


class SubmitProgram(BaseModel):
    """Submit a Program for the block to the sandbox.

    The sandbox validates it, checks its algebra against the block's PyTorch reference in float64,
    compiles it to Triton, verifies the kernels numerically (several shapes including ragged ones,
    two dtypes, several seeds) and, on a GPU, times them. The result is the Report: the first
    failing stage with what is wrong and what to change, or VERIFIED with the measured errors and
    timings (or why there are none). Input: {"program": <the Program as a JSON object>}.
    You may call it several times in one turn to try alternatives side by side: the programs are
    evaluated at once, each in its own worker, and each call gets its own Report.
    """

    program: Any  # a Program; the sandbox validates it so that errors come back as a Report


class DescribePrimitive(BaseModel):
    """Show one primitive's full documentation and JSON schema.

    ``name`` is an epilogue op (e.g. "scale_rows"), an aux step ("rstd"), a prep step
    ("interleave_rows"), or one of "Program", "gemm", "Operand", "TensorDecl", "MainloopConfig".
    """

    name: str


class Finish(BaseModel):
    """End the run, with a one-line ``reason``.

    Call it once a program is verified and you cannot make it faster (or timings are not measured
    on this device), or when you cannot make progress. The best verified program is kept.
    """

    reason: str


TOOLS: dict[str, type[BaseModel]] = {
    "submit_program": SubmitProgram,
    "describe_primitive": DescribePrimitive,
    "finish": Finish,
}


def _description(model: type[BaseModel]) -> str:
    return inspect.cleandoc(model.__doc__ or "")


def submit_program_schema() -> dict[str, Any]:
    """``{"program": <Program schema>}`` with the Program's ``$defs`` at the top level."""
    program = Program.model_json_schema()
    defs = program.pop("$defs", {})
    return {
        "type": "object",
        "properties": {"program": program},
        "required": ["program"],
        "$defs": defs,
    }


def _plain_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    return {k: v for k, v in schema.items() if k not in ("title", "description")}


def tool_specs() -> list[ToolSpec]:
    """The tools offered to every provider, in a fixed order."""
    return [
        ToolSpec(
            name="submit_program",
            description=_description(SubmitProgram),
            input_schema=submit_program_schema(),
        ),
        *(
            ToolSpec(name=name, description=_description(model), input_schema=_plain_schema(model))
            for name, model in TOOLS.items()
            if name != "submit_program"
        ),
    ]


@dataclass(frozen=True)
class Request:
    """A well-formed tool call: which tool, with its validated arguments."""

    call: ToolCallPart
    args: BaseModel


def parse_call(call: ToolCallPart) -> Request | RetryPromptPart:
    """Check a call's tool name and arguments; a ``RetryPromptPart`` says what to fix."""

    def retry(message: str) -> RetryPromptPart:
        return RetryPromptPart(content=message, tool_call_id=call.id, name=call.name)

    model = TOOLS.get(call.name)
    if model is None:
        return retry(f"there is no tool {call.name!r}: {did_you_mean(call.name, TOOLS)}")
    try:
        raw = call.parsed_arguments()
    except ValueError as e:
        return retry(f"{e}; send a JSON object matching the tool's input schema")
    try:
        args = model.model_validate(raw)
    except ValidationError as e:
        text = format_validation_error(e).replace("invalid program:", "invalid arguments:", 1)
        return retry(f"{call.name}: {text}")
    return Request(call, args)
