"""Run an eval's cells and record them: in process, in local worker processes, or on Ray.

``run_eval(eval_dir, parallel=N, ray_address=...)`` runs every cell that has no ``done`` result
yet (a resumed eval skips finished cells and continues unfinished ones from their transcripts),
appends each result to ``results.jsonl`` as it arrives, and rewrites the markdown table and plots.

Executors (all call ``cell.run_cell``):

* ``parallel == 1`` — in this process, one cell after another (the sandbox already isolates the
  generated kernels in worker processes);
* ``parallel > 1`` — one worker process per cell (``python -m coda.evals.worker``), at most
  ``parallel`` at a time; with GPUs each slot owns one GPU (``CUDA_VISIBLE_DEVICES``), so
  ``parallel`` may not exceed the GPU count. A worker that dies without a result is retried
  (``retries`` times, continuing its transcript), then recorded as an ``error``;
* ``ray_address`` — Ray tasks on an existing cluster (``distributed.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from coda.primitives import backend

from .cell import run_cell
from .results import CellResult, EvalDir, EvalDirError
from .spec import Cell, EvalSpec

RESULT_FILE = "result.json"
LOG_FILE = "log.txt"
OnCell = Callable[[CellResult, int, int], None]  # (result, cells done, cells to run)


class HarnessError(ValueError):
    """A request the harness cannot carry out (e.g. more workers than GPUs)."""


def gpu_count() -> int:
    return 0 if backend.INTERPRET else torch.cuda.device_count()


def pending(edir: EvalDir, spec: EvalSpec) -> list[Cell]:
    """Cells without a ``done`` result, in spec order."""
    done = {cid for cid, r in edir.results().items() if r.status == "done"}
    return [c for c in spec.cells() if c.id not in done]


def run_eval(
    edir: EvalDir,
    *,
    parallel: int = 1,
    ray_address: str | None = None,
    retries: int = 2,
    on_cell: OnCell | None = None,
) -> list[CellResult]:
    """Run the pending cells of ``edir``; returns every cell's latest result in spec order.

    The tables and plots are rewritten afterwards, however the run ended. When the run itself
    failed (a full disk, Ctrl-C), that failure is what is raised, even if the tables could not be
    written either; otherwise a ``ReportError`` says which file could not be written."""
    from .report import write_report

    spec = edir.spec()
    cells = pending(edir, spec)
    if ray_address is not None:
        from .distributed import run_on_ray

        stream = run_on_ray(edir, spec, cells, ray_address, retries=retries)
    elif parallel > 1:
        stream = run_in_workers(edir, cells, parallel=parallel, retries=retries)
    else:
        stream = run_in_process(edir, spec, cells)
    try:
        for done, result in enumerate(stream, start=1):
            edir.append(result)
            if on_cell is not None:
                on_cell(result, done, len(cells))
    except BaseException:
        with contextlib.suppress(EvalDirError):  # the run's own failure is the one to report
            write_report(edir)
        raise
    write_report(edir)
    return edir.ordered_results()


def run_in_process(edir: EvalDir, spec: EvalSpec, cells: list[Cell]) -> Iterator[CellResult]:
    for cell in cells:
        yield run_cell(spec, cell, edir.cell_dir(cell.id))


# -- local worker processes ------------------------------------------------------------------------
@dataclass
class _Job:
    cell: Cell
    attempt: int
    proc: subprocess.Popen
    slot: int


def slot_envs(parallel: int) -> list[dict[str, str]]:
    """Per-slot environment overrides: one GPU each when there are GPUs."""
    gpus = gpu_count()
    if gpus == 0:
        return [{} for _ in range(parallel)]
    if parallel > gpus:
        raise HarnessError(
            f"--parallel {parallel} but this machine has {gpus} GPU(s): each worker owns one GPU, "
            f"so use --parallel {gpus} or fewer (or --ray ADDRESS for a cluster)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    return [{"CUDA_VISIBLE_DEVICES": ids[i]} for i in range(parallel)]


def run_in_workers(
    edir: EvalDir, cells: list[Cell], *, parallel: int, retries: int
) -> Iterator[CellResult]:
    envs = slot_envs(parallel)
    queue: list[tuple[Cell, int]] = [(c, 1) for c in cells]
    running: list[_Job] = []
    try:
        while queue or running:
            free = [s for s in range(parallel) if all(j.slot != s for j in running)]
            while queue and free:
                cell, attempt = queue.pop(0)
                running.append(_launch(edir, cell, attempt, free.pop(0), envs))
            time.sleep(0.1)
            for job in [j for j in running if j.proc.poll() is not None]:
                running.remove(job)
                result = _collect(edir, job, retries)
                if result is None:
                    queue.insert(0, (job.cell, job.attempt + 1))
                else:
                    yield result
    except BaseException:
        _stop(running)
        raise


def _launch(edir: EvalDir, cell: Cell, attempt: int, slot: int, envs: list) -> _Job:
    cell_dir = edir.cell_dir(cell.id)
    cell_dir.mkdir(parents=True, exist_ok=True)
    (cell_dir / RESULT_FILE).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "coda.evals.worker", str(edir.path), cell.id, str(attempt)]
    with open(cell_dir / LOG_FILE, "ab") as log:
        log.write(f"--- attempt {attempt} ---\n".encode())
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **envs[slot]}
        )
    return _Job(cell, attempt, proc, slot)


def _collect(edir: EvalDir, job: _Job, retries: int) -> CellResult | None:
    """The worker's result; ``None`` to retry a worker that died without one."""
    path = edir.cell_dir(job.cell.id) / RESULT_FILE
    if job.proc.returncode == 0 and path.is_file():
        return CellResult.model_validate_json(path.read_text())
    if job.attempt <= retries:
        return None
    log = edir.cell_dir(job.cell.id) / LOG_FILE
    return CellResult(
        cell=job.cell.id,
        block=job.cell.block,
        provider=job.cell.provider.label,
        model=job.cell.provider.model or "",
        seed=job.cell.seed,
        status="error",
        error=(
            f"the worker process {_exit_text(job.proc.returncode)} without a result, "
            f"{job.attempt} time(s); see {log}"
        ),
        device=backend.describe(),
        attempts=job.attempt,
    )


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stop(running: list[_Job], grace_s: float = 30.0) -> None:
    """Ctrl-C: let each worker record its interruption, then make sure it is gone."""
    for job in running:
        with contextlib.suppress(ProcessLookupError):
            job.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for job in running:
        try:
            job.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            job.proc.kill()
            job.proc.wait()


def write_result(cell_dir: Path, result: CellResult) -> None:
    """A worker's result, written whole or not at all (rename is atomic)."""
    tmp = cell_dir / (RESULT_FILE + ".tmp")
    tmp.write_text(result.model_dump_json())
    tmp.replace(cell_dir / RESULT_FILE)
