"""Providers: one protocol (``base``), one adapter per model source.

``builtin`` (offline planner, the default), ``anthropic`` and ``openai`` (official SDKs, imported
only when chosen), ``replay`` (a recorded transcript) and ``function`` (a Python function; tests).
``make_provider`` builds one by name, turning a missing SDK or key into a ``ProviderError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from coda.blocks.block import Block

from .base import (
    AssistantTurn,
    Message,
    Provider,
    ProviderError,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
    TranscriptExhausted,
    Usage,
    UserMessage,
)
from .builtin import BuiltinProvider
from .function import FunctionProvider
from .http import check_base_url
from .replay import ReplayProvider
from .retry import RetryPolicy

PROVIDERS = ("builtin", "anthropic", "openai", "replay")


def make_provider(
    name: str,
    block: Block,
    *,
    model: str | None = None,
    base_url: str | None = None,
    transcript: str | Path | None = None,
    replay_skip: int = 0,
) -> Provider:
    """The provider called ``name``. Raises ``ProviderError`` (kind ``config``) for an unknown
    name, a missing SDK, a missing key, a ``base_url`` that is not an http(s) URL with a host, or
    a missing ``--transcript``; the planner's ``NoRule`` when ``builtin`` cannot lower
    ``block``."""
    if base_url is not None and name in ("anthropic", "openai"):
        check_base_url(base_url)
    if name == "builtin":
        return BuiltinProvider(block)
    if name == "replay":
        if transcript is None:
            raise ProviderError(
                "--provider replay needs --transcript FILE (a run's transcript.jsonl)",
                kind="config",
            )
        return ReplayProvider(transcript, skip=replay_skip)
    if name == "anthropic":
        with _sdk(name):
            from .anthropic import AnthropicProvider

        return AnthropicProvider(model, base_url=base_url)
    if name == "openai":
        with _sdk(name):
            from .openai import OpenAIProvider

        return OpenAIProvider(model, base_url=base_url)
    raise ProviderError(
        f"unknown provider {name!r}: choose one of {', '.join(PROVIDERS)}", kind="config"
    )


@contextmanager
def _sdk(name: str) -> Iterator[None]:
    """Import the provider module of the SDK ``name``; the SDK missing is a ``ProviderError``
    (kind ``config``) that says which extra installs it. Another missing module stays an
    ``ImportError``: that is a broken installation, not a choice."""
    try:
        yield
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != name:
            raise
        raise ProviderError(
            f"--provider {name} needs the {name!r} package, which is not installed: "
            "pip install 'coda-agent[llm]'",
            kind="config",
        ) from None


__all__ = [
    "PROVIDERS",
    "AssistantTurn",
    "BuiltinProvider",
    "FunctionProvider",
    "Message",
    "Provider",
    "ProviderError",
    "ReplayProvider",
    "RetryPolicy",
    "RetryPromptPart",
    "TextPart",
    "ToolCallPart",
    "ToolResultPart",
    "ToolSpec",
    "TranscriptExhausted",
    "Usage",
    "UserMessage",
    "make_provider",
]
