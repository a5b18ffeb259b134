"""bench/experiments/step_idle.py: its timeline arithmetic on a made-up GPU trace, its phase
times from made-up host marks, and its refusal without a GPU (the measurements need one)."""

from __future__ import annotations

import pytest
import torch

from . import load_script

experiment = load_script("experiments/step_idle")


def test_the_timeline_counts_busy_time_once_and_bins_the_gaps() -> None:
    # µs: a kernel overlapping another (counted once), gaps of 1, 10 and 150, and a kernel that
    # ends before the window starts (left out); two steps in the window
    kernels = [
        experiment.Span(*k)
        for k in [
            (0.0, 5.0, "before"),
            (10.0, 20.0, "a"),
            (15.0, 25.0, "b"),
            (26.0, 30.0, "c"),
            (40.0, 50.0, "d"),
            (200.0, 210.0, "e"),
        ]
    ]
    t = experiment.timeline(kernels, start=8.0, steps=2)
    busy = (25.0 - 10.0) + (30.0 - 26.0) + (50.0 - 40.0) + (210.0 - 200.0)
    assert t["busy_ms_per_step"] == pytest.approx(busy / 1e3 / 2)
    assert t["window_ms_per_step"] == pytest.approx((210.0 - 8.0) / 1e3 / 2)
    assert t["idle_ms_per_step"] == pytest.approx((210.0 - 8.0 - busy) / 1e3 / 2)
    # the stretch from the window's start to the first kernel is not a gap between kernels
    assert t["gaps_per_step"] == 1.5
    assert t["gap_hist_count_per_step"] == {
        "<2us": 0.5, "2-5us": 0.0, "5-20us": 0.5, "20-100us": 0.0, ">100us": 0.5,
    }  # fmt: skip
    assert t["longest"][0] == (150.0, "d", "e")
    assert t["longest"][-1] == (1.0, "b", "c")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the no-GPU message")
def test_it_refuses_without_a_gpu(tmp_path, capsys) -> None:  # noqa: ANN001
    assert experiment.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_phase_times_are_medians_from_each_mark_to_the_next() -> None:
    # two steps' perf_counter marks (seconds): the phases named by the mark that ends them
    steps = [
        [("start", 0.0), ("zero_grad", 0.001), ("embed", 0.002), ("forward", 0.006)],
        [("start", 1.0), ("zero_grad", 1.001), ("embed", 1.004), ("forward", 1.010)],
    ]
    ms = experiment.phase_ms(steps)
    assert list(ms) == ["zero_grad", "embed", "forward", "step"]
    assert ms["zero_grad"] == pytest.approx(1.0)
    assert ms["embed"] == pytest.approx(2.0)  # median of 1 and 3
    assert ms["forward"] == pytest.approx(5.0)  # median of 4 and 6
    assert ms["step"] == pytest.approx(8.0)  # median of 6 and 10
