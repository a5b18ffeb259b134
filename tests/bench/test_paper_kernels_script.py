"""bench/paper_kernels.py: it fails fast without a GPU, and its dry run (CPU, toy sizes) runs every
code path the GPU run takes — correctness checks, baselines, tables, result files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.bench import load_script


def _script():  # noqa: ANN202
    return load_script("paper_kernels")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the no-GPU message")
def test_fails_fast_without_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert _script().main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def table_of(out: Path) -> str:
    return (out / "paper_kernels.md").read_text()


def test_dry_run_writes_tables_and_numbers(tmp_path: Path) -> None:
    only = "gemm_rmsnorm_swiglu,gemm_rope"
    code = _script().main(
        ["--dry-run", "--out", str(tmp_path), "--only", only, "--subtiles", "2,4", "--runs", "2"]
    )
    assert code == 0
    result = json.loads((tmp_path / "paper_kernels.json").read_text())
    assert result["environment"]["dry_run"] is True
    assert [r["block"] for r in result["kernels"]] == ["gemm_rmsnorm_swiglu", "gemm_rope"]
    assert all(r["correct"] and r["coda_ms"] > 0 and r["compile_ms"] > 0 for r in result["kernels"])
    (mlp,) = result["llama_mlp"]
    # output + 5 gradients, for the op with separate gate/up weights and for the packed one
    assert mlp["correct"] and len(mlp["checks"]) == 12 and mlp["coda_fwd_bwd_ms"] > 0
    assert mlp["coda_packed_fwd_bwd_ms"] > 0 and "packed vs compile" in table_of(tmp_path)
    # what ran each exported Program's steps at these sizes (the backend; what tuning pinned)
    assert set(mlp["kernels"]["llama_mlp_bwd_saved"]["ran"]) >= {"down_bwd", "gate_up_bwd"}
    # --runs 2: every time is the median of two interleaved comparisons, kept in the JSON, and
    # each ratio the table shows is formed within a run, with its min–max over the runs
    assert len(mlp["coda_packed_fwd_bwd_ms_runs"]) == 2
    assert mlp["coda_packed_fwd_bwd_ms"] == pytest.approx(
        sum(mlp["coda_packed_fwd_bwd_ms_runs"]) / 2
    )
    ratios = mlp["coda_packed_speedup_vs_compile_runs"]
    runs = zip(mlp["compile_fwd_bwd_ms_runs"], mlp["coda_packed_fwd_bwd_ms_runs"], strict=True)
    assert ratios == [compiled / packed for compiled, packed in runs]
    table = table_of(tmp_path)
    assert f"({min(ratios):.3f}–{max(ratios):.3f})" in table
    for r in result["kernels"]:
        assert len(r["coda_ms_runs"]) == len(r["gemm_ms_runs"]) == 2
        low, high = min(r["coda_over_gemm_runs"]), max(r["coda_over_gemm_runs"])
        assert f"({low:.3f}–{high:.3f}) |" in table
    assert "DRY RUN" in table and "| gemm_rope |" in table
    # --subtiles: each kernel again with its epilogue in 2 sub-tiles (checked, timed); 4 refused
    # with why (the interpreter's 32-column tile would leave 8-column sub-tiles)
    for r in result["kernels"]:
        two, four = r["subtiles"]
        assert two["correct"] and two["ms"] > 0
        assert {c["epilogue_subtiles"] for c in two["configs"].values()} == {2}
        assert "leaves 8 columns each" in four["skipped"]
    assert "| gemm_rope | 64 | 2 | yes |" in table


def test_mlp_widths_pick_rows_of_the_llama_mlp_section(capsys: pytest.CaptureFixture) -> None:
    script = _script()
    assert script.parse_args([]).mlp_sizes == script.MLP_SIZES
    (only,) = script.parse_args(["--mlp-widths", "4096"]).mlp_sizes
    assert only == {"M": 16384, "d": 4096, "f": 14336}
    with pytest.raises(SystemExit):
        script.parse_args(["--mlp-widths", "2048,1024"])
    assert "among 2048, 4096, got 2048,1024" in capsys.readouterr().err
