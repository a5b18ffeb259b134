"""Aux ``rstd``: the RMSNorm reciprocal ``r_i = (mean_j x_ij² + eps)^(-1/2)`` per row.

Two sources (docs/algebra.md §1): partial sums of squares written by the epilogue of the GEMM that
produced ``x`` (then this step only sums ``⌈d/BN⌉`` numbers per row), or, when no GEMM in the
program produced ``x`` (e.g. the block's own input), ``x`` itself — one memory-bound pass over it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import triton.language as tl
from pydantic import Field

from .. import backend
from ..base import AuxStep, Name, RunEnv
from ..checking import ProgramEnv
from ..errors import ProgramError
from ..launch import launch_kernel
from ..sizes import cdiv, row_tile
from ..types import TensorInfo


@backend.jit
def _rstd_kernel(
    x_ptr,
    out_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    inv_n,
    eps,
    SQUARE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program finishes BLOCK_ROWS rows: sum (squares of) `cols` values per row, then rsqrt.
    pid = tl.program_id(axis=0)
    offs_r = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < rows
    row_ptrs = x_ptr + offs_r.to(tl.int64)[:, None] * stride_row
    total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, cols, BLOCK_COLS):
        offs_c = start + tl.arange(0, BLOCK_COLS)
        mask = mask_r[:, None] & (offs_c < cols)[None, :]
        x = tl.load(row_ptrs + offs_c[None, :] * stride_col, mask=mask, other=0.0).to(tl.float32)
        if SQUARE:
            total += x * x
        else:
            total += x
    r = tl.rsqrt(tl.sum(total, axis=1) * inv_n + eps)
    tl.store(out_ptr + offs_r, r, mask=mask_r)


def row_blocks(rows: int, cols: int) -> tuple[int, int]:
    """Rows and columns per chunk of a per-row statistic kernel (``rstd``, ``mean_rstd``): up to
    1024 columns, about 2048 elements per chunk."""
    return row_tile(rows, cols, max_cols=1024, elements=2048)


class Rstd(AuxStep):
    """RMSNorm reciprocal per row: ``out[i] = rsqrt(mean_j x[i, j]² + eps)`` (fp32, length rows).

    ``src``: ``partial_reduce(kind="sumsq", axis="row")`` partials of the GEMM that produced x
    (⌈d/BLOCK_N⌉ numbers per row), or a 2-D ``[rows, d]`` tensor (one pass). ``out`` feeds
    ``scale_rows`` in the GEMM that consumes the normalised tensor.
    """

    kind: Literal["rstd"] = "rstd"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    src: Name
    eps: float = Field(1e-6, gt=0, le=1)
    out: Name

    def check(self, env: ProgramEnv) -> None:
        info = env.tensor(self.src, role="src")
        p = info.partials
        if p is not None and (p.kind != "sumsq" or p.axis != "row"):
            raise ProgramError(
                f"rstd needs partial sums of squares along rows, but {self.src!r} holds "
                f"partials({p.kind}, axis={p.axis})",
                hint="produce it with partial_reduce(kind='sumsq', axis='row')",
            )
        if p is None and len(info.shape) != 2:
            raise ProgramError(
                f"rstd src {self.src!r} must be a 2-D tensor or partials, but it is "
                f"{info.describe()}"
            )
        env.define(self.out, TensorInfo((info.shape[0],), "float32", env.where))

    def reference(self, env: RunEnv) -> None:
        x = env.tensors[self.src].to(env.compute)
        partials = env.infos[self.src].partials
        # Partials are already squared: sum the per-tile values; a tensor is squared here.
        mean_sq = x.sum(dim=1) / partials.length if partials else (x * x).mean(dim=1)
        env.tensors[self.out] = torch.rsqrt(mean_sq + self.eps)

    def launch(self, env: RunEnv) -> None:
        x, out = env.tensors[self.src], env.tensors[self.out]
        rows, cols = x.shape
        partials = env.infos[self.src].partials
        square = partials is None
        n = cols if square else partials.length
        block_rows, block_cols = row_blocks(rows, cols)
        launch_kernel(
            _rstd_kernel,
            (cdiv(rows, block_rows),),
            x,
            out,
            rows,
            cols,
            x.stride(0),
            x.stride(1),
            1.0 / n,
            self.eps,
            SQUARE=square,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
        )
