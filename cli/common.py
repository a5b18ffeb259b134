"""What every ``coda-agent`` command shares: error and note output, ``--json``'s one object, the
``--provider`` choices, and loading blocks from ``--block-file``.

This module, like the command modules, imports only the standard library, Typer and Rich at import
time: ``coda-agent --help`` (and shell completion, which runs the command line on every TAB) must
not pay for torch, Triton or the pydantic models. What a command needs from the rest of coda it
imports when it runs.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from coda.blocks import Block


# ``--provider``: the model sources ``coda.agent.providers.make_provider`` builds by name (a test
# keeps the two lists equal; they are repeated here so that listing them imports nothing).
PROVIDERS = ("builtin", "anthropic", "openai", "replay")


def complete_provider(incomplete: str) -> list[str]:
    """Shell completion of ``--provider``."""
    return [p for p in PROVIDERS if p.startswith(incomplete)]


def check_provider(value: str | None) -> str | None:
    """``--provider`` is one of ``PROVIDERS``: anything else is a usage error (exit 2) before
    the command starts, naming the closest choice."""
    if value is None or value in PROVIDERS:
        return value
    close = difflib.get_close_matches(value, PROVIDERS, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise typer.BadParameter(
        f"unknown provider {value!r}: {hint}choose one of {', '.join(PROVIDERS)}"
    )


class Failure(Exception):
    """A command's refusal, raised by functions that do not know whether ``--json`` was given: the
    command turns it into output with ``fail(f.message, f.code, as_json)``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# C0 and C1 control characters but newline and tab: ESC starts the sequences that move the cursor,
# clear the screen or retitle the terminal, and others ring, rewind or erase.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` from outside (a model, a server, a file) without control characters other than
    newline and tab, so that printing it cannot drive the terminal. Escape Rich markup after."""
    return _CONTROL.sub("", text)


def stdout_width(piped: int) -> int | None:
    """The width a console on stdout should be given: ``None`` (Rich measures the terminal, or
    takes ``COLUMNS`` when it is set), else ``piped`` for output that is not a terminal (CI logs,
    ``| tee``), which Rich would otherwise cut to 80 columns."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit():
        return None
    return piped


def stderr() -> Console:
    """A console on stderr (never stdout, which ``--json`` keeps for its one object)."""
    return Console(stderr=True, highlight=False)


def fail(
    message: str, code: int = 2, as_json: bool = False, details: dict[str, Any] | None = None
) -> typer.Exit:
    """Print ``message`` as an error on stderr (and, for ``--json``, as the one JSON object on
    stdout: ``{"error": ..., "exit_code": ...}`` plus ``details``' keys); the ``Exit`` to raise."""
    stderr().print(f"[red]error:[/] {escape(printable(message))}", soft_wrap=True)
    if as_json:
        print(json.dumps({"error": message, "exit_code": code, **(details or {})}))
    return typer.Exit(code)


def note(message: str) -> None:
    """A warning on stderr."""
    stderr().print(f"[yellow]note:[/] {escape(printable(message))}", soft_wrap=True)


def print_json(data: Any) -> None:
    """``--json``'s one object on stdout."""
    print(json.dumps(data, indent=2))


def block_file_path(
    block_file: Path | None, as_json: bool = False, what: str = "--block-file"
) -> Path | None:
    """``--block-file`` (or the block file a transcript recorded: ``what``) as an absolute path,
    checked to be a file.

    A relative path is taken from the current folder here, where the user typed it: the sandbox
    worker that imports the file again runs in a temporary folder of its own."""
    if block_file is None:
        return None
    path = Path(os.path.abspath(block_file))
    if not path.is_file():
        missing = "is a folder, not a Python file" if path.is_dir() else "does not exist"
        relative = not block_file.is_absolute()
        hint = f" (a relative path is taken from {Path.cwd()})" if relative else ""
        raise fail(f"{what} {block_file}: {path} {missing}{hint}", as_json=as_json)
    return path


def import_block_file(block_file: Path | str, timeout_s: float | None = None) -> list[Block]:
    """Register the blocks of ``block_file`` (absolute). The file is imported in a subprocess
    first (stopped after ``timeout_s``, the command's ``--timeout``, when given), so one that
    exits, crashes or hangs when imported is a usage error (``Failure``), not the end of this
    process; what it prints goes to stderr."""
    from coda.blocks import load_block_file

    try:
        with contextlib.redirect_stdout(sys.stderr):
            return load_block_file(block_file, probe=True, probe_timeout_s=timeout_s)
    except (FileNotFoundError, ImportError, ValueError) as e:
        raise Failure(str(e)) from None


def load_blocks(
    block_file: Path, as_json: bool = False, timeout_s: float | None = None
) -> list[Block]:
    """``import_block_file`` for a command that fails by itself."""
    try:
        return import_block_file(block_file, timeout_s)
    except Failure as f:
        raise fail(f.message, f.code, as_json) from None


def resolve_block(
    block: str | None,
    block_file: Path | None,
    as_json: bool = False,
    timeout_s: float | None = None,
) -> Block:
    """The block to work on: ``--block NAME``, or the one block of ``--block-file`` (imported
    within ``timeout_s``, when given)."""
    from coda.blocks import BlockNotFound, get_block

    found = load_blocks(block_file, as_json, timeout_s) if block_file is not None else []
    if block is None and len(found) > 1:
        names = ", ".join(b.name for b in found)
        raise fail(
            f"{block_file} defines several blocks ({names}); pick one with --block", 2, as_json
        )
    if block is None and found:
        return found[0]
    if block is None:
        raise fail("give --block NAME or --block-file FILE (see `coda-agent blocks`)", 2, as_json)
    try:
        return get_block(block)
    except BlockNotFound as e:
        raise fail(_not_found(block, found, block_file, e), as_json=as_json) from None
    except ValueError as e:
        raise fail(str(e), as_json=as_json) from None


def _not_found(name: str, found: list[Block], block_file: Path | None, error: Exception) -> str:
    """Why ``--block name`` names no block: with ``--block-file``, the file's own blocks (and
    the closest of them) first, rather than among every built-in one."""
    if not found:
        return str(error)
    names = [b.name for b in found]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"no block named {name!r}: {hint}{block_file} defines {', '.join(map(repr, names))} "
        "(`coda-agent blocks` lists the built-in ones)"
    )
