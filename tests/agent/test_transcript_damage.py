"""Damaged transcripts, as real files: a torn last line is cut off (and kept) before a resume
appends, undecodable lines are skipped with a note naming them, and records changed by hand are a
clear error naming the line — never a traceback, never a transcript that a resume makes unreadable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from coda.agent.providers.base import ToolResultPart, UserMessage
from coda.agent.providers.replay import ReplayProvider, _verdicts
from coda.agent.runs import TORN, RunDir
from coda.agent.synthesize import resume, synthesize
from coda.agent.transcript import (
    EndRecord,
    MessageRecord,
    ResumeRecord,
    TranscriptError,
    read_transcript,
    record_line,
)
from coda.cli.main import app

from .scripted import BLOCK, FAST, Script, finish

runner = CliRunner()


def crashed_run(tmp_path: Path) -> RunDir:
    """A run that died after its first records (run_start and the task): no sandbox needed."""
    with pytest.raises(RuntimeError):
        synthesize(BLOCK, tmp_path / "runs", provider=Script([RuntimeError("crash")]))
    (path,) = (tmp_path / "runs").iterdir()
    return RunDir.open(path)


def test_resume_cuts_a_torn_tail_off_keeps_its_bytes_and_the_run_stays_readable(
    tmp_path: Path,
) -> None:
    run = crashed_run(tmp_path)
    whole = run.transcript.read_bytes()
    torn = b'{"event": "message", "turn": 1, "message": {"role": "assis'
    run.transcript.write_bytes(whole + torn)
    assert any("torn last line" in n for n in run.state().notes)

    result = resume(RunDir.open(run.path), BLOCK, Script([finish("done")]), sandbox=FAST)
    assert result.stop.kind == "finished"
    after = read_transcript(run.transcript)
    assert after.notes == []  # every line reads: nothing was glued onto the torn bytes
    assert after.records[-1].__class__ is EndRecord
    assert any(isinstance(r, ResumeRecord) for r in after.records)
    assert run.transcript.read_bytes().startswith(whole)
    assert (run.path / TORN).read_bytes() == torn + b"\n"


def test_repair_tail_reports_what_it_did(tmp_path: Path) -> None:
    run = crashed_run(tmp_path)
    assert run.repair_tail() is None  # a whole transcript is left alone
    whole = run.transcript.read_bytes()
    run.transcript.write_bytes(whole + b'{"event": "re')
    note = RunDir.open(run.path).repair_tail()
    assert note is not None and "13 bytes" in note and TORN in note
    assert run.transcript.read_bytes() == whole
    # a whole record that only lost its newline keeps the record, and gets the newline back
    run.transcript.write_bytes(whole[:-1])
    note = RunDir.open(run.path).repair_tail()
    assert note is not None and "newline" in note
    assert run.transcript.read_bytes() == whole


def test_a_tear_inside_a_utf8_character_is_skipped_with_a_note_and_show_works(
    tmp_path: Path,
) -> None:
    run = crashed_run(tmp_path)
    lines = run.transcript.read_bytes().splitlines(keepends=True)
    text = "ü".encode()  # two bytes: keep only the first
    broken = b'{"event": "retry", "turn": 1, "attempt": 1, "delay_s": 1, "error": "' + text[:1]
    run.transcript.write_bytes(lines[0] + broken + b"\n" + b"".join(lines[1:]) + broken)
    found = read_transcript(run.transcript)
    assert len(found.records) == 2 and len(found.notes) == 2
    assert f"{run.transcript}:2: skipped a line that is not UTF-8 text" in found.notes[0]
    assert f"{run.transcript}:4: skipped a torn last line" in found.notes[1]
    shown = runner.invoke(app, ["show", str(run.path)])
    assert shown.exit_code == 0, shown.output
    assert "Traceback" not in shown.output and "unfinished" in shown.output
    assert ":2: skipped a line that is not UTF-8 text" in " ".join(shown.output.split())


def test_a_line_that_is_not_json_in_the_middle_is_skipped_with_a_note(tmp_path: Path) -> None:
    run = crashed_run(tmp_path)
    lines = run.transcript.read_bytes().splitlines(keepends=True)
    run.transcript.write_bytes(lines[0] + b'{"event": "mess{"event": "retry"}\n' + lines[1])
    found = read_transcript(run.transcript)
    assert len(found.records) == 2
    assert found.notes == [
        f"{run.transcript}:2: skipped a line that is not JSON (Expecting ',' delimiter; 33 bytes)"
    ]


def _tampered_candidate(data: dict[str, Any] | None = None) -> str:
    """A tool result whose Report is not a Report (valid JSON, valid record, wrong content)."""
    part = ToolResultPart(
        tool_call_id="c1",
        name="submit_program",
        content="candidate 1",
        data=data or {"candidate": 1, "report": {"verified": "perhaps"}},
    )
    return record_line(MessageRecord(turn=1, message=UserMessage(parts=[part])))


def _costed_turn(cost: float) -> str:
    """An assistant turn whose recorded cost was edited (``json`` writes NaN as ``NaN``)."""
    turn = {"role": "assistant", "parts": [], "stop_reason": "end_turn"}
    return json.dumps({"event": "message", "turn": 1, "message": turn, "cost_usd": cost})


@pytest.mark.parametrize(
    "line,expected",
    [
        ('{"event": "message", "turn": "one", "message": {}}', ":3: not a transcript record"),
        ('{"event": "candidate", "turn": 1}', ":3: not a transcript record (candidate.index"),
        ('["a", "list"]', ":3: not a transcript record"),
        (_tampered_candidate(), ":3: the message record does not hold together (verified"),
        (
            _tampered_candidate({"candidate": 1, "report": {}}).replace(
                '"candidate": 1', '"candidate": Infinity'
            ),
            ":3: the message record does not hold together (OverflowError",
        ),
        (_costed_turn(float("nan")), ":3: not a transcript record (message.cost_usd: Input "),
        (_costed_turn(-1e9), ":3: not a transcript record (message.cost_usd: Input should be"),
    ],
    ids=["wrong-type", "missing-fields", "not-an-object", "bad-report", "inf-index"]
    + ["nan-cost", "negative-cost"],
)
def test_a_tampered_record_is_a_clear_error_naming_its_line(
    tmp_path: Path, line: str, expected: str
) -> None:
    run = crashed_run(tmp_path)
    run.transcript.write_text(run.transcript.read_text() + line + "\n")
    with pytest.raises(TranscriptError, match="changed by hand") as err:
        run.state()
    assert f"{run.transcript}{expected}" in str(err.value)
    for args in (["show", str(run.path)], ["synthesize", "--resume", str(run.path)]):
        shown = runner.invoke(app, args)
        assert shown.exit_code == 2 and "Traceback" not in shown.output
        assert expected in " ".join(shown.output.split())


@pytest.mark.parametrize(
    "field,key,value,expected",
    [
        ("budgets", "bogus", 1, "budgets: Value error, unknown budget 'bogus' (known: max_turns"),
        ("budgets", "max_turns", "lots", "max_turns: Input should be a valid integer"),
        ("budgets", "max_cost", float("nan"), "max_cost: nan is not a budget"),
        ("budgets", "timeout_s", -5.0, "timeout_s: -5.0 is not a budget"),
        ("sandbox", "bogus", 1, "sandbox: Value error, unknown sandbox option 'bogus'"),
        ("sandbox", "timeout_s", "soon", "timeout_s: Input should be a valid number"),
        ("sandbox", "timeout_s", float("inf"), "timeout_s: inf is not a finite number"),
    ],
)
def test_hand_edited_budgets_and_sandbox_options_are_a_clear_error_naming_line_1(
    tmp_path: Path, field: str, key: str, value: Any, expected: str
) -> None:
    run = crashed_run(tmp_path)
    first, rest = run.transcript.read_text().split("\n", 1)
    start = json.loads(first)
    start[field][key] = value
    run.transcript.write_text(json.dumps(start) + "\n" + rest)
    with pytest.raises(TranscriptError, match="changed by hand") as err:
        run.state()
    assert f"{run.transcript}:1: not a transcript record (run_start.{field}: " in str(err.value)
    assert expected in str(err.value)
    for args in (["show", str(run.path)], ["synthesize", "--resume", str(run.path)]):
        shown = runner.invoke(app, [*args, "--json"])
        assert shown.exit_code == 2 and "Traceback" not in shown.output
        assert expected in json.loads(shown.stdout.splitlines()[-1])["error"]


def test_a_replayed_transcript_with_a_tampered_report_is_a_clear_error(tmp_path: Path) -> None:
    run = crashed_run(tmp_path)
    line = _tampered_candidate({"candidate": 1, "report": "oops"})
    run.transcript.write_text(run.transcript.read_text() + line + "\n")
    with pytest.raises(TranscriptError, match=":3: the message record does not hold together"):
        ReplayProvider(run.transcript)
    args = ["synthesize", "--provider", "replay", "--transcript", str(run.transcript)]
    shown = runner.invoke(app, [*args, "--runs-dir", str(tmp_path / "replays")])
    assert shown.exit_code == 2 and "Traceback" not in shown.output
    assert ":3: the message record does not hold together" in " ".join(shown.output.split())
    part = ToolResultPart(tool_call_id="c1", name="s", content="", data={"report": "oops"})
    assert _verdicts(UserMessage(parts=[part])) == {}  # no verdict, rather than a TypeError
