"""A run without a verified candidate: no candidate is called best or new best (the leading one
is the one that got furthest), and no empty error table is printed."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from coda.cli import agent
from coda.cli.main import app
from tests.agent.scripted import BLOCK
from tests.evals.models import never_verifies

runner = CliRunner()


def test_an_unverified_candidate_is_never_called_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent, "_make_provider", lambda *args, **kw: never_verifies(BLOCK))
    done = runner.invoke(app, ["synthesize", "-b", "llama_mlp", "--runs-dir", str(tmp_path)])
    assert done.exit_code == 1, done.output
    text = " ".join(done.output.split())
    assert "candidate 1: not verified" in text and "NOT VERIFIED llama_mlp" in text
    assert "best: candidate" not in text and "new best" not in text
    assert "│ best │ none verified (candidate 1 got furthest) │" in text
    assert "measured error vs the float64 reference" not in text  # no rows: no table

    (run,) = tmp_path.iterdir()
    shown = runner.invoke(app, ["show", str(run)])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert "1 (furthest)" in text and "furthest candidate's report" in text
    assert "(best)" not in text and "best candidate's report" not in text
    summary = (run / "summary.md").read_text()
    assert "| 1 (furthest) |" in summary and "## Furthest candidate (1)" in summary
    assert "- best: none verified (candidate 1 got furthest)" in summary
