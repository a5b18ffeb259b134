"""bench/experiments/cute_launch_host.py: it loads without the CuTe DSL and — where the DSL is
installed — times both CuTe steps of the shipped MLP backward on a CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from . import BENCH, load_script

experiment = load_script("experiments/cute_launch_host")


def test_it_loads_without_the_dsl_and_names_its_program() -> None:
    assert (experiment.ROOT / "export" / "programs" / "llama_mlp_bwd_saved.json").exists()
    assert set(experiment.SIZES) == {"M", "d", "f"}


@pytest.mark.skipif(
    importlib.util.find_spec("quack") is None or importlib.util.find_spec("cutlass") is None,
    reason="the CuTe DSL and QuACK are not installed",
)
def test_it_times_both_steps_on_a_cpu(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "host.json"
    script = BENCH / "experiments" / "cute_launch_host.py"
    env = {**os.environ, "CODA_CACHE_DIR": str(tmp_path), "CUTE_DSL_ARCH": "sm_90a"}
    r = subprocess.run(
        [sys.executable, str(script), "--launches", "20", "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    times = json.loads(out.read_text())
    assert set(times) == {"down_bwd", "gate_up_bwd"} and all(t > 0 for t in times.values())
