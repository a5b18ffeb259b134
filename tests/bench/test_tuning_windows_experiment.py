"""bench/experiments/tuning_windows.py: its summary arithmetic and table on made-up timings, and
its refusal without a GPU (the measurements need one)."""

from __future__ import annotations

import pytest
import torch

from . import load_script

experiment = load_script("experiments/tuning_windows")


def test_the_summary_takes_medians_per_window_against_the_reference() -> None:
    samples = {
        "cublas": {30: [1.60, 1.64, 1.62], 100: [1.64, 1.66, 1.65]},
        "cute launch": {30: [1.58, 1.57, 1.59], 100: [1.72, 1.70, 1.74]},
    }
    summary = experiment.summarize(samples)
    assert summary["cublas"]["30"] == {"ms": pytest.approx(1.62), "over_reference": 1.0}
    assert summary["cute launch"]["30"]["ms"] == pytest.approx(1.58)
    assert summary["cute launch"]["30"]["over_reference"] == pytest.approx(1.58 / 1.62)
    assert summary["cute launch"]["100"]["over_reference"] == pytest.approx(1.72 / 1.65)
    lines = experiment.table(summary, [30, 100]).splitlines()
    assert lines[0] == "| variant | 30 ms windows | 100 ms windows |"
    assert lines[3] == "| cute launch | 1.580 (0.975×) | 1.720 (1.042×) |"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without one")
def test_it_refuses_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert experiment.main(["--blocks", "gemm_rmsnorm"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_the_cute_side_is_the_fastest_cute_candidate_when_tuning_chose_triton() -> None:
    from coda.primitives.cute.tuning import CANDIDATES, TRITON, CuteTuning

    first, second, third, *_ = CANDIDATES
    times = {str(first): 1.70, str(second): 1.66, str(third): 1.68, TRITON: 1.62}
    chose_triton = CuteTuning("ab", "key", None, 1.62, False, times)
    assert experiment._fastest_cute(chose_triton) == second
    chose_cute = CuteTuning("ab", "key", third, 1.68, False, times)
    assert experiment._fastest_cute(chose_cute) == third
    only_triton = CuteTuning("ab", "key", None, 1.62, False, {TRITON: 1.62})
    assert experiment._fastest_cute(only_triton) is None


def test_finalists_are_the_final_round_s_fastest_first_and_ranked_per_window() -> None:
    from coda.primitives.codegen.tuning import Trial, TuningResult
    from coda.primitives.ir import MainloopConfig

    a, b, c = (MainloopConfig(block_n=n) for n in (64, 128, 256))
    trials = [Trial(a, 1.10, final_ms=1.05), Trial(b, 1.00, final_ms=1.02), Trial(c, 1.30)]
    tuned = TuningResult("s", "key", b, 1.02, cached=False, trials=trials)
    lone = TuningResult("t", "key", a, 1.0, cached=False, trials=[Trial(a, 1.0, final_ms=1.0)])
    cached = TuningResult("u", "key", a, None, cached=True)
    ordered = experiment._finalists({"s": tuned, "t": lone, "u": cached})
    assert list(ordered) == ["s"]
    assert [t.config for t in ordered["s"]] == [b, a]

    summary = experiment.summarize(
        {
            "cublas": {20: [1.0], 100: [1.0]},
            "pick": {20: [1.02], 100: [1.08]},
            "other": {20: [1.05], 100: [1.04]},
        }
    )
    ranks = experiment.finalist_ranks(summary, ["pick", "other"], [20, 100])
    assert ranks["20"] == {"first": "pick", "pick_over_first": 1.0}
    assert ranks["100"]["first"] == "other"
    assert ranks["100"]["pick_over_first"] == pytest.approx(1.08 / 1.04)
