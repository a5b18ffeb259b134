"""The two-graphs experiment runs end to end on the CPU (``--dry-run``: toy model, nothing
captured), so the GPU call spends its time on the captures it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import load_script

experiment = load_script("experiments/two_graphs")


def test_dry_run_builds_every_step_and_runs_each_in_turn(tmp_path: Path) -> None:
    assert experiment.main(["--dry-run", "--variants", "hf_graph,hf", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "two_graphs.json").read_text())
    assert result["failed_at"] is None
    stages = [s.split(" (")[0] for s in result["stages"]]  # less the losses
    assert stages == ["built 0:hf_graph", "built 1:hf", "round 0 ran", "round 1 ran"]


def test_only_plain_and_graph_variants(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        experiment.parse_args(["--variants", "hf,coda_lm_head_ops"])
    assert "plain or _graph variants only" in capsys.readouterr().err
