"""Trajectory export: an eval's runs as JSONL records for fine-tuning or RL.

One record per cell that ran to an answer (``status == "done"``), rebuilt from the cell's
transcript:

* ``messages`` — the conversation in the common chat format: ``system`` (the exact system prompt),
  ``user`` (the task), ``assistant`` (its text and ``tool_calls``: id, name, arguments as sent),
  ``tool`` (what the model read back: the compact Report, an error, a primitive's documentation),
  and ``user`` reminders; ``tools`` — the tool specs that were offered;
* ``steps`` — one per ``submit_program`` call: the tool-call id, turn, program hash, the full
  sandbox Report, and that candidate's ``speedup`` and ``reward``;
* the outcome: ``verified``, ``speedup``, ``speedup_measured``, ``reward``, stop reason, turns,
  tokens, dollars.

**Reward.** ``reward = verified × speedup``, where ``speedup`` is the geometric mean over the
candidate's profiled shapes of ``baseline_ms / program_ms`` (baseline: eager PyTorch by default,
or ``torch.compile``). When the speedup is not measured (no GPU, or a baseline that could not be
timed) it is taken as 1 — "correct, speed unknown" — so the reward is exactly the verified bit
(1.0 or 0.0), ``speedup`` is ``null`` and ``speedup_measured`` is ``false`` so such records can be
filtered or weighted apart. An unverified candidate's reward is 0. A trajectory's reward is its
best candidate's (the run's result).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from coda.agent.providers.base import (
    AssistantTurn,
    RetryPromptPart,
    TextPart,
    ToolResultPart,
    UserMessage,
)
from coda.agent.runs import RunDir
from coda.agent.transcript import Candidate, RunState
from coda.sandbox.report import Report

from .metrics import geomean
from .results import CellResult, EvalDir

Baseline = Literal["eager", "compile"]


def speedup(report: Report, baseline: Baseline = "eager") -> float | None:
    """Geometric-mean speedup of a verified candidate over ``baseline``; ``None``: not
    measured."""
    pairs = [(getattr(r, f"{baseline}_ms"), r.program_ms) for r in report.profile]
    if not pairs or any(base is None for base, _ in pairs):
        return None
    return geomean(base / ms for base, ms in pairs)


def reward(report: Report, baseline: Baseline = "eager") -> float:
    """``verified × speedup``, the speedup taken as 1 when it is not measured."""
    if not report.verified:
        return 0.0
    measured = speedup(report, baseline)
    return 1.0 if measured is None else measured


def chat_messages(state: RunState) -> list[dict[str, Any]]:
    """The conversation as chat messages (system first)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": state.start.system}]
    for message in state.messages:
        if isinstance(message, AssistantTurn):
            out.append(
                {
                    "role": "assistant",
                    "content": message.text,
                    "tool_calls": [
                        {"id": c.id, "name": c.name, "arguments": c.arguments}
                        for c in message.tool_calls
                    ],
                }
            )
        else:
            out += _user_parts(message)
    return out


def _user_parts(message: UserMessage) -> list[dict[str, Any]]:
    found = []
    for part in message.parts:
        if isinstance(part, TextPart):
            found.append({"role": "user", "content": part.text})
        elif isinstance(part, ToolResultPart):
            found.append(
                {
                    "role": "tool",
                    "tool_call_id": part.tool_call_id,
                    "name": part.name,
                    "content": part.content,
                    "is_error": part.is_error,
                }
            )
        elif isinstance(part, RetryPromptPart) and part.tool_call_id is not None:
            found.append(
                {
                    "role": "tool",
                    "tool_call_id": part.tool_call_id,
                    "name": part.name,
                    "content": part.content,
                    "is_error": True,
                }
            )
        else:
            found.append({"role": "user", "content": part.content})
    return found


def _step(c: Candidate, baseline: Baseline) -> dict[str, Any]:
    measured = speedup(c.report, baseline) if c.report.verified else None
    return {
        "turn": c.turn,
        "candidate": c.index,
        "tool_call_id": c.tool_call_id,
        "program_hash": c.report.program_hash,
        "verified": c.report.verified,
        "speedup": measured,
        "reward": reward(c.report, baseline),
        "report": c.report.model_dump(mode="json"),
    }


def trajectory(
    edir: EvalDir, result: CellResult, baseline: Baseline = "eager"
) -> dict[str, Any] | None:
    """One cell's record, or ``None`` when it has no run folder."""
    if result.run_dir is None:
        return None
    state = RunDir.open(edir.path / result.run_dir).state()
    best = state.best
    measured = speedup(best.report, baseline) if best and best.report.verified else None
    return {
        "eval": str(edir.path),
        "cell": result.cell,
        "block": result.block,
        "provider": result.provider,
        "model": state.model,
        "seed": result.seed,
        "run_dir": result.run_dir,
        "messages": chat_messages(state),
        "tools": [t.model_dump(mode="json") for t in state.start.tools],
        "steps": [_step(c, baseline) for c in state.candidates],
        "verified": best is not None and best.report.verified,
        "baseline": baseline,
        "speedup": measured,
        "speedup_measured": measured is not None,
        "reward": reward(best.report, baseline) if best is not None else 0.0,
        "stop": state.end.reason if state.end else None,
        "turns": state.turns,
        "tokens": {"input": state.usage.input_tokens, "output": state.usage.output_tokens},
        "cost_usd": state.cost_usd,
    }


def trajectories(edir: EvalDir, baseline: Baseline = "eager") -> Iterator[dict[str, Any]]:
    for result in edir.ordered_results():
        if result.status == "done":
            record = trajectory(edir, result, baseline)
            if record is not None:
                yield record


def export(edir: EvalDir, out: Path, baseline: Baseline = "eager") -> tuple[int, int]:
    """Write the records to ``out``; returns (written, cells skipped: errors or no run)."""
    written = 0
    with open(out, "w", encoding="utf-8") as f:
        for record in trajectories(edir, baseline):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            written += 1
    return written, len(edir.ordered_results()) - written
