"""The command line: the demo command, listing, verifying a file, JSON output, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from coda.agent.cli import app
from coda.agent.planner import lower
from coda.blocks import get_block

runner = CliRunner()


def test_synthesize_llama_mlp_writes_a_verified_run(tmp_path: Path) -> None:
    result = runner.invoke(app, ["synthesize", "--block", "llama_mlp", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "VERIFIED llama_mlp" in result.output
    assert "measured error vs the float64 reference" in result.output
    assert "timings: not measured" in result.output
    (run,) = tmp_path.iterdir()
    assert run.name.endswith("-llama_mlp")
    report = json.loads((run / "report.json").read_text())
    assert report["verified"] is True
    assert {p.name for p in (run / "kernels").iterdir()} == {"gate_up.py", "down.py"}
    assert json.loads((run / "program.json").read_text())["block"] == "llama_mlp"
    records = [json.loads(line) for line in (run / "transcript.jsonl").read_text().splitlines()]
    events = [r["event"] for r in records]
    # task, turn 1 (submit), its Report, turn 2 (finish), its answer
    assert events == ["run_start"] + ["message"] * 2 + ["candidate"] + ["message"] * 3 + ["end"]
    assert records[-1]["reason"] == "finished" and records[-1]["verified"] is True
    assert "not measured" in (run / "summary.md").read_text()
    shown = runner.invoke(app, ["show", str(run)])
    assert shown.exit_code == 0 and "VERIFIED" in shown.output


def test_synthesize_json(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["synthesize", "-b", "llama_mlp", "--runs-dir", str(tmp_path), "--json"]
    )
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["verified"] is True and data["report"]["block"] == "llama_mlp"
    assert data["provider"] == "builtin" and data["turns"] == 2
    assert data["stop"]["reason"] == "finished"


def test_unknown_block_exits_2() -> None:
    result = runner.invoke(app, ["synthesize", "--block", "llama_mpl"])
    assert result.exit_code == 2
    assert "did you mean 'llama_mlp'" in result.output


def test_blocks_lists_llama_mlp() -> None:
    result = runner.invoke(app, ["blocks"])
    assert result.exit_code == 0 and "llama_mlp" in result.output


def test_verify_a_program_file(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(lower(get_block("llama_mlp")).model_dump_json())
    result = runner.invoke(app, ["verify", str(good), "--block", "llama_mlp"])
    assert result.exit_code == 0, result.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"block": "llama_mlp", "steps": "nope"}')
    result = runner.invoke(app, ["verify", str(bad), "--block", "llama_mlp"])
    assert result.exit_code == 1 and "FAILED at validate" in result.output
