"""GPU timing that compares fairly: interleaved rounds of ``triton.testing.do_bench`` medians.

Under sustained bf16 load an H200's clocks fall (measured here, 2026-11-29: the same kernel timed
12–27% slower at the end of a tuning sweep than at its start), so two functions timed one after
the other are compared at different clocks. ``interleaved_ms`` times every function once per round,
rotating the order each round, and reports the median of the per-round medians: drift then affects
all of them alike. Each ``do_bench`` call flushes L2 between runs and returns a median.

Windows must also be long enough to reach the clock a kernel sustains. A kernel that draws more
power per unit of time runs at a lower clock once the GPU sits at its power limit, and a 30 ms
window ends before that: at 8192³ on an H200 (2026-12-03, ``bench/experiments/tuning_windows.py``) a
CuTe ``gemm_rmsnorm`` kernel ran at 1290–1545 MHz against its Triton kernel's 1350–1590, and 30 ms
windows ranked the CuTe kernel first (1.644 against 1.676 ms) where 100 and 300 ms windows rank the
Triton kernel first (1.625 against 1.664 ms in 100 ms windows). ``sustained_ms`` times in the
windows the profiler and the benchmarks use; a choice between kernels that draw different power (two
backends, two tile shapes) is made with it.
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


SUSTAINED = {"rounds": 3, "warmup": 25, "rep": 100}  # the profiler's and benchmarks' windows


def sustained_ms(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """``interleaved_ms`` in 100 ms windows (``SUSTAINED``): each function's time at the clock it
    sustains at the power limit, as the profiler reports it."""
    return interleaved_ms(fns, **SUSTAINED)


HOST_CALLS = 30  # calls per function that host_ms times


def host_ms(
    fns: dict[str, Callable[[], object]],
    *,
    calls: int = HOST_CALLS,
    warmup: int = 3,
    synchronize: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Each function's host time: the median wall-clock milliseconds of one call among ``calls``
    calls issued back to back — nothing between them, the device synchronized (``synchronize``,
    default ``torch.cuda.synchronize``) before each function's calls and after. For a kernel
    launch this is what issuing it costs the host, which bounds a step that the host cannot issue
    as fast as the device runs it (a training step on few tokens) the way the kernel's device
    time bounds a step the device is behind on; ``interleaved_ms`` measures the latter."""
    import time

    if synchronize is None:
        import torch

        synchronize = torch.cuda.synchronize
    out: dict[str, float] = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        synchronize()
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        synchronize()
        out[name] = statistics.median(samples)
    return out
