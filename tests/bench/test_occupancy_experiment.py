"""bench/experiments/occupancy.py: its dry run (CPU interpreter) pins each config on the kernel,
checks it against the reference executor and tabulates it — so the GPU run measures only the
configs; and the occupancy arithmetic it reports."""

from __future__ import annotations

import json
from pathlib import Path

from . import load_script

experiment = load_script("experiments/occupancy")


def test_dry_run_checks_every_config_of_a_reducing_kernel(tmp_path: Path) -> None:
    configs = "256w_sub4,128_4w_s3_x2,128_8w_s3_x2_r128_sub4"
    args = ["--dry-run", "--kernels", "gemm_partial_cross_entropy", "--configs", configs]
    assert experiment.main([*args, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "occupancy.json").read_text())
    assert [r["config"] for r in rows] == [*configs.split(","), "cublas"]
    for row in rows[:-1]:
        assert row["wrong"] == {} and row["ms"] > 0 and "error" not in row
    # the occupancy fields reach the pinned config (the interpreter ignores them)
    assert [(r["programs_per_sm"], r["maxnreg"]) for r in rows[:-1]] == [
        (1, None),
        (2, None),
        (2, 128),
    ]
    assert (
        "| gemm_partial_cross_entropy | 128_4w_s3_x2 |" in (tmp_path / "occupancy.md").read_text()
    )


def test_resident_programs_follow_registers_and_shared_memory() -> None:
    # 255 registers × 128 threads: two fit in 64K registers; 112 KB of shared memory: two fit
    assert experiment.resident_programs({"registers": 255, "shared_bytes": 112 * 1024}, 4) == 2
    # 8 warps at 202 registers: one; 120 KB + the 1 KB reserve each: one
    assert experiment.resident_programs({"registers": 202, "shared_bytes": 90 * 1024}, 8) == 1
    assert experiment.resident_programs({"registers": 128, "shared_bytes": 120 * 1024}, 4) == 1
    assert experiment.resident_programs({}, 4) is None
