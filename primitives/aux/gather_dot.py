"""Aux ``gather_dot``: one entry of a product per row, ``scale[i] · a[i, :] · w[index[i], :]``.

The target logit of cross-entropy is one column per row of ``Z = r ⊙ (A Wᵀ)``. In the GEMM's
epilogue (``select_column``) every output tile compares each of its elements with the row's
target and reduces along the row — work on all ``M × V`` logits, measured at ~0.6 ms of a
2.2 ms LM-head GEMM on an H200 (bench/RESULTS.md). Recomputed from the operands it is ``M``
dot products of length ``K``: one pass over ``A`` plus ``M`` gathered rows of ``W`` (~70 MB for
8192 tokens at d = 2048, tens of microseconds).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import triton.language as tl

from .. import backend
from ..base import AuxStep, Name, RunEnv
from ..checking import ProgramEnv
from ..errors import ProgramError
from ..launch import launch_kernel
from ..sizes import cdiv, row_tile
from ..types import TensorInfo


@backend.jit
def _gather_dot_kernel(
    a_ptr,
    w_ptr,
    index_ptr,
    scale_ptr,
    out_ptr,
    rows,
    cols,
    width,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_index,
    stride_scale,
    HAS_SCALE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program: BLOCK_ROWS rows of A against the rows of W their indices pick, K in chunks.
    pid = tl.program_id(axis=0)
    offs_r = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < rows
    index = tl.load(index_ptr + offs_r * stride_index, mask=mask_r, other=-1)
    valid = mask_r & (index >= 0) & (index < width)
    picked = tl.where(valid, index, 0).to(tl.int64)
    a_rows = a_ptr + offs_r.to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + picked[:, None] * stride_wn
    total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, cols, BLOCK_COLS):
        offs_c = start + tl.arange(0, BLOCK_COLS)
        mask = valid[:, None] & (offs_c < cols)[None, :]
        a = tl.load(a_rows + offs_c[None, :] * stride_ak, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + offs_c[None, :] * stride_wk, mask=mask, other=0.0).to(tl.float32)
        total += a * w
    dot = tl.sum(total, axis=1)
    if HAS_SCALE:
        dot *= tl.load(scale_ptr + offs_r * stride_scale, mask=mask_r, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_r, tl.where(valid, dot, 0.0), mask=mask_r)


def _blocks(rows: int, cols: int) -> tuple[int, int]:
    """Rows and columns per chunk: up to 256 columns and 32 rows, about 4096 elements."""
    return row_tile(rows, cols, max_cols=256, elements=4096, max_rows=32)


class GatherDot(AuxStep):
    """One entry of ``a @ w.T`` per row: ``out[i] = scale[i] · Σ_k a[i, k] · w[index[i], k]``
    (fp32, length M) — each token's target logit without the other ``V − 1``. ``a`` ``[M, K]``,
    ``w`` ``[W, K]``: a gemm step's operands (``a``, ``w.T``); ``index``: int64, length M;
    ``scale`` (optional): e.g. the gemm's ``scale_rows`` ``rstd``. An index outside ``[0, W)``
    (-100) gives 0.0, as ``select_column``, which it replaces when the logits are ``[scale_rows
    of] acc``: ``lse_combine(minus=out)`` gives the loss. Summed in another order than the GEMM:
    equal to fp32 rounding.
    """

    kind: Literal["gather_dot"] = "gather_dot"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    a: Name
    w: Name
    index: Name
    scale: Name | None = None
    out: Name

    def check(self, env: ProgramEnv) -> None:
        a, w = env.tensor(self.a, role="a"), env.tensor(self.w, role="w")
        for role, info in (("a", a), ("w", w)):
            if info.partials is not None or len(info.shape) != 2:
                raise ProgramError(
                    f"gather_dot {role} {getattr(self, role)!r} must be a 2-D tensor, but it is "
                    f"{info.describe()}"
                )
        if a.shape[1] != w.shape[1]:
            raise ProgramError(
                f"gather_dot needs a [M, K] and w [W, K] with the same K, but a is "
                f"{a.describe()} and w is {w.describe()}",
                hint="w is the gemm's B operand given as w.T (an nn.Linear weight [out, in])",
            )
        rows = a.shape[0]
        index = env.vector(self.index, rows, role="index", what="one row index of w per row of a")
        if index.dtype != "int64":
            raise ProgramError(
                f"index {self.index!r} must be an int64 tensor of row indices, but it is "
                f"{index.dtype}"
            )
        if self.scale is not None:
            env.vector(self.scale, rows, role="scale", what="one factor per row of a")
        env.define(self.out, TensorInfo((rows,), "float32", env.where))

    def reference(self, env: RunEnv) -> None:
        a, w = env.tensors[self.a].to(env.compute), env.tensors[self.w].to(env.compute)
        index = env.tensors[self.index]
        valid = (index >= 0) & (index < w.shape[0])
        dot = (a * w[torch.where(valid, index, 0)]).sum(dim=1)
        if self.scale is not None:
            dot = dot * env.tensors[self.scale].to(env.compute)
        dot = torch.where(valid, dot, 0.0)
        env.tensors[self.out] = dot if env.compute == torch.float64 else dot.to(torch.float32)

    def launch(self, env: RunEnv) -> None:
        a, w = env.tensors[self.a], env.tensors[self.w]
        index, out = env.tensors[self.index], env.tensors[self.out]
        scale = env.tensors[self.scale] if self.scale is not None else out  # unread if None
        rows, cols = a.shape
        if rows == 0:
            return
        block_rows, block_cols = _blocks(rows, cols)
        launch_kernel(
            _gather_dot_kernel,
            (cdiv(rows, block_rows),),
            a,
            w,
            index,
            scale,
            out,
            rows,
            cols,
            w.shape[0],
            a.stride(0),
            a.stride(1),
            w.stride(0),
            w.stride(1),
            index.stride(0),
            scale.stride(0),
            HAS_SCALE=self.scale is not None,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
        )
