"""Eval metrics: per-cell numbers from a best candidate's timings, and aggregates over cells.

Per cell (``CellResult`` in ``results.py``): verified, speedups of the best candidate over eager
PyTorch and ``torch.compile`` (geometric mean over its profiled shapes), its time as a multiple of
the GEMMs alone, turns, wall time, tokens, dollars.

Per group of cells (a block × provider, or a provider over all blocks; ``Aggregate``):

* ``pass@k`` — the unbiased estimator over the group's ``n`` seeds with ``c`` verified,
  ``1 − C(n−c, k) / C(n, k)`` (Chen et al. 2021), averaged over blocks for a provider's total;
* ``fast_p`` — the share of cells that verified *and* are at least ``p``× faster than a baseline
  (eager or ``torch.compile``). It is a measurement only when every cell of the group ran on a GPU
  and every verified one was timed; otherwise it is ``None``: "not measured", never a guess;
* geometric-mean speedups and ratio to GEMMs alone over the verified, timed cells;
* mean turns and wall time, total tokens and dollars, dollars per verified kernel (``None`` when a
  model's price is unknown, or when nothing verified).

Cells whose status is ``error`` (the harness or the provider failed, not the model's answer) are
left out of every rate and counted separately: a resumed eval retries them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from math import comb

from coda.sandbox.report import ProfileRow

BASELINES = ("eager", "compile")


def geomean(values: Iterable[float]) -> float | None:
    xs = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in xs) / len(xs)) if xs else None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn from ``n`` (``c`` correct) is
    correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 ≤ c ≤ n and 1 ≤ k ≤ n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass(frozen=True)
class Timing:
    """A best candidate's timings reduced to one number per baseline (``None``: not measured)."""

    time_ms: float | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    ratio_to_gemms: float | None = None


def timing(rows: Sequence[ProfileRow]) -> Timing:
    if not rows:
        return Timing()
    return Timing(
        time_ms=sum(r.program_ms for r in rows),
        speedup_eager=geomean(r.eager_ms / r.program_ms for r in rows if r.eager_ms),
        speedup_compile=geomean(r.compile_ms / r.program_ms for r in rows if r.compile_ms),
        ratio_to_gemms=geomean(r.program_ms / r.gemms_ms for r in rows),
    )


@dataclass(frozen=True)
class CellNumbers:
    """What aggregation reads from a cell (a ``CellResult`` satisfies it)."""

    block: str
    provider: str
    verified: bool
    errored: bool
    gpu: bool  # ran where timings are measured
    turns: int
    seconds: float
    tokens: int
    cost_usd: float | None
    speedup: dict[str, float | None]  # baseline -> speedup, None when not measured
    ratio_to_gemms: float | None


@dataclass
class Aggregate:
    block: str  # "all" for a provider's total over blocks
    provider: str
    n: int  # cells that ran to an answer (errors excluded)
    errors: int
    verified: int
    pass_at: dict[int, float | None] = field(default_factory=dict)
    fast: dict[str, dict[float, float | None]] = field(default_factory=dict)
    speedup: dict[str, float | None] = field(default_factory=dict)
    ratio_to_gemms: float | None = None
    turns_mean: float | None = None
    seconds_mean: float | None = None
    tokens: int = 0
    cost_usd: float | None = None
    cost_per_verified: float | None = None

    @property
    def measured(self) -> bool:
        return any(v is not None for v in self.speedup.values())


def _fast(cells: list[CellNumbers], baseline: str, p: float) -> float | None:
    """Share of ``cells`` verified and ≥ ``p``× faster than ``baseline``; ``None`` (not
    measured) when a cell ran without a GPU or a verified cell has no time for the baseline."""
    if not cells or not all(c.gpu for c in cells):
        return None
    speedups = [c.speedup[baseline] for c in cells if c.verified]
    if any(s is None for s in speedups):
        return None
    return sum(s >= p for s in speedups) / len(cells)  # type: ignore[operator]


def aggregate(
    cells: list[CellNumbers], block: str, provider: str, ks: list[int], ps: list[float]
) -> Aggregate:
    """One group's numbers; for ``block == "all"`` pass@k is averaged over the blocks."""
    ran = [c for c in cells if not c.errored]
    agg = Aggregate(block, provider, len(ran), len(cells) - len(ran), sum(c.verified for c in ran))
    agg.pass_at = {k: _pass_rate(ran, k) for k in ks}
    agg.fast = {b: {p: _fast(ran, b, p) for p in ps} for b in BASELINES}
    timed = [c for c in ran if c.verified]
    agg.speedup = {b: geomean(c.speedup[b] for c in timed if c.speedup[b]) for b in BASELINES}
    agg.ratio_to_gemms = geomean(c.ratio_to_gemms for c in timed if c.ratio_to_gemms)
    if ran:
        agg.turns_mean = sum(c.turns for c in ran) / len(ran)
        agg.seconds_mean = sum(c.seconds for c in ran) / len(ran)
    agg.tokens = sum(c.tokens for c in cells)
    costs = [c.cost_usd for c in cells]
    agg.cost_usd = None if any(x is None for x in costs) else sum(costs)  # type: ignore[arg-type]
    if agg.cost_usd is not None and agg.verified:
        agg.cost_per_verified = agg.cost_usd / agg.verified
    return agg


def _pass_rate(cells: list[CellNumbers], k: int) -> float | None:
    """Mean over blocks of the unbiased pass@k; ``None`` when some block has fewer than k
    samples."""
    by_block: dict[str, list[CellNumbers]] = {}
    for c in cells:
        by_block.setdefault(c.block, []).append(c)
    rates = []
    for group in by_block.values():
        if len(group) < k:
            return None
        rates.append(pass_at_k(len(group), sum(c.verified for c in group), k))
    return sum(rates) / len(rates) if rates else None


def aggregates(cells: list[CellNumbers], ks: list[int], ps: list[float]) -> list[Aggregate]:
    """Per block × provider, then per provider over all blocks (in first-seen order)."""
    blocks = list(dict.fromkeys(c.block for c in cells))
    providers = list(dict.fromkeys(c.provider for c in cells))
    rows = []
    for b in blocks:
        for p in providers:
            group = [c for c in cells if c.block == b and c.provider == p]
            if group:
                rows.append(aggregate(group, b, p, ks, ps))
    for p in providers:
        rows.append(aggregate([c for c in cells if c.provider == p], "all", p, ks, ps))
    return rows
