"""``coda-agent blocks`` at any width: block names, the column users copy, are never cut (the other
columns wrap instead), and piped output takes its width from ``COLUMNS`` when it is set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rich.cells import cell_len
from rich.console import Console
from typer.testing import CliRunner

from coda.blocks import list_blocks
from coda.blocks.registry import builtin_blocks
from coda.cli import agent
from coda.cli.main import app

runner = CliRunner()


def _names() -> list[str]:
    return [b.name for b in list_blocks()]


def _listed_whole(output: str, names: list[str]) -> list[str]:
    """The names that do not appear whole on some line of ``output``."""
    lines = output.splitlines()
    return [n for n in names if not any(f" {n} " in line for line in lines)]


@pytest.mark.parametrize("width", [80, 110])
def test_blocks_lists_every_name_whole(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "console", Console(highlight=False, width=width))
    done = runner.invoke(app, ["blocks"])
    assert done.exit_code == 0, done.output
    assert "…" not in done.output
    assert _listed_whole(done.output, _names()) == []
    assert max(cell_len(line) for line in done.output.splitlines()) <= width


def test_a_console_too_narrow_for_the_table_still_shows_whole_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent, "console", Console(highlight=False, width=40))
    done = runner.invoke(app, ["blocks"])
    assert done.exit_code == 0, done.output
    assert _listed_whole(done.output, _names()) == []


def test_piped_blocks_follow_columns() -> None:
    env = {**os.environ, "COLUMNS": "72"}
    done = subprocess.run(
        [sys.executable, "-m", "coda.cli", "blocks"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert max(cell_len(line) for line in done.stdout.splitlines()) <= 72
    # a fresh process lists the built-in blocks (this one may hold block files' too)
    assert _listed_whole(done.stdout, [b.name for b in builtin_blocks()]) == []


def test_the_width_is_counted_in_terminal_cells() -> None:
    """A description with a combining accent (``x̂``: two characters, one cell) is as wide on
    screen as the table allows, though its line has one character more."""
    from types import SimpleNamespace

    spec = SimpleNamespace(shape=["M", "d"])
    hat = SimpleNamespace(
        name="hat_block", description="x̂ · w " * 40, inputs={"x": spec}, outputs=["y"]
    )
    console = Console(highlight=False, width=110, record=True)
    console.print(agent.blocks_table([*builtin_blocks(), hat], 110))
    lines = console.export_text().splitlines()
    assert max(cell_len(line) for line in lines) <= 110
    assert max(len(line) for line in lines) > 110  # what a count of characters would say
