"""The ``builtin`` provider: the offline planner, as a deterministic "model" that calls tools.

Each turn it reads the history — its own ``submit_program`` calls and the Reports that answered
them — asks ``PlanSearch`` (``planner/search.py``) what to try next, and replies with a short note
of why plus one tool call: ``submit_program`` with the next candidate, or ``finish`` with the
reason the search is over. No network, no key, no tokens; the same history gives the same reply,
so resumed and replayed runs make the same choices.
"""

from __future__ import annotations

import json

from coda.blocks.block import Block
from coda.planner import TUNING_CONFIGS, Finish, Outcome, PlanSearch
from coda.primitives.errors import ProgramError
from coda.primitives.ir import Program
from coda.sandbox.report import Report

from .base import (
    AssistantTurn,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
    UserMessage,
    tool_call_ids,
)

MODEL = "coda-planner"


class BuiltinProvider:
    """CODA's rewrite rules plus a Report-driven search. Raises ``NoRule`` (from the planner)
    when the block has an op no rule lowers — before any run starts."""

    name = "builtin"
    model = MODEL

    def __init__(self, block: Block, configs=TUNING_CONFIGS) -> None:  # noqa: ANN001
        self.search = PlanSearch(block, configs)

    def complete(
        self,
        system: str,
        messages: list[UserMessage | AssistantTurn],
        tools: list[ToolSpec],
        *,
        timeout_s: float | None = None,  # nothing here waits on a server
    ) -> AssistantTurn:
        step = self.search.propose(outcomes(messages))
        call_id = f"builtin_{len(tool_call_ids(messages)) + 1}"
        if isinstance(step, Finish):
            parts = [
                TextPart(text=step.reason),
                ToolCallPart(
                    id=call_id, name="finish", arguments=json.dumps({"reason": step.reason})
                ),
            ]
        else:
            program = step.program.model_dump(mode="json")
            parts = [
                TextPart(text=f"Next candidate: {step.label}. Why: {step.why}."),
                ToolCallPart(
                    id=call_id, name="submit_program", arguments=json.dumps({"program": program})
                ),
            ]
        return AssistantTurn(parts=parts, stop_reason="tool_use", model=self.model)


def outcomes(messages: list[UserMessage | AssistantTurn]) -> list[Outcome]:
    """What each submitted program's Report said, in submission order."""
    programs: dict[str, Program] = {}
    for m in messages:
        if isinstance(m, AssistantTurn):
            for call in m.tool_calls:
                if call.name == "submit_program":
                    try:
                        programs[call.id] = Program.parse(call.parsed_arguments()["program"])
                    except (ValueError, KeyError, ProgramError):
                        continue
    found = []
    for m in messages:
        if not isinstance(m, UserMessage):
            continue
        for part in m.parts:
            if isinstance(part, ToolResultPart) and part.tool_call_id in programs and part.data:
                report = Report.model_validate(part.data["report"])
                found.append(_outcome(programs[part.tool_call_id], report))
    return found


def _outcome(program: Program, report: Report) -> Outcome:
    failed = report.failed_stage
    failure = ""
    if failed is not None:
        first = failed.message.splitlines()[0] if failed.message else ""
        failure = f"{failed.stage}: {first}"
    time_ms = sum(r.program_ms for r in report.profile) if report.profile else None
    tuned = bool(report.profile) and all(r.tuned for r in report.profile)
    return Outcome(program, report.verified, time_ms, failure, tuned)
