"""Aux ``rescale_rows``: multiply each row of a stored tensor by a per-row factor, one pass.

A norm whose statistic spans more columns than one output tile (OLMo 2's RMSNorm over the whole q
projection, ``[M, heads·D]``) cannot finish inside the GEMM's epilogue: each tile only sees a slice
of its row. When the norm is followed by something that commutes with a row scale but not with
the per-column weight γ — RoPE rotates within a row, so ``rope(r ⊙ q ⊙ γ) = r ⊙ rope(q ⊙ γ)`` —
the epilogue applies γ and the rotation and writes partial sums of squares, aux ``rstd`` finishes
``r``, and this step applies ``r`` last (docs/algebra.md §1: a row scale commutes with anything
linear per row).

Without a ``vector`` it copies ``src`` into a new tensor (rounded to ``dtype``): a block output that
equals a block input, e.g. the residual's gradient ``dx = dout`` of an attention output's backward,
must be written by a step (outputs are never the inputs themselves).
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
from ..sizes import cdiv
from ..types import TensorInfo, torch_dtype
from .partials import _act_dtype
from .rstd import row_blocks


@backend.jit
def _rescale_rows_kernel(
    src_ptr,
    r_ptr,
    out_ptr,
    rows,
    cols,
    stride_sm,
    stride_sn,
    stride_om,
    stride_on,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    HAS_VECTOR: tl.constexpr,
):
    # One program: BLOCK_ROWS rows × BLOCK_COLS columns, scaled in fp32 and rounded once (without
    # a vector: copied, rounded to out's dtype).
    offs_r = tl.program_id(axis=0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_c = tl.program_id(axis=1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    rows64 = offs_r.to(tl.int64)[:, None]
    x = tl.load(src_ptr + rows64 * stride_sm + offs_c[None, :] * stride_sn, mask=mask, other=0.0)
    y = x.to(tl.float32)
    if HAS_VECTOR:
        r = tl.load(r_ptr + offs_r, mask=offs_r < rows, other=0.0)
        y = y * r[:, None]
    out_ptrs = out_ptr + rows64 * stride_om + offs_c[None, :] * stride_on
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


class RescaleRows(AuxStep):
    """Scale each row of a 2-D tensor into a new one: ``out[i, j] = src[i, j] * vector[i]``.

    ``vector``: float32, one value per row (e.g. ``rstd``'s output; none: a copy); ``dtype``:
    ``act`` or ``float32``. For a row scale known only once every tile of the row is written, e.g.
    an RMSNorm over a whole RoPE'd projection (r commutes with the rotation).
    """

    kind: Literal["rescale_rows"] = "rescale_rows"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    src: Name
    vector: Name | None = None
    out: Name
    dtype: Literal["act", "float32"] = "act"

    def check(self, env: ProgramEnv) -> None:
        info = env.matrix(self.src, role="src")
        if self.vector is None:  # a copy
            env.define(self.out, TensorInfo(info.shape, self.dtype, env.where))
            return
        what = f"one value per row of {self.src!r}"
        r = env.vector(self.vector, info.shape[0], role="vector", what=what)
        if r.dtype != "float32":
            raise ProgramError(
                f"rescale_rows vector {self.vector!r} is {r.describe()}; it must be float32 "
                "(a statistic such as rstd's output)"
            )
        env.define(self.out, TensorInfo(info.shape, self.dtype, env.where))

    def reference(self, env: RunEnv) -> None:
        out = env.tensors[self.src].to(env.compute)
        if self.vector is not None:
            out = out * env.tensors[self.vector].to(env.compute)[:, None]
        exact = env.compute == torch.float64
        env.tensors[self.out] = out if exact else out.to(torch_dtype(self.dtype, _act_dtype(env)))

    def launch(self, env: RunEnv) -> None:
        src, out = env.tensors[self.src], env.tensors[self.out]
        rows, cols = src.shape
        if rows == 0 or cols == 0:
            return
        block_rows, block_cols = row_blocks(rows, min(cols, 256))
        launch_kernel(
            _rescale_rows_kernel,
            (cdiv(rows, block_rows), cdiv(cols, block_cols)),
            src,
            src if self.vector is None else env.tensors[self.vector],  # unread without a vector
            out,
            rows,
            cols,
            src.stride(0),
            src.stride(1),
            out.stride(0),
            out.stride(1),
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
            HAS_VECTOR=self.vector is not None,
        )
