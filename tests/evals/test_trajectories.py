"""Trajectory export: the conversation in chat form, one step per submitted program with its
Report and reward, and the reward defined when the speedup is not measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coda.cli.main import app
from coda.evals.harness import run_eval
from coda.evals.trajectories import reward, speedup
from coda.sandbox.report import ProfileRow, Report

from .common import make_eval, model

runner = CliRunner()


def test_an_eval_exports_one_trajectory_per_answered_cell(tmp_path: Path) -> None:
    edir = make_eval(tmp_path / "ev", [model("broken_then_fixed"), model("server_down_once")])
    run_eval(edir)  # the second cell errors (the server is down): no trajectory for it
    out = tmp_path / "t.jsonl"
    result = runner.invoke(app, ["export-trajectories", str(edir.path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"wrote 1 trajectories to {out} (1 cell(s) without an answer skipped)" in text
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    roles = [m["role"] for m in record["messages"]]
    assert roles == ["system", "user"] + ["assistant", "tool"] * 3
    assert record["messages"][0]["content"].startswith("You ")  # the exact system prompt
    first_call = record["messages"][2]["tool_calls"][0]
    assert first_call["name"] == "submit_program" and first_call["id"] == "c1"
    assert json.loads(first_call["arguments"])["program"]["block"] == "llama_mlp"
    assert "FAILED at semantics" in record["messages"][3]["content"]
    assert [t["name"] for t in record["tools"]] == [
        "submit_program",
        "describe_primitive",
        "finish",
    ]
    steps = record["steps"]
    assert [(s["tool_call_id"], s["verified"], s["reward"]) for s in steps] == [
        ("c1", False, 0.0),
        ("c2", True, 1.0),
    ]
    assert steps[1]["report"]["verified"] is True and steps[1]["speedup"] is None
    # CPU: the speedup is not measured, so the reward is exactly the verified bit
    assert record["verified"] and record["reward"] == 1.0
    assert record["speedup"] is None and record["speedup_measured"] is False
    assert record["tokens"] == {"input": 300, "output": 60} and record["stop"] == "finished"
    assert runner.invoke(app, ["export-trajectories", str(tmp_path)]).exit_code == 2


def _report(verified: bool, rows: list[tuple[float, float | None]]) -> Report:
    profile = [
        ProfileRow(
            sizes={"M": i},
            dtype="bfloat16",
            program_ms=ms,
            gemms_ms=ms,
            eager_ms=eager,
            compile_ms=None,
            tflops=1.0,
        )
        for i, (ms, eager) in enumerate(rows)
    ]
    return Report(
        verified=verified,
        block="b",
        program_hash="h",
        device="cuda (NVIDIA H200)",
        stages=[],
        profile=profile,
    )


def test_reward_is_verified_times_the_geomean_speedup() -> None:
    fast = _report(True, [(1.0, 2.0), (2.0, 8.0)])
    assert speedup(fast) == pytest.approx(math.sqrt(2.0 * 4.0))
    assert reward(fast) == pytest.approx(math.sqrt(8.0))
    assert reward(_report(False, [(1.0, 2.0)])) == 0.0
    assert speedup(fast, "compile") is None and reward(fast, "compile") == 1.0  # not measured
    assert speedup(_report(True, [])) is None and reward(_report(True, [])) == 1.0
