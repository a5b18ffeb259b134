"""Prep ``fold_norm_weight``: fold an RMSNorm's γ into the ``nn.Linear`` weight that follows it.

In training this runs in every forward and backward call (the weights change every step), over
weights as large as the LM head's: on the GPU it is one Triton pass that reads the weight once and
writes it once, vectorized along rows — PyTorch's broadcasting multiply (``w * γ[None, :]``) takes
a slower, unvectorized path for the broadcast operand.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from .. import backend  # noqa: F401  (selects the interpreter before the kernel is defined)
from ..base import Name, PrepStep, RunEnv
from ..checking import ProgramEnv
from ..sizes import cdiv
from ..types import TensorInfo


@triton.jit
def _scale_columns_kernel(
    w_ptr,
    g_ptr,
    out_ptr,
    rows,
    cols,
    stride_wm,
    stride_wn,
    stride_g,
    stride_om,
    stride_on,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program: a BLOCK_ROWS × BLOCK_COLS tile of out = w · diag(g), the product in fp32 and
    # rounded once to out's dtype.
    offs_r = tl.program_id(axis=0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_c = tl.program_id(axis=1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask_c = offs_c < cols
    mask = (offs_r < rows)[:, None] & mask_c[None, :]
    r64 = offs_r.to(tl.int64)[:, None]
    g = tl.load(g_ptr + offs_c * stride_g, mask=mask_c, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + r64 * stride_wm + offs_c[None, :] * stride_wn, mask=mask, other=0.0)
    out = (w.to(tl.float32) * g[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64 * stride_om + offs_c[None, :] * stride_on, out, mask=mask)


def scale_columns(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``w · diag(γ)`` in ``w``'s dtype — each product formed in fp32 and rounded once — by the
    Triton kernel (on ``w``'s device; on the CPU only under the interpreter)."""
    out = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    rows, cols = w.shape
    if out.numel() == 0:
        return out
    block_rows, block_cols = 16, 256
    grid = (cdiv(rows, block_rows), cdiv(cols, block_cols))
    _scale_columns_kernel[grid](
        w,
        gamma,
        out,
        rows,
        cols,
        w.stride(0),
        w.stride(1),
        gamma.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
    )
    return out


class FoldNormWeight(PrepStep):
    """Fold a norm weight γ into the following ``nn.Linear`` weight: ``out = weight · diag(γ)``.

    ``weight`` is ``[out, in]`` and ``gamma`` has length ``in``: ``out[o, i] = weight[o, i] *
    γ[i]``, computed in fp32 and rounded once to the weight's dtype. Then ``rmsnorm(x) @ weightᵀ ==
    diag(r) · (x @ outᵀ)``: the norm becomes ``rstd`` + ``scale_rows`` (CODA_MATH §1).
    """

    kind: Literal["fold_norm_weight"] = "fold_norm_weight"
    weight: Name
    gamma: Name
    out: Name

    def check(self, env: ProgramEnv) -> None:
        w = env.matrix(self.weight, role="weight")
        env.vector(self.gamma, w.shape[1], role="gamma", what="one value per input feature")
        env.define(self.out, TensorInfo(w.shape, w.dtype, env.where))

    def apply(self, env: RunEnv) -> None:
        w, gamma = env.tensors[self.weight], env.tensors[self.gamma]
        if env.compute == torch.float64:  # the exact reference executor
            env.tensors[self.out] = (w.double() * gamma.double()[None, :]).to(w.dtype)
        elif w.is_cuda:
            # the fp32 formula of the last branch, bit for bit, in one pass (every training step)
            env.tensors[self.out] = scale_columns(w, gamma)
        elif w.dtype in _HALF and gamma.dtype == w.dtype:
            # PyTorch multiplies 16-bit tensors in fp32 and rounds once, and the product of two
            # 16-bit floats is exact in fp32: the same bits as the fp32 formula, without fp32 copies
            env.tensors[self.out] = w * gamma[None, :]
        else:
            env.tensors[self.out] = (w.float() * gamma.float()[None, :]).to(w.dtype)


_HALF = (torch.bfloat16, torch.float16)
