"""The ``replay`` provider: a recorded ``transcript.jsonl`` plays the model, turn by turn.

Each ``complete`` returns the next recorded assistant turn verbatim (parts, usage, stop reason), so
the loop re-runs every recorded tool call against today's sandbox without any API call — to
reproduce a run, or to re-score an old one. When a fresh Report's verdict differs from the recorded
one, that is noted in ``divergences``. After the last recorded turn it raises
``TranscriptExhausted``, which ends the run cleanly.
"""

from __future__ import annotations

from pathlib import Path

# The module, not its names: ``transcript`` imports ``providers.base``, so importing
# ``coda.agent.transcript`` first reaches this file while ``transcript`` is still initialising.
from .. import transcript as _transcript
from .base import (
    AssistantTurn,
    ToolResultPart,
    ToolSpec,
    TranscriptExhausted,
    UserMessage,
)


class ReplayProvider:
    name = "replay"

    def __init__(self, transcript: str | Path, *, skip: int = 0) -> None:
        """Play ``transcript``'s assistant turns, starting after the first ``skip`` (a resumed
        replay has already played them). A record whose content does not hold together is a
        ``TranscriptError`` naming its line, raised here rather than mid-run."""
        read = _transcript.read_transcript(Path(transcript))
        read.state()
        records = read.records
        self.start = records[0]
        self.model = self.start.model
        self.source = str(transcript)
        messages = [r.message for r in records if isinstance(r, _transcript.MessageRecord)]
        self.turns = [m for m in messages if isinstance(m, AssistantTurn)]
        # the recorded answer to assistant turn i: the user message right after it, if any
        self.answers: list[UserMessage | None] = []
        for i, m in enumerate(messages):
            if isinstance(m, AssistantTurn):
                nxt = messages[i + 1] if i + 1 < len(messages) else None
                self.answers.append(nxt if isinstance(nxt, UserMessage) else None)
        self.divergences: list[str] = []
        self._next = skip

    def complete(
        self,
        system: str,
        messages: list[UserMessage | AssistantTurn],
        tools: list[ToolSpec],
        *,
        timeout_s: float | None = None,  # nothing here waits on a server
    ) -> AssistantTurn:
        if self._next > 0 and messages and isinstance(messages[-1], UserMessage):
            self._compare(self._next - 1, messages[-1])
        if self._next >= len(self.turns):
            raise TranscriptExhausted(len(self.turns))
        turn = self.turns[self._next]
        self._next += 1
        return turn

    def _compare(self, index: int, fresh: UserMessage) -> None:
        recorded = self.answers[index]
        if recorded is None:
            return
        before = _verdicts(recorded)
        for call_id, verified in _verdicts(fresh).items():
            if call_id in before and before[call_id] != verified:
                self.divergences.append(
                    f"turn {index + 1}, call {call_id}: recorded "
                    f"{'verified' if before[call_id] else 'failed'}, now "
                    f"{'verified' if verified else 'failed'}"
                )


def _verdicts(message: UserMessage) -> dict[str, bool]:
    """Each answered call's verdict, from the Reports the message carries (a result whose
    ``report`` is not a Report's object has none)."""
    found = {}
    for p in message.parts:
        report = p.data.get("report") if isinstance(p, ToolResultPart) and p.data else None
        if isinstance(report, dict) and isinstance(report.get("verified"), bool):
            found[p.tool_call_id] = report["verified"]
    return found
