"""Oversized replies: what the loop keeps of an assistant part longer than ``MAX_PART_CHARS``.

A model (or a server) may answer with megabytes: a runaway text, a tool call whose arguments
repeat forever. The loop records every reply in the transcript and sends the history back on every
turn, so such a part is cut to ``MAX_PART_CHARS`` characters before it is recorded, with a note
saying how many were cut. A cut tool call is not run (its arguments are no longer whole): the loop
answers it with an error the model can act on (``call_note``); a cut text gets a note too
(``text_note``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .providers.base import AssistantTurn, TextPart, ToolCallPart

MAX_PART_CHARS = 256 * 1024  # a Program is a few KB of JSON; the longest prompt part ~30 KB


@dataclass(frozen=True)
class Cut:
    """One part that was cut: its original length; ``call`` for a tool call's arguments."""

    chars: int
    call: ToolCallPart | None = None

    @property
    def removed(self) -> int:
        return self.chars - MAX_PART_CHARS


def _clipped(text: str) -> str:
    cut = len(text) - MAX_PART_CHARS
    return (
        f"{text[:MAX_PART_CHARS]}\n[… {cut} characters cut: a reply part is kept up to "
        f"{MAX_PART_CHARS} characters]"
    )


def clip_reply(reply: AssistantTurn) -> tuple[AssistantTurn, list[Cut]]:
    """``reply`` with every part past ``MAX_PART_CHARS`` cut (and noted), and what was cut."""
    parts: list[TextPart | ToolCallPart] = []
    cuts: list[Cut] = []
    for part in reply.parts:
        if isinstance(part, TextPart) and len(part.text) > MAX_PART_CHARS:
            cuts.append(Cut(len(part.text)))
            part = part.model_copy(update={"text": _clipped(part.text)})
        elif isinstance(part, ToolCallPart) and len(part.arguments) > MAX_PART_CHARS:
            chars = len(part.arguments)
            part = part.model_copy(update={"arguments": _clipped(part.arguments)})
            cuts.append(Cut(chars, part))
        parts.append(part)
    if not cuts:
        return reply, cuts
    return reply.model_copy(update={"parts": parts}), cuts


def call_note(cut: Cut) -> str:
    """The error answer to a tool call whose arguments were cut."""
    name = cut.call.name if cut.call is not None else "the tool"
    return (
        f"Your call of {name!r} was not run: its arguments were {cut.chars} characters, over the "
        f"{MAX_PART_CHARS}-character limit of a reply part ({cut.removed} were cut). A Program "
        "is a few KB of JSON: submit it without repeated or generated filler."
    )


def text_note(cut: Cut) -> str:
    """The note on a text part that was cut."""
    return (
        f"Your reply's text was {cut.chars} characters, over the {MAX_PART_CHARS}-character "
        f"limit of a reply part; the last {cut.removed} were cut. Keep prose short and answer "
        "with a tool call."
    )
