"""Scripted models for the agent tests: turns built by hand, programs for llama_mlp that fail or
verify, and fast sandbox options (in process, one seed, two ragged shapes)."""

from __future__ import annotations

import copy
import json
from typing import Any

from coda.agent.providers import AssistantTurn, FunctionProvider, TextPart, ToolCallPart, Usage
from coda.blocks import get_block
from coda.planner import lower
from coda.sandbox import SandboxOptions

BLOCK = get_block("llama_mlp")
FAST = SandboxOptions(
    isolate=False, seeds=[0], shapes=[{"M": 67, "d": 48, "f": 80}, {"M": 5, "d": 24, "f": 36}]
)


def good_program() -> dict[str, Any]:
    return lower(BLOCK).model_dump(mode="json")


def broken_program() -> dict[str, Any]:
    """The good program without the residual: its algebra fails at the semantics stage."""
    data = copy.deepcopy(good_program())
    data["steps"][2]["epilogue"] = [{"op": "store", "src": "acc", "to": "out"}]
    return data


def call(name: str, args: Any, call_id: str) -> ToolCallPart:
    text = args if isinstance(args, str) else json.dumps(args)
    return ToolCallPart(id=call_id, name=name, arguments=text)


def turn(
    *calls: ToolCallPart,
    text: str = "",
    usage: tuple[int, int] = (100, 20),
    stop: str = "tool_use",
    model: str = "test-model",
) -> AssistantTurn:
    parts: list[Any] = [TextPart(text=text)] if text else []
    return AssistantTurn(
        parts=[*parts, *calls],
        usage=Usage(input_tokens=usage[0], output_tokens=usage[1]),
        stop_reason=stop if calls or stop != "tool_use" else "end_turn",
        model=model,
    )


def submit(program: Any, call_id: str, **kw: Any) -> AssistantTurn:
    return turn(call("submit_program", {"program": program}, call_id), **kw)


def finish(reason: str = "done", call_id: str = "fin", **kw: Any) -> AssistantTurn:
    return turn(call("finish", {"reason": reason}, call_id), **kw)


class Script(FunctionProvider):
    """Returns the given turns in order (an item that is an exception is raised instead) and
    keeps every request it saw."""

    def __init__(self, turns: list[Any], model: str = "test-model") -> None:
        self.turns = list(turns)
        self.requests: list[list] = []
        super().__init__(self._next, model=model)

    def _next(self, system: str, messages: list, tools: list) -> AssistantTurn:
        self.requests.append(list(messages))
        item = self.turns.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item
