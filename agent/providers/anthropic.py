"""The ``anthropic`` provider: Claude through the official ``anthropic`` SDK (Messages API, tools).

Each ``complete`` is one ``client.messages.create`` call: the system prompt, the whole normalised
history converted to Messages-API content blocks (``text``, ``tool_use``, ``tool_result``), and the
tools with their JSON-Schema ``input_schema``. Every request asks for prompt caching
(``cache_control`` breakpoints, see ``cached_request``), so the tools, the system prompt and the
conversation so far are read from the cache on the next turn instead of being billed again at the
full input rate.
The key comes from ``ANTHROPIC_API_KEY``;
``base_url`` (``--base-url``) reaches a proxy or gateway. The SDK's own retries are off: the loop
retries (``retry.py``) so that each wait is visible. SDK types never leave this module.
"""

from __future__ import annotations

import json
import os
from typing import Any

import anthropic

from .base import (
    AssistantTurn,
    ProviderError,
    StopReason,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
    Usage,
    UserMessage,
    answered_call,
    part_text,
)
from .http import (
    SdkClient,
    call_within,
    check_base_url,
    malformed,
    out_of_time,
    request_timeout,
    sdk_errors,
    token_count,
)

DEFAULT_MODEL = "claude-sonnet-4-5"
KEY_VAR = "ANTHROPIC_API_KEY"
DEFAULT_BASE_URL = "https://api.anthropic.com"

_STOP: dict[str, StopReason] = {
    "tool_use": "tool_use",
    "end_turn": "end_turn",
    "stop_sequence": "end_turn",
    "max_tokens": "max_tokens",
    "model_context_window_exceeded": "max_tokens",
    "refusal": "refusal",
}


class AnthropicProvider:
    """Claude via the Messages API. Raises ``ProviderError`` (kind ``config``) without a key."""

    name = "anthropic"

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_output_tokens: int = 8192,
        request_timeout_s: float = 600.0,
    ) -> None:
        key = api_key or os.environ.get(KEY_VAR)
        if not key:
            raise ProviderError(
                f"{KEY_VAR} is not set: export your Anthropic API key to use --provider "
                "anthropic (--provider builtin needs no key)",
                kind="config",
            )
        self.model = model or DEFAULT_MODEL
        where = "--base-url" if base_url else "ANTHROPIC_BASE_URL"
        self.base_url = base_url or os.environ.get("ANTHROPIC_BASE_URL") or DEFAULT_BASE_URL
        check_base_url(self.base_url, where)
        self.max_output_tokens = max_output_tokens
        self.request_timeout_s = request_timeout_s
        self._sdk = SdkClient(
            lambda: anthropic.Anthropic(
                api_key=key, base_url=self.base_url, max_retries=0, timeout=request_timeout_s
            ),
            where=where,
            base_url=self.base_url,
            example=DEFAULT_BASE_URL,
        )

    def complete(
        self,
        system: str,
        messages: list[UserMessage | AssistantTurn],
        tools: list[ToolSpec],
        *,
        timeout_s: float | None = None,
    ) -> AssistantTurn:
        limit = request_timeout(self.request_timeout_s, timeout_s)
        client, request = self._sdk.client, cached_request(system, messages, tools)
        with sdk_errors(
            anthropic, "Anthropic", key_var=KEY_VAR, model=self.model, base_url=self.base_url
        ):
            response = call_within(
                limit,
                lambda: client.messages.create(
                    timeout=limit, model=self.model, max_tokens=self.max_output_tokens, **request
                ),
                close=self._sdk.replace,
                expired=lambda: out_of_time(
                    "Anthropic", self.base_url, limit, self.request_timeout_s, timeout_s
                ),
            )
        return from_anthropic(response, self.model)


# -- conversion ------------------------------------------------------------------------------------
EPHEMERAL = {"type": "ephemeral"}  # a 5-minute cache entry, refreshed each time it is read


def cached_request(
    system: str, messages: list[UserMessage | AssistantTurn], tools: list[ToolSpec]
) -> dict[str, Any]:
    """``system``, ``messages`` and ``tools`` for ``messages.create``, with cache breakpoints.

    The Messages API caches the request's prefix (tools, then system, then messages) up to each
    block marked ``cache_control``, at most 4 per request. The marks: the last tool (the tools),
    the system prompt (tools + system: the same on every turn of every run), and the last block of
    the last two user messages — the newest one writes the conversation so far to the cache, the
    one before reads what the previous turn wrote, however many blocks a turn added. A prefix
    shorter than the model's minimum (1,024–4,096 tokens) is simply not cached.
    """
    converted = [to_anthropic(m) for m in messages]
    users = [m for m in converted if m["role"] == "user" and m["content"]]
    for message in users[-2:]:
        message["content"][-1] = {**message["content"][-1], "cache_control": EPHEMERAL}
    specs = [
        {"name": t.name, "description": t.description, "input_schema": t.input_schema}
        for t in tools
    ]
    if specs:
        specs[-1]["cache_control"] = EPHEMERAL
    return {
        "system": [{"type": "text", "text": system, "cache_control": EPHEMERAL}],
        "messages": converted,
        "tools": specs,
    }


def to_anthropic(message: UserMessage | AssistantTurn) -> dict[str, Any]:
    """One normalised message as a Messages-API message (tool results first, as the API wants)."""
    if isinstance(message, AssistantTurn):
        blocks: list[dict[str, Any]] = []
        for part in message.parts:
            if isinstance(part, TextPart) and part.text.strip():
                blocks.append({"type": "text", "text": part.text})
            elif isinstance(part, ToolCallPart):
                blocks.append(
                    {"type": "tool_use", "id": part.id, "name": part.name, "input": _input(part)}
                )
        return {"role": "assistant", "content": blocks or [{"type": "text", "text": "(empty)"}]}
    results, texts = [], []
    for part in message.parts:
        call_id = answered_call(part)
        if call_id is not None:
            results.append(
                {
                    "type": "tool_result",
                    "tool_use_id": call_id,
                    "content": part_text(part),
                    "is_error": not isinstance(part, ToolResultPart) or part.is_error,
                }
            )
        else:
            texts.append({"type": "text", "text": part_text(part)})
    return {"role": "user", "content": results + texts}


def _input(call: ToolCallPart) -> dict[str, Any]:
    try:
        return call.parsed_arguments()
    except ValueError:
        return {}


def from_anthropic(response: Any, model: str) -> AssistantTurn:
    """The SDK's ``Message`` as an ``AssistantTurn``; ``ProviderError`` when it is malformed."""
    content = getattr(response, "content", None)
    if not isinstance(content, list):
        raise malformed("Anthropic", "no `content` list in the message")
    parts: list[TextPart | ToolCallPart] = []
    for block in content:
        kind = getattr(block, "type", None)
        if kind == "text":
            text = getattr(block, "text", None)
            parts.append(TextPart(text="" if text is None else str(text)))
        elif kind == "tool_use":
            name, call_id, args = (getattr(block, k, None) for k in ("name", "id", "input"))
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise malformed("Anthropic", "a `tool_use` block without `id` or `name`")
            parts.append(ToolCallPart(id=call_id, name=name, arguments=json.dumps(args or {})))
    reason = getattr(response, "stop_reason", None)
    if not isinstance(reason, str):
        raise malformed("Anthropic", "no `stop_reason`")
    stop = _STOP.get(reason, "other")
    if stop == "refusal":
        details = getattr(response, "stop_details", None)
        explanation = getattr(details, "explanation", None)
        if explanation:
            parts.append(TextPart(text=str(explanation)))
    return AssistantTurn(
        parts=parts,
        usage=_usage(getattr(response, "usage", None)),
        stop_reason=stop,
        model=str(getattr(response, "model", None) or model),
    )


def _usage(usage: Any) -> Usage:
    """The turn's tokens; every count present must be a whole number ≥ 0 (``token_count``).

    The Messages API reports uncached input (``input_tokens``), cache writes and cache reads
    separately; ``Usage.input_tokens`` is their sum, with the cached parts kept apart for pricing.
    """
    tokens = [getattr(usage, k, None) for k in ("input_tokens", "output_tokens")]
    if any(t is None for t in tokens):
        raise malformed("Anthropic", "no `usage` with `input_tokens` and `output_tokens`")
    counted = {
        k: token_count("Anthropic", f"usage.{k}", v)
        for k in ("input_tokens", "output_tokens", *_CACHE_FIELDS)
        if (v := getattr(usage, k, None)) is not None
    }
    written = counted.get("cache_creation_input_tokens", 0)
    read = counted.get("cache_read_input_tokens", 0)
    return Usage(
        input_tokens=counted["input_tokens"] + written + read,
        output_tokens=counted["output_tokens"],
        cache_write_tokens=written,
        cache_read_tokens=read,
    )


_CACHE_FIELDS = ("cache_creation_input_tokens", "cache_read_input_tokens")
