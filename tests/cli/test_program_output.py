"""The builder code ``synthesize`` and ``show`` print is complete: every line whole, unboxed, so it
can be copied and run, however narrow the console."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from coda.cli import agent
from coda.cli.main import app
from coda.primitives import Program

runner = CliRunner()


def _printed_code(output: str, title: str) -> str:
    """The lines between the rule titled ``title`` and the next rule."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if f" {title} " in line and "─" in line)
    end = next(i for i in range(start + 1, len(lines)) if set(lines[i]) == {"─"})
    return "\n".join(lines[start + 1 : end])


def test_synthesize_and_show_print_the_program_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent, "console", Console(highlight=False, width=80))
    done = runner.invoke(app, ["synthesize", "-b", "llama_mlp", "--runs-dir", str(tmp_path)])
    assert done.exit_code == 0, done.output
    (run,) = tmp_path.iterdir()
    expected = Program.parse(json.loads((run / "program.json").read_text())).to_python()
    assert max(len(line) for line in expected.splitlines()) > 80  # a line the console would cut
    printed = _printed_code(done.output, "best program (candidate 1, builder form)")
    assert printed == expected.rstrip("\n")

    shown = runner.invoke(app, ["show", str(run)])
    assert shown.exit_code == 0, shown.output
    assert _printed_code(shown.output, "program") == expected.rstrip("\n")
    namespace: dict = {}
    exec(_printed_code(shown.output, "program"), namespace)  # the copied code runs
    assert namespace["program"] == Program.parse(json.loads((run / "program.json").read_text()))
