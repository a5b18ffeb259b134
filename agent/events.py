"""What the agent loop reports while it runs (the CLI's live progress), and why it stopped.

The loop calls ``on_event(event)`` with one of these frozen dataclasses as things happen; a
listener must not raise. ``Stop`` is the reason a run ended (also in the transcript's end record).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coda.sandbox.report import StageResult

from .providers.base import AssistantTurn, Usage
from .transcript import Candidate, StopKind


@dataclass(frozen=True)
class Stop:
    kind: StopKind
    message: str
    exit_code: int | None = None  # set for provider errors: 2 for configuration, 1 otherwise


@dataclass(frozen=True)
class TurnStarted:
    turn: int


@dataclass(frozen=True)
class TurnEnded:
    turn: int
    reply: AssistantTurn
    seconds: float
    usage: Usage  # the run's total so far
    cost_usd: float | None  # the run's total so far


@dataclass(frozen=True)
class Retrying:
    attempt: int
    delay_s: float
    error: str


@dataclass(frozen=True)
class CandidateStarted:
    index: int
    turn: int


@dataclass(frozen=True)
class StageDone:
    index: int
    stage: StageResult


@dataclass(frozen=True)
class CandidateDone:
    candidate: Candidate
    is_best: bool
    best: Candidate | None


@dataclass(frozen=True)
class ToolAnswered:
    name: str
    ok: bool
    summary: str


@dataclass(frozen=True)
class Stopped:
    stop: Stop


Event = (
    TurnStarted
    | TurnEnded
    | Retrying
    | CandidateStarted
    | StageDone
    | CandidateDone
    | ToolAnswered
    | Stopped
)
OnEvent = Callable[[Event], None]
