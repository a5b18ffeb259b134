"""Aux ``norm_rows``: apply an RMSNorm whose statistic is known, to a whole tensor, optionally
adding a residual — the finishing pass of a *post*-norm.

A norm that reads a GEMM's output (Gemma's ``post_feedforward_layernorm``, OLMo 2's norms after
``o_proj`` and ``down_proj``) cannot run in that GEMM's epilogue: a row's statistic spans every
N-tile. The GEMM stores ``y`` and writes partial sums of squares, ``rstd`` finishes them into
``r``, and this step forms ``out = residual + r ⊙ y ⊙ (offset + γ)`` in one read of ``y`` (and of
the residual), rounding once (docs/algebra.md §1, post-norms).
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
def _norm_rows_kernel(
    src_ptr,
    rstd_ptr,
    weight_ptr,
    res_ptr,
    out_ptr,
    rows,
    cols,
    stride_sm,
    stride_sn,
    stride_r,
    stride_w,
    stride_rm,
    stride_rn,
    stride_om,
    stride_on,
    offset,
    rstd_out_ptr,
    inv_cols,
    eps,
    stat_eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_RSTD_OUT: tl.constexpr,
    COMPUTE_RSTD: tl.constexpr,
    STORE_RSTD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program: BLOCK_ROWS rows, all their columns in chunks of BLOCK_COLS; fp32 throughout,
    # one rounding at the store (and the stored values' squares summed for the next norm).
    # COMPUTE_RSTD (aux rms_rows): r from a first pass over the rows, summed as _rstd_kernel sums
    # them (the same chunk width: the same bits), written to rstd_ptr with STORE_RSTD; otherwise
    # r is read from rstd_ptr.
    pid = tl.program_id(axis=0)
    offs_r = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < rows
    r64 = offs_r.to(tl.int64)[:, None]
    if COMPUTE_RSTD:
        total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
        for start in range(0, cols, BLOCK_COLS):
            col = start + tl.arange(0, BLOCK_COLS)
            mask = mask_r[:, None] & (col < cols)[None, :]
            x_ptrs = src_ptr + r64 * stride_sm + col[None, :] * stride_sn
            x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
            total += x * x
        r = tl.rsqrt(tl.sum(total, axis=1) * inv_cols + stat_eps)
        if STORE_RSTD:
            tl.store(rstd_ptr + offs_r * stride_r, r, mask=mask_r)
    else:
        r = tl.load(rstd_ptr + offs_r * stride_r, mask=mask_r, other=0.0).to(tl.float32)
    squares = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, cols, BLOCK_COLS):
        col = start + tl.arange(0, BLOCK_COLS)
        mask_c = col < cols
        mask = mask_r[:, None] & mask_c[None, :]
        y = tl.load(src_ptr + r64 * stride_sm + col[None, :] * stride_sn, mask=mask, other=0.0)
        g = tl.load(weight_ptr + col * stride_w, mask=mask_c, other=0.0).to(tl.float32)
        out = y.to(tl.float32) * r[:, None] * (offset + g)[None, :]
        if HAS_RESIDUAL:
            res_ptrs = res_ptr + r64 * stride_rm + col[None, :] * stride_rn
            out += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        out_ptrs = out_ptr + r64 * stride_om + col[None, :] * stride_on
        rounded = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptrs, rounded, mask=mask)
        if HAS_RSTD_OUT:
            stored = tl.where(mask, rounded.to(tl.float32), 0.0)
            squares += stored * stored
    if HAS_RSTD_OUT:
        r_out = tl.rsqrt(tl.sum(squares, axis=1) * inv_cols + eps)
        tl.store(rstd_out_ptr + offs_r, r_out, mask=mask_r)


def _blocks(rows: int, cols: int) -> tuple[int, int]:
    """Rows and columns per chunk: up to 1024 columns, about 4096 elements per chunk."""
    return row_tile(rows, cols, max_cols=1024, elements=4096)


class NormRows(AuxStep):
    """``out = residual + src · rstd · (offset + weight)`` over a whole ``[M, d]`` tensor (fp32,
    rounded once; without ``residual``, the norm alone): a post-norm after the GEMM that stored
    ``src`` wrote ``partial_reduce(kind="sumsq")``, finished by aux ``rstd``. ``offset``: 1.0
    for Gemma's ``1 + γ``. ``rstd_out``: also the next norm's ``rsqrt(mean_j out² + rstd_eps)``
    (fp32).
    """

    kind: Literal["norm_rows"] = "norm_rows"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    src: Name
    rstd: Name
    weight: Name
    offset: float = Field(0.0, allow_inf_nan=False)
    residual: Name | None = None
    out: Name
    rstd_out: Name | None = None
    rstd_eps: float = Field(1e-6, gt=0, le=1)

    def check(self, env: ProgramEnv) -> None:
        info = env.matrix(self.src, role="src")
        rows, cols = info.shape
        env.vector(self.rstd, rows, role="rstd", what=f"one reciprocal per row of {self.src!r}")
        env.vector(self.weight, cols, role="weight", what=f"one scale per column of {self.src!r}")
        if self.residual is not None:
            res = env.matrix(self.residual, role="residual")
            if res.shape != info.shape:
                raise ProgramError(
                    f"norm_rows residual {self.residual!r} is {res.describe()}, but it must have "
                    f"the shape of src {self.src!r}, {info.describe()}",
                    hint="residual is the tensor the normalised src is added to (the residual "
                    "stream of the sub-layer)",
                )
        env.define(self.out, TensorInfo(info.shape, info.dtype, env.where))
        if self.rstd_out is not None:
            if self.rstd_out == self.out:
                raise ProgramError(
                    f"norm_rows writes out and rstd_out to the same name {self.out!r}",
                    hint="give the normalised tensor and its row reciprocals different names",
                )
            env.define(self.rstd_out, TensorInfo((rows,), "float32", env.where))

    def reference(self, env: RunEnv) -> None:
        src = env.tensors[self.src]
        y = src.to(env.compute)
        r = env.tensors[self.rstd].to(env.compute)
        scale = self.offset + env.tensors[self.weight].to(env.compute)
        out = y * r[:, None] * scale[None, :]
        if self.residual is not None:
            out = out + env.tensors[self.residual].to(env.compute)
        exact = env.compute == torch.float64
        env.tensors[self.out] = out if exact else out.to(src.dtype)
        if self.rstd_out is not None:
            stored = env.tensors[self.out].to(env.compute)
            r_out = torch.rsqrt(stored.pow(2).mean(dim=1) + self.rstd_eps)
            env.tensors[self.rstd_out] = r_out if exact else r_out.to(torch.float32)

    def launch(self, env: RunEnv) -> None:
        src, out = env.tensors[self.src], env.tensors[self.out]
        rstd, weight = env.tensors[self.rstd], env.tensors[self.weight]
        res = env.tensors[self.residual] if self.residual is not None else None
        rstd_out = env.tensors[self.rstd_out] if self.rstd_out is not None else None
        launch_rows(src, rstd, weight, out, self.offset, residual=res, rstd_out=rstd_out,
                    rstd_eps=self.rstd_eps)  # fmt: skip


def launch_rows(
    src: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    offset: float,
    *,
    residual: torch.Tensor | None = None,
    rstd_out: torch.Tensor | None = None,
    rstd_eps: float = 1e-6,
    stat_eps: float | None = None,
    store_rstd: bool = False,
) -> None:
    """``_norm_rows_kernel`` over ``src`` into ``out``: ``r`` read from ``rstd``, or with
    ``stat_eps`` computed from ``src`` (and written to ``rstd`` where ``store_rstd``; aux
    ``rms_rows``); plus ``residual`` and the next norm's ``rstd_out`` where given (a tensor not
    given is not read or written: another stands in its place)."""
    rows, cols = src.shape
    if rows == 0 or cols == 0:
        return
    res = src if residual is None else residual
    block_rows, block_cols = _blocks(rows, cols)
    launch_kernel(
        _norm_rows_kernel,
        (cdiv(rows, block_rows),),
        src, rstd, weight, res, out, rows, cols,
        src.stride(0), src.stride(1), rstd.stride(0), weight.stride(0),
        res.stride(0), res.stride(1), out.stride(0), out.stride(1),
        offset, rstd if rstd_out is None else rstd_out, 1.0 / cols, rstd_eps, stat_eps or 0.0,
        HAS_RESIDUAL=residual is not None,
        HAS_RSTD_OUT=rstd_out is not None,
        COMPUTE_RSTD=stat_eps is not None,
        STORE_RSTD=store_rstd,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
    )  # fmt: skip
