"""``--json`` on ``blocks``, ``show`` and ``eval``: exactly one JSON object on stdout, on errors
too; unknown blocks name the closest spelling."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from coda.cli.main import app
from tests.agent.test_transcript_damage import crashed_run
from tests.evals.common import BUILTIN, make_eval
from tests.evals.test_compare import result

runner = CliRunner()


def one_object(args: list[str], code: int) -> dict:
    done = runner.invoke(app, args)
    assert done.exit_code == code, (done.stdout, done.stderr)
    data = json.loads(done.stdout)  # one JSON document, nothing else
    assert isinstance(data, dict)
    return data


def test_blocks_json_lists_every_block_with_its_inputs() -> None:
    data = one_object(["blocks", "--json"], 0)
    by_name = {b["name"]: b for b in data["blocks"]}
    mlp = by_name["llama_mlp"]
    assert mlp["outputs"] == ["out"] and mlp["inputs"]["x"] == ["M", "d"]
    assert mlp["description"]


def test_blocks_json_reports_a_missing_block_file_as_one_object(tmp_path: Path) -> None:
    missing = tmp_path / "nope.py"
    data = one_object(["blocks", "--block-file", str(missing), "--json"], 2)
    assert data["exit_code"] == 2 and f"{missing} does not exist" in data["error"]


def test_show_json_of_an_unfinished_run(tmp_path: Path) -> None:
    run = crashed_run(tmp_path)
    data = one_object(["show", str(run.path), "--json"], 0)
    assert data["run_dir"] == str(run.path) and data["block"] == "llama_mlp"
    assert data["finished"] is False and data["stop"] is None
    assert data["turns"] == 0 and data["candidates"] == [] and data["best"] is None
    assert data["verified"] is False and data["report"] is None


def test_show_json_of_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    data = one_object(["show", str(tmp_path), "--json"], 2)
    assert data["exit_code"] == 2 and str(tmp_path) in data["error"]


def test_eval_json_summary_and_compare(tmp_path: Path) -> None:
    edir = make_eval(tmp_path / "ev", [BUILTIN])
    (cell,) = edir.spec().cells()
    edir.append(result(cell.id, 0, True, None))
    data = one_object(["eval", "--resume", str(edir.path), "--json"], 0)
    assert data["eval_dir"] == str(edir.path) and data["cells"] == 1 and data["verified"] == 1
    assert data["errors"] == [] and data["results"][0]["cell"] == cell.id
    same = one_object(["eval", "--compare", str(edir.path), str(edir.path), "--json"], 0)
    assert same["regressions"] == 0 and same["cells"][0]["cell"] == cell.id


def test_eval_json_usage_errors_are_one_object_and_name_the_closest_block() -> None:
    data = one_object(["eval", "--blocks", "lama_mlp", "--json"], 2)
    assert "no block named 'lama_mlp': did you mean 'llama_mlp'?" in data["error"]
    data = one_object(["eval", "--compare", "only-one", "--json"], 2)
    assert "coda-agent eval --compare A B" in data["error"]


def test_synthesize_names_the_closest_block() -> None:
    data = one_object(["synthesize", "--block", "lama_mlp", "--json"], 2)
    assert "did you mean 'llama_mlp'?" in data["error"]
