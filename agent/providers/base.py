"""The provider protocol: normalised messages in, one assistant turn out.

Every provider (the built-in planner, Anthropic, OpenAI, a replayed transcript, a test's scripted
function) speaks these types and nothing else; SDK types never leave their adapter module. All of
them are pydantic models that serialise to JSON and back, so a transcript on disk can rebuild the
exact message history (``--resume``) or stand in for the model (``--provider replay``).

Message parts (pydantic-ai's vocabulary):

* ``TextPart`` — prose, from the user (the task) or the assistant (its reasoning).
* ``ToolCallPart`` — the assistant calls a tool; ``arguments`` is the JSON text *as the model sent
  it* (it may be malformed: the loop answers with the parse error).
* ``ToolResultPart`` — the loop's answer to one call: ``content`` is what the model reads (e.g. a
  compact sandbox Report); ``data`` is structured detail for programs (the full Report), never sent
  to an LLM.
* ``RetryPromptPart`` — a validation error the model must fix (bad JSON, unknown tool, missing
  field); sent as an error tool result when it answers a call, otherwise as a user note.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TextPart(_Part):
    """Plain text."""

    kind: Literal["text"] = "text"
    text: str


class ToolCallPart(_Part):
    """The assistant asks for a tool; ``arguments`` is the model's JSON text, unparsed."""

    kind: Literal["tool_call"] = "tool_call"
    id: str
    name: str
    arguments: str = "{}"

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a JSON object; ``ValueError`` says what is wrong with them."""
        try:
            value = json.loads(self.arguments or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(
                f"the arguments of {self.name!r} are not valid JSON ({e.msg} at line {e.lineno}, "
                f"column {e.colno})"
            ) from None
        except RecursionError:
            raise ValueError(
                f"the arguments of {self.name!r} are nested too deeply to read (a Program nests "
                "a few levels)"
            ) from None
        except ValueError:  # a number longer than Python reads (4300 digits)
            raise ValueError(
                f"the arguments of {self.name!r} hold a number too long to read (over 4300 digits)"
            ) from None
        if not isinstance(value, dict):
            raise ValueError(
                f"the arguments of {self.name!r} must be a JSON object, not {type(value).__name__}"
            )
        return value


class ToolResultPart(_Part):
    """The loop's answer to tool call ``tool_call_id``."""

    kind: Literal["tool_result"] = "tool_result"
    tool_call_id: str
    name: str
    content: str
    is_error: bool = False
    data: dict[str, Any] | None = None  # structured detail for programs; never sent to an LLM


class RetryPromptPart(_Part):
    """A correction the model must act on; answers call ``tool_call_id`` when there is one."""

    kind: Literal["retry_prompt"] = "retry_prompt"
    content: str
    tool_call_id: str | None = None
    name: str | None = None


UserPart = Annotated[TextPart | ToolResultPart | RetryPromptPart, Field(discriminator="kind")]
AssistantPart = Annotated[TextPart | ToolCallPart, Field(discriminator="kind")]


class Usage(BaseModel):
    """Tokens one turn consumed, as the provider reported them.

    ``input_tokens`` counts every input token, cached or not; ``cache_write_tokens`` (written to
    the provider's prompt cache) and ``cache_read_tokens`` (read from it) are the parts of it that
    were billed at the cache rates (``pricing.py``). Every count is a whole number ≥ 0, and the
    cached parts never exceed the input they belong to.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    input_tokens: NonNegativeInt = 0
    output_tokens: NonNegativeInt = 0
    cache_write_tokens: NonNegativeInt = 0
    cache_read_tokens: NonNegativeInt = 0

    @model_validator(mode="after")
    def _cached_within_input(self) -> Usage:
        cached = self.cache_write_tokens + self.cache_read_tokens
        if cached > self.input_tokens:
            raise ValueError(
                f"cache_write_tokens + cache_read_tokens ({cached}) exceed input_tokens "
                f"({self.input_tokens}): the cached tokens are part of the input"
            )
        return self

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def uncached_input_tokens(self) -> int:
        """Input tokens billed at the full input rate."""
        return self.input_tokens - self.cache_write_tokens - self.cache_read_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
            cache_read_tokens=self.cache_read_tokens + other.cache_read_tokens,
        )


StopReason = Literal["tool_use", "end_turn", "max_tokens", "refusal", "other"]


class UserMessage(BaseModel):
    """What the loop sends: the task, tool results, corrections."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    role: Literal["user"] = "user"
    parts: list[UserPart]


class AssistantTurn(BaseModel):
    """One completion: the assistant's parts, the tokens it cost and why it stopped."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    role: Literal["assistant"] = "assistant"
    parts: list[AssistantPart]
    usage: Usage = Usage()
    stop_reason: StopReason = "end_turn"
    model: str = ""

    @property
    def text(self) -> str:
        return "\n".join(p.text for p in self.parts if isinstance(p, TextPart)).strip()

    @property
    def tool_calls(self) -> list[ToolCallPart]:
        return [p for p in self.parts if isinstance(p, ToolCallPart)]


Message = Annotated[UserMessage | AssistantTurn, Field(discriminator="role")]


class ToolSpec(BaseModel):
    """A tool the model may call: name, description (from a docstring), JSON-Schema input."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    description: str
    input_schema: dict[str, Any]


ErrorKind = Literal[
    "config", "auth", "not_found", "network", "rate_limit", "server", "bad_request", "malformed"
]


class ProviderError(Exception):
    """A provider could not produce a turn. ``message`` says what happened and what to change.

    ``retryable`` errors (rate limits, overloaded or failing servers, dropped connections) are
    retried by the loop with bounded backoff; ``retry_after`` is the server's requested wait.
    ``exit_code`` is 2 for configuration problems (missing or rejected key, unknown model or
    endpoint), 1 for a failed run.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: ErrorKind,
        retryable: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.retryable = retryable
        self.retry_after = retry_after

    @property
    def exit_code(self) -> int:
        return 2 if self.kind in ("config", "auth", "not_found") else 1


class DeadlineExceeded(ProviderError):
    """The run's wall-clock budget (``--timeout``) ran out before or during a provider request,
    or left no time to retry one: the loop stops the run as a timeout, not a provider failure."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="network")


class TranscriptExhausted(ProviderError):
    """A replayed transcript has no more recorded turns."""

    def __init__(self, turns: int) -> None:
        super().__init__(
            f"the replayed transcript has no more assistant turns ({turns} were recorded)",
            kind="config",
        )


@runtime_checkable
class Provider(Protocol):
    """A model: given the system prompt, the history and the tools, produce the next turn.

    ``timeout_s`` is the longest this one request may take (the run's remaining wall-clock time;
    ``None``: no run limit): a provider that makes requests bounds each by it (and by its own
    request timeout); a local one may ignore it.
    """

    name: str  # "builtin", "anthropic", "openai", "replay", ...
    model: str  # the model identifier used for pricing and records

    def complete(
        self,
        system: str,
        messages: list[UserMessage | AssistantTurn],
        tools: list[ToolSpec],
        *,
        timeout_s: float | None = None,
    ) -> AssistantTurn: ...


def answered_call(part: TextPart | ToolResultPart | RetryPromptPart) -> str | None:
    """The id of the tool call ``part`` answers (an error answer for a ``RetryPromptPart``)."""
    return None if isinstance(part, TextPart) else part.tool_call_id


def part_text(part: TextPart | ToolResultPart | RetryPromptPart) -> str:
    return part.text if isinstance(part, TextPart) else part.content


def tool_call_ids(messages: list[UserMessage | AssistantTurn]) -> set[str]:
    """Every tool-call id already used in ``messages`` (providers make new ids unique)."""
    return {c.id for m in messages if isinstance(m, AssistantTurn) for c in m.tool_calls}
