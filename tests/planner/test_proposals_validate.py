"""The planner never emits an invalid Program: for every built-in block and every block of every
eval suite (``evals/suites/*.toml``, with any block file a suite names), each Program the search
proposes — every decomposition, and each under every tuning config — passes the sandbox's
validate stage (no kernel runs), or the planner refuses with ``NoRules``, whose partial Program
validates against the block with the values it computes as outputs."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coda.blocks import Block, get_block, load_block_file
from coda.blocks.registry import builtin_blocks
from coda.evals.suites import SUITES_DIR, load_suite, select, suite_names
from coda.planner import NoRules, PlanSearch, Proposal
from coda.primitives.ir import Program
from coda.sandbox import SandboxOptions
from coda.sandbox.stages import validate

OPTIONS = SandboxOptions()


def _python_files(value: Any) -> Iterator[str]:
    """Every string ending in ``.py`` anywhere in a suite's TOML data."""
    if isinstance(value, str) and value.endswith(".py"):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _python_files(v)
    elif isinstance(value, list):
        for v in value:
            yield from _python_files(v)


def suite_blocks() -> dict[str, Block]:
    """The blocks every suite runs (block files it names loaded first, relative to its folder)."""
    blocks: dict[str, Block] = {}
    for name in suite_names():
        path = SUITES_DIR / f"{name}.toml"
        for file in _python_files(tomllib.loads(path.read_text())):
            load_block_file(str((SUITES_DIR / file).resolve()))
        for block in select(load_suite(name)).blocks:
            blocks[block] = get_block(block)
    return blocks


def all_blocks() -> dict[str, Block]:
    return {**{b.name: b for b in builtin_blocks()}, **suite_blocks()}


BLOCKS = all_blocks()


def _size_sets(block: Block) -> list[dict[str, int]]:
    """The shape sets ``evaluate`` validates at (its verify shapes and the float32 one)."""
    sets = list(OPTIONS.verify_shapes(block))
    extra = OPTIONS.float32_shape(block)
    return sets + [extra] if extra is not None and extra not in sets else sets


def _check(program: Program, block: Block, what: str) -> None:
    results: list = []
    validate(program, block, _size_sets(block), results, OPTIONS)
    (stage,) = results
    assert stage.status == "passed", f"{block.name}, {what}: {stage.message}"


def _proposals(search: PlanSearch) -> Iterator[Proposal]:
    for base in search.decompositions:
        yield base
        for config in search.configs:
            yield search._with_config(base, config)


def test_the_suites_are_covered() -> None:
    assert {"llama_mlp", "gemm_rope", "llama_attn_in_bwd_saved"} <= set(BLOCKS)
    assert Path(SUITES_DIR).is_dir() and len(suite_names()) >= 3


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_every_proposal_passes_validate(name: str) -> None:
    block = BLOCKS[name]
    try:
        search = PlanSearch(block)
    except NoRules as refusal:
        assert refusal.unlowered, refusal
        if refusal.partial is not None:
            _check(refusal.partial.program, refusal.partial.block, "the partial Program")
        return
    assert search.decompositions
    for proposal in _proposals(search):
        _check(proposal.program, block, proposal.label)
