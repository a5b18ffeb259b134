"""A run on disk: ``runs/<time>-<block>/`` with the transcript, best program, kernels and report.

``transcript.jsonl`` is appended and flushed record by record, so a run that dies loses nothing it
had done; the other files are (re)written whenever the best candidate changes.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coda.primitives.ir import Program
from coda.sandbox.report import Report


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

    @property
    def kernels_dir(self) -> Path:
        return self.path / "kernels"

    def append_transcript(self, record: dict[str, Any]) -> None:
        with open(self.path / "transcript.jsonl", "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()

    def candidate_kernels(self, index: int) -> Path:
        """Where candidate ``index``'s generated kernels are written."""
        return self.path / "candidates" / f"{index:03d}" / "kernels"

    def write_best(self, program: Program, report: Report, index: int) -> None:
        """Make candidate ``index`` the run's result: program, its kernels, its report."""
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
