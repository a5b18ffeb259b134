"""The transcript of a run: ``transcript.jsonl``, one JSON record per line, appended as it happens.

Records (``event`` is the tag):

* ``run_start`` — block, provider, model, budgets, and the exact system prompt and tool specs sent;
* ``message`` — every message in order: the task (turn 0), each assistant turn (with its usage and
  cost), each batch of tool results (Reports in full under ``data``);
* ``candidate`` — one line per sandbox evaluation: index, verdict, time, whether it became the best;
* ``retry`` — a provider error that was retried, and the wait;
* ``resume`` — a later ``--resume`` continued the run here;
* ``end`` — why the run stopped, with its totals.

The ``message`` records alone rebuild the conversation, so ``--resume`` continues it and
``--provider replay`` replays its assistant turns; ``RunState`` is that reconstruction. A run that
died mid-write leaves at most a torn last line, which reading skips.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from coda.primitives.errors import ProgramError
from coda.primitives.ir import Program
from coda.sandbox.report import Report

from .providers.base import AssistantTurn, Message, ToolResultPart, ToolSpec, Usage, UserMessage

SCHEMA_VERSION = 1

StopKind = Literal[
    "finished",  # the model called finish
    "converged",  # verified, and no improvement for --patience turns
    "max_turns",
    "max_tokens",
    "max_cost",
    "timeout",
    "refused",  # the model refused
    "malformed",  # too many unusable replies in a row
    "provider_error",  # the provider failed after bounded retries
    "end_of_transcript",  # a replayed transcript ran out of turns
    "interrupted",  # Ctrl-C
]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunStart(_Record):
    event: Literal["run_start"] = "run_start"
    version: int = SCHEMA_VERSION
    block: str
    block_file: str | None = None
    provider: str
    model: str
    base_url: str | None = None
    transcript: str | None = None  # the recorded run a replay plays back
    budgets: dict[str, Any] = {}
    sandbox: dict[str, Any] = {}
    system: str
    tools: list[ToolSpec]
    started_at: str


class MessageRecord(_Record):
    event: Literal["message"] = "message"
    turn: int
    message: Message
    seconds: float | None = None  # how long the provider took (assistant turns)
    cost_usd: float | None = None  # None: unknown price (assistant turns)


class CandidateRecord(_Record):
    event: Literal["candidate"] = "candidate"
    turn: int
    index: int
    tool_call_id: str
    program_hash: str
    verified: bool
    headline: str
    time_ms: float | None = None
    best: bool = False
    seconds: float = 0.0


class RetryRecord(_Record):
    event: Literal["retry"] = "retry"
    turn: int
    attempt: int
    delay_s: float
    error: str


class ResumeRecord(_Record):
    event: Literal["resume"] = "resume"
    at: str
    turns_before: int
    provider: str  # the provider and model from here on
    model: str


class EndRecord(_Record):
    event: Literal["end"] = "end"
    reason: StopKind
    message: str
    verified: bool
    turns: int
    input_tokens: int
    output_tokens: int
    cost_usd: float | None
    seconds: float
    best_candidate: int | None = None


Record = Annotated[
    RunStart | MessageRecord | CandidateRecord | RetryRecord | ResumeRecord | EndRecord,
    Field(discriminator="event"),
]
_RECORD = TypeAdapter(Record)


class TranscriptError(ValueError):
    """A transcript that cannot be read; the message names the file and line."""


def read_records(path: Path) -> list[Any]:
    """Every record of ``path``; a torn last line (a crash mid-write) is skipped."""
    if not path.is_file():
        raise TranscriptError(f"{path} does not exist (is it a run folder's transcript.jsonl?)")
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(_RECORD.validate_json(line))
        except ValidationError as e:
            if number == len(lines):
                break  # torn by a crash while writing: everything before it is intact
            first = e.errors()[0]
            loc = ".".join(map(str, first["loc"]))
            raise TranscriptError(
                f"{path}:{number}: not a transcript record ({loc}: {first['msg']})"
            ) from None
    if not records or not isinstance(records[0], RunStart):
        raise TranscriptError(f"{path} does not start with a run_start record")
    return records


def record_line(record: BaseModel) -> str:
    return json.dumps(record.model_dump(mode="json"), ensure_ascii=False)


@dataclass
class Candidate:
    """One sandbox evaluation: the program (``None`` when it did not parse) and its Report."""

    index: int
    turn: int
    tool_call_id: str
    program: Program | None
    report: Report

    @property
    def time_ms(self) -> float | None:
        """Summed median time over the profiled shapes; ``None`` when not measured."""
        rows = self.report.profile
        return sum(r.program_ms for r in rows) if rows else None


def _progress(report: Report) -> int:
    return sum(s.status == "passed" for s in report.stages)


def better(a: Candidate, b: Candidate | None) -> bool:
    """Verified beats unverified; among verified, measured-faster wins (an unmeasured one never
    displaces the first); among unverified, the one that got further through the stages."""
    if b is None:
        return True
    if a.report.verified != b.report.verified:
        return a.report.verified
    if a.report.verified:
        return a.time_ms is not None and (b.time_ms is None or a.time_ms < b.time_ms)
    return _progress(a.report) > _progress(b.report)


def candidate_from(result: ToolResultPart, turn: int, program_json: Any) -> Candidate | None:
    """The candidate a ``submit_program`` result describes (``None`` for other results)."""
    data = result.data or {}
    if "report" not in data:
        return None
    try:
        program = Program.parse(program_json) if program_json is not None else None
    except ProgramError:
        program = None
    return Candidate(
        index=int(data["candidate"]),
        turn=turn,
        tool_call_id=result.tool_call_id,
        program=program,
        report=Report.model_validate(data["report"]),
    )


@dataclass
class RunState:
    """A run rebuilt from its records: conversation, counters, candidates, best, how it ended."""

    start: RunStart
    messages: list[UserMessage | AssistantTurn] = field(default_factory=list)
    turns: int = 0
    usage: Usage = field(default_factory=Usage)
    cost_usd: float | None = 0.0
    candidates: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None
    best_turn: int = 0
    retries: int = 0
    malformed: int = 0
    end: EndRecord | None = None
    resumes: int = 0
    provider: str = ""  # the latest provider and model (a resume may switch them)
    model: str = ""

    @classmethod
    def from_records(cls, records: list[Any]) -> RunState:
        state = cls(start=records[0], provider=records[0].provider, model=records[0].model)
        for record in records[1:]:
            state.absorb(record)
        return state

    def absorb(self, record: Any) -> None:
        if isinstance(record, MessageRecord):
            self._message(record)
        elif isinstance(record, RetryRecord):
            self.retries += 1
        elif isinstance(record, ResumeRecord):
            self.resumes += 1
            self.end = None
            self.provider, self.model = record.provider, record.model
        elif isinstance(record, EndRecord):
            self.end = record

    def _message(self, record: MessageRecord) -> None:
        message = record.message
        self.messages.append(message)
        if isinstance(message, AssistantTurn):
            self.turns += 1
            self.usage = self.usage + message.usage
            if self.cost_usd is not None:
                self.cost_usd = None if record.cost_usd is None else self.cost_usd + record.cost_usd
            return
        calls = self.calls()
        for part in message.parts:
            if not isinstance(part, ToolResultPart):
                if part.kind == "retry_prompt":
                    self.malformed += 1
                continue
            program = calls.get(part.tool_call_id)
            cand = candidate_from(part, record.turn, program)
            if cand is not None:
                self.candidates.append(cand)
                if better(cand, self.best):
                    self.best, self.best_turn = cand, record.turn

    def calls(self) -> dict[str, Any]:
        """Tool-call id → the ``program`` argument of each ``submit_program`` call so far."""
        found = {}
        for m in self.messages:
            if isinstance(m, AssistantTurn):
                for c in m.tool_calls:
                    if c.name == "submit_program":
                        try:
                            found[c.id] = c.parsed_arguments().get("program")
                        except ValueError:
                            found[c.id] = None
        return found

    def pending_calls(self) -> list[Any]:
        """Tool calls of the last assistant turn that were never answered (a crash mid-turn)."""
        if self.messages and isinstance(self.messages[-1], AssistantTurn):
            return self.messages[-1].tool_calls
        return []

    @property
    def next_candidate(self) -> int:
        return max((c.index for c in self.candidates), default=0) + 1
