"""GPU timing that compares fairly: interleaved rounds of ``triton.testing.do_bench`` medians.

Under sustained bf16 load an H200's clocks fall (measured here, 2026-11-29: the same kernel timed
12–27% slower at the end of a tuning sweep than at its start), so two functions timed one after
the other are compared at different clocks. ``interleaved_ms`` times every function once per round,
rotating the order each round, and reports the median of the per-round medians: drift then affects
all of them alike. Each ``do_bench`` call flushes L2 between runs and returns a median.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable


def interleaved_ms(
    fns: dict[str, Callable[[], object]], *, rounds: int = 3, warmup: int = 10, rep: int = 30
) -> dict[str, float]:
    """Median milliseconds of each function, measured in ``rounds`` interleaved rounds."""
    import triton

    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            ms = triton.testing.do_bench(fns[name], warmup=warmup, rep=rep, return_mode="median")
            samples[name].append(float(ms))
    return {n: statistics.median(v) for n, v in samples.items()}
