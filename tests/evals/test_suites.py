"""Suites: every shipped suite parses and names registered blocks; planned blocks run once they
exist; a wrong name is an error naming the file and the close match."""

from __future__ import annotations

from pathlib import Path

import pytest

import coda.evals.suites as suites
from coda.blocks import list_blocks
from coda.evals.suites import SuiteError, load_suite, resolve_blocks, select, suite_names


def test_every_shipped_suite_loads_and_its_blocks_are_registered() -> None:
    assert {"smoke", "llama", "paper-kernels", "families"} <= set(suite_names())
    for name in suite_names():
        suite = load_suite(name)
        suites.load_suite_blocks(suite)  # the blocks its own block files define
        registered = {b.name for b in list_blocks()}
        assert set(suite.blocks) <= registered, f"{suite.path}: move unregistered names to planned"
        assert not set(suite.blocks) & set(suite.planned)
    assert load_suite("smoke").blocks == ["llama_mlp"]


def test_planned_blocks_are_skipped_until_registered(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "future.toml").write_text(
        'blocks = ["llama_mlp"]\nplanned = ["llama_moe", "gemm_swiglu"]\n'
    )
    (tmp_path / "later.toml").write_text('blocks = []\nplanned = ["llama_moe"]\n')
    future = select(load_suite("future", tmp_path))
    assert future.blocks == ["llama_mlp", "gemm_swiglu"] and future.skipped == ["llama_moe"]
    with pytest.raises(SuiteError, match="suite 'later' has no registered block yet"):
        select(load_suite("later", tmp_path))
    monkeypatch.setattr(suites, "_registered", lambda: {"llama_mlp", "llama_moe"})
    assert select(load_suite("later", tmp_path)).blocks == ["llama_moe"]


def test_shipped_suites_cover_the_paper_and_the_layer() -> None:
    assert len(select(load_suite("paper-kernels")).blocks) == 10
    assert "llama_lm_head_ce_bwd" in select(load_suite("llama")).blocks


def test_a_suite_imports_its_block_files(tmp_path: Path) -> None:
    (tmp_path / "blocks").mkdir()
    (tmp_path / "blocks" / "mine.py").write_text(
        "from coda.blocks import Add, Block, ShapeSets, TensorSpec, register\n"
        "suite_only = register(Block(name='suite_only_add', description='a + b', inputs={'a': "
        "TensorSpec(shape=['M']), 'b': TensorSpec(shape=['M'])}, graph=[Add(a='a', b='b', "
        "out='out')], outputs=['out'], shapes=ShapeSets(cpu=[{'M': 3}])))\n"
    )
    (tmp_path / "own.toml").write_text(
        'blocks = ["suite_only_add"]\nblock_files = ["blocks/mine.py"]\n'
    )
    suite = load_suite("own", tmp_path)
    assert suite.block_files == [(tmp_path / "blocks" / "mine.py").resolve()]
    assert select(suite).blocks == ["suite_only_add"]
    (tmp_path / "lost.toml").write_text('blocks = []\nblock_files = ["blocks/gone.py"]\n')
    with pytest.raises(SuiteError, match=r"lost.toml: block_files \[.*gone.py'\] do not exist"):
        load_suite("lost", tmp_path)


def test_wrong_names_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match="no suite named 'smok': did you mean 'smoke'"):
        load_suite("smok")
    (tmp_path / "typo.toml").write_text('blocks = ["llama_mpl"]\n')
    with pytest.raises(SuiteError, match=r"typo.toml: no block named 'llama_mpl': did you mean"):
        select(load_suite("typo", tmp_path))
    (tmp_path / "extra.toml").write_text('blocks = []\nmodels = ["x"]\n')
    with pytest.raises(SuiteError, match=r"unknown keys \['models'\]"):
        load_suite("extra", tmp_path)
    with pytest.raises(SuiteError, match="--blocks: no block named 'nope'"):
        resolve_blocks(None, ["nope"])
    with pytest.raises(SuiteError, match="exactly one of --suite NAME or --blocks"):
        resolve_blocks("smoke", ["llama_mlp"])
