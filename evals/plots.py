"""The eval's plots (matplotlib, Agg backend, PNG), written next to ``results.md``.

* ``speedup.png`` — per block, one bar per provider: the geometric-mean speedup of the verified
  cells' best kernels over eager PyTorch and over ``torch.compile`` (a line at 1×). When nothing
  was timed (no GPU) the figure says "not measured" instead of drawing bars.
* ``errors.png`` — per provider, why candidates failed: failed candidates by sandbox stage, plus
  malformed tool calls and cells the harness could not run.

matplotlib is optional (``pip install 'coda-agent[evals]'``): without it no plot is drawn and the
returned notes say so (``results.md`` repeats them).
"""

from __future__ import annotations

from pathlib import Path

from .metrics import BASELINES, geomean
from .report import write_whole
from .results import CellResult

SPEEDUP_PNG = "speedup.png"
ERRORS_PNG = "errors.png"
STAGES = ("validate", "semantics", "compile", "verify", "profile")
MISSING = "plots not drawn: matplotlib is not installed (pip install 'coda-agent[evals]')"


def write_plots(folder: Path, results: list[CellResult]) -> list[str]:
    """Draw both plots into ``folder``; returns notes for ``results.md``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [MISSING]
    notes = [_speedup(plt, folder / SPEEDUP_PNG, results)]
    _errors(plt, folder / ERRORS_PNG, results)
    notes.append(f"plots: `{SPEEDUP_PNG}`, `{ERRORS_PNG}`")
    return [n for n in notes if n]


def speedups(results: list[CellResult], baseline: str) -> dict[tuple[str, str], float]:
    """(block, provider) -> geometric-mean speedup over the verified, timed cells."""
    found = {}
    for key in dict.fromkeys((r.block, r.provider) for r in results):
        values = [
            getattr(r, f"speedup_{baseline}")
            for r in results
            if (r.block, r.provider) == key and r.verified
        ]
        mean = geomean(v for v in values if v is not None)
        if mean is not None:
            found[key] = mean
    return found


def _speedup(plt, path: Path, results: list[CellResult]) -> str:  # noqa: ANN001
    measured = {b: speedups(results, b) for b in BASELINES}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if not any(measured.values()):
        for ax in axes:
            ax.set_axis_off()
        fig.text(
            0.5,
            0.5,
            "Speedup: not measured\n\nno verified cell was timed (timings need a CUDA GPU;\n"
            "on a CPU kernels run in the Triton interpreter and are not timed)",
            ha="center",
            va="center",
            fontsize=13,
        )
        _save(plt, fig, path)
        return f'`{SPEEDUP_PNG}` says "not measured": no verified cell was timed'
    blocks = list(dict.fromkeys(r.block for r in results))
    providers = list(dict.fromkeys(r.provider for r in results))
    width = 0.8 / max(len(providers), 1)
    for ax, baseline in zip(axes, BASELINES, strict=True):
        for i, provider in enumerate(providers):
            xs = [j + i * width for j in range(len(blocks))]
            ys = [measured[baseline].get((b, provider), 0.0) for b in blocks]
            bars = ax.bar(xs, ys, width, label=provider)
            ax.bar_label(bars, labels=[f"{y:.2f}×" if y else "" for y in ys], fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks([j + width * (len(providers) - 1) / 2 for j in range(len(blocks))])
        ax.set_xticklabels(blocks, rotation=20, ha="right")
        name = "torch.compile" if baseline == "compile" else "eager PyTorch"
        ax.set_title(f"speedup over {name} (geomean, verified)")
        ax.set_ylabel("speedup (×)")
    axes[0].legend(fontsize=8)
    _save(plt, fig, path)
    return ""


def _errors(plt, path: Path, results: list[CellResult]) -> None:  # noqa: ANN001
    providers = list(dict.fromkeys(r.provider for r in results))
    series = {
        s: [_sum(results, p, lambda r, s=s: r.failures.get(s, 0)) for p in providers]
        for s in STAGES
    }
    series["malformed tool call"] = [_sum(results, p, lambda r: r.tool_errors) for p in providers]
    series["cell error (harness)"] = [
        _sum(results, p, lambda r: int(r.status == "error")) for p in providers
    ]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(providers) + 3), 4.2))
    bottom = [0] * len(providers)
    for label, counts in series.items():
        if any(counts):
            ax.bar(providers, counts, bottom=bottom, label=label)
            bottom = [a + b for a, b in zip(bottom, counts, strict=True)]
    if not any(bottom):
        ax.bar(providers, [0] * len(providers))  # keeps the providers on the x axis
        ax.set_ylim(0, 1)
        ax.text(0.5, 0.5, "no errors", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=8)
    ax.set_title("why candidates failed (all cells)")
    ax.set_ylabel("count")
    ax.tick_params(axis="x", labelrotation=15)
    _save(plt, fig, path)


def _sum(results: list[CellResult], provider: str, value) -> int:  # noqa: ANN001
    return sum(value(r) for r in results if r.provider == provider)


def _save(plt, fig, path: Path) -> None:  # noqa: ANN001
    """Write ``fig`` to ``path`` whole or not at all (``ReportError`` when it cannot be)."""
    try:
        fig.tight_layout()
        write_whole(path, lambda tmp: fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".")))
    finally:
        plt.close(fig)
