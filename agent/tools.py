"""The agent's three tools: their specs, and how a call's arguments are checked.

Each tool is a pydantic model: its docstring is the tool description the model reads, its fields the
input schema. ``submit_program``'s schema says only that ``program`` is a JSON object: the Program's
fields, types and limits are in the system prompt's structure and catalogue (``prompting.py``,
generated from ``Program.model_json_schema()``), which the model reads once per request, and the
sandbox validates the Program and answers a malformed one with a Report that says what to change.
Sending the whole Program schema as well would bill the same facts twice on every turn.

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
from coda.primitives.ir import format_validation_error

from .providers.base import RetryPromptPart, ToolCallPart, ToolSpec


class SubmitProgram(BaseModel):
    """Submit a Program for the block to the sandbox; the answer is its Report.

    Input: {"program": <the Program as a JSON object, as the system prompt describes it>}.
    You may call it several times in one turn to try alternatives side by side: the programs are
    evaluated at once, each in its own worker, and each call gets its own Report.
    """

    program: Any  # a Program; the sandbox validates it so that errors come back as a Report


class DescribePrimitive(BaseModel):
    """Show one primitive's full documentation and JSON schema.

    ``name`` is an epilogue op (e.g. "scale_rows"), an aux step ("rstd"), a prep step
    ("interleave_rows"), or one of "Program", "gemm", "Operand", "TensorDecl", "OutputView",
    "MainloopConfig".
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
    """``{"program": <a JSON object>}``: the Program's own fields are described in the system
    prompt, once."""
    return {
        "type": "object",
        "properties": {
            "program": {
                "type": "object",
                "description": "The Program: see 'Program structure' and the catalogue.",
            }
        },
        "required": ["program"],
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
