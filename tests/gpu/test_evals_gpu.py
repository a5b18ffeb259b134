"""Evals on a GPU: the stored kernels re-verify in bf16 and fp16 and are timed (passed on the H200,
2026-11-30); an eval cell has speedups and fast_p is a measurement (passed on the H200 in 250 s,
2026-11-30, untuned: with tuning it ran past 260 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coda.evals.harness import run_eval
from coda.evals.metrics import aggregates
from coda.evals.results import EvalDir
from coda.evals.spec import EvalSpec, ProviderSpec
from coda.evals.store import regress
from coda.sandbox import SandboxOptions

SIZES = {"M": 2048, "d": 1024, "f": 2816}
QUICK = SandboxOptions(seeds=[0], bench_shapes=[SIZES])
# The cell measures speedups, not tuning: every turn of the agent loop would tune again.
UNTUNED = SandboxOptions(seeds=[0], bench_shapes=[SIZES], tune=False)


def test_the_stored_kernels_verify_in_bf16_and_are_timed() -> None:
    for row in regress(options=QUICK):
        assert row.status == "ok", row.message
        assert row.time_now_ms is not None and row.time_now_ms > 0


def test_regress_records_times_then_checks_them_gpu(tmp_path: Path) -> None:
    """The built-in entries were accepted from CPU runs, with no time: the first regress on this
    GPU records the times it measures, the second compares against them."""
    times = tmp_path / "times.json"
    first = regress(options=QUICK, times=times)
    assert first and all(r.status == "ok" for r in first), [r.message for r in first]
    assert all("now recorded for cuda" in r.time_note for r in first)
    second = regress(options=QUICK, times=times)
    for before, row in zip(first, second, strict=True):
        assert row.status in ("ok", "slower") and row.time_note == "", row.message
        assert row.time_recorded_ms == before.time_now_ms and row.slowdown is not None


@pytest.mark.slow
def test_an_eval_cell_on_a_gpu_measures_speedups(tmp_path: Path) -> None:
    spec = EvalSpec(
        blocks=["llama_mlp"],
        providers=[ProviderSpec.parse("builtin")],
        sandbox=UNTUNED.model_dump(mode="json"),
        budgets={"max_turns": 4},
    )
    (result,) = run_eval(EvalDir.create(tmp_path / "ev", spec))
    assert result.verified and result.device.startswith("cuda")
    assert result.speedup_eager is not None and result.ratio_to_gemms is not None
    (row, _) = aggregates([result.numbers()], [1], [1.0])
    assert row.fast["eager"][1.0] is not None
