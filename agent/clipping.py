"""Oversized replies: what the loop keeps of an assistant reply too large to record whole.

A model (or a server) may answer with megabytes: a runaway text, a tool call whose arguments
repeat forever, a tool name or call id megabytes long, or many large parts. The loop records every
reply in the transcript and sends the history back on every turn, so before a reply is recorded:

* a text or a tool call's arguments is cut to ``MAX_PART_CHARS`` characters, with a note saying
  how many were cut;
* a tool name past ``MAX_NAME_CHARS`` is cut to a prefix and a mark (no tool has such a name: the
  call is answered as a call of an unknown tool), and a call id past ``MAX_NAME_CHARS`` to a
  prefix and a hash of the whole id (ids stay distinct);
* the whole reply is kept up to ``MAX_REPLY_CHARS`` characters (texts, arguments, names and ids,
  in order): the part that crosses it is cut there, and the parts after it are dropped.

A cut tool call is not run (its arguments are no longer whole): the loop answers it with an error
the model can act on (``call_note``); a cut text, and the parts dropped, get a note too
(``text_note``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .providers.base import AssistantTurn, TextPart, ToolCallPart

MAX_PART_CHARS = 256 * 1024  # a Program is a few KB of JSON; the longest prompt part ~30 KB
MAX_REPLY_CHARS = 4 * MAX_PART_CHARS  # all the parts of one reply together
MAX_NAME_CHARS = 128  # a tool name or call id; tool names are under 32, ids under 64


@dataclass(frozen=True)
class Cut:
    """What was cut of a reply: one part's text or arguments (``chars`` long, ``kept`` of them
    recorded; ``call``: the recorded call whose arguments they were), or, with ``dropped`` > 0,
    that many parts left out whole (``chars`` in all)."""

    chars: int
    kept: int
    call: ToolCallPart | None = None
    dropped: int = 0

    @property
    def removed(self) -> int:
        return self.chars - self.kept


def _clipped(text: str, keep: int, limit: str) -> str:
    return f"{text[:keep]}\n[… {len(text) - keep} characters cut: {limit}]"


def _short_name(name: str) -> str:
    if len(name) <= MAX_NAME_CHARS:
        return name
    return f"{name[:64]}[… {len(name) - 64} characters cut]"


def _short_id(call_id: str) -> str:
    if len(call_id) <= MAX_NAME_CHARS:
        return call_id
    digest = hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{call_id[:64]}-cut-{digest}"


def _size(part: TextPart | ToolCallPart) -> int:
    if isinstance(part, TextPart):
        return len(part.text)
    return len(part.arguments) + len(part.name) + len(part.id)


def clip_reply(reply: AssistantTurn) -> tuple[AssistantTurn, list[Cut]]:
    """``reply`` cut to the limits above (each cut noted), and what was cut."""
    parts: list[TextPart | ToolCallPart] = []
    cuts: list[Cut] = []
    left = MAX_REPLY_CHARS
    dropped, dropped_chars = 0, 0
    changed = False
    for original in reply.parts:
        part = original
        if isinstance(part, ToolCallPart):
            short = {"name": _short_name(part.name), "id": _short_id(part.id)}
            if short != {"name": part.name, "id": part.id}:
                part = part.model_copy(update=short)
        if left <= 0:
            dropped, dropped_chars = dropped + 1, dropped_chars + _size(part)
            changed = True
            continue
        text = part.text if isinstance(part, TextPart) else part.arguments
        room = left - (_size(part) - len(text))  # what the name and id leave for the arguments
        keep = max(min(MAX_PART_CHARS, room), 0)
        if len(text) > keep:
            limit = (
                f"a reply part is kept up to {MAX_PART_CHARS} characters"
                if keep == MAX_PART_CHARS
                else f"a whole reply is kept up to {MAX_REPLY_CHARS} characters"
            )
            clipped = _clipped(text, keep, limit)
            if isinstance(part, TextPart):
                part = part.model_copy(update={"text": clipped})
                cuts.append(Cut(len(text), keep))
            else:
                part = part.model_copy(update={"arguments": clipped})
                cuts.append(Cut(len(text), keep, part))
        left -= _size(part)
        changed = changed or part is not original
        parts.append(part)
    if dropped:
        cuts.append(Cut(dropped_chars, 0, dropped=dropped))
    if not changed:
        return reply, cuts
    return reply.model_copy(update={"parts": parts}), cuts


def call_note(cut: Cut) -> str:
    """The error answer to a tool call whose arguments were cut."""
    name = cut.call.name if cut.call is not None else "the tool"
    return (
        f"Your call of {name!r} was not run: its arguments were {cut.chars} characters, over "
        f"{_limit(cut)} ({cut.removed} were cut). A Program is a few KB of JSON: submit it "
        "without repeated or generated filler."
    )


def text_note(cut: Cut) -> str:
    """The note on a text part that was cut, or on the parts dropped from a reply."""
    if cut.dropped:
        return (
            f"Your reply was over the {MAX_REPLY_CHARS}-character limit of a whole reply: its "
            f"last {cut.dropped} part(s) ({cut.chars} characters) were dropped, and no tool call "
            "among them was run. Keep prose short and answer with a few small tool calls."
        )
    return (
        f"Your reply's text was {cut.chars} characters, over {_limit(cut)}; the last "
        f"{cut.removed} were cut. Keep prose short and answer with a tool call."
    )


def _limit(cut: Cut) -> str:
    """The limit that cut a part: its own, or what was left of the whole reply's."""
    if cut.kept == MAX_PART_CHARS:
        return f"the {MAX_PART_CHARS}-character limit of a reply part"
    return f"what was left ({cut.kept}) of the {MAX_REPLY_CHARS}-character limit of a whole reply"
