"""A provider backed by a Python function: the scripted model tests use (pydantic-ai's
``FunctionModel``). ``fn(system, messages, tools)`` returns the next ``AssistantTurn`` — or
raises ``ProviderError`` to play a failing server."""

from __future__ import annotations

from collections.abc import Callable

from .base import AssistantTurn, ToolSpec, UserMessage

TurnFunction = Callable[[str, list[UserMessage | AssistantTurn], list[ToolSpec]], AssistantTurn]


class FunctionProvider:
    name = "function"

    def __init__(self, fn: TurnFunction, model: str = "function") -> None:
        self.fn = fn
        self.model = model

    def complete(
        self,
        system: str,
        messages: list[UserMessage | AssistantTurn],
        tools: list[ToolSpec],
        *,
        timeout_s: float | None = None,  # nothing here waits on a server
    ) -> AssistantTurn:
        return self.fn(system, messages, tools)
