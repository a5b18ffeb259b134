"""Run one eval cell: the agent on one block with one provider, in the cell's folder.

``run_cell`` is what every executor calls (in process, a worker process, a Ray task). It picks up
where the cell stopped: a cell folder whose run ended (any reason but ``interrupted`` or
``provider_error``) is read back, not rerun; an unfinished or interrupted run is continued from
its transcript (``coda.agent.synthesize.resume``); otherwise a new run starts. The result is
always read from the transcript (``RunState``), so fresh, resumed and read-back cells are scored
by the same code. A block the built-in planner cannot lower is that cell's answer, not an
error: a ``refused`` result carrying the planner's ``NoRules`` text, while the other cells run.
"""

from __future__ import annotations

import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from coda.agent.events import OnEvent
from coda.agent.providers import ProviderError
from coda.agent.runs import RunDir
from coda.agent.synthesize import BudgetError, resume, synthesize
from coda.agent.transcript import EndRecord, RunState, TranscriptError, read_transcript
from coda.blocks import get_block, load_block_file
from coda.blocks.block import Block
from coda.planner import NoRule
from coda.primitives import backend

from .metrics import timing
from .results import CellResult
from .spec import Cell, EvalSpec

# An ended run with one of these reasons is continued, not read back.
RESUMABLE = ("interrupted", "provider_error")
# The stop reason of a cell whose block the built-in planner cannot lower (no run folder).
REFUSED = "refused"


def latest_run(cell_dir: Path) -> RunDir | None:
    """The newest run folder in ``cell_dir`` whose transcript can be read."""
    if not cell_dir.is_dir():
        return None
    for path in sorted((p for p in cell_dir.iterdir() if p.is_dir()), reverse=True):
        try:
            run = RunDir.open(path)
            run.state()
        except TranscriptError:
            continue
        return run
    return None


def run_cell(
    spec: EvalSpec,
    cell: Cell,
    cell_dir: Path,
    *,
    attempts: int = 1,
    on_event: OnEvent | None = None,
) -> CellResult:
    """Run (or continue, or read back) ``cell``; errors become an ``error`` result, never an
    exception (``KeyboardInterrupt`` excepted: the run records it and it propagates)."""
    try:
        run = latest_run(cell_dir)
        if run is None or _resumable(run.state()):
            run = _agent(spec, cell, cell_dir, run, on_event)
        return from_state(cell, run, cell_dir.parent.parent, attempts=attempts)
    except NoRule as e:  # the built-in planner cannot lower the block: its answer, recorded
        return _refused(cell, e, attempts)
    except (ProviderError, BudgetError) as e:
        return _error(cell, getattr(e, "message", str(e)), attempts)
    except Exception as e:  # noqa: BLE001 - one broken cell must not end the eval
        tail = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:]).strip()
        return _error(cell, f"{type(e).__name__}: {e}\n{tail}", attempts)


def _resumable(state: RunState) -> bool:
    return state.end is None or state.end.reason in RESUMABLE


def _agent(
    spec: EvalSpec, cell: Cell, cell_dir: Path, run: RunDir | None, on_event: OnEvent | None
) -> RunDir:
    block = cell_block(spec, cell.block)
    provider = cell.provider.build(block)
    budgets, sandbox = spec.budgets_obj(), spec.sandbox_options()
    if run is not None:
        return resume(run, block, provider, budgets=budgets, sandbox=sandbox, on_event=on_event).run
    result = synthesize(
        block,
        cell_dir,
        provider=provider,
        budgets=budgets,
        sandbox=sandbox,
        block_file=spec.block_files.get(cell.block),
        base_url=cell.provider.base_url,
        on_event=on_event,
    )
    return result.run


def cell_block(spec: EvalSpec, name: str) -> Block:
    """A registered block, or one from the eval's ``--block-file`` (imported here first)."""
    if name in spec.block_files:
        load_block_file(spec.block_files[name])
    return get_block(name)


def from_state(cell: Cell, run: RunDir, eval_dir: Path, *, attempts: int = 1) -> CellResult:
    """Score a run from its transcript."""
    transcript = read_transcript(run.transcript)
    state, records = transcript.state(), transcript.records
    best = state.best
    report = best.report if best is not None else None
    worst = report.worst_check() if report is not None and report.verified else None
    times = timing(report.profile if report is not None and report.verified else [])
    failures: dict[str, int] = {}
    for c in state.candidates:
        failed = c.report.failed_stage
        if failed is not None:
            failures[failed.stage] = failures.get(failed.stage, 0) + 1
    end = state.end
    error = end is not None and end.reason == "provider_error"
    return CellResult(
        cell=cell.id,
        block=cell.block,
        provider=cell.provider.label,
        model=state.model,
        seed=cell.seed,
        status="error" if error else "done",
        error=end.message if error and end is not None else None,
        verified=best is not None and best.report.verified,
        stop=end.reason if end else None,
        stop_message=end.message if end else "",
        turns=state.turns,
        seconds=round(sum(r.seconds for r in records if isinstance(r, EndRecord)), 3),
        input_tokens=state.usage.input_tokens,
        output_tokens=state.usage.output_tokens,
        cost_usd=state.cost_usd,
        candidates=len(state.candidates),
        verified_candidates=sum(c.report.verified for c in state.candidates),
        failures=failures,
        tool_errors=state.malformed,
        worst_error_ratio=worst.max_abs_err / worst.allowed if worst and worst.allowed else None,
        time_ms=times.time_ms,
        speedup_eager=times.speedup_eager,
        speedup_compile=times.speedup_compile,
        ratio_to_gemms=times.ratio_to_gemms,
        device=report.device if report is not None else backend.describe(),
        run_dir=str(run.path.relative_to(eval_dir)) if run.path.is_relative_to(eval_dir) else None,
        attempts=attempts,
        finished_at=_now(),
    )


def _refused(cell: Cell, refusal: NoRule, attempts: int) -> CellResult:
    """The built-in planner's refusal of the cell's block (``NoRules``: every op it cannot lower,
    one line each) as the cell's answer: done, not verified, ``stop="refused"`` with the text in
    ``stop_message``. Deterministic, so a resumed eval does not run it again."""
    return _unrun(cell, attempts, status="done", stop=REFUSED, stop_message=str(refusal))


def _error(cell: Cell, message: str, attempts: int) -> CellResult:
    return _unrun(cell, attempts, status="error", error=message)


def _unrun(cell: Cell, attempts: int, **outcome: Any) -> CellResult:
    """The result of a cell whose agent loop never ran: its identity, this device, ``outcome``."""
    return CellResult(
        cell=cell.id,
        block=cell.block,
        provider=cell.provider.label,
        model=cell.provider.model or "",
        seed=cell.seed,
        device=backend.describe(),
        attempts=attempts,
        finished_at=_now(),
        **outcome,
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
