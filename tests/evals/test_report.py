"""results.md and the plots from GPU-timed cells (numbers), from CPU cells ("not measured"), and
without matplotlib (a note, no PNG)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from coda.evals.plots import MISSING, write_plots
from coda.evals.report import markdown
from coda.evals.results import CellResult
from coda.evals.spec import EvalSpec, ProviderSpec

GPU = "cuda (NVIDIA H200)"
PROVIDERS = ["builtin", "anthropic:claude-sonnet-4-5"]


def results(device: str = GPU) -> list[CellResult]:
    timed = device == GPU
    found = []
    for label, speedup in zip(PROVIDERS, (1.6, 1.2), strict=True):
        spec = ProviderSpec.parse(label)
        for seed in range(2):
            found.append(
                CellResult(
                    cell=f"llama_mlp--{label}--s{seed}",
                    block="llama_mlp",
                    provider=spec.label,
                    model=spec.model or "",
                    seed=seed,
                    status="done",
                    verified=seed == 0 or label == "builtin",
                    speedup_eager=speedup if timed else None,
                    speedup_compile=speedup / 1.2 if timed else None,
                    ratio_to_gemms=1.05 if timed else None,
                    device=device,
                    failures={} if label == "builtin" else {"verify": 1},
                )
            )
    return found


def spec() -> EvalSpec:
    return EvalSpec(
        blocks=["llama_mlp"],
        providers=[ProviderSpec.parse(p) for p in PROVIDERS],
        seeds=2,
        ks=[1, 2],
        ps=[1.0, 1.5],
    )


def test_gpu_cells_give_numbers(tmp_path: Path) -> None:
    md = markdown(spec(), results())
    assert "timings: not measured" not in md
    row = next(line for line in md.splitlines() if line.startswith("| all | anthropic"))
    # 1 of 2 verified; the verified one is 1.2× eager (fast_1 yes, fast_1.5 no), 1.0× compile
    assert (
        "| 2 | 0 | 1 | 0.50 | 1.00 | 0.50 / 0.00 | 0.50 / 0.00 | 1.200× | 1.000× | 1.050 |" in row
    )
    assert write_plots(tmp_path, results()) == ["plots: `speedup.png`, `errors.png`"]
    assert (tmp_path / "speedup.png").stat().st_size > 10_000


def test_cpu_cells_are_not_measured(tmp_path: Path) -> None:
    md = markdown(spec(), results("cpu (Triton interpreter)"))
    assert "timings: not measured (no GPU" in md
    row = next(line for line in md.splitlines() if line.startswith("| all | builtin"))
    assert row.count("not measured") == 5  # fast_p ×2, speedups ×2, ratio to GEMMs
    notes = write_plots(tmp_path, results("cpu (Triton interpreter)"))
    assert notes[0] == '`speedup.png` says "not measured": no verified cell was timed'


def test_without_matplotlib_no_plot_and_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert write_plots(tmp_path, results()) == [MISSING]
    assert not list(tmp_path.iterdir())
