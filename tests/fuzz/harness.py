"""Run a fuzzed candidate through the sandbox's front stages and judge how it ended.

validate → semantics → compile (code generation and import; no kernel runs) in this process,
exactly as ``evaluate`` runs them. An outcome is ``accepted`` (every stage passed), ``rejected``
(a stage failed with a specific message), or ``crash``: an exception escaped a stage, or a stage
failed with a generic one (cause ``exception``: Python's own error, not the sandbox's words) — a
bug to fix at its root, whatever the input was.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from typing import Any, Literal

from coda.blocks import Block
from coda.sandbox.report import StageResult
from coda.sandbox.runner import program_hash
from coda.sandbox.stages import compile_stage, semantics, validate

# Causes a front stage may legitimately fail with: the program's fault or the block's.
SPECIFIC = {"program", "block"}


@dataclass(frozen=True)
class Outcome:
    status: Literal["accepted", "rejected", "crash"]
    stage: str
    reason: str  # a template of the message (names and numbers elided), for distributions
    message: str


_LOCATED = ("steps[", "prep[", "inputs", "outputs", "block")


def reason_template(message: str) -> str:
    """The message's first line without its location, names and numbers: a histogram key.

    ``steps[1] (gemm 'g').epilogue[0] (map): value 'v' is not…`` → ``value … is not…``.
    """
    lines = message.splitlines() or [""]
    pydantic = lines[0].startswith("invalid program:") and len(lines) > 1
    first = lines[1].strip() if pydantic else lines[0]
    if (pydantic or first.startswith(_LOCATED)) and ": " in first:
        first = first.split(": ", 1)[1]  # drop the location
    first = re.sub(r"(?<![A-Za-z])'[^']*'|\"[^\"]*\"", "…", first)  # not "block's"
    first = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", first)
    return first.split(" — ")[0][:90]


def run_front(data: Any, block: Block, shapes: list[dict[str, int]] | None = None) -> Outcome:
    """validate → semantics → compile for one candidate; never raises."""
    shapes = shapes or block.shapes.cpu
    results: list[StageResult] = []
    try:
        program_hash(data)  # what evaluate does first with any input
        program, infos = validate(data, block, shapes, results)
        if program is not None:
            semantics(program, block, block.shapes.cpu, results)
        if program is not None and results[-1].status == "passed":
            compile_stage(program, infos[0], block, shapes[0], results)
    except Exception as e:  # noqa: BLE001 - escaping the stages is exactly what we look for
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        stage = results[-1].stage if results else "validate"
        return Outcome("crash", stage, f"uncaught {type(e).__name__}", tb)
    failed = next((r for r in results if r.status == "failed"), None)
    if failed is None:
        return Outcome("accepted", "compile", "", "")
    if failed.cause not in SPECIFIC:
        return Outcome("crash", failed.stage, f"generic: {failed.cause}", failed.message)
    return Outcome("rejected", failed.stage, reason_template(failed.message), failed.message)
