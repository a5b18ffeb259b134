"""bench/experiments/subtile_registers.py: it compiles a generated kernel for Hopper on this CPU
machine and reads its registers and spill stack, per number of epilogue sub-tiles; a slicing too
narrow for the tile is reported, not compiled. The script runs in a process of its own, as it is
run: in a test worker that had run other tests first its Hopper compile has failed (Triton's
compiler state is process-wide), which its own process never showed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "experiments" / "subtile_registers.py"
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton ships no NVIDIA tools")
def test_registers_of_a_kernel_per_slicing(tmp_path: Path) -> None:
    args = ["--blocks", "gemm_swiglu", "--tile", "64x128x64", "--warps", "4", "--subtiles", "8,16"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    eight, sixteen = json.loads((tmp_path / "subtile_registers.json").read_text())
    assert eight["step"] == "d" and eight["subtiles"] == 8
    assert 32 <= eight["registers"] <= 255 and eight["spill_stack_bytes"] >= 0
    assert eight["shared_bytes"] > 0
    assert "too narrow" in sixteen["error"]  # 8 columns: not compiled
    assert (
        "| gemm_swiglu | d | 64×128×64, 4w 3s | 8 |"
        in (tmp_path / "subtile_registers.md").read_text()
    )
