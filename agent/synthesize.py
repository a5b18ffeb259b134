"""Synthesize a kernel for a block: propose candidates, evaluate each in the sandbox, keep the best.

This is the offline path the demo runs (the built-in planner's candidates). The agent loop with LLM
providers (``loop.py``) drives the same pieces — ``evaluate`` and ``RunDir`` — turn by turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from coda.blocks.block import Block
from coda.primitives.ir import Program
from coda.sandbox.report import Report, StageResult
from coda.sandbox.runner import evaluate
from coda.sandbox.stages import SandboxOptions

from .planner import lower
from .runs import RunDir


@dataclass
class Candidate:
    program: Program
    report: Report


@dataclass
class SynthesisResult:
    block: str
    run: RunDir
    candidates: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None
    seconds: float = 0.0

    @property
    def verified(self) -> bool:
        return self.best is not None and self.best.report.verified


def better(a: Candidate, b: Candidate | None) -> bool:
    """Verified beats unverified; among verified, faster (when measured) wins."""
    if b is None:
        return True
    if a.report.verified != b.report.verified:
        return a.report.verified
    ta = sum(r.program_ms for r in a.report.profile) if a.report.profile else None
    tb = sum(r.program_ms for r in b.report.profile) if b.report.profile else None
    return ta is not None and (tb is None or ta < tb)


def synthesize(
    block: Block,
    runs_dir: str | Path = "runs",
    *,
    options: SandboxOptions | None = None,
    block_file: str | None = None,
    on_stage: Callable[[int, StageResult], None] | None = None,
) -> SynthesisResult:
    """Evaluate the built-in planner's candidates for ``block``; write the run directory."""
    start = time.perf_counter()
    run = RunDir.create(runs_dir, block.name)
    result = SynthesisResult(block.name, run)
    for index, program in enumerate([lower(block)], start=1):
        run.append_transcript(
            {
                "event": "candidate",
                "index": index,
                "provider": "builtin",
                "program": program.model_dump(mode="json"),
            }
        )
        stage_cb = (lambda s, i=index: on_stage(i, s)) if on_stage else None
        report = evaluate(
            program,
            block,
            options,
            block_file=block_file,
            kernels_dir=run.candidate_kernels(index),
            on_stage=stage_cb,
        )
        run.append_transcript(
            {
                "event": "report",
                "index": index,
                "verified": report.verified,
                "report": report.model_dump(mode="json"),
            }
        )
        candidate = Candidate(program, report)
        result.candidates.append(candidate)
        if better(candidate, result.best):
            result.best = candidate
            run.write_best(program, report, index)
    result.seconds = time.perf_counter() - start
    return result
