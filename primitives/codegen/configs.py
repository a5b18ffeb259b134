"""Mainloop configurations: what ``config="auto"`` resolves to, and the candidate space.

Both executors resolve configs through ``resolve_config`` so that partial-reduction buffers
(``[M, ⌈N/BLOCK_N⌉]``) have the same width in the reference executor and in the kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from .. import backend
from ..ir import MainloopConfig
from .kernel import SUBTILE_COUNTS

if TYPE_CHECKING:
    from ..analysis import GemmInfo

# Under the CPU interpreter each program is numpy work per tile: small tiles keep ragged test shapes
# spanning several tiles (so edge masks are exercised) while staying fast.
INTERPRETER_DEFAULT = MainloopConfig(
    block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1
)

# A sound Hopper default for bf16/fp16 (128×128 output tile, 64-deep K steps, 3-stage pipeline).
GPU_DEFAULT = MainloopConfig(
    block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3
)


def resolve_config(config: Literal["auto"] | MainloopConfig, gemm: GemmInfo) -> MainloopConfig:
    """The concrete config a step runs with at its analysed sizes ``gemm`` (``M, N, K``) when
    nothing tuned it; ``"auto"`` is this backend's default (the interpreter's small tiles, or
    the GPU's), its epilogue sub-tiles widened to a multiple of ``gemm.column_multiple`` (a power
    of two: an epilogue reducing over whole heads needs every head inside one sub-tile)."""
    if config != "auto":
        return config
    default = INTERPRETER_DEFAULT if backend.INTERPRET else GPU_DEFAULT
    return fit_columns(default, gemm.column_multiple)


def fit_columns(config: MainloopConfig, multiple: int) -> MainloopConfig:
    """``config`` with one epilogue sub-tile of ``block_n ≥ multiple`` columns when its sub-tiles
    are not a multiple of ``multiple`` wide (unchanged otherwise). A wider tile gets fewer rows,
    keeping the tile's area (its registers, and the shared memory an epilogue that regroups the
    tile by heads takes) at most the original's: 128×128 widened for 256-wide heads is 64×256
    (128×256 with the pipeline's stages needs 262 KB of shared memory on an H200, over its 227)."""
    if config.epilogue_block_n % multiple == 0:
        return config
    block_n = max(config.block_n, multiple)
    block_m = max(16, min(config.block_m, config.block_m * config.block_n // block_n))
    return config.model_copy(
        update={"block_m": block_m, "block_n": block_n, "epilogue_subtiles": 1}
    )


def with_subtiles(config: MainloopConfig, subtiles: int, multiple: int = 1) -> MainloopConfig:
    """``config`` with its epilogue run on ``subtiles`` column slices of the same tile (every
    other field kept): how a benchmark times one tuned kernel at each slicing side by side.

    Raises ``ValueError`` naming the config when the slicing cannot run it: ``subtiles`` not one
    of ``SUBTILE_COUNTS`` (1, 2, 4, 8), slices narrower than 16 columns, or slices not a multiple
    of ``multiple`` columns (the step's ``column_multiple``: an epilogue that reduces over whole
    heads needs every head inside one slice)."""
    if subtiles not in SUBTILE_COUNTS:
        raise ValueError(f"epilogue sub-tiles must be one of {SUBTILE_COUNTS}, got {subtiles}")
    width = config.block_n // subtiles
    tile = f"{config.block_m}×{config.block_n}"
    if width < 16:
        raise ValueError(
            f"a {tile} tile in {subtiles} epilogue sub-tiles leaves {width} columns each, "
            "fewer than 16: use fewer sub-tiles or a wider block_n"
        )
    if width % multiple:
        raise ValueError(
            f"a {tile} tile in {subtiles} epilogue sub-tiles leaves {width} columns each, but "
            f"this epilogue needs a multiple of {multiple} (whole heads in each sub-tile): use "
            "fewer sub-tiles"
        )
    return config.model_copy(update={"epilogue_subtiles": subtiles})
