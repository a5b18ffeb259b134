"""The launch-path experiment runs end to end on the CPU (``--dry-run``: interpreter, toy
model), counting the patched step's launches per path, and puts the launch functions back."""

from __future__ import annotations

import json
from pathlib import Path

from . import load_script

experiment = load_script("experiments/launch_path")


def test_dry_run_counts_the_patched_step_s_launches_per_path(tmp_path: Path) -> None:
    assert experiment.main(["--dry-run", "--steps", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "launch_path_llama.json").read_text())
    assert set(result["variants"]) == {"hf", "coda_lm_head", "coda_lm_head_triton"}
    assert "per_step" not in result["variants"]["hf"]
    for name in ("coda_lm_head", "coda_lm_head_triton"):
        per_step = result["variants"][name]["per_step"]
        # the interpreter takes launch_kernel's path on every launch, pinned or not
        calls = per_step["launch_kernel"]["calls"]
        assert calls >= per_step["PinnedLaunch.__call__"]["calls"] > 0
    assert result["floors_us"] is None
    from coda.primitives import runtime

    assert runtime.BACKEND is None


def test_the_timers_are_undone() -> None:
    import coda.primitives.aux.rstd as rstd
    from coda.primitives import launch
    from coda.primitives.cute import launch as cute

    real = (launch.launch_kernel, launch._run, launch.PinnedLaunch.__call__)
    real_cute = (cute.CuteLaunch.__call__, cute.CuteLaunch.arguments, cute._run)
    with experiment.timed_launch_path(experiment.Timers()):
        assert rstd.launch_kernel is not real[0] and launch._run is not real[1]
        assert cute.CuteLaunch.__call__ is not real_cute[0] and cute._run is not real_cute[2]
    assert (rstd.launch_kernel, launch._run, launch.PinnedLaunch.__call__) == real
    assert (cute.CuteLaunch.__call__, cute.CuteLaunch.arguments, cute._run) == real_cute


def test_a_step_that_waits_behind_a_busy_gpu_is_caught(monkeypatch) -> None:  # noqa: ANN001
    """``behind_busy_gpu`` on a CPU, the GPU's queued work stood in for: a step whose range
    ``waits`` sleeps as a call blocking on the device would is slow to issue, and the range is
    named as the innermost call that lasted over half the busy time (its parent is not)."""
    import time

    import torch

    monkeypatch.setattr(experiment, "_cycles_per_ms", lambda: 1.0)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)

    class Bench:
        def synchronize(self) -> None:
            pass

    def step() -> None:
        with torch.profiler.record_function("step"):
            with torch.profiler.record_function("waits"):
                time.sleep(0.02)
            torch.ones(3).add_(1)

    got = experiment.behind_busy_gpu(step, Bench(), busy_ms=20.0, steps=3)
    assert got["host_ms"] >= 20.0 and got["busy_ms"] == 20.0
    assert [w["name"] for w in got["waited"]] == ["waits"]
