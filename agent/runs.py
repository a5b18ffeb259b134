"""A run on disk: ``runs/<time>-<block>/`` with the transcript, best program, kernels and report.

* ``transcript.jsonl`` — every record of the run (``transcript.py``), appended, flushed and synced
  one at a time, so a run that dies loses nothing it had done;
* ``program.json`` / ``program.py`` / ``kernels/*.py`` — the best *verified* program, its builder
  form and its generated Triton (absent until a candidate verifies);
* ``report.json`` — the best candidate's Report (``"verified"`` says whether it passed);
* ``summary.md`` — turns, tokens, cost, errors, timings or "not measured";
* ``candidates/NNN/kernels/`` — every candidate's generated kernels;
* ``transcript.torn`` — the bytes of a torn last transcript line that ``repair_tail`` cut off
  (appended there, so nothing a crash left behind is lost).

Folders are made with one atomic ``mkdir`` each: two runs started in the same second, in threads
or processes, get ``<time>-<block>`` and ``<time>-<block>-2``, never the same folder. A write that
fails (a full disk, a read-only folder) is a ``RunDirError`` naming the file; a failed append is
rolled back, so the transcript never keeps half a line.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from coda.primitives.ir import Program
from coda.sandbox.report import Report

from .jsonl import append_line, repair_tail
from .transcript import TranscriptError, read_transcript, record_line

if TYPE_CHECKING:
    from .transcript import RunState

TRANSCRIPT = "transcript.jsonl"
TORN = "transcript.torn"


class RunDirError(OSError):
    """A run folder that cannot be made or written; the message names the path and what to do."""


@contextlib.contextmanager
def writing(path: Path, doing: str) -> Iterator[None]:
    """Turn an ``OSError`` while ``doing`` something to ``path`` into a ``RunDirError``."""
    try:
        yield
    except RunDirError:
        raise
    except OSError as e:
        raise RunDirError(
            f"cannot {doing} {path}: {e.strerror or e} — free space on that disk or fix its "
            "permissions (or choose another --runs-dir)"
        ) from None


def unique_dir(base: Path) -> Path:
    """Make ``base`` — or ``base-2``, ``base-3``, … if taken — atomically; the folder made.

    ``mkdir`` either creates the folder or fails because it exists, so concurrent callers (threads
    or processes) never get the same one."""
    with writing(base.parent, "create the folder"):
        if base.parent.exists() and not base.parent.is_dir():
            raise RunDirError(f"{base.parent} is a file, not a folder: choose another --runs-dir")
        base.parent.mkdir(parents=True, exist_ok=True)
        n = 1
        while True:
            path = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                n += 1


@dataclass
class RunDir:
    path: Path
    _repaired: bool = field(default=False, repr=False, compare=False)
    notes: list[str] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def create(cls, runs_dir: str | Path, block: str) -> RunDir:
        """A new, empty run folder ``<runs_dir>/<time>-<block>[-n]`` (``RunDirError`` if the
        folder cannot be made)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return cls(unique_dir(Path(runs_dir) / f"{stamp}-{block}"), _repaired=True)

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
        """Append one transcript record and push it to disk before returning.

        The first append to a folder that already existed cuts a torn tail off first
        (``repair_tail``); an append that fails is rolled back to the previous end of the file.
        """
        if not self._repaired:
            self.repair_tail()
        with writing(self.transcript, "append to"):
            append_line(self.transcript, (record_line(record) + "\n").encode("utf-8"))

    def repair_tail(self) -> str | None:
        """Cut a torn last line off the transcript before anything is appended after it.

        A last line without its newline (or, with it, one that is not JSON) is what a crash
        mid-write leaves; appending after it would glue the next record onto it. A whole record
        that only lost its newline gets the newline back. The bytes cut off are appended to
        ``transcript.torn``. Returns a note saying what was done (also kept in ``notes``), or
        ``None`` when the tail was whole."""
        self._repaired = True
        with writing(self.transcript, "repair the end of"):
            note = repair_tail(self.transcript, self.path / TORN)
        if note is not None:
            self.notes.append(note)
        return note

    def records(self) -> list[Any]:
        return read_transcript(self.transcript).records

    def state(self) -> RunState:
        """The run its transcript records (``notes`` lists lines that were skipped)."""
        return read_transcript(self.transcript).state()

    def candidate_kernels(self, index: int) -> Path:
        """Where candidate ``index``'s generated kernels are written."""
        return self.path / "candidates" / f"{index:03d}" / "kernels"

    def write_best(self, program: Program, report: Report, index: int) -> None:
        """Make verified candidate ``index`` the run's result: program, its kernels, its report."""
        with writing(self.path, "write the best program into"):
            self._write_best(program, report, index)

    def _write_best(self, program: Program, report: Report, index: int) -> None:
        if self.kernels_dir.exists():
            shutil.rmtree(self.kernels_dir)
        source = self.candidate_kernels(index)
        if source.exists():
            shutil.copytree(source, self.kernels_dir)
        (self.path / "program.json").write_text(program.model_dump_json(indent=2) + "\n")
        (self.path / "program.py").write_text(program.to_python())
        self.write_report(report)

    def write_report(self, report: Report) -> None:
        with writing(self.path / "report.json", "write"):
            (self.path / "report.json").write_text(report.model_dump_json(indent=2) + "\n")

    def write_summary(self, text: str) -> None:
        with writing(self.path / "summary.md", "write"):
            (self.path / "summary.md").write_text(text)
