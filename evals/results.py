"""An eval on disk, and one cell's result.

``EVAL_DIR/``:

* ``eval.json`` — the ``EvalSpec`` (written when the eval starts; ``--resume`` reads it);
* ``results.jsonl`` — one ``CellResult`` per line, appended and synced as each cell ends (only
  the parent process writes it). A cell may have several lines (an ``error`` line, then a later
  ``done`` one after a resume): the last line of a cell is its result;
* ``cells/<cell id>/`` — the cell's run folder(s) (``<time>-<block>/``, see ``coda.agent.runs``),
  and ``log.txt`` when the cell ran in a worker process;
* ``results.md``, ``speedup.png``, ``errors.png`` — written by ``report.py`` after every run.

``EvalDir.create`` creates ``eval.json`` exclusively: two evals started at once never share a
folder (and never overwrite each other's spec).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from coda.agent.jsonl import append_line, repair_tail
from coda.agent.runs import unique_dir
from coda.primitives.errors import first_validation_error

from .metrics import CellNumbers
from .spec import EvalSpec

SPEC_FILE = "eval.json"
RESULTS_FILE = "results.jsonl"
TORN_FILE = "results.torn"


class EvalDirError(ValueError):
    """A folder that is not an eval, or whose files do not parse; the message names the file."""


class CellResult(BaseModel):
    """One cell's outcome. ``status`` ``done``: the agent ran to an answer (verified or not; a
    block the built-in planner cannot lower is answered ``stop="refused"``, its ``NoRules`` text
    in ``stop_message``); ``error``: the harness or the provider failed (left out of the rates,
    retried on resume).
    Timings and speedups are ``None`` when not measured (no GPU)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    cell: str
    block: str
    provider: str  # the ProviderSpec label, kind:model
    model: str
    seed: int
    status: Literal["done", "error"]
    error: str | None = None
    verified: bool = False
    stop: str | None = None
    stop_message: str = ""
    turns: int = 0
    seconds: float = 0.0  # wall time of the run's recorded invocations
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = 0.0
    candidates: int = 0
    verified_candidates: int = 0
    failures: dict[str, int] = {}  # failing stage -> candidates that failed there
    tool_errors: int = 0
    worst_error_ratio: float | None = None  # best candidate: max |err| / allowed over checks
    time_ms: float | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    ratio_to_gemms: float | None = None
    device: str = ""
    run_dir: str | None = None  # relative to the eval folder
    attempts: int = 1
    finished_at: str = ""

    def numbers(self) -> CellNumbers:
        return CellNumbers(
            block=self.block,
            provider=self.provider,
            verified=self.verified,
            errored=self.status == "error",
            gpu=self.device.startswith("cuda"),
            turns=self.turns,
            seconds=self.seconds,
            tokens=self.input_tokens + self.output_tokens,
            cost_usd=self.cost_usd,
            speedup={"eager": self.speedup_eager, "compile": self.speedup_compile},
            ratio_to_gemms=self.ratio_to_gemms,
        )


@dataclass
class EvalDir:
    path: Path
    _repaired: bool = field(default=False, repr=False, compare=False)

    @property
    def spec_file(self) -> Path:
        return self.path / SPEC_FILE

    @property
    def results_file(self) -> Path:
        return self.path / RESULTS_FILE

    def cell_dir(self, cell_id: str) -> Path:
        return self.path / "cells" / cell_id

    @classmethod
    def create(cls, path: Path, spec: EvalSpec, *, unique: bool = False) -> EvalDir:
        """A new eval in ``path``, its spec written. ``eval.json`` is created exclusively, so two
        evals never share a folder: the second gets an ``EvalDirError`` — or, with ``unique``
        (a default folder name), the folder ``path-2`` (``-3``, …) made atomically instead."""
        try:
            if path.exists() and not path.is_dir():
                raise EvalDirError(f"{path} is a file, not a folder: choose another --out")
            if unique:
                path = unique_dir(path)
            path.mkdir(parents=True, exist_ok=True)
            with open(path / SPEC_FILE, "x", encoding="utf-8") as f:
                f.write(spec.model_dump_json(indent=2) + "\n")
        except FileExistsError:
            raise EvalDirError(
                f"{path} already holds an eval: continue it with `coda-agent eval --resume "
                f"{path}`, or choose another --out"
            ) from None
        except OSError as e:
            raise EvalDirError(
                f"cannot create the eval folder {path}: {e.strerror or e} — choose another --out"
            ) from None
        return cls(path)

    @classmethod
    def open(cls, path: Path) -> EvalDir:
        found = cls(Path(path))
        if not found.spec_file.is_file():
            raise EvalDirError(f"{path} has no {SPEC_FILE} (is it an eval folder?)")
        return found

    def spec(self) -> EvalSpec:
        try:
            return EvalSpec.model_validate_json(self.spec_file.read_bytes())
        except ValidationError as e:
            what = first_validation_error(e)
            raise EvalDirError(f"{self.spec_file}: not an eval spec ({what})") from None
        except OSError as e:
            raise EvalDirError(f"cannot read {self.spec_file}: {e.strerror}") from None

    def append(self, result: CellResult) -> None:
        """Append one cell result and push it to disk before returning. The first append cuts
        off a line torn by an earlier crash (its bytes go to ``results.torn``), so the new line
        is not glued onto it; a failed append is rolled back."""
        try:
            if not self._repaired:
                self._repaired = True
                repair_tail(self.results_file, self.path / TORN_FILE)
            append_line(self.results_file, (result.model_dump_json() + "\n").encode("utf-8"))
        except OSError as e:
            raise EvalDirError(
                f"cannot append to {self.results_file}: {e.strerror or e} — free space on that "
                "disk or fix its permissions, then continue with `coda-agent eval --resume`"
            ) from None

    def results(self) -> dict[str, CellResult]:
        """The last result of every cell. A torn last line (a crash while writing) is skipped;
        any other line that is not a cell result is an ``EvalDirError`` naming it."""
        if not self.results_file.is_file():
            return {}
        chunks = self.results_file.read_bytes().split(b"\n")
        last = chunks.pop()  # b"" unless the last line lost its newline (torn, mostly)
        latest: dict[str, CellResult] = {}
        for number, chunk in enumerate(chunks, start=1):
            if chunk.strip():
                result = self._line(number, chunk)
                latest[result.cell] = result
        with contextlib.suppress(ValidationError):  # torn: skipped; whole but for the newline: kept
            result = CellResult.model_validate_json(last)
            latest[result.cell] = result
        return latest

    def _line(self, number: int, chunk: bytes) -> CellResult:
        try:
            return CellResult.model_validate_json(chunk)
        except ValidationError as e:
            raise EvalDirError(
                f"{self.results_file}:{number}: not a cell result ({first_validation_error(e)}); "
                "delete the line (`--resume` reruns a cell without a result)"
            ) from None

    def ordered_results(self) -> list[CellResult]:
        """Results in the spec's cell order (cells not run yet are absent)."""
        found = self.results()
        return [found[c.id] for c in self.spec().cells() if c.id in found]
