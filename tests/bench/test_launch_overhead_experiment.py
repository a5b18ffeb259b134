"""The launch-overhead experiment runs end to end on the CPU (``--dry-run``: interpreter, toy
sizes), so the GPU call measures every step it names and profiles a real launch."""

from __future__ import annotations

import json
from pathlib import Path

from . import load_script

experiment = load_script("experiments/launch_overhead")


def test_dry_run_times_the_run_each_step_and_both_sum_partials(tmp_path: Path) -> None:
    kernel = "gemm_residual_partial_rmsnorm"
    assert experiment.main(["--dry-run", "--kernels", kernel, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "launch_overhead.json").read_text())
    (row,) = result["kernels"]
    wanted = ["triton_combine", "torch_ops", "gemm:ab", "aux:sum_partials1"]
    assert all(row[f"host_us[{k}]"] > 0 for k in wanted), row
    assert row["correct[32]"] is True
    assert set(result["floors_us"]) == {"triton_empty_kernel", "torch_empty", "torch_sum"}


def test_dry_run_profiles_one_fused_gemm_launch(tmp_path: Path) -> None:
    args = ["--dry-run", "--cprofile", "--kernels", "gemm_swiglu", "--out", str(tmp_path)]
    assert experiment.main(args) == 0
    report = (tmp_path / "launch_profile.txt").read_text()
    assert "function calls" in report and "Ordered by: internal time" in report
