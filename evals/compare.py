"""``coda-agent eval --compare A B``: what changed from eval A to eval B.

Cells are matched by id (block, provider label, seed); aggregates by (block, provider). A
*regression* is a cell verified in A and not in B, a cell that ran in A and errored in B, a cell
whose speedup over eager PyTorch (both measured) fell below A's divided by ``slowdown``, or an
aggregate whose pass@1 fell. Improvements are listed too. Speedups that were not measured on
either side are compared as "not measured", never as numbers.

B is *incomplete* when cells verified in A have no result in B (B was interrupted, or does not
run them): nothing can be said of those cells, so the comparison fails like a regression and says
to resume B. Cells that only B ran, and cells of A that were not verified, are listed as "only in
A" / "only in B" and change no verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .metrics import Aggregate, aggregates
from .report import fmt
from .results import CellResult, EvalDir


@dataclass
class CellDelta:
    cell: str
    a: CellResult | None
    b: CellResult | None
    regressions: list[str] = field(default_factory=list)
    improvements: list[str] = field(default_factory=list)
    missing: bool = False  # verified in A, no result in B


@dataclass
class GroupDelta:
    block: str
    provider: str
    a: Aggregate | None
    b: Aggregate | None
    regressions: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    a: EvalDir
    b: EvalDir
    cells: list[CellDelta]
    groups: list[GroupDelta]

    @property
    def regressions(self) -> int:
        return sum(len(c.regressions) for c in self.cells) + sum(
            len(g.regressions) for g in self.groups
        )

    @property
    def missing(self) -> list[str]:
        """The cells verified in A that have no result in B (B is incomplete)."""
        return [c.cell for c in self.cells if c.missing]

    @property
    def failed(self) -> bool:
        """Regressions, or B incomplete: ``eval --compare`` exits 1."""
        return bool(self.regressions or self.missing)


def cell_delta(cell: str, a: CellResult | None, b: CellResult | None, slowdown: float) -> CellDelta:
    d = CellDelta(cell, a, b)
    if a is None or b is None:
        d.missing = a is not None and a.verified
        return d
    if a.status == "done" and b.status == "error":
        d.regressions.append("errored")
    if a.verified and not b.verified and b.status == "done":
        d.regressions.append("no longer verified")
    if b.verified and not a.verified:
        d.improvements.append("now verified")
    if a.verified and b.verified and a.speedup_eager and b.speedup_eager:
        if b.speedup_eager < a.speedup_eager / slowdown:
            d.regressions.append(f"slower ({a.speedup_eager:.3f}× → {b.speedup_eager:.3f}×)")
        elif b.speedup_eager > a.speedup_eager * slowdown:
            d.improvements.append(f"faster ({a.speedup_eager:.3f}× → {b.speedup_eager:.3f}×)")
    return d


def compare(a: EvalDir, b: EvalDir, *, slowdown: float = 1.10) -> Comparison:
    ra, rb = a.results(), b.results()
    ids = list(dict.fromkeys([*ra, *rb]))
    cells = [cell_delta(i, ra.get(i), rb.get(i), slowdown) for i in ids]
    ks = sorted(set(a.spec().pass_ks()) & set(b.spec().pass_ks())) or [1]
    ps = a.spec().ps
    ga = {(g.block, g.provider): g for g in aggregates([r.numbers() for r in ra.values()], ks, ps)}
    gb = {(g.block, g.provider): g for g in aggregates([r.numbers() for r in rb.values()], ks, ps)}
    groups = []
    for key in dict.fromkeys([*ga, *gb]):
        g = GroupDelta(key[0], key[1], ga.get(key), gb.get(key))
        pa = g.a.pass_at.get(1) if g.a else None
        pb = g.b.pass_at.get(1) if g.b else None
        if pa is not None and pb is not None and pb < pa:
            g.regressions.append(f"pass@1 {pa:.2f} → {pb:.2f}")
        groups.append(g)
    return Comparison(a, b, cells, groups)


def _delta(a: float | None, b: float | None, pattern: str = "{:+.2f}") -> str:
    if a is None or b is None:
        return "not measured" if a is None and b is None else "n/a"
    return pattern.format(b - a)


def incomplete(c: Comparison) -> str:
    """What to do about the cells verified in A that B has no result for."""
    return (
        f"B is incomplete: {len(c.missing)} cell(s) verified in A were not run in B — resume it "
        f"with `coda-agent eval --resume {c.b.path}`, then compare again"
    )


def markdown(c: Comparison) -> str:
    lines = [f"# eval comparison: A = `{c.a.path}`, B = `{c.b.path}`", ""]
    if c.regressions:
        verdict = f"**{c.regressions} regression(s)**"
    elif c.missing:
        verdict = "**no regressions in the cells both evals ran**"
    else:
        verdict = "**no regressions**"
    lines += [verdict, ""]
    if c.missing:
        lines += [f"**{incomplete(c)}**", ""]
    lines += ["## Aggregates", ""]
    lines += [
        "| block | provider | verified A → B | pass@1 A → B | speedup vs eager A → B | "
        "$ / verified A → B | regressions |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in c.groups:
        lines.append(
            f"| {g.block} | {g.provider} | {_pair(g, lambda x: f'{x.verified}/{x.n}')} | "
            f"{_pair(g, lambda x: fmt(x.pass_at.get(1), missing='n/a'))} | "
            f"{_pair(g, lambda x: fmt(x.speedup['eager'], '{:.3f}×'))} | "
            f"{_pair(g, lambda x: fmt(x.cost_per_verified, '${:.4f}', 'n/a'))} | "
            f"{'; '.join(g.regressions) or '-'} |"
        )
    lines += ["", "## Cells", "", "| cell | A | B | Δ turns | Δ wall s | Δ speedup | changes |"]
    lines.append("|---|---|---|---|---|---|---|")
    for d in c.cells:
        changes = [f"REGRESSION: {r}" for r in d.regressions] + d.improvements
        if d.missing:
            changes.append("NOT RUN IN B: verified in A")
        elif d.a is None or d.b is None:
            changes.append("only in " + ("B" if d.a is None else "A"))
        lines.append(
            f"| `{d.cell}` | {_verdict(d.a)} | {_verdict(d.b)} | "
            f"{_delta(_get(d.a, 'turns'), _get(d.b, 'turns'), '{:+.0f}')} | "
            f"{_delta(_get(d.a, 'seconds'), _get(d.b, 'seconds'), '{:+.1f}')} | "
            f"{_delta(_get(d.a, 'speedup_eager'), _get(d.b, 'speedup_eager'), '{:+.3f}')} | "
            f"{'; '.join(changes) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def _get(r: CellResult | None, name: str) -> float | None:
    return None if r is None else getattr(r, name)


def _verdict(r: CellResult | None) -> str:
    if r is None:
        return "-"
    return "error" if r.status == "error" else ("verified" if r.verified else "not verified")


def _pair(g: GroupDelta, show) -> str:  # noqa: ANN001
    left = show(g.a) if g.a is not None else "-"
    right = show(g.b) if g.b is not None else "-"
    return f"{left} → {right}"
