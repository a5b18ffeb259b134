"""Summaries of runs and reports: ``summary.md``, and the numbers the CLI's tables show.

``RunFacts`` is one run's numbers, taken from a finished loop (``AgentResult``) or rebuilt from a
transcript (``RunState``, e.g. an interrupted run shown by ``coda-agent show``), so both read the
same. ``error_rows`` is the per-output error table of a Report.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coda.sandbox.report import Report

from .providers.base import Usage
from .providers.pricing import format_cost
from .transcript import Candidate, RunState

if TYPE_CHECKING:
    from .loop import AgentResult


@dataclass(frozen=True)
class ErrorRow:
    """One output in one dtype: its worst check (largest error / allowed) over shapes and seeds,
    and the largest relative error of any check."""

    output: str
    dtype: str
    checks: int
    shapes: int
    max_abs_err: float
    torch_max_abs_err: float
    allowed: float
    rel_err: float
    passed: bool


def error_rows(report: Report) -> list[ErrorRow]:
    groups = defaultdict(list)
    for c in report.checks:
        groups[(c.output, c.dtype)].append(c)
    rows = []
    for (output, dtype), checks in groups.items():
        scored = [c for c in checks if c.max_abs_err is not None]
        worst = (
            max(scored, key=lambda c: c.max_abs_err / max(c.allowed or 1e-30, 1e-30))
            if scored
            else checks[0]
        )
        rows.append(
            ErrorRow(
                output=output,
                dtype=dtype,
                checks=len(checks),
                shapes=len({tuple(sorted(c.sizes.items())) for c in checks}),
                max_abs_err=worst.max_abs_err if worst.max_abs_err is not None else float("nan"),
                torch_max_abs_err=worst.torch_max_abs_err or float("nan"),
                allowed=worst.allowed or float("nan"),
                rel_err=max((c.rel_err or 0 for c in scored), default=float("nan")),
                passed=all(c.passed for c in checks),
            )
        )
    return rows


@dataclass(frozen=True)
class RunFacts:
    """One run's numbers. ``stop`` is ``None`` for a run that never recorded its end."""

    block: str
    provider: str
    model: str
    turns: int
    usage: Usage
    cost_usd: float | None
    candidates: list[Candidate]
    best: Candidate | None
    stop: tuple[str, str] | None  # (kind, message)
    seconds: float | None
    tool_errors: int
    retries: int

    @property
    def verified(self) -> bool:
        return self.best is not None and self.best.report.verified

    @property
    def best_role(self) -> str:
        """What the run's leading candidate is called: ``best`` once it verified; until then it
        is only the one that got ``furthest`` through the sandbox's stages."""
        return "best" if self.verified else "furthest"

    def best_text(self) -> str:
        """The ``best`` row: the best candidate, or that none verified (and which got
        furthest)."""
        if self.best is None:
            return "none"
        if not self.verified:
            return f"none verified (candidate {self.best.index} got furthest)"
        return f"candidate {self.best.index}"

    @classmethod
    def from_result(cls, r: AgentResult) -> RunFacts:
        return cls(
            r.block,
            r.provider,
            r.model,
            r.turns,
            r.usage,
            r.cost_usd,
            r.candidates,
            r.best,
            (r.stop.kind, r.stop.message),
            r.seconds,
            r.tool_errors,
            r.retries,
        )

    @classmethod
    def from_state(cls, s: RunState) -> RunFacts:
        end = s.end
        return cls(
            s.start.block,
            s.provider,
            s.model,
            s.turns,
            s.usage,
            s.cost_usd,
            s.candidates,
            s.best,
            (end.reason, end.message) if end else None,
            end.seconds if end else None,
            s.malformed,
            s.retries,
        )

    def time_text(self) -> str:
        best = self.best
        if best is None or not best.report.verified:
            return "no verified candidate"
        if best.time_ms is None:
            return "not measured"
        return f"{best.time_ms:.4f} ms"

    def facts(self) -> list[tuple[str, str]]:
        """(label, value) rows: what the run did and what it cost."""
        verified = sum(c.report.verified for c in self.candidates)
        stop = f"{self.stop[0]}: {self.stop[1]}" if self.stop else "unfinished (no end record)"
        return [
            ("provider", f"{self.provider} ({self.model})"),
            ("turns", str(self.turns)),
            ("tokens", tokens_text(self.usage)),
            ("cost", format_cost(self.cost_usd)),
            ("candidates", f"{len(self.candidates)} ({verified} verified)"),
            ("best", self.best_text()),
            ("best time", self.time_text()),
            ("tool-call errors", str(self.tool_errors)),
            ("provider retries", str(self.retries)),
            ("stopped", stop),
            ("wall time", f"{self.seconds:.1f} s" if self.seconds is not None else "unknown"),
        ]


def tokens_text(usage: Usage) -> str:
    """``total (in, out)``, with the input's prompt-cache reads and writes when there were any."""
    if not (usage.cache_write_tokens or usage.cache_read_tokens):
        return f"{usage.total:,} ({usage.input_tokens:,} in, {usage.output_tokens:,} out)"
    return (
        f"{usage.total:,} ({usage.input_tokens:,} in: {usage.cache_read_tokens:,} read from the "
        f"prompt cache, {usage.cache_write_tokens:,} written to it; {usage.output_tokens:,} out)"
    )


def run_markdown(facts: RunFacts, device: str) -> str:
    """``summary.md``: the verdict, the run's numbers, every candidate, the best one's Report."""
    verdict = "VERIFIED" if facts.verified else "NOT VERIFIED"
    lines = [f"# coda-agent run: {facts.block}", "", f"**{verdict}**", ""]
    lines += [f"- {label}: {value}" for label, value in facts.facts()]
    lines += [f"- device: {device}", "", "## Candidates", ""]
    if facts.candidates:
        lines += ["| # | turn | verdict | time | report |", "|---|---|---|---|---|"]
        for c in facts.candidates:
            mark = f" ({facts.best_role})" if facts.best is c else ""
            time_text = f"{c.time_ms:.4f} ms" if c.time_ms is not None else "not measured"
            head = c.report.headline().replace("|", "\\|")
            verdict = "verified" if c.report.verified else "failed"
            lines.append(f"| {c.index}{mark} | {c.turn} | {verdict} | {time_text} | {head} |")
    else:
        lines.append("No candidate was submitted.")
    if facts.best is not None:
        lines += ["", f"## {facts.best_role.capitalize()} candidate ({facts.best.index})", ""]
        lines += report_sections(facts.best.report)
    return "\n".join(lines) + "\n"


def report_sections(report: Report) -> list[str]:
    """A Report in markdown: headline, stages, the error table, timings or "not measured"."""
    lines = [
        f"**{report.headline()}**",
        "",
        f"- program: {report.program_hash}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in report.versions.items())}",
        "",
        "### Stages",
        "",
        "| stage | status | seconds | message |",
        "|---|---|---|---|",
    ]
    for s in report.stages:
        msg = s.summary().replace("|", "\\|")
        lines.append(f"| {s.stage} | {s.status} | {s.seconds:.2f} | {msg} |")
    rows = error_rows(report)
    if rows:
        lines += [
            "",
            "### Errors against the float64 reference (worst over shapes and seeds)",
            "",
            "| output | dtype | checks | max abs err | PyTorch's max abs err | allowed | "
            "rel err | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r.output} | {r.dtype} | {r.checks} | {r.max_abs_err:.3g} | "
                f"{r.torch_max_abs_err:.3g} | {r.allowed:.3g} | {r.rel_err:.3g} | "
                f"{'pass' if r.passed else 'FAIL'} |"
            )
    lines += ["", "### Timings", ""]
    lines += _timing_lines(report)
    return lines


def _timing_lines(report: Report) -> list[str]:
    if not report.profile:
        prof = report.stage("profile")
        return [f"not measured ({prof.message if prof else 'the run stopped before profiling'})"]
    lines = [
        "| sizes | dtype | program ms | GEMMs alone ms | ratio | eager ms | "
        "torch.compile ms | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in report.profile:
        sizes = ", ".join(f"{k}={v}" for k, v in p.sizes.items())
        eager = f"{p.eager_ms:.3f}" if p.eager_ms else "n/a"
        comp = f"{p.compile_ms:.3f}" if p.compile_ms else "n/a"
        lines.append(
            f"| {sizes} | {p.dtype} | {p.program_ms:.3f} | {p.gemms_ms:.3f} | "
            f"{p.ratio_to_gemms:.3f} | {eager} | {comp} | {p.tflops:.0f} |"
        )
    return lines
