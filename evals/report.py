"""An eval's human-readable outputs: ``results.md`` (tables) and the plots (``plots.py``).

``write_report`` rewrites them from ``results.jsonl`` after every run, so a partial or resumed
eval always has up-to-date tables. Numbers that were not measured (timings without a GPU) read
"not measured"; a missing price reads "unknown". Each file is written whole or not at all (to a
temporary name, then renamed): a full disk or a read-only folder leaves the previous file, never a
truncated one, and is a ``ReportError`` naming the file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from .metrics import BASELINES, Aggregate, aggregates
from .results import RESULTS_FILE, CellResult, EvalDir, EvalDirError
from .spec import EvalSpec

NOT_MEASURED = "not measured"
BASELINE_NAMES = {"eager": "eager", "compile": "torch.compile"}


def fmt(value: float | None, pattern: str = "{:.2f}", missing: str = NOT_MEASURED) -> str:
    return missing if value is None else pattern.format(value)


class ReportError(EvalDirError):
    """``results.md`` or a plot could not be written (a full disk, a read-only folder). The
    results themselves, in ``results.jsonl``, are untouched."""

    def __init__(self, path: Path, error: OSError) -> None:
        folder = path.parent
        super().__init__(
            f"cannot write {path}: {error.strerror or error} — the results themselves are intact "
            f"in {folder / RESULTS_FILE}; free space on that disk or fix its permissions, then "
            f"rewrite the tables and plots with `coda-agent eval --resume {folder}`"
        )


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` the file to a temporary name beside ``path``, then rename it over ``path``: the
    file is whole or keeps its previous content. A failure leaves no temporary file and is a
    ``ReportError`` naming ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ReportError(path, e) from None


def write_report(edir: EvalDir) -> None:
    """Rewrite ``results.md`` and the plots (``ReportError`` when one cannot be written)."""
    from .plots import write_plots

    spec = edir.spec()
    results = edir.ordered_results()
    notes = write_plots(edir.path, results)
    text = markdown(spec, results, notes)
    write_whole(edir.path / "results.md", lambda tmp: tmp.write_text(text, encoding="utf-8"))


def markdown(spec: EvalSpec, results: list[CellResult], notes: list[str] | None = None) -> str:
    total = len(spec.cells())
    errors = sum(r.status == "error" for r in results)
    done = len(results) - errors
    what = f"suite `{spec.suite}`" if spec.suite else "blocks " + ", ".join(spec.blocks)
    lines = [f"# coda-agent eval: {what}", ""]
    lines += [
        f"- cells: {done} of {total} done, {errors} errors, {total - len(results)} not run yet",
        f"- providers: {', '.join(p.label for p in spec.providers)}; seeds per cell: {spec.seeds}",
        f"- devices: {', '.join(sorted({r.device for r in results if r.device})) or 'none yet'}",
    ]
    if spec.skipped:
        lines.append(f"- planned blocks not registered yet (skipped): {', '.join(spec.skipped)}")
    if results and not any(r.device.startswith("cuda") for r in results):
        lines.append(
            "- timings: not measured (no GPU: kernels ran in the Triton interpreter), so fast_p, "
            "speedups and the ratio to GEMMs alone are not measured"
        )
    lines += [f"- {n}" for n in notes or []]
    rows = aggregates([r.numbers() for r in results], spec.pass_ks(), spec.ps)
    lines += ["", "## Summary", "", *summary_table(rows, spec), "", "## Cells", ""]
    lines += cell_table(results)
    lines += refusals(results)
    failed = [r for r in results if r.status == "error"]
    if failed:
        lines += ["", "## Errors", "", "Resume the eval (`coda-agent eval --resume DIR`) to retry:"]
        lines += [f"- `{r.cell}`: {(r.error or '').splitlines()[0]}" for r in failed]
    return "\n".join(lines) + "\n"


def refusals(results: list[CellResult]) -> list[str]:
    """A section naming, per refused cell, every op the built-in planner could not lower."""
    refused = [r for r in results if r.stop == "refused"]
    if not refused:
        return []
    lines = ["", "## Refusals", "", "The built-in planner cannot lower these blocks:"]
    for r in refused:
        lines += [
            "",
            f"- `{r.cell}`:",
            "",
            "  ```",
            *(f"  {t}" for t in r.stop_message.splitlines()),
        ]
        lines.append("  ```")
    return lines


def summary_table(rows: list[Aggregate], spec: EvalSpec) -> list[str]:
    ks, ps = spec.pass_ks(), spec.ps
    head = ["block", "provider", "n", "errors", "verified"]
    head += [f"pass@{k}" for k in ks]
    fast = ",".join(f"{p:g}" for p in ps)
    head += [f"fast_{{{fast}}} vs {BASELINE_NAMES[b]}" for b in BASELINES]
    head += [f"speedup vs {BASELINE_NAMES[b]}" for b in BASELINES]
    head += ["× GEMMs alone", "turns", "wall s", "tokens", "cost", "$ / verified"]
    lines = [_row(head), _row(["---"] * len(head))]
    for a in rows:
        cells = [a.block, a.provider, str(a.n), str(a.errors), str(a.verified)]
        cells += [fmt(a.pass_at.get(k), missing="n/a") for k in ks]
        cells += [_fast(a, b, ps) for b in BASELINES]
        cells += [fmt(a.speedup[b], "{:.3f}×") for b in BASELINES]
        cells += [fmt(a.ratio_to_gemms, "{:.3f}")]
        cells += [fmt(a.turns_mean, "{:.1f}", "n/a"), fmt(a.seconds_mean, "{:.1f}", "n/a")]
        cells += [f"{a.tokens:,}", fmt(a.cost_usd, "${:.4f}", "unknown")]
        cells += [_per_verified(a)]
        lines.append(_row(cells))
    return lines


def _fast(a: Aggregate, baseline: str, ps: list[float]) -> str:
    values = [a.fast[baseline][p] for p in ps]
    if any(v is None for v in values):
        return NOT_MEASURED
    return " / ".join(f"{v:.2f}" for v in values)


def _per_verified(a: Aggregate) -> str:
    if a.verified == 0:
        return "no verified kernel"
    return fmt(a.cost_per_verified, "${:.4f}", "unknown")


CellColumn = tuple[str, Callable[[CellResult], str]]

CELL_COLUMNS: list[CellColumn] = [
    ("cell", lambda r: f"`{r.cell}`"),
    ("status", lambda r: r.status),
    ("verified", lambda r: "yes" if r.verified else "no"),
    ("stop", lambda r: r.stop or "-"),
    ("turns", lambda r: str(r.turns)),
    ("wall s", lambda r: f"{r.seconds:.1f}"),
    ("tokens", lambda r: f"{r.input_tokens + r.output_tokens:,}"),
    ("cost", lambda r: fmt(r.cost_usd, "${:.4f}", "unknown")),
    ("candidates", lambda r: f"{r.candidates} ({r.verified_candidates} verified)"),
    ("failures", lambda r: ", ".join(f"{k} {v}" for k, v in r.failures.items()) or "-"),
    ("err / allowed", lambda r: fmt(r.worst_error_ratio, "{:.2f}", "-")),
    ("speedup vs eager", lambda r: _timed(r, r.speedup_eager, "{:.3f}×")),
    ("vs torch.compile", lambda r: _timed(r, r.speedup_compile, "{:.3f}×")),
    ("× GEMMs alone", lambda r: _timed(r, r.ratio_to_gemms, "{:.3f}")),
    ("run", lambda r: f"`{r.run_dir}`" if r.run_dir else "-"),
]


def _timed(r: CellResult, value: float | None, pattern: str) -> str:
    """A verified cell's timing number; "-" for a cell with nothing to time."""
    return fmt(value, pattern) if r.verified else "-"


def cell_table(results: list[CellResult]) -> list[str]:
    lines = [_row([c for c, _ in CELL_COLUMNS]), _row(["---"] * len(CELL_COLUMNS))]
    for r in results:
        lines.append(_row([f(r) for _, f in CELL_COLUMNS]))
    return lines


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
