"""A run on disk: ``runs/<time>-<block>/`` with the transcript, best program, kernels and report.

* ``transcript.jsonl`` — every record of the run (``transcript.py``), appended, flushed and synced
  one at a time, so a run that dies loses nothing it had done;
* ``program.json`` / ``program.py`` / ``kernels/*.py`` — the best *verified* program, its builder
  form and its generated Triton (absent until a candidate verifies);
* ``report.json`` — the best candidate's Report (``"verified"`` says whether it passed);
* ``summary.md`` — turns, tokens, cost, errors, timings or "not measured";
* ``candidates/NNN/kernels/`` — every candidate's generated kernels.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from coda.primitives.ir import Program
from coda.sandbox.report import Report

from .transcript import RunState, TranscriptError, read_records, record_line

TRANSCRIPT = "transcript.jsonl"


@dataclass
class RunDir:
    path: Path

    @classmethod
    def create(cls, runs_dir: str | Path, block: str) -> RunDir:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(runs_dir) / f"{stamp}-{block}"
        path, n = base, 1
        while path.exists():
            n += 1
            path = Path(f"{base}-{n}")
        path.mkdir(parents=True)
        return cls(path)

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        """An existing run folder; ``TranscriptError`` if it has no transcript."""
        run = cls(Path(path))
        if not run.transcript.is_file():
            raise TranscriptError(f"{path} has no {TRANSCRIPT} (is it a run folder?)")
        return run

    @property
    def transcript(self) -> Path:
        return self.path / TRANSCRIPT

    @property
    def kernels_dir(self) -> Path:
        return self.path / "kernels"

    def append(self, record: BaseModel) -> None:
        """Append one transcript record and push it to disk before returning."""
        with open(self.transcript, "a", encoding="utf-8") as f:
            f.write(record_line(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self) -> list[Any]:
        return read_records(self.transcript)

    def state(self) -> RunState:
        return RunState.from_records(self.records())

    def candidate_kernels(self, index: int) -> Path:
        """Where candidate ``index``'s generated kernels are written."""
        return self.path / "candidates" / f"{index:03d}" / "kernels"

    def write_best(self, program: Program, report: Report, index: int) -> None:
        """Make verified candidate ``index`` the run's result: program, its kernels, its report."""
        if self.kernels_dir.exists():
            shutil.rmtree(self.kernels_dir)
        source = self.candidate_kernels(index)
        if source.exists():
            shutil.copytree(source, self.kernels_dir)
        (self.path / "program.json").write_text(program.model_dump_json(indent=2) + "\n")
        (self.path / "program.py").write_text(program.to_python())
        self.write_report(report)

    def write_report(self, report: Report) -> None:
        (self.path / "report.json").write_text(report.model_dump_json(indent=2) + "\n")

    def write_summary(self, text: str) -> None:
        (self.path / "summary.md").write_text(text)
