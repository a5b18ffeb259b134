"""The ``openai`` provider: the official ``openai`` SDK's chat completions with function calling.

``base_url`` (``--base-url``) reaches any OpenAI-compatible server (vLLM, llama.cpp, Ollama): point
it at the API root that serves ``/chat/completions`` (e.g. ``http://localhost:8000/v1``). The key
comes from ``OPENAI_API_KEY``; it is required for OpenAI's own API, and optional with a custom
``--base-url`` (local servers usually ignore it; a placeholder is sent). The SDK's own retries are
off: the loop retries (``retry.py``). SDK types never leave this module.

OpenAI caches the longest prefix a request shares with a recent one on its own; every request here
starts with the same bytes (the tools, then the system prompt, then the conversation so far, each
serialised the same way on every turn), so each turn reads the previous turn's prefix from the
cache. To OpenAI's own API each request also names a ``prompt_cache_key`` (a hash of the tools and
the system prompt) so that requests sharing that prefix are routed to the same cache; other
OpenAI-compatible servers are not sent it (``cache_key=True`` sends it anyway). Cached tokens come
back as ``usage.prompt_tokens_details.cached_tokens`` and are priced at the cached-input rate.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import openai

from .base import (
    AssistantTurn,
    ProviderError,
    StopReason,
    TextPart,
    ToolCallPart,
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

DEFAULT_MODEL = "gpt-4.1"
KEY_VAR = "OPENAI_API_KEY"
DEFAULT_BASE_URL = "https://api.openai.com/v1"
PLACEHOLDER_KEY = "not-needed"  # sent to a custom --base-url when OPENAI_API_KEY is unset

_STOP: dict[str, StopReason] = {
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "stop": "end_turn",
    "length": "max_tokens",
    "content_filter": "refusal",
}


class OpenAIProvider:
    """Chat completions with tools. Raises ``ProviderError`` (kind ``config``) without a key for
    OpenAI's own API."""

    name = "openai"

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float = 600.0,
        cache_key: bool | None = None,
    ) -> None:
        where = "--base-url" if base_url else "OPENAI_BASE_URL"
        base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        if base_url:
            check_base_url(base_url, where)
        key = api_key or os.environ.get(KEY_VAR)
        if not key and not base_url:
            raise ProviderError(
                f"{KEY_VAR} is not set: export your OpenAI API key to use --provider openai, or "
                "pass --base-url for an OpenAI-compatible server that needs none "
                "(--provider builtin needs no key)",
                kind="config",
            )
        self.model = model or DEFAULT_MODEL
        self.base_url = base_url or DEFAULT_BASE_URL
        self.request_timeout_s = request_timeout_s
        self.cache_key = self.base_url == DEFAULT_BASE_URL if cache_key is None else cache_key
        self._sdk = SdkClient(
            lambda: openai.OpenAI(
                api_key=key or PLACEHOLDER_KEY,
                base_url=self.base_url,
                max_retries=0,
                timeout=request_timeout_s,
            ),
            where=where,
            base_url=self.base_url,
            example="http://localhost:8000/v1 (the root that serves /chat/completions)",
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
        client, request = self._sdk.client, self._request(system, messages, tools)
        with sdk_errors(
            openai, "OpenAI", key_var=KEY_VAR, model=self.model, base_url=self.base_url
        ):
            completion = call_within(
                limit,
                lambda: client.chat.completions.create(timeout=limit, model=self.model, **request),
                close=self._sdk.replace,
                expired=lambda: out_of_time(
                    "OpenAI", self.base_url, limit, self.request_timeout_s, timeout_s
                ),
            )
        return from_openai(completion, self.model)

    def _request(
        self, system: str, messages: list[UserMessage | AssistantTurn], tools: list[ToolSpec]
    ) -> dict[str, Any]:
        """The request's body: tools first, then the messages, the same bytes turn after turn."""
        specs = to_openai_tools(tools)
        body: dict[str, Any] = {"tools": specs, "messages": to_openai(system, messages)}
        if self.cache_key:
            body["prompt_cache_key"] = prompt_cache_key(system, specs)
        return body


# -- conversion ------------------------------------------------------------------------------------
def to_openai_tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as chat-completions functions, in the order given."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.input_schema,
            },
        }
        for t in tools
    ]


def prompt_cache_key(system: str, tools: list[dict[str, Any]]) -> str:
    """A name for the prefix every turn shares: a hash of the tools and the system prompt."""
    prefix = json.dumps([tools, system], sort_keys=True, ensure_ascii=False)
    return "coda-" + hashlib.sha256(prefix.encode()).hexdigest()[:32]


def to_openai(system: str, messages: list[UserMessage | AssistantTurn]) -> list[dict[str, Any]]:
    """The history as chat messages: system first; each tool result as a ``tool`` message right
    after the assistant message that called it; other user parts as one ``user`` message."""
    out: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for message in messages:
        if isinstance(message, AssistantTurn):
            out.append(_assistant(message))
            continue
        texts = []
        for part in message.parts:
            call_id = answered_call(part)
            if call_id is not None:
                out.append({"role": "tool", "tool_call_id": call_id, "content": part_text(part)})
            else:
                texts.append(part_text(part))
        if texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _assistant(turn: AssistantTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
    calls = [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in turn.tool_calls
    ]
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = "(empty)"
    return message


def from_openai(completion: Any, model: str) -> AssistantTurn:
    """The SDK's ``ChatCompletion`` as an ``AssistantTurn``; ``ProviderError`` when malformed."""
    choices = getattr(completion, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise malformed("OpenAI", "no `choices` in the completion")
    message = getattr(choices[0], "message", None)
    if message is None:
        raise malformed("OpenAI", "the first choice has no `message`")
    parts: list[TextPart | ToolCallPart] = []
    content = getattr(message, "content", None)
    if isinstance(content, str) and content.strip():
        parts.append(TextPart(text=content))
    for i, call in enumerate(getattr(message, "tool_calls", None) or []):
        fn = getattr(call, "function", None)
        name, arguments = getattr(fn, "name", None), getattr(fn, "arguments", None)
        if not isinstance(name, str):
            raise malformed("OpenAI", f"tool call {i} has no function name")
        call_id = getattr(call, "id", None) or f"call_{i}"
        parts.append(ToolCallPart(id=str(call_id), name=name, arguments=_text(arguments)))
    stop = _STOP.get(str(getattr(choices[0], "finish_reason", None)), "other")
    refusal = getattr(message, "refusal", None)
    if refusal:
        parts.append(TextPart(text=str(refusal)))
        stop = "refusal"
    elif any(isinstance(p, ToolCallPart) for p in parts):
        stop = "tool_use"  # some compatible servers say "stop" even when they call tools
    return AssistantTurn(
        parts=parts,
        usage=_usage(getattr(completion, "usage", None)),
        stop_reason=stop,
        model=str(getattr(completion, "model", None) or model),
    )


def _text(arguments: Any) -> str:
    if arguments is None:
        return "{}"
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _usage(usage: Any) -> Usage:
    """Token counts; servers that report none (some local ones) count as zero tokens, and a
    count that is reported must be a whole number ≥ 0 (``token_count``). ``prompt_tokens``
    includes the cached tokens that ``prompt_tokens_details`` breaks out."""
    prompt, completion = (getattr(usage, k, None) for k in ("prompt_tokens", "completion_tokens"))
    details = getattr(usage, "prompt_tokens_details", None)
    cached = {
        k: token_count("OpenAI", f"usage.prompt_tokens_details.{k}", v)
        for k in ("cached_tokens", "cache_write_tokens")
        if (v := getattr(details, k, None)) is not None
    }
    input_tokens = 0 if prompt is None else token_count("OpenAI", "usage.prompt_tokens", prompt)
    if sum(cached.values()) > input_tokens:
        raise malformed(
            "OpenAI",
            f"`usage.prompt_tokens_details` counts {sum(cached.values())} cached tokens, more than "
            f"the {input_tokens} `usage.prompt_tokens` that include them; the turn is not counted "
            "— check that --base-url points at a server that reports usage correctly",
        )
    return Usage(
        input_tokens=input_tokens,
        output_tokens=0
        if completion is None
        else token_count("OpenAI", "usage.completion_tokens", completion),
        cache_write_tokens=cached.get("cache_write_tokens", 0),
        cache_read_tokens=cached.get("cached_tokens", 0),
    )
