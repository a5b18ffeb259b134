"""The command line: the demo command, listing, verifying a file, JSON output, exit codes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coda.blocks import get_block, load_block_file
from coda.cli.main import app
from coda.planner import lower
from tests.helpers import captured_residual_file

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
    args = ["verify", str(good), "--block", "llama_mlp", "--semantics-seed", "42", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["verified"] and report["semantics"]["seed"] == 42  # the run can be repeated
    bad = tmp_path / "bad.json"
    bad.write_text('{"block": "llama_mlp", "steps": "nope"}')
    result = runner.invoke(app, ["verify", str(bad), "--block", "llama_mlp"])
    assert result.exit_code == 1 and "FAILED at validate" in result.output


def test_verify_names_an_invalid_program_once_on_its_validate_line(tmp_path: Path) -> None:
    program = lower(get_block("llama_mlp")).model_dump(mode="json")
    program["steps"][1]["epilogue"][0]["op"] = "scale_row"
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(program))
    result = runner.invoke(app, ["verify", str(path), "--block", "llama_mlp"])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    line = "✗ validate 0.00s invalid program: steps.1.gemm.epilogue.0: unknown op 'scale_row'"
    assert line in text, text
    assert text.count("unknown op 'scale_row'") == 1
    assert "FAILED at validate [program]" in text


ODD_BLOCK = """
from coda.blocks import Add, Block, ShapeSets, TensorSpec

odd_sum = Block(
    name="odd_sum",
    description="a + b",
    inputs={"a": TensorSpec(shape=["M", "d"]), "b": TensorSpec(shape=["M", "d"])},
    graph=[Add(a="a", b="b", out="y")],
    outputs=["y"],
    shapes=ShapeSets(cpu=[{"M": 4, "d": 8}]),
)
"""


def test_a_block_the_planner_cannot_lower_is_a_usage_error(tmp_path: Path) -> None:
    block_file = tmp_path / "odd.py"
    block_file.write_text(ODD_BLOCK)
    runs = tmp_path / "runs"
    result = runner.invoke(
        app, ["synthesize", "--block-file", str(block_file), "--runs-dir", str(runs)]
    )
    assert result.exit_code == 2
    assert "the built-in planner cannot lower block 'odd_sum'" in result.output
    assert "graph[0] add(out='y'): no lowering rule" in result.output
    assert "Traceback" not in result.output and not runs.exists()


MYSTERY_FILE = Path(__file__).parents[1] / "planner" / "mystery_block.py"


def test_a_refusal_lists_every_op_and_shows_the_partial_program(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    args = ["synthesize", "--block-file", str(MYSTERY_FILE), "--runs-dir", str(runs)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "Traceback" not in result.output and not runs.exists()
    assert "the built-in planner cannot lower block 'mixed': 3 graph ops are not lowered:" in (
        result.stderr
    )
    for line in (
        "graph[1] test_mystery(out='m'): no lowering rule — no rule for op 'test_mystery'",
        "graph[2] linear(out='z'): not judged — it reads 'm', which graph[1] could not produce",
        "graph[3] rmsnorm(out='n'): no lowering rule — its output 'n' feeds a block output",
    ):
        assert line in result.stderr
    shown = result.stderr[result.stderr.index("{") :]  # the partial Program, as JSON
    assert json.loads(shown)["outputs"] == {"out": "out", "y": "y"}

    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["exit_code"] == 2 and "3 graph ops are not lowered" in data["error"]
    assert [(u["index"], u["op"], u.get("after")) for u in data["unlowered"]] == [
        (1, "test_mystery", None),
        (2, "linear", 1),
        (3, "rmsnorm", None),
    ]
    partial = data["partial_program"]
    assert partial["computes"] == ["out", "y"] and partial["program"]["block"] == "mixed"


def test_an_llm_provider_runs_on_a_block_the_planner_refuses(tmp_path: Path) -> None:
    from tests.agent.fake_llm import FakeLLM, openai_tool

    server = FakeLLM()
    server.replies = [openai_tool("call_1", "finish", {"reason": "read the task"})]
    try:
        result = runner.invoke(
            app,
            ["synthesize", "--block-file", str(MYSTERY_FILE), "--runs-dir", str(tmp_path)]
            + ["--provider", "openai", "--base-url", f"{server.url}/v1", "--model", "local"],
        )
    finally:
        server.close()
    assert "Traceback" not in result.output and "NOT VERIFIED mixed" in result.output
    task = server.requests[0].body["messages"][1]["content"]
    assert "## What the built-in planner could not lower" in str(task)


def test_provider_configuration_errors_exit_2(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    base = ["synthesize", "-b", "llama_mlp", "--runs-dir", str(tmp_path)]
    result = runner.invoke(app, [*base, "--provider", "anthropic"])
    assert result.exit_code == 2 and "ANTHROPIC_API_KEY is not set" in result.output
    result = runner.invoke(app, [*base, "--provider", "gemini"])
    assert result.exit_code == 2 and "unknown provider 'gemini'" in result.output
    result = runner.invoke(app, [*base, "--provider", "replay"])
    assert result.exit_code == 2 and "needs --transcript" in result.output
    local = ["--provider", "openai", "--base-url", "http://127.0.0.1:9/v1", "--model", "my-llama"]
    result = runner.invoke(app, [*base, *local, "--max-cost", "1"])
    assert result.exit_code == 2 and "no price is known for model 'my-llama'" in result.output
    result = runner.invoke(app, [*base, "--model", "gpt-4.1"])  # the default builtin provider
    assert result.exit_code == 2
    assert "the built-in planner (--provider builtin) runs offline, with no model or server" in (
        result.output
    )
    assert "drop --model gpt-4.1, or choose --provider anthropic or openai" in result.output
    assert not list(tmp_path.iterdir()) and "Traceback" not in result.output


def test_resume_replay_and_show_through_the_cli(tmp_path: Path) -> None:
    cut = runner.invoke(
        app,
        ["synthesize", "-b", "llama_mlp", "--runs-dir", str(tmp_path / "a"), "--max-turns", "1"],
    )
    assert cut.exit_code == 0, cut.output  # verified at turn 1, then the turn budget ran out
    (run,) = (tmp_path / "a").iterdir()
    shown = runner.invoke(app, ["show", str(run)])
    assert shown.exit_code == 0 and "max_turns: reached --max-turns 1" in shown.output

    spent = runner.invoke(app, ["synthesize", "--resume", str(run)])
    assert spent.exit_code == 2 and "has spent its budget (1 turns, --max-turns 1)" in spent.output
    more = ["synthesize", "--resume", str(run), "--max-turns", "5"]
    other = runner.invoke(app, [*more, "--block", "llama_mlp_bwd"])
    assert other.exit_code == 2
    assert f"{run} is a run of block 'llama_mlp', and --resume continues that block: drop " in (
        " ".join(other.output.split())
    )
    modelled = runner.invoke(app, [*more, "--model", "gpt-4.1"])
    assert modelled.exit_code == 2 and "drop --model gpt-4.1" in modelled.output
    resumed = runner.invoke(app, [*more, "--block", "llama_mlp", "--json"])
    assert resumed.exit_code == 0, resumed.output
    data = json.loads(resumed.output)
    assert data["turns"] == 2 and data["stop"]["reason"] == "finished"
    assert len(data["candidates"]) == 1 and data["run_dir"] == str(run)
    again = runner.invoke(app, ["synthesize", "--resume", str(run)])
    assert again.exit_code == 2 and "already ended (finished" in again.output  # refused

    transcript = str(run / "transcript.jsonl")
    replayed = runner.invoke(
        app,
        ["synthesize", "--provider", "replay", "--transcript", transcript]
        + ["--runs-dir", str(tmp_path / "b"), "--json"],
    )
    assert replayed.exit_code == 0, replayed.output
    data = json.loads(replayed.output)
    assert data["verified"] and data["turns"] == 2 and data["block"] == "llama_mlp"
    assert data["divergences"] == [] and data["model"] == "coda-planner"


def test_candidate_budget_and_parallel_flags(tmp_path: Path) -> None:
    args = ["synthesize", "-b", "llama_mlp", "--runs-dir", str(tmp_path), "--json"]
    done = runner.invoke(app, [*args, "--max-candidates", "1", "--parallel", "2"])
    assert done.exit_code == 0, done.output  # verified by the first candidate
    data = json.loads(done.output)
    assert data["stop"] == {
        "reason": "max_candidates",
        "message": "reached --max-candidates 1",
    }
    (run,) = tmp_path.iterdir()
    budgets = json.loads((run / "transcript.jsonl").read_text().splitlines()[0])["budgets"]
    assert (budgets["max_candidates"], budgets["parallel"]) == (1, 2)
    spent = runner.invoke(app, ["synthesize", "--resume", str(run)])
    assert spent.exit_code == 2
    assert "has spent its budget (1 candidates, --max-candidates 1)" in spent.output


def test_show_renders_an_unfinished_run(tmp_path: Path) -> None:
    from coda.agent.synthesize import synthesize
    from tests.agent.scripted import BLOCK, Script

    with pytest.raises(RuntimeError):
        synthesize(BLOCK, tmp_path, provider=Script([RuntimeError("crash")]))
    (run,) = tmp_path.iterdir()
    shown = runner.invoke(app, ["show", str(run)])
    assert shown.exit_code == 0 and "unfinished" in shown.output
    assert f"synthesize --resume {run}" in shown.output.replace("\n", "")
    assert runner.invoke(app, ["show", str(tmp_path)]).exit_code == 2


PROJ_BLOCK = captured_residual_file("cli_file_proj_residual", [{"M": 5, "d": 24}])


def test_the_resume_hint_of_a_block_file_run_names_the_file(tmp_path: Path) -> None:
    import shlex

    block_file = tmp_path / "proj.py"
    block_file.write_text(PROJ_BLOCK)
    runs = tmp_path / "runs"
    done = runner.invoke(
        app, ["synthesize", "--block-file", str(block_file), "--runs-dir", str(runs)]
    )
    assert done.exit_code == 0, done.output
    (run,) = runs.iterdir()
    # cut the run off after its first candidate, as a crash would
    lines = (run / "transcript.jsonl").read_text().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if '"event": "candidate"' in line)
    (run / "transcript.jsonl").write_text("".join(lines[: first + 1]))

    shown = runner.invoke(app, ["show", str(run)])
    assert shown.exit_code == 0, shown.output
    hint = shown.output.split("unfinished: continue with `")[1].split("`")[0]  # one line
    assert hint == f"coda-agent synthesize --resume {run} --block-file {block_file}"
    resumed = runner.invoke(app, shlex.split(hint)[1:])
    assert resumed.exit_code == 0, resumed.output
    assert "VERIFIED cli_file_proj_residual" in resumed.output


def test_a_provider_failure_is_a_clean_error_with_a_resume_hint(tmp_path: Path) -> None:
    from tests.agent.fake_llm import FakeLLM, Reply

    server = FakeLLM()
    server.replies = [Reply(401, {"error": {"message": "invalid api key"}})]
    try:
        result = runner.invoke(
            app,
            ["synthesize", "-b", "llama_mlp", "--runs-dir", str(tmp_path), "--provider", "openai"]
            + ["--base-url", f"{server.url}/v1", "--model", "local-model"],
        )
    finally:
        server.close()
    assert result.exit_code == 2 and "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert "rejected the credentials (HTTP 401): invalid api key — check OPENAI_API_KEY" in text
    (run,) = tmp_path.iterdir()
    assert f"coda-agent synthesize --resume {run}" in text
    assert "NOT VERIFIED llama_mlp" in text


def test_verify_timeout_stops_a_hanging_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.helpers import residual_program

    block_file = Path(__file__).parents[1] / "sandbox" / "faulty_block.py"
    monkeypatch.setenv("CODA_TEST_FAULT", "hang")  # the worker's verify stage sleeps 600 s
    monkeypatch.setenv("CODA_TEST_CHILD_PID_FILE", str(tmp_path / "child"))
    program = tmp_path / "program.json"
    (block,) = load_block_file(block_file)
    program.write_text(json.dumps(residual_program(block)))
    start = time.monotonic()
    args = ["verify", str(program), "--block-file", str(block_file), "--timeout", "5"]
    result = runner.invoke(app, args)
    assert time.monotonic() - start < 25
    assert result.exit_code == 1, result.output
    assert "FAILED at verify" in result.output, result.output
    assert "the worker was killed during verify: timed out after 5 s" in result.output


@pytest.mark.parametrize("url", ["http://[::1", "notaurl", "ftp://127.0.0.1/v1"])
def test_a_base_url_that_is_not_an_http_url_exits_2_before_any_request(
    tmp_path: Path, url: str
) -> None:
    base = ["synthesize", "-b", "llama_mlp", "--runs-dir", str(tmp_path), "--json"]
    for provider in ("anthropic", "openai"):
        result = runner.invoke(
            app,
            [*base, "--provider", provider, "--base-url", url],
            env={"ANTHROPIC_API_KEY": "sk-ant-test", "OPENAI_API_KEY": "sk-test"},
        )
        assert result.exit_code == 2 and "Traceback" not in result.output
        error = json.loads(result.stdout.splitlines()[-1])["error"]
        assert error.startswith(f"--base-url {url!r} is not a usable URL")
    assert not list(tmp_path.iterdir())  # no run was started
