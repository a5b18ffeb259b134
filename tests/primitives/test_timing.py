"""``coda.primitives.timing.host_ms``: the host's time per call, measured on a CPU with stand-in
functions (the device's timings, ``interleaved_ms``, need a GPU: tests/gpu)."""

from __future__ import annotations

import time

from coda.primitives.timing import host_ms


def test_host_time_is_the_median_call_between_two_synchronizations() -> None:
    events: list[str] = []

    def quick() -> None:
        events.append("quick")

    def slow() -> None:
        events.append("slow")
        time.sleep(0.002)

    got = host_ms(
        {"quick": quick, "slow": slow}, calls=5, warmup=2, synchronize=lambda: events.append("sync")
    )
    assert got["slow"] >= 2.0 > got["quick"] >= 0.0
    # per function: its warm-up calls, a synchronization, the timed calls, a synchronization
    one = lambda name: [name] * 2 + ["sync"] + [name] * 5 + ["sync"]  # noqa: E731
    assert events == one("quick") + one("slow")


def test_the_median_ignores_a_call_the_os_delayed() -> None:
    calls = iter(range(100))

    def once_late() -> None:
        if next(calls) == 4:  # the second timed call (after three warm-up calls)
            time.sleep(0.05)

    (ms,) = host_ms({"f": once_late}, calls=5, synchronize=lambda: None).values()
    assert ms < 10.0
