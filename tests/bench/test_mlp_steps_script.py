"""bench/mlp_steps.py: its dry run (CPU, toy sizes) times every step of both exported Programs and
writes the breakdown, with each fused step also at forced epilogue sub-tile counts; without a GPU
(and no --dry-run) it refuses."""

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
    assert _script().main(["--dry-run", "--out", str(tmp_path), "--subtiles", "2,4"]) == 0
    results = json.loads((tmp_path / "mlp_steps.json").read_text())
    assert [r["program"] for r in results] == ["llama_mlp_train", "llama_mlp_bwd_saved"]
    backward = {s["step"]: s for s in results[1]["steps"]}
    assert backward["down_bwd"]["kind"] == "fused gemm"
    assert backward["w_down_grad"]["kind"] == "vendor gemm"
    assert all(s["ms"] > 0 for r in results for s in r["steps"])
    assert "| **whole** |" in (tmp_path / "mlp_steps.md").read_text()
    # --subtiles: each fused step again at 2 sub-tiles (checked, timed), and 4 refused with why
    # (the interpreter's 32-column tile would leave 8-column sub-tiles)
    two, four = backward["down_bwd"]["subtiles"]
    assert two["correct"] and two["ms"] > 0 and two["config"]["epilogue_subtiles"] == 2
    assert two["config"]["block_n"] == backward["down_bwd"]["config"]["block_n"]
    assert four["ms"] is None and "leaves 8 columns each" in four["skipped"]
    assert backward["w_down_grad"]["subtiles"] == [] and backward["w_down_grad"]["tuning"] is None
    assert backward["down_bwd"]["tuning"]["best"]["block_n"] == 32  # the interpreter's one config
    assert "| down_bwd | sub-tiles forced to 2 |" in (tmp_path / "mlp_steps.md").read_text()


def test_subtiles_flag_takes_only_one_two_or_four() -> None:
    with pytest.raises(SystemExit):
        _script().parse_args(["--subtiles", "3"])
