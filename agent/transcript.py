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
``--provider replay`` replays its assistant turns; ``RunState`` is that reconstruction.

Damage is reported, never fatal where the rest can be read: a run that died mid-write leaves a torn
last line, and a line that is not UTF-8 text or not JSON at all is skipped — both with a note that
names the line (``Transcript.notes``; ``RunDir.repair_tail`` cuts a torn tail off before anything
is appended after it). A line that is JSON but not a record, or a record whose content does not
hold together (a hand edit, another tool), is a ``TranscriptError`` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from coda.primitives.errors import ProgramError, first_validation_error
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
    "max_candidates",
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

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, value: dict[str, Any]) -> dict[str, Any]:
        """The loop's ``Budgets``, each a number of its type, finite and ≥ 0 (or ``None``)."""
        from .loop import Budgets  # the loop imports this module

        known = [f.name for f in dataclasses.fields(Budgets)]
        _only(value, known, "budget")
        try:
            budgets = TypeAdapter(Budgets).validate_python(value)
        except ValidationError as e:
            raise ValueError(_first_error(e)) from None
        checked = dataclasses.asdict(budgets)
        for name, number in checked.items():
            if number is not None and not (math.isfinite(number) and number >= 0):
                raise ValueError(f"{name}: {number!r} is not a budget (a finite number ≥ 0)")
        return checked

    @field_validator("sandbox")
    @classmethod
    def _sandbox(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Options ``SandboxOptions`` accepts, with finite numbers (the options the caller
        always chooses, ``loop.CALLER_ONLY_OPTIONS``, are not read from a transcript)."""
        from coda.sandbox.stages import SandboxOptions

        from .loop import CALLER_ONLY_OPTIONS

        _only(value, list(SandboxOptions.model_fields), "sandbox option")
        try:
            recorded = {k: v for k, v in value.items() if k not in CALLER_ONLY_OPTIONS}
            SandboxOptions(**{**recorded, "plugins": []})
        except ValidationError as e:
            raise ValueError(_first_error(e)) from None
        for name, number in value.items():
            if isinstance(number, float) and not math.isfinite(number):
                raise ValueError(f"{name}: {number!r} is not a finite number")
        return value


class MessageRecord(_Record):
    event: Literal["message"] = "message"
    turn: int
    message: Message
    seconds: float | None = None  # how long the provider took (assistant turns)
    # None: unknown price (assistant turns); never NaN, infinite or negative, which would
    # defeat --max-cost on resume
    cost_usd: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None


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
    cache_write_tokens: int = 0  # parts of input_tokens; absent from transcripts written before
    cache_read_tokens: int = 0  # the loop recorded them


Record = Annotated[
    RunStart | MessageRecord | CandidateRecord | RetryRecord | ResumeRecord | EndRecord,
    Field(discriminator="event"),
]
_RECORD = TypeAdapter(Record)


class TranscriptError(ValueError):
    """A transcript that cannot be read; the message names the file and line."""


@dataclass
class Transcript:
    """The records of a ``transcript.jsonl``, the line each came from, and what was skipped."""

    path: Path
    records: list[Any]
    lines: list[int]  # the 1-based line number of each record
    notes: list[str]  # one per skipped line: which, and why

    def state(self) -> RunState:
        return RunState.from_transcript(self)


def read_transcript(path: Path) -> Transcript:
    """Every record of ``path``. Lines that are not UTF-8 or not JSON (a torn last line, bytes
    written by something else) are skipped with a note; a JSON line that is not a record raises
    ``TranscriptError`` naming the line."""
    path = Path(path)
    if not path.is_file():
        raise TranscriptError(f"{path} does not exist (is it a run folder's transcript.jsonl?)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TranscriptError(f"cannot read {path}: {e.strerror}") from None
    chunks = data.split(b"\n")
    torn_tail = chunks[-1] != b""  # the last line has no newline: a write that did not finish
    if not torn_tail:
        chunks.pop()
    found = Transcript(path, [], [], [])
    for number, chunk in enumerate(chunks, start=1):
        last = number == len(chunks)
        record = _parse_line(path, number, chunk, last and torn_tail, found.notes)
        if record is not None:
            found.records.append(record)
            found.lines.append(number)
    if not found.records or not isinstance(found.records[0], RunStart):
        skipped = f" ({len(found.notes)} unreadable line(s) skipped)" if found.notes else ""
        raise TranscriptError(
            f"{path} does not start with a run_start record{skipped}: is it a run folder's "
            "transcript.jsonl?"
        )
    return found


def read_records(path: Path) -> list[Any]:
    """Every record of ``path`` (``read_transcript`` without the notes)."""
    return read_transcript(path).records


def _parse_line(path: Path, number: int, chunk: bytes, torn: bool, notes: list[str]) -> Any:
    """One line's record; ``None`` (with a note) for a blank, torn, non-UTF-8 or non-JSON line.

    ``torn``: the file's last line, without its newline — kept if it is a whole record (only the
    newline was lost), else skipped as the write a crash cut short."""
    try:
        text = chunk.decode("utf-8")
        if not text.strip():
            return None
        json.loads(text)
        return _RECORD.validate_json(text)
    except UnicodeDecodeError as e:
        if not torn:
            notes.append(
                f"{path}:{number}: skipped a line that is not UTF-8 text (byte "
                f"{chunk[e.start]:#04x} at column {e.start + 1}; {len(chunk)} bytes)"
            )
            return None
    except (json.JSONDecodeError, RecursionError) as e:
        if not torn:
            what = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            notes.append(
                f"{path}:{number}: skipped a line that is not JSON ({what}; {len(chunk)} bytes)"
            )
            return None
    except ValidationError as e:
        if not torn:
            first = e.errors()[0]
            loc = ".".join(map(str, first["loc"])) or "the line"
            raise TranscriptError(
                f"{path}:{number}: not a transcript record ({loc}: {first['msg']}); the line was "
                "changed by hand or by another program: restore it, or delete the line"
            ) from None
    notes.append(
        f"{path}:{number}: skipped a torn last line ({len(chunk)} bytes without a newline: the run "
        "stopped while writing it)"
    )
    return None


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

    notes: list[str] = field(default_factory=list)  # lines of the transcript that were skipped
    # the largest index of a candidate record, answered or not (a crash between a turn's
    # candidate records and its answers leaves records that no message holds)
    recorded_index: int = 0

    @classmethod
    def from_records(cls, records: list[Any]) -> RunState:
        state = cls(start=records[0], provider=records[0].provider, model=records[0].model)
        for record in records[1:]:
            state.absorb(record)
        return state

    @classmethod
    def from_transcript(cls, transcript: Transcript) -> RunState:
        """The run a transcript records; a record whose content does not hold together (a tool
        result whose Report does not parse, say) is a ``TranscriptError`` naming its line."""
        records = transcript.records
        state = cls(start=records[0], provider=records[0].provider, model=records[0].model)
        state.notes = list(transcript.notes)
        for record, number in zip(records[1:], transcript.lines[1:], strict=True):
            try:
                state.absorb(record)
            except (KeyError, TypeError, ValueError, OverflowError) as e:
                detail = _first_error(e)
                raise TranscriptError(
                    f"{transcript.path}:{number}: the {record.event} record does not hold "
                    f"together ({detail}); the line was changed by hand or by another program: "
                    "restore it, or delete the line"
                ) from None
        return state

    def absorb(self, record: Any) -> None:
        if isinstance(record, MessageRecord):
            self._message(record)
        elif isinstance(record, CandidateRecord):
            self.recorded_index = max(self.recorded_index, record.index)
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
        """The index the next candidate gets: past every candidate recorded, so that a call
        answered again on resume never reuses a recorded index (nor its kernels folder)."""
        return max([self.recorded_index, *(c.index for c in self.candidates)]) + 1


def _only(value: dict[str, Any], known: list[str], what: str) -> None:
    """Refuse a key of ``value`` that is not in ``known``."""
    for key in value:
        if key not in known:
            raise ValueError(f"unknown {what} {key!r} (known: {', '.join(known)})")


def _first_error(error: Exception) -> str:
    """A one-line account of what was wrong in a record's content."""
    if isinstance(error, ValidationError):
        return first_validation_error(error)
    if isinstance(error, KeyError):
        return f"missing {error.args[0]!r}"
    return f"{type(error).__name__}: {error}"
