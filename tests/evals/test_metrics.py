"""Eval metrics: the unbiased pass@k against enumeration, geometric means, a best candidate's
timings, and fast_p that is "not measured" unless every cell was timed on a GPU."""

from __future__ import annotations

import itertools
import math

import pytest

from coda.evals.metrics import CellNumbers, aggregate, geomean, pass_at_k, timing
from coda.sandbox.report import ProfileRow


@pytest.mark.parametrize(
    "n,c,k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (6, 1, 5), (4, 3, 2)]
)
def test_pass_at_k_is_the_chance_that_some_k_of_n_samples_pass(n: int, c: int, k: int) -> None:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    expected = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="k ≤ n"):
        pass_at_k(2, 1, 3)


def test_geomean_and_timing_of_profile_rows() -> None:
    assert geomean([2.0, 8.0]) == pytest.approx(4.0) and geomean([]) is None
    rows = [
        ProfileRow(
            sizes={"M": 1},
            dtype="bfloat16",
            program_ms=1.0,
            gemms_ms=0.9,
            eager_ms=2.0,
            compile_ms=1.5,
            tflops=1.0,
        ),
        ProfileRow(
            sizes={"M": 2},
            dtype="bfloat16",
            program_ms=2.0,
            gemms_ms=1.9,
            eager_ms=8.0,
            compile_ms=None,
            tflops=1.0,
        ),
    ]
    t = timing(rows)
    assert t.time_ms == 3.0 and t.speedup_eager == pytest.approx(math.sqrt(2.0 * 4.0))
    assert t.speedup_compile == pytest.approx(1.5)  # only the shape torch.compile was timed at
    assert t.ratio_to_gemms == pytest.approx(math.sqrt(1.0 / 0.9 * 2.0 / 1.9))
    assert timing([]).speedup_eager is None


def cell(verified: bool, eager: float | None, gpu: bool = True, **kw) -> CellNumbers:  # noqa: ANN003
    values = dict(block="b", provider="p", turns=2, seconds=1.0, tokens=10, cost_usd=0.01)
    values.update(kw)
    return CellNumbers(
        verified=verified,
        errored=False,
        gpu=gpu,
        speedup={"eager": eager, "compile": eager},
        ratio_to_gemms=1.1 if verified and eager else None,
        **values,
    )


def test_fast_p_counts_verified_and_fast_cells_over_all_cells() -> None:
    cells = [cell(True, 2.0), cell(True, 1.2), cell(False, None)]
    agg = aggregate(cells, "b", "p", [1, 2], [1.0, 1.5])
    assert agg.fast["eager"] == {1.0: pytest.approx(2 / 3), 1.5: pytest.approx(1 / 3)}
    assert agg.speedup["eager"] == pytest.approx(math.sqrt(2.4))
    assert agg.pass_at[1] == pytest.approx(2 / 3) and agg.pass_at[2] == 1.0
    assert agg.cost_per_verified == pytest.approx(0.03 / 2)


def test_without_gpu_timings_fast_p_is_not_measured() -> None:
    cpu = aggregate([cell(True, None, gpu=False), cell(False, None, gpu=False)], "b", "p", [1], [1])
    assert cpu.fast["eager"][1] is None and cpu.speedup["eager"] is None and not cpu.measured
    assert cpu.pass_at[1] == 0.5
    untimed = aggregate([cell(True, 2.0), cell(True, None)], "b", "p", [1], [1])
    assert untimed.fast["eager"][1] is None  # one verified cell has no time: not a measurement


def test_errored_cells_are_left_out_of_rates_and_unknown_prices_stay_unknown() -> None:
    errored = CellNumbers(
        "b", "p", False, True, True, 0, 0.0, 0, 0.0, {"eager": None, "compile": None}, None
    )
    agg = aggregate([cell(True, 2.0), errored, cell(True, 1.0, cost_usd=None)], "b", "p", [1], [1])
    assert (agg.n, agg.errors, agg.verified, agg.pass_at[1]) == (2, 1, 2, 1.0)
    assert agg.cost_usd is None and agg.cost_per_verified is None
