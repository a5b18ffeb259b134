"""bench/experiments/loss_chunks.py: a dry run on the CPU (toy Llama, one layer) compares the
patched step in ``chunk_rows``'s chunks and in chunks of 4 rows beside eager Hugging Face — the
same loss and gradient norm from each, the rows each ran with — and writes its table and JSON."""

from __future__ import annotations

import json

import pytest

from . import load_script

experiment = load_script("experiments/loss_chunks")


def test_a_dry_run_compares_one_chunk_with_chunks_of_rows(tmp_path) -> None:  # noqa: ANN001
    args = ["--dry-run", "--rows", "4", "--runs", "1", "--layers", "1", "--out", str(tmp_path)]
    assert experiment.main(args) == 0
    # (a dry run is 2 sequences of 9 tokens, whatever --batch says)
    result = json.loads((tmp_path / "loss_chunks-b2.json").read_text())
    variants = result["variants"]
    assert list(variants) == ["hf", "default", "rows4"]
    tokens = result["tokens"]  # a dry run's 2 × 9: one chunk by chunk_rows
    assert [v["chunk_rows"] for v in variants.values()] == [None, tokens, 4]
    for name in ("default", "rows4"):
        assert variants[name]["loss"] == pytest.approx(variants["hf"]["loss"], rel=1e-5)
        assert variants[name]["grad_norm"] == pytest.approx(variants["hf"]["grad_norm"], rel=1e-4)
        assert variants[name]["step_ms"]["median"] > 0
    table = (tmp_path / "loss_chunks-b2.md").read_text()
    assert "| rows4 | 4 |" in table and f"| default | {tokens} |" in table
    assert "rows4 / default within each comparison: " in table


def test_the_table_gives_each_comparisons_ratios() -> None:
    row = {"chunk_rows": None, "memory_gb": None, "loss": 1.0, "grad_norm": 2.0,
           "host_ms": 1.0, "host_ms_back_to_back": 1.0}  # fmt: skip
    runs = [
        {"hf": 20.0, "default": 19.0, "rows8": 21.0},
        {"hf": 30.0, "default": 31.0, "rows8": 29.0},
    ]
    rows = {
        name: {**row, "step_ms": {"median": m, "min": m, "max": m}}
        for name, m in (("hf", 25.0), ("default", 25.0), ("rows8", 25.0))
    }
    text = experiment.table(rows, runs)
    assert "| default | — | 25.00 (25.00–25.00) | 1.000× (1.010× (0.968–1.053)) |" in text
    assert "rows8 / default within each comparison: 1.020× (0.935–1.105)" in text


def test_rows_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        experiment.parse_args(["--rows", "0"])
