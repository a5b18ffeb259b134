"""The regression store: accepted agent-authored kernels, re-verified on every change.

A store is a folder; ``<store>/<block>/<name>.json`` holds one ``StoredKernel``: the Program, and
where it came from (provider, model, date, run id, hardware, library versions, the errors it was
verified with and, when measured, its time per benchmark shape). Two stores matter:

* ``STORE_DIR`` (``evals/regression/``), the built-in entries: package data, read-only once
  installed, re-verified by the test suite on every change;
* ``user_store()``, where ``accept`` writes unless told otherwise: ``$CODA_STORE`` when set, else
  ``$XDG_DATA_HOME/coda-agent/store`` (``~/.local/share/coda-agent/store``). A per-user folder
  rather than one under the working directory, so that every run accepted from anywhere lands in
  the same store and ``regress`` finds it from anywhere; never inside the installed package, which
  may not be writable and is replaced on every upgrade.

* ``accept(run_dir)`` adds a run's best program; a run without a verified candidate is refused,
  and so is a name already taken by a different program (``force`` replaces it) or a name that is
  not a plain file name. The same program accepted twice is reported, not duplicated: also when
  the user's store is the target and a built-in entry holds it, since ``regress`` checks both.
* ``regress(stores)`` re-verifies every stored Program with the sandbox's defaults for this device
  (CPU: the Triton interpreter, float32 and float16; GPU: bfloat16 and float16, and timings). An
  entry fails when it no longer verifies (its block gone, its JSON unreadable, a check over its
  tolerance) or — on a GPU of the same kind as the one it was recorded on — when its time over the
  recorded benchmark shapes grew by more than ``slowdown``× the recorded time. An entry of a block
  defined in a block file records the file; it is imported only when the caller names it
  (``block_files``, ``regress --block-file``) — a store is data and never chooses code to run.

Where an entry has no time recorded on this device (accepted from a CPU run, as the built-in
entries are, or on other hardware), the first ``regress`` that measures it records its times in
the times file (``RecordedTimes``: ``default_times_file()``, per program hash, device, shape and
dtype, beside the user's store; a regress never writes into a store) and later runs on that device
compare against them, so the slowdown check applies to every entry from its second run on.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from coda.agent.runs import RunDir
from coda.agent.summary import error_rows
from coda.blocks import BlockNotFound, get_block, load_block_file
from coda.primitives.errors import did_you_mean, first_validation_error
from coda.sandbox.report import Report
from coda.sandbox.runner import evaluate
from coda.sandbox.stages import SandboxOptions

from .spec import slug

STORE_DIR = Path(__file__).resolve().parent / "regression"  # the built-in entries (read-only)
STORE_ENV = "CODA_STORE"


def user_store() -> Path:
    """The store ``accept`` writes to by default (read when called, not at import):
    ``$CODA_STORE``, else ``$XDG_DATA_HOME/coda-agent/store``, else
    ``~/.local/share/coda-agent/store``."""
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV]).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data).expanduser() / "coda-agent" / "store"


def default_stores() -> list[Path]:
    """What ``regress`` checks when no store is named: the built-in entries, and the user's
    store once it exists."""
    user = user_store()
    return [STORE_DIR, user] if user.is_dir() and user.resolve() != STORE_DIR else [STORE_DIR]


class AcceptError(ValueError):
    """A run that cannot be accepted; the message says why and what to do."""


class StoreError(ValueError):
    """A store that cannot be read (missing folder, no entries)."""


class MeasuredError(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    output: str
    dtype: str
    checks: int
    max_abs_err: float
    allowed: float
    rel_err: float


class TimedShape(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    sizes: dict[str, int]
    dtype: str
    program_ms: float


class Provenance(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    provider: str
    model: str
    accepted_at: str  # ISO date-time, UTC
    run_id: str  # the run folder's name
    run_started_at: str
    candidate: int
    hardware: str  # the device the run's sandbox used, e.g. "cuda (NVIDIA H200)"
    machine: str  # platform of the accepting machine
    versions: dict[str, str]
    errors: list[MeasuredError]
    time_ms: float | None = None  # summed over ``timings``; None: not measured
    timings: list[TimedShape] = []


class StoredKernel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    version: Literal[1] = 1  # the entry format this code reads; another is unreadable, not guessed
    name: str
    block: str
    block_file: str | None = None
    program_hash: str
    program: dict[str, Any]
    provenance: Provenance


@dataclass(frozen=True)
class Accepted:
    path: Path
    entry: StoredKernel
    duplicate: bool  # the same program was already stored (at ``path``)


def accept(
    run_dir: Path, *, name: str | None = None, store: Path | None = None, force: bool = False
) -> Accepted:
    """Store the best verified program of ``run_dir`` in ``store`` (default ``user_store()``)."""
    if name is not None:
        check_entry_name(name)
    store = user_store() if store is None else store
    run = RunDir.open(run_dir)
    state = run.state()
    best = state.best
    if best is None or not best.report.verified or best.program is None:
        tried = f"{len(state.candidates)} candidate(s)"
        head = f"; the furthest got: {best.report.headline()}" if best is not None else ""
        raise AcceptError(
            f"{run_dir} has no verified candidate ({tried}{head}): only a verified program can be "
            "accepted — continue the run (`coda-agent synthesize --resume`) or start a new one"
        )
    report = best.report
    entry = StoredKernel(
        name=slug(name or f"{state.provider}-{report.program_hash}"),
        block=state.start.block,
        block_file=state.start.block_file,
        program_hash=report.program_hash,
        program=best.program.model_dump(mode="json"),
        provenance=_provenance(state, run, best.index, report),
    )
    for stored_in in _stores_checked_with(store):
        for path, stored in _entries(stored_in / slug(entry.block)):
            if stored is not None and stored.program_hash == entry.program_hash:
                return Accepted(path, stored, duplicate=True)
    folder = store / slug(entry.block)
    path = folder / f"{entry.name}.json"
    if path.exists() and not force:
        raise AcceptError(
            f"{path} already holds a different program: choose another --name, or --force to "
            "replace it"
        )
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(entry.model_dump_json(indent=2) + "\n")
    return Accepted(path, entry, duplicate=False)


def check_entry_name(name: str) -> None:
    """An entry's name is its file name in its block's folder: a name that is not a plain file
    name (a path separator, a leading dot that would hide the file, other characters) is refused
    rather than silently renamed."""
    if "/" in name or "\\" in name:
        raise AcceptError(
            f"--name {name!r} contains a path separator: an entry's name is a file name in the "
            "store's folder for its block; give a name of letters, digits, '.', '_' and '-'"
        )
    if not name or name != slug(name) or name.startswith("."):
        better = slug(name).lstrip(".")
        example = f" (e.g. {better!r})" if better else ""
        raise AcceptError(
            f"--name {name!r} is not a plain file name: give a name of letters, digits, '.', "
            f"'_' and '-' that does not start with '.'{example}"
        )


def _stores_checked_with(store: Path) -> list[Path]:
    """The stores whose entries ``regress`` checks together with ``store``'s by default: the
    built-in entries beside the user's store; any other store is checked alone (``regress
    --store``), so only its own entries make a program already stored there."""
    if store.resolve() in (user_store().resolve(), STORE_DIR):
        return list(dict.fromkeys([STORE_DIR, store]))
    return [store]


def _provenance(state: Any, run: RunDir, index: int, report: Report) -> Provenance:
    return Provenance(
        provider=state.provider,
        model=state.model,
        accepted_at=datetime.now(UTC).isoformat(timespec="seconds"),
        run_id=run.path.name,
        run_started_at=state.start.started_at,
        candidate=index,
        hardware=report.device,
        machine=f"{platform.system()} {platform.machine()}",
        versions=dict(report.versions),
        errors=[
            MeasuredError(
                output=r.output,
                dtype=r.dtype,
                checks=r.checks,
                max_abs_err=r.max_abs_err,
                allowed=r.allowed,
                rel_err=r.rel_err,
            )
            for r in error_rows(report)
        ],
        time_ms=sum(p.program_ms for p in report.profile) if report.profile else None,
        timings=[
            TimedShape(sizes=p.sizes, dtype=p.dtype, program_ms=p.program_ms)
            for p in report.profile
        ],
    )


def _entries(folder: Path) -> list[tuple[Path, StoredKernel | None]]:
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            found.append((path, StoredKernel.model_validate_json(path.read_text())))
        except (ValidationError, ValueError):
            found.append((path, None))
    return found


def store_files(stores: Path | Sequence[Path], blocks: list[str] | None = None) -> list[Path]:
    """The entries of ``stores`` (of ``blocks`` only, when given). A store that is not a folder,
    a block with no entry in any store, or no entry at all is a ``StoreError``."""
    stores = [Path(stores)] if isinstance(stores, str | os.PathLike) else list(stores)
    files = []
    for store in stores:
        if not store.is_dir():
            raise StoreError(
                f"{store} is not a folder: give a regression store (`coda-agent accept RUN` "
                f"makes one at {user_store()}; the built-in one is {STORE_DIR})"
            )
        files += sorted(store.glob("*/*.json"))
    where = ", ".join(str(s) for s in stores)
    if blocks:
        stored = {f.parent.name for f in files}
        for block in blocks:
            if block not in stored:
                raise StoreError(
                    f"{where} holds no kernels for block {block!r}: {did_you_mean(block, stored)}"
                )
        files = [f for f in files if f.parent.name in blocks]
    if not files:
        raise StoreError(f"{where} holds no kernels (add one with `coda-agent accept RUN`)")
    return files


# -- regress -------------------------------------------------------------------------------------
Status = Literal["ok", "broken", "slower"]
TIMES_ENV = "CODA_REGRESS_TIMES"


def default_times_file() -> Path:
    """Where ``regress`` records the times of entries with none recorded on its device:
    ``$CODA_REGRESS_TIMES`` when set, else ``regress-times.json`` beside the user's store's
    default folder (``~/.local/share/coda-agent/``)."""
    if os.environ.get(TIMES_ENV):
        return Path(os.environ[TIMES_ENV]).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data).expanduser() / "coda-agent" / "regress-times.json"


class RecordedTimes:
    """Times ``regress`` measured itself, by program hash and device: ``{hash: {device:
    {"recorded_at": ..., "timings": [TimedShape, ...]}}}`` in one JSON file (an unreadable file
    counts as empty; it is only rewritten when a time is recorded)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        self.data: dict[str, Any] = data if isinstance(data, dict) else {}

    def get(self, program_hash: str, device: str) -> tuple[list[TimedShape], str]:
        """The timings recorded for this program on this device and when; none if none."""
        entry = self.data.get(program_hash, {}).get(device)
        try:
            timings = [TimedShape.model_validate(t) for t in entry["timings"]]
            return timings, str(entry.get("recorded_at", ""))
        except (TypeError, KeyError, ValidationError):
            return [], ""

    def record(self, program_hash: str, device: str, report: Report) -> None:
        """Record the report's profiled times as this program's on ``device``."""
        self.data.setdefault(program_hash, {})[device] = {
            "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "timings": [
                TimedShape(sizes=p.sizes, dtype=p.dtype, program_ms=p.program_ms).model_dump()
                for p in report.profile
            ],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


@dataclass(frozen=True)
class RegressRow:
    path: Path
    name: str
    block: str
    status: Status
    message: str  # what failed, or "verified"
    error_now: float | None = None  # worst max|err| / allowed, now
    error_recorded: float | None = None
    time_now_ms: float | None = None
    time_recorded_ms: float | None = None
    time_note: str = ""  # why the times were not compared ("" when they were)

    @property
    def slowdown(self) -> float | None:
        """Now over recorded, when the two are comparable (same hardware, same shapes)."""
        if self.time_note or self.time_now_ms is None or not self.time_recorded_ms:
            return None
        return self.time_now_ms / self.time_recorded_ms


def regress(
    store: Path | Sequence[Path] = STORE_DIR,
    *,
    slowdown: float = 1.10,
    blocks: list[str] | None = None,
    options: SandboxOptions | None = None,
    on_row: Callable[[RegressRow], None] | None = None,
    times: Path | None = None,
    block_files: Sequence[str | Path] = (),
) -> list[RegressRow]:
    """Re-verify every stored kernel (see the module docstring for what fails). ``times``: the
    file of times regress records itself (default ``default_times_file()``). ``block_files``:
    the block files the caller names for entries of blocks defined in a file — a store is data,
    and the file an entry records is imported only when named here (``named_block_files``)."""
    named = named_block_files(block_files)
    rows = []
    recorded = RecordedTimes(times or default_times_file())
    for path in store_files(store, blocks):
        row = check_entry(
            path, slowdown=slowdown, options=options or SandboxOptions(), times=recorded,
            block_files=named,
        )  # fmt: skip
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def named_block_files(paths: Sequence[str | Path]) -> frozenset[str]:
    """Import the block files ``paths`` (each in a subprocess first: ``load_block_file(probe=
    True)``, bounded in time; ``StoreError`` for one that fails) and return their resolved
    paths, the files whose entries ``check_entry`` may check."""
    named = set()
    for path in paths:
        resolved = Path(path).expanduser().resolve()
        try:
            load_block_file(resolved, probe=True)
        except (FileNotFoundError, ImportError, ValueError) as e:
            raise StoreError(f"--block-file {path}: {e}") from None
        named.add(str(resolved))
    return frozenset(named)


def check_entry(
    path: Path,
    *,
    slowdown: float,
    options: SandboxOptions,
    times: RecordedTimes | None = None,
    block_files: frozenset[str] = frozenset(),
) -> RegressRow:
    """Re-verify one stored entry. An entry whose block is defined in a file is checked only when
    that file was named (``block_files``, from ``named_block_files``, which imported it): the
    store's JSON never chooses code to import."""
    try:
        entry = StoredKernel.model_validate_json(path.read_text())
    except ValidationError as e:
        message = f"unreadable: {first_validation_error(e, root='the entry')}"
        return RegressRow(path, path.stem, path.parent.name, "broken", message)
    except (OSError, ValueError) as e:
        return RegressRow(path, path.stem, path.parent.name, "broken", f"unreadable: {e}")
    if entry.block_file and str(Path(entry.block_file).resolve()) not in block_files:
        return RegressRow(
            path, entry.name, entry.block, "broken",
            f"block {entry.block!r} is defined in {entry.block_file}, which is imported only "
            f"when named: add --block-file {entry.block_file}",
        )  # fmt: skip
    try:
        block = get_block(entry.block)
    except (BlockNotFound, ImportError, ValueError) as e:
        return RegressRow(path, entry.name, entry.block, "broken", f"block: {e}")
    report = evaluate(entry.program, block, options, block_file=entry.block_file)
    return _judge(path, entry, report, slowdown, times)


def _judge(
    path: Path,
    entry: StoredKernel,
    report: Report,
    slowdown: float,
    times: RecordedTimes | None = None,
) -> RegressRow:
    """The row of a stored kernel for its Report; ``times``: where regress's own recorded times
    are read (and this run's recorded, for a verified kernel with no comparable time yet)."""
    prov = entry.provenance
    worst = report.worst_check()
    recorded = max((e.max_abs_err / e.allowed for e in prov.errors if e.allowed), default=None)
    now_ms, then_ms, note = _times(entry, report)
    if note and now_ms is not None and times is not None and report.verified:
        now_ms, then_ms, note = _recorded_times(entry, report, times, note)
    row = RegressRow(
        path=path,
        name=entry.name,
        block=entry.block,
        status="ok",
        message="verified",
        error_now=worst.max_abs_err / worst.allowed if worst and worst.allowed else None,
        error_recorded=recorded,
        time_now_ms=now_ms,
        time_recorded_ms=then_ms,
        time_note=note,
    )
    if not report.verified:
        return replace(row, status="broken", message=report.headline())
    if row.slowdown is not None and row.slowdown > slowdown:
        return replace(
            row, status="slower", message=f"{row.slowdown:.3f}× its recorded time (> {slowdown})"
        )
    return row


def _times(entry: StoredKernel, report: Report) -> tuple[float | None, float | None, str]:
    """(now, recorded) over the benchmark shapes both measured; a note when they are not
    comparable (then the slowdown is not judged)."""
    prov = entry.provenance
    now_all = sum(p.program_ms for p in report.profile) if report.profile else None
    if now_all is None:
        prof = report.stage("profile")
        return None, prov.time_ms, prof.message if prof else "timings not measured"
    if prov.time_ms is None:
        return now_all, None, "no recorded time to compare"
    if report.device != prov.hardware:
        return (
            now_all,
            prov.time_ms,
            (f"not compared: recorded on {prov.hardware}, now {report.device}"),
        )
    recorded = {(_key(t.sizes), t.dtype): t.program_ms for t in prov.timings}
    common = [p for p in report.profile if (_key(p.sizes), p.dtype) in recorded]
    if not common:
        return now_all, prov.time_ms, "not compared: no benchmark shape in common with the record"
    now = sum(p.program_ms for p in common)
    then = sum(recorded[(_key(p.sizes), p.dtype)] for p in common)
    return now, then, ""


def _recorded_times(
    entry: StoredKernel, report: Report, times: RecordedTimes, why: str
) -> tuple[float | None, float | None, str]:
    """(now, recorded, note) against the times regress recorded on this device; with none in
    common, this run's times are recorded (``why``: why the entry's own were not comparable)."""
    now_all = sum(p.program_ms for p in report.profile)
    timings, when = times.get(entry.program_hash, report.device)
    recorded = {(_key(t.sizes), t.dtype): t.program_ms for t in timings}
    common = [p for p in report.profile if (_key(p.sizes), p.dtype) in recorded]
    if not common:
        times.record(entry.program_hash, report.device, report)
        return (
            now_all,
            None,
            f"{why}; this run's times are now recorded for {report.device} in {times.path}: "
            "the next regress compares against them",
        )
    now = sum(p.program_ms for p in common)
    then = sum(recorded[(_key(p.sizes), p.dtype)] for p in common)
    return now, then, ""


def _key(sizes: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(sizes.items()))
