"""Summaries of a report: the per-output error table (CLI and ``summary.md``) and timings."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from coda.sandbox.report import Report


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


def markdown(report: Report, *, title: str, extra: dict[str, str] | None = None) -> str:
    lines = [f"# {title}", "", f"**{report.headline()}**", ""]
    for key, value in (extra or {}).items():
        lines.append(f"- {key}: {value}")
    lines += [
        f"- device: {report.device}",
        f"- program: {report.program_hash}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in report.versions.items())}",
        "",
        "## Stages",
        "",
        "| stage | status | seconds | message |",
        "|---|---|---|---|",
    ]
    for s in report.stages:
        msg = s.message.splitlines()[0] if s.message else ""
        lines.append(f"| {s.stage} | {s.status} | {s.seconds:.2f} | {msg} |")
    rows = error_rows(report)
    if rows:
        lines += [
            "",
            "## Errors against the float64 reference (worst over shapes and seeds)",
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
    lines += ["", "## Timings", ""]
    if report.profile:
        lines += [
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
    else:
        prof = report.stage("profile")
        lines.append(
            f"not measured ({prof.message if prof else 'the run stopped before profiling'})"
        )
    return "\n".join(lines) + "\n"
