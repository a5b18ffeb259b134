"""Named eval suites: ``evals/suites/<name>.toml`` (package data), each a list of blocks.

A suite file holds ``description``, ``blocks`` (registered block names: a name that is not
registered is an error naming the file and the close matches), ``planned`` (names of blocks that
are being added elsewhere and are not registered yet: skipped with a notice until a block of that
name exists, then run), ``block_files`` (Python block files, relative to the suite file, that
define its blocks: imported before the names are checked) and an optional default ``seeds``.
``resolve_blocks`` turns a suite name or an explicit ``--blocks a,b,c`` list into the blocks to
run.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from coda.blocks import BlockNotFound, get_block, list_blocks, load_block_file

SUITES_DIR = Path(__file__).resolve().parent / "suites"
_KEYS = {"description", "blocks", "planned", "seeds", "block_files"}


class SuiteError(ValueError):
    """A suite that does not exist or does not parse; the message says what to change."""


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    blocks: list[str]
    planned: list[str] = field(default_factory=list)
    seeds: int | None = None
    path: Path | None = None
    block_files: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class Selection:
    """What an eval runs: the blocks, and the planned ones skipped because they do not exist yet."""

    blocks: list[str]
    skipped: list[str]


def suite_names() -> list[str]:
    return sorted(p.stem for p in SUITES_DIR.glob("*.toml"))


def load_suite(name: str, directory: Path = SUITES_DIR) -> Suite:
    path = directory / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in directory.glob("*.toml"))
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise SuiteError(f"no suite named {name!r}: {hint}known: {', '.join(known)}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SuiteError(f"{path}: not valid TOML ({e})") from None
    unknown = set(data) - _KEYS
    if unknown:
        raise SuiteError(f"{path}: unknown keys {sorted(unknown)} (allowed: {sorted(_KEYS)})")
    blocks, planned = data.get("blocks", []), data.get("planned", [])
    if not _names(blocks) or not _names(planned):
        raise SuiteError(f"{path}: `blocks` and `planned` must be lists of block names")
    seeds = data.get("seeds")
    if seeds is not None and (not isinstance(seeds, int) or seeds < 1):
        raise SuiteError(f"{path}: `seeds` must be a positive integer, not {seeds!r}")
    files = data.get("block_files", [])
    if not _names(files):
        raise SuiteError(f"{path}: `block_files` must be a list of paths relative to {directory}")
    found = [(directory / f).resolve() for f in files]
    missing = [str(f) for f in found if not f.is_file()]
    if missing:
        raise SuiteError(f"{path}: block_files {missing} do not exist")
    description = str(data.get("description", ""))
    return Suite(name, description, blocks, planned, seeds, path, found)


def _names(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v for v in value)


def _registered() -> set[str]:
    return {b.name for b in list_blocks()}


def check_block_names(names: list[str], where: str) -> None:
    """Raise ``SuiteError`` naming ``where`` for the first name that is not a registered block."""
    for name in names:
        try:
            get_block(name)
        except BlockNotFound as e:
            raise SuiteError(f"{where}: {e}") from None


def load_suite_blocks(suite: Suite) -> None:
    """Register the blocks of the suite's ``block_files`` (a file whose blocks are all
    registered already is not imported again)."""
    registered = _registered()
    for path in suite.block_files:
        if not set(suite.blocks) <= registered:
            load_block_file(path)
            registered = _registered()


def select(suite: Suite) -> Selection:
    """The suite's blocks plus its planned blocks that are registered by now (importing the
    suite's block files first)."""
    load_suite_blocks(suite)
    check_block_names(suite.blocks, str(suite.path or suite.name))
    registered = _registered()
    ready = [b for b in suite.planned if b in registered]
    skipped = [b for b in suite.planned if b not in registered]
    blocks = list(dict.fromkeys([*suite.blocks, *ready]))
    if not blocks:
        raise SuiteError(
            f"suite {suite.name!r} has no registered block yet (planned: {', '.join(skipped)}); "
            "run another suite or pass --blocks"
        )
    return Selection(blocks, skipped)


def resolve_blocks(suite: str | None, blocks: list[str] | None) -> tuple[Selection, Suite | None]:
    """The blocks to run for ``--suite NAME`` or ``--blocks a,b,c`` (exactly one is given)."""
    if (suite is None) == (not blocks):
        raise SuiteError("give exactly one of --suite NAME or --blocks a,b,c")
    if suite is not None:
        loaded = load_suite(suite)
        return select(loaded), loaded
    names = list(dict.fromkeys(blocks or []))
    check_block_names(names, "--blocks")
    return Selection(names, []), None
