"""Bracketed text from Reports, models and servers reaches the console as written: Rich must not
read ``[program]`` or ``[at M=64, d=64]`` as markup (``--json`` always had them); and their control
characters (escape sequences that retitle or clear the terminal) never reach it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from coda.agent.events import Retrying, StageDone, Stop, Stopped, ToolAnswered, TurnEnded
from coda.agent.providers.base import ToolResultPart, Usage, UserMessage
from coda.agent.runs import RunDir
from coda.agent.transcript import MessageRecord
from coda.cli import agent as cli
from coda.cli import evals as eval_cli
from coda.cli.main import app
from coda.evals.results import CellResult
from coda.sandbox import SandboxOptions, evaluate
from tests.agent.scripted import BLOCK, submit
from tests.agent.test_transcript_damage import crashed_run

BRACKETED = "output out does not match [at M=64, d=64] (see [bold]this[/bold] and [red])"


def failed_report():
    """A Report whose validate stage failed (cause ``program``) with a bracketed message."""
    report = evaluate('{"block": "llama_mlp"}', BLOCK, SandboxOptions(isolate=False))
    stage = report.stages[0].model_copy(update={"message": BRACKETED})
    return report.model_copy(update={"stages": [stage]})


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Console:
    console = Console(record=True, width=300, highlight=False)
    monkeypatch.setattr(cli, "console", console)
    return console


def test_progress_lines_keep_bracketed_text(recorded: Console) -> None:
    report = failed_report()
    progress = cli.Progress()
    progress(StageDone(1, report.stages[0]))
    progress(Retrying(1, 2.0, "HTTP 429 [rate_limit_error]: slow down [retry in 2s]"))
    progress(ToolAnswered("submit_program", False, "[program] steps[0]: unknown op [gemm2]"))
    progress(Stopped(Stop("provider_error", "the server said [internal] no")))
    reply = submit({}, "c1", text="[plan] fold [gamma] into the weight")
    progress(TurnEnded(1, reply, 1.0, Usage(), 0.0))
    text = recorded.export_text()
    for fragment in (
        BRACKETED,
        "HTTP 429 [rate_limit_error]: slow down [retry in 2s]",
        "[program] steps[0]: unknown op [gemm2]",
        "the server said [internal] no",
        "[plan] fold [gamma] into the weight",
    ):
        assert fragment in text, fragment


def test_show_keeps_the_reports_bracketed_text(tmp_path: Path, recorded: Console) -> None:
    run = crashed_run(tmp_path)
    report = failed_report()
    part = ToolResultPart(
        tool_call_id="c1",
        name="submit_program",
        content="candidate 1",
        data={"candidate": 1, "report": report.model_dump(mode="json")},
    )
    RunDir.open(run.path).append(MessageRecord(turn=1, message=UserMessage(parts=[part])))
    shown = CliRunner().invoke(app, ["show", str(run.path)])
    assert shown.exit_code == 0, shown.output
    text = recorded.export_text()
    assert "FAILED at validate [program]:" in text  # the candidates table's headline
    assert BRACKETED in text  # the report panel


def test_verify_prints_the_report_text_as_written(tmp_path: Path, recorded: Console) -> None:
    program = tmp_path / "p.json"
    program.write_text('{"block": "llama_mlp", "steps": "nope"}')
    CliRunner().invoke(app, ["verify", str(program), "--block", "llama_mlp"])
    text = recorded.export_text()
    assert "FAILED at validate [program]\n" in text  # the stage's own line holds the summary
    assert "invalid program: inputs: Field required" in text


def test_eval_cell_lines_keep_bracketed_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    console = Console(record=True, width=300, highlight=False)
    monkeypatch.setattr(eval_cli, "console", console)
    cell = CellResult(
        cell="c", block="b", provider="builtin", model="m", seed=0, status="error",
        error="ProviderError: [overloaded] try later",
    )  # fmt: skip
    eval_cli._cell_line(cell, 1, 2)
    assert "[1/2] c: ERROR ProviderError: [overloaded] try later" in console.export_text()


ESCAPES = "\x1b]0;PWNED\x07\x1b[2J\x1b[31m\x9b31m\r\x08"  # retitle, clear, colour (C0 and C1)


def test_printable_drops_control_characters_but_newlines_and_tabs() -> None:
    from coda.cli.common import printable

    assert printable(f"a{ESCAPES}b\n\tc") == "a]0;PWNED[2J[31m31mb\n\tc"
    assert printable("plain [text] ü") == "plain [text] ü"


def test_escape_sequences_from_models_and_servers_never_reach_the_terminal(
    tmp_path: Path, recorded: Console, capsys: pytest.CaptureFixture[str]
) -> None:
    from coda.agent.providers.base import ToolCallPart
    from coda.cli.common import fail
    from tests.agent.scripted import turn

    progress = cli.Progress()
    progress(Retrying(1, 2.0, f"HTTP 429{ESCAPES} slow down"))
    progress(ToolAnswered(f"tool{ESCAPES}", False, f"no such tool{ESCAPES}"))
    progress(Stopped(Stop("provider_error", f"HTTP 400: bad{ESCAPES} request")))
    reply = turn(ToolCallPart(id="c1", name=f"x{ESCAPES}", arguments="{}"), text=f"hi{ESCAPES}")
    progress(TurnEnded(1, reply, 1.0, Usage(), 0.0))
    run = crashed_run(tmp_path)  # the run table and the header of `show`
    end = {"event": "end", "reason": "provider_error", "message": f"bad{ESCAPES} request"}
    end |= {"verified": False, "turns": 0, "input_tokens": 0, "output_tokens": 0}
    end |= {"cost_usd": None, "seconds": 1.0}
    run.transcript.write_text(run.transcript.read_text() + json.dumps(end) + "\n")
    assert CliRunner().invoke(app, ["show", str(run.path)]).exit_code == 0
    fail(f"the server said bad{ESCAPES} request")
    shown = recorded.export_text() + capsys.readouterr().err
    assert "]0;PWNED" in shown and "HTTP 400: bad]0;PWNED" in shown
    assert "bad]0;PWNED[2J[31m31m request" in " ".join(shown.split())
    for char in ("\x1b", "\x07", "\x9b", "\r", "\x08"):
        assert char not in shown, repr(char)
