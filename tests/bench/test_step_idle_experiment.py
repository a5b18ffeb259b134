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


def _row(embed_ms: float, step_ms: float, **flags: object) -> dict:
    return {"phases_ms": {"zero_grad": 0.1, "embed": embed_ms}, "step_ms": step_ms, **flags}


def test_the_waits_summary_says_what_each_long_first_op_coincided_with() -> None:
    rows = [
        # a first op that waited for the GPU: busy at the start, done after it
        _row(2.1, 14.0, gpu_done_at_start=False, gpu_done_after_embed=True,
             involuntary_switches=0, voluntary_switches=0),
        # one descheduled, with the collector running in the step
        _row(1.5, 13.0, gpu_done_at_start=True, gpu_done_after_embed=True,
             involuntary_switches=2, voluntary_switches=0, gc_ms=0.4, gc_generations=[0]),
        # short first ops
        _row(0.2, 12.0, gpu_done_at_start=False, gpu_done_after_embed=False,
             involuntary_switches=0, voluntary_switches=1),
        _row(0.3, 11.0, gpu_done_at_start=True, gpu_done_after_embed=True,
             involuntary_switches=0, voluntary_switches=0, gc_ms=0.2, gc_generations=[1]),
    ]  # fmt: skip
    s = experiment.summarize_waits(rows, long_ms=1.0)
    assert s["steps"] == 4
    assert s["median_ms"] == {"zero_grad": pytest.approx(0.1), "embed": pytest.approx(0.9)}
    assert s["median_step_ms"] == pytest.approx(12.5)
    assert s["gc_ms_per_step"] == pytest.approx(0.15)
    assert s["long_embed"] == {
        "steps": 2, "gpu_busy_at_start": 1, "gpu_done_after_embed": 2,
        "involuntary_switch": 1, "garbage_collected": 1,
    }  # fmt: skip
    assert s["median_step_ms_gpu_busy_at_start"] == pytest.approx(13.0)  # of 14 and 12
    assert s["median_step_ms_gpu_idle_at_start"] == pytest.approx(12.0)  # of 13 and 11


def test_one_steps_phases_run_from_each_mark_to_the_next() -> None:
    marks = [("start", 1.0), ("zero_grad", 1.001), ("embed", 1.003), ("forward", 1.010)]
    got = experiment.phases_of(marks)
    assert list(got["phases_ms"]) == ["zero_grad", "embed", "forward"]
    assert got["phases_ms"] == pytest.approx({"zero_grad": 1.0, "embed": 2.0, "forward": 7.0})
    assert got["step_ms"] == pytest.approx(10.0)


def test_the_step_watch_adds_up_the_collections_in_a_step() -> None:
    watch = experiment.StepWatch()
    watch.on_gc("stop", {"generation": 0})  # a stop without its start (watch attached mid-way)
    assert watch.row == {}
    for generation in (0, 2):
        watch.on_gc("start", {"generation": generation})
        watch.on_gc("stop", {"generation": generation})
    assert watch.row["gc_generations"] == [0, 2]
    assert 0.0 <= watch.row["gc_ms"] < 100.0
    assert watch.gpu_done() is None  # no step before: nothing recorded to query
