"""`coda-agent eval` end to end (the built-in planner, the sandbox's defaults) and its usage
errors: each names what is wrong and exits 2 before any cell runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coda.cli.main import app

runner = CliRunner()


def flat(text: str) -> str:
    return " ".join(text.split())


def test_eval_resume_compare_and_export_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "ev"
    result = runner.invoke(app, ["eval", "--suite", "smoke", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = flat(result.output)
    assert "1 block(s) × 1 provider(s) × 1 seed(s) = 1 cells, 0 already done; running 1" in text
    assert "[1/1] llama_mlp--builtin_coda-planner--s0: verified (finished, 2 turns" in text
    assert "1 of 1 cells verified" in text
    spec = json.loads((out / "eval.json").read_text())
    assert spec["suite"] == "smoke" and spec["sandbox"] is None and spec["seeds"] == 1
    assert "| all | builtin:coda-planner | 1 | 0 | 1 | 1.00 |" in (out / "results.md").read_text()

    again = runner.invoke(app, ["eval", "--resume", str(out)])
    assert again.exit_code == 0 and "1 already done; running 0" in flat(again.output)
    assert len((out / "results.jsonl").read_text().splitlines()) == 1

    same = runner.invoke(app, ["eval", "--compare", str(out), str(out)])
    assert same.exit_code == 0 and "no regressions" in same.output
    exported = runner.invoke(app, ["export-trajectories", str(out)])
    assert exported.exit_code == 0 and (out / "trajectories.jsonl").is_file()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--suite", "smok"], "no suite named 'smok': did you mean 'smoke'?"),
        (["--blocks", "llama_mpl"], "--blocks: no block named 'llama_mpl': did you mean"),
        (["--blocks", "llama_mlp", "--providers", "gemini"], "unknown provider 'gemini'"),
        (["--blocks", "llama_mlp", "--providers", "python:nomodule"], "python:package.module"),
        (["--blocks", "llama_mlp", "--providers", "builtin,builtin"], "share the id"),
        (["--blocks", "llama_mlp", "--max-turns", "0"], "Invalid value for '--max-turns'"),
        (
            [],
            "give --suite NAME or --blocks a,b,c to run an eval, --resume EVAL_DIR to continue "
            "one, or --compare A B to diff two",
        ),
        (["--suite", "smoke", "--blocks", "llama_mlp"], "exactly one of --suite NAME or --blocks"),
        (["--compare", "only-one"], "write `coda-agent eval --compare A B` (two folders)"),
        (["--blocks", "llama_mlp", "-j", "2", "--ray", "auto"], "not both"),
        (
            ["--blocks", "llama_mlp", "--k", "a,b"],
            "--k: 'a' is not an integer: give a comma-separated list such as --k 1,5,10",
        ),
        (
            ["--blocks", "llama_mlp", "--p", "1.0,fast"],
            "--p: 'fast' is not a number: give a comma-separated list such as --p 1.0,1.5,2.0",
        ),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["eval", *args, "--out", str(tmp_path / "ev")])
    assert result.exit_code == 2 and message in flat(result.output), result.output
    assert not (tmp_path / "ev").exists() and "Traceback" not in result.output


def test_a_missing_key_stops_before_any_cell(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    args = ["eval", "--blocks", "llama_mlp", "--providers", "builtin,anthropic:claude-haiku-4-5"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "ev")])
    assert result.exit_code == 2 and "provider anthropic:claude-haiku-4-5" in result.output
    assert "ANTHROPIC_API_KEY is not set" in flat(result.output)
    assert not (tmp_path / "ev").exists()


def test_an_unenforceable_budget_stops_before_any_cell(tmp_path: Path) -> None:
    args = ["eval", "--blocks", "llama_mlp", "--providers", "openai:my-llama@http://127.0.0.1:9/v1"]
    result = runner.invoke(app, [*args, "--max-cost", "1", "--out", str(tmp_path / "ev")])
    assert result.exit_code == 2 and "no price is known for model 'my-llama'" in flat(result.output)
    assert not (tmp_path / "ev").exists()


def test_an_existing_eval_is_resumed_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "eval.json").write_text("{}")
    result = runner.invoke(app, ["eval", "--blocks", "llama_mlp", "--out", str(tmp_path / "ev")])
    assert result.exit_code == 2 and "already holds an eval" in flat(result.output)
    resumed = runner.invoke(app, ["eval", "--resume", str(tmp_path / "ev")])
    assert resumed.exit_code == 2 and "eval.json: not an eval spec" in flat(resumed.output)
    mixed = runner.invoke(app, ["eval", "--resume", str(tmp_path / "ev"), "--suite", "smoke"])
    assert mixed.exit_code == 2 and "--resume takes the eval's own settings" in flat(mixed.output)
    assert runner.invoke(app, ["eval", "--resume", str(tmp_path / "none")]).exit_code == 2


SPEC_WITH_A_BLOCK_TWICE = {
    "blocks": ["llama_mlp", "llama_mlp"],
    "providers": [{"kind": "builtin", "model": "coda-planner", "base_url": None}],
}


def test_resuming_an_eval_whose_spec_lists_a_block_twice_is_a_usage_error(tmp_path: Path) -> None:
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "eval.json").write_text(json.dumps(SPEC_WITH_A_BLOCK_TWICE))  # edited by hand
    result = runner.invoke(app, ["eval", "--resume", str(ev)])
    text = flat(result.output)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert (
        f"{ev / 'eval.json'} is not a valid eval spec (two cells share the id "
        "'llama_mlp--builtin_coda-planner--s0'"
    ) in text
    assert "list each block and each provider once in it, or start a new eval" in text
    assert sorted(p.name for p in ev.iterdir()) == ["eval.json"]  # no cell ran


def an_eval(path: Path) -> Path:
    path.mkdir()
    spec = {**SPEC_WITH_A_BLOCK_TWICE, "blocks": ["llama_mlp"]}
    (path / "eval.json").write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize(
    "where,problem",
    [
        ("no/such/t.jsonl", "is in a folder that does not exist ({tmp}/no/such)"),
        ("a-folder", "is a folder"),
        pytest.param(
            "read-only/t.jsonl",
            "cannot be written (Permission denied)",
            marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere"),
        ),
    ],
)
def test_export_to_an_out_that_cannot_be_written_is_a_usage_error(
    tmp_path: Path, where: str, problem: str
) -> None:
    ev = an_eval(tmp_path / "ev")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "read-only").mkdir(mode=0o555)
    out = tmp_path / where
    result = runner.invoke(app, ["export-trajectories", str(ev), "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    expected = f"--out {out} {problem.format(tmp=tmp_path)}: choose a writable file path"
    assert expected in flat(result.output)
    assert not (tmp_path / "no").exists()  # no folder is made for it


PROJ_RESIDUAL = """
from coda.blocks import Add, Block, Linear, ShapeSets, TensorSpec

proj_residual = Block(
    name="proj_residual",
    description="x + x @ w.T",
    inputs={
        "x": TensorSpec(shape=["M", "d"]),
        "w": TensorSpec(shape=["d", "d"], init="linear_weight"),
    },
    graph=[Linear(x="x", weight="w", out="y"), Add(a="x", b="y", out="out")],
    outputs=["out"],
    shapes=ShapeSets(cpu=[{"M": 13, "d": 24}]),
)

odd_sum = Block(
    name="odd_sum",
    description="a + b",
    inputs={"a": TensorSpec(shape=["M", "d"]), "b": TensorSpec(shape=["M", "d"])},
    graph=[Add(a="a", b="b", out="y")],
    outputs=["y"],
    shapes=ShapeSets(cpu=[{"M": 4, "d": 8}]),
)
"""


def test_blocks_from_a_file_are_recorded_and_unlowerable_ones_refused(
    tmp_path: Path,
) -> None:
    """A block the built-in planner cannot lower is its cell's recorded answer (the refusal,
    every op it cannot lower), and the other cells run."""
    block_file = tmp_path / "my_blocks.py"
    block_file.write_text(PROJ_RESIDUAL)
    base = ["eval", "--block-file", str(block_file)]
    out = tmp_path / "ev"
    result = runner.invoke(app, [*base, "--blocks", "odd_sum,proj_residual", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = flat(result.output)
    assert "odd_sum--builtin_coda-planner--s0: refused graph[0] add(out='y'): no lowering rule" in (
        text
    )
    assert "1 of 2 cells verified" in text
    spec = json.loads((out / "eval.json").read_text())
    assert spec["block_files"] == {
        "odd_sum": str(block_file.resolve()),
        "proj_residual": str(block_file.resolve()),
    }
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    (refused,) = [r for r in results if r["block"] == "odd_sum"]
    assert (refused["status"], refused["stop"], refused["verified"]) == ("done", "refused", False)
    assert refused["stop_message"].startswith("graph[0] add(out='y'): no lowering rule")
    report = (out / "results.md").read_text()
    assert "## Refusals" in report and "graph[0] add(out='y'): no lowering rule" in report

    # a refusal is the cell's answer: a resumed eval does not run it again
    again = runner.invoke(app, ["eval", "--resume", str(out), "--block-file", str(block_file)])
    assert again.exit_code == 0 and "2 already done; running 0" in flat(again.output)
