"""`coda-agent eval --suite NAME` with a suite that ships its own block files: the files are
imported (a captured block here), recorded in the eval's spec for the cells' workers, and the
cell verifies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import coda.evals.suites as suites
from coda.cli.main import app
from tests.helpers import captured_residual_file

CPU_SHAPES = [{"M": 5, "d": 24}, {"M": 37, "d": 40}]
BLOCK_FILE = captured_residual_file("suite_file_proj_residual", CPU_SHAPES)


def test_a_suite_with_block_files_runs_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = tmp_path / "suites"
    (shipped / "files").mkdir(parents=True)
    (shipped / "files" / "mine.py").write_text(BLOCK_FILE)
    (shipped / "mine.toml").write_text(
        'blocks = ["suite_file_proj_residual"]\nblock_files = ["files/mine.py"]\n'
    )
    load = suites.load_suite
    monkeypatch.setattr(suites, "load_suite", lambda name, directory=shipped: load(name, directory))
    out = tmp_path / "ev"
    result = CliRunner().invoke(app, ["eval", "--suite", "mine", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 of 1 cells verified" in " ".join(result.output.split())
    spec = json.loads((out / "eval.json").read_text())
    path = str((shipped / "files" / "mine.py").resolve())
    assert spec["block_files"] == {"suite_file_proj_residual": path}
