"""Aux ``mean_rstd``: LayerNorm's row statistics, ``μ_i = mean_j x_ij`` and ``r_i = (mean_j (x_ij −
μ_i)² + eps)^(-1/2)``, from one read of each row tile.

A LayerNorm feeding a GEMM runs in that GEMM's epilogue (``LN(x)·Wᵀ = r ⊙ (x W'ᵀ − μ ⊗ s) + c``
with γ folded into ``W'``, ``s`` its row sums and ``c = W β``): this step gives ``μ`` and ``r``.
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
from ..sizes import cdiv
from ..types import TensorInfo
from .rstd import row_blocks


@backend.jit
def _mean_rstd_kernel(
    x_ptr,
    mean_ptr,
    rstd_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    inv_n,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program finishes BLOCK_ROWS rows: the mean, then the mean square of x − mean (the
    # two-pass variance: no cancellation between E[x²] and μ²).
    pid = tl.program_id(axis=0)
    offs_r = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < rows
    row_ptrs = x_ptr + offs_r.to(tl.int64)[:, None] * stride_row
    total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, cols, BLOCK_COLS):
        offs_c = start + tl.arange(0, BLOCK_COLS)
        mask = mask_r[:, None] & (offs_c < cols)[None, :]
        total += tl.load(row_ptrs + offs_c[None, :] * stride_col, mask=mask, other=0.0).to(
            tl.float32
        )
    mean = tl.sum(total, axis=1) * inv_n
    squares = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, cols, BLOCK_COLS):
        offs_c = start + tl.arange(0, BLOCK_COLS)
        mask = mask_r[:, None] & (offs_c < cols)[None, :]
        x = tl.load(row_ptrs + offs_c[None, :] * stride_col, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean[:, None], 0.0)
        squares += d * d
    r = tl.rsqrt(tl.sum(squares, axis=1) * inv_n + eps)
    tl.store(mean_ptr + offs_r, mean, mask=mask_r)
    tl.store(rstd_ptr + offs_r, r, mask=mask_r)


class MeanRstd(AuxStep):
    """LayerNorm's statistics per row of a 2-D tensor ``src`` ``[rows, d]``: ``mean[i] = mean_j
    src[i, j]`` and ``out[i] = rsqrt(mean_j (src[i, j] − mean[i])² + eps)`` (both fp32, length
    rows).

    In the epilogue of the GEMM that consumes the normalised tensor: ``load_row_vector`` of
    ``mean`` for the rank-one correction ``acc − mean ⊗ s``, then ``scale_rows`` by ``out``.
    """

    kind: Literal["mean_rstd"] = "mean_rstd"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    src: Name
    eps: float = Field(1e-5, gt=0, le=1)
    mean: Name
    out: Name

    def check(self, env: ProgramEnv) -> None:
        info = env.tensor(self.src, role="src")
        if info.partials is not None or len(info.shape) != 2:
            raise ProgramError(
                f"mean_rstd src {self.src!r} must be a 2-D tensor [rows, d], but it is "
                f"{info.describe()}",
                hint="pass the stored tensor the LayerNorm normalises (not partial sums)",
            )
        if self.mean == self.out:
            raise ProgramError(
                f"mean_rstd writes mean and out to the same name {self.out!r}",
                hint="give the row means and the reciprocals different names",
            )
        for name in (self.mean, self.out):
            env.define(name, TensorInfo((info.shape[0],), "float32", env.where))

    def reference(self, env: RunEnv) -> None:
        x = env.tensors[self.src].to(env.compute)
        mean = x.mean(dim=1)
        env.tensors[self.mean] = mean
        env.tensors[self.out] = torch.rsqrt(((x - mean[:, None]) ** 2).mean(dim=1) + self.eps)

    def launch(self, env: RunEnv) -> None:
        x = env.tensors[self.src]
        rows, cols = x.shape
        block_rows, block_cols = row_blocks(rows, cols)
        launch_kernel(
            _mean_rstd_kernel,
            (cdiv(rows, block_rows),),
            x,
            env.tensors[self.mean],
            env.tensors[self.out],
            rows,
            cols,
            x.stride(0),
            x.stride(1),
            1.0 / max(cols, 1),
            self.eps,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
        )
