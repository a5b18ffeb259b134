"""bench/mlp_steps.py: its dry run (CPU, toy sizes) times every step of both exported Programs and
writes the breakdown; without a GPU (and no --dry-run) it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.bench import load_script


def _script():  # noqa: ANN202
    return load_script("mlp_steps")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the no-GPU message")
def test_refuses_without_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert _script().main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_dry_run_times_every_step_of_both_programs(tmp_path: Path) -> None:
    assert _script().main(["--dry-run", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "mlp_steps.json").read_text())
    assert [r["program"] for r in results] == ["llama_mlp_train", "llama_mlp_bwd_saved"]
    backward = {s["step"]: s for s in results[1]["steps"]}
    assert backward["down_bwd"]["kind"] == "fused gemm"
    assert backward["w_down_grad"]["kind"] == "vendor gemm"
    assert all(s["ms"] > 0 for r in results for s in r["steps"])
    assert "| **whole** |" in (tmp_path / "mlp_steps.md").read_text()
