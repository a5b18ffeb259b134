"""Every epilogue primitive in bfloat16 on the GPU (compiled Triton, 128-wide tiles), at a ragged
shape spanning several tiles — the same cases and formulas as tests/primitives/test_ops.py, which
cannot check bf16 on the CPU (the interpreter's bf16 tl.dot is wrong)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.primitives.test_ops import CASES, EXTRA_CASES, HALF_SPACE_CASES, _run_case

DEVICE = os.environ.get("CODA_TEST_DEVICE", "cuda")
DTYPE = getattr(torch, os.environ.get("CODA_TEST_DTYPE", "bfloat16"))
# ragged in M (300), N (392, N/2 = 196) and K (200) against 128 × 128 × 64 tiles;
# CODA_TEST_DEVICE=cpu checks this file through the interpreter at a toy size.
GPU_SIZES = {"M": 37, "N": 50, "K": 29} if DEVICE == "cpu" else {"M": 300, "N": 392, "K": 200}


@pytest.mark.parametrize("name", sorted(CASES))
def test_primitive_bf16(name: str) -> None:
    _run_case(CASES[name], GPU_SIZES, DTYPE, device=DEVICE)


@pytest.mark.parametrize("name", sorted(EXTRA_CASES))
def test_partial_reduce_and_rope_variants_bf16(name: str) -> None:
    _run_case(EXTRA_CASES[name], GPU_SIZES, DTYPE, device=DEVICE)


@pytest.mark.parametrize("name", sorted(HALF_SPACE_CASES))
def test_half_width_space_bf16(name: str) -> None:
    _run_case(HALF_SPACE_CASES[name], GPU_SIZES, DTYPE, device=DEVICE)


def test_small_tiles_bf16() -> None:
    # many tiles per row: the partials and the select/onehot edges across tile boundaries
    config = {"block_m": 32, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}
    for name in ("select_column", "rope", "pairwise"):
        _run_case(CASES[name], GPU_SIZES, DTYPE, config=config, device=DEVICE)
    _run_case(
        EXTRA_CASES["partial_reduce[lse,row]"], GPU_SIZES, DTYPE, config=config, device=DEVICE
    )
