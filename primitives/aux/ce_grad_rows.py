"""Aux ``ce_grad_rows``: the cross-entropy gradient of stored logits, one pass over each row.

An LM head that keeps its logits (the projection ``z``, rounded once to the activation dtype, as
Hugging Face's ``lm_head`` output is) needs no second GEMM for the gradient: this step reads each
row once and writes ``dz = (softmax(s) − onehot(t)) · dloss`` — ``s`` the logits the loss reads,
``z`` itself or ``cap · tanh(z / cap)`` through a softcap (Gemma 2's ``final_logit_softcapping``),
whose derivative ``1 − (s / cap)²`` then multiplies ``dz`` — and the row statistic
``c = Σ_j z_j · dz_j`` (÷ ``divide_by``) that the RMSNorm backward in the epilogue of ``dz W``
needs (docs/algebra.md §4: ``Σ_k x̂_k γ_k dh_k = Σ_j z_j dz_j / r``). The softmax uses the
log-sum-exp the forward's epilogue already reduced (``lse_combine``), so one read suffices. Each
element of ``dz`` is written after its logit is read, by the same program, so the runtime may
write ``dz`` over logits nothing reads afterwards (``storage_sharing``): one ``[M, V]`` buffer.
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
from ..sizes import SizeExpr, cdiv, row_tile
from ..sizes import evaluate as evaluate_size
from ..types import TensorInfo, torch_dtype
from .partials import _act_dtype


@backend.jit
def _ce_grad_rows_kernel(
    z_ptr,
    lse_ptr,
    index_ptr,
    scale_ptr,
    dz_ptr,
    zdz_ptr,
    rows,
    cols,
    stride_zm,
    stride_zn,
    stride_dm,
    stride_dn,
    cap,
    divide,
    HAS_CAP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program: BLOCK_ROWS rows, streamed BLOCK_COLS columns at a time; dz in fp32, rounded
    # once on the store, and Σ z·dz of the unrounded dz (as the GEMM epilogue it replaces).
    offs_r = tl.program_id(axis=0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < rows
    rows64 = offs_r.to(tl.int64)[:, None]
    lse = tl.load(lse_ptr + offs_r, mask=mask_r, other=0.0)
    scale = tl.load(scale_ptr + offs_r, mask=mask_r, other=0.0)
    target = tl.load(index_ptr + offs_r, mask=mask_r, other=-1)
    total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, cols, BLOCK_COLS):
        offs_c = start + tl.arange(0, BLOCK_COLS)
        mask = mask_r[:, None] & (offs_c < cols)[None, :]
        z = tl.load(z_ptr + rows64 * stride_zm + offs_c[None, :] * stride_zn, mask=mask, other=0.0)
        z = z.to(tl.float32)
        s = z
        if HAS_CAP:  # tanh(u) = 2·sigmoid(2u) − 1 (the interpreter has no tanh)
            s = cap * (2.0 * tl.sigmoid(2.0 * z / cap) - 1.0)
        onehot = tl.where(offs_c[None, :] == target[:, None], 1.0, 0.0)
        dz = (tl.exp(s - lse[:, None]) - onehot) * scale[:, None]
        if HAS_CAP:
            dz = dz * (1.0 - (s / cap) * (s / cap))
        dz = tl.where(mask, dz, 0.0)
        total += z * dz
        dz_ptrs = dz_ptr + rows64 * stride_dm + offs_c[None, :] * stride_dn
        tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
    tl.store(zdz_ptr + offs_r, tl.sum(total, axis=1) / divide, mask=mask_r)


def ce_grad_blocks(rows: int, cols: int) -> tuple[int, int]:
    """Rows and columns per program step: up to 4096 columns a step (a row of a large
    vocabulary streams through in long contiguous reads, one row per program: a chunk of 1024
    rows is 1024 programs), about 4096 elements a step."""
    return row_tile(rows, cols, max_cols=4096, elements=4096, max_rows=16)


class CrossEntropyGradRows(AuxStep):
    """``out = (exp(s − lse) − onehot(index)) · scale`` ``[M, V]``, the cross-entropy's gradient
    with respect to stored logits ``z`` (``logits``), with ``s = z`` or, given ``cap``, ``s = cap ·
    tanh(z / cap)`` and a factor ``1 − (s / cap)²``; ``lse``, ``scale`` (the per-row ``dloss``)
    float32, ``index`` int64 (out of ``[0, V)``: no onehot). ``zdz = Σ_j z_j · out_j ÷
    divide_by`` (float32, length M: RMSNorm's ``c`` with ``"d"``). ``dtype``: ``out``'s.
    """

    kind: Literal["ce_grad_rows"] = "ce_grad_rows"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    # each program loads a block of z and stores dz's block at the same indices after it: dz
    # may be written over the logits (runtime's decision: storage_sharing)
    shares_storage: ClassVar[dict[str, str]] = {"out": "logits"}
    logits: Name
    lse: Name
    index: Name
    scale: Name
    out: Name
    zdz: Name
    cap: float | None = Field(None, gt=0)
    divide_by: SizeExpr | None = None
    dtype: Literal["act", "float32"] = "act"

    def check(self, env: ProgramEnv) -> None:
        info = env.matrix(self.logits, role="logits")
        rows = info.shape[0]
        for role in ("lse", "scale"):
            name = getattr(self, role)
            v = env.vector(name, rows, role=role, what=f"one value per row of {self.logits!r}")
            if v.dtype != "float32":
                raise ProgramError(
                    f"ce_grad_rows {role} {name!r} is {v.describe()}; it must be float32 (the "
                    + ("log-sum-exp from lse_combine)" if role == "lse" else "per-row dloss)")
                )
        what = f"one class id per row of {self.logits!r}"
        index = env.vector(self.index, rows, role="index", what=what)
        if index.dtype != "int64":
            raise ProgramError(
                f"ce_grad_rows index {self.index!r} must be an int64 tensor of class ids, but it "
                f"is {index.dtype}"
            )
        if self.divide_by is not None and env.size(self.divide_by, what="divide_by") <= 0:
            raise ProgramError(f"divide_by {self.divide_by!r} must be positive")
        if self.zdz == self.out:
            raise ProgramError(f"ce_grad_rows out and zdz are both {self.out!r}: name each anew")
        env.define(self.out, TensorInfo(info.shape, self.dtype, env.where))
        env.define(self.zdz, TensorInfo((rows,), "float32", env.where))

    def _divide(self, env: RunEnv) -> float:
        return float(evaluate_size(self.divide_by, env.sizes)) if self.divide_by else 1.0

    def reference(self, env: RunEnv) -> None:
        z = env.tensors[self.logits].to(env.compute)
        lse = env.tensors[self.lse].to(env.compute)
        scale = env.tensors[self.scale].to(env.compute)
        index = env.tensors[self.index]
        s = z if self.cap is None else self.cap * torch.tanh(z / self.cap)
        valid = (index >= 0) & (index < z.shape[1])
        onehot = torch.zeros_like(z)
        onehot[valid.nonzero().flatten(), index[valid]] = 1.0
        dz = (torch.exp(s - lse[:, None]) - onehot) * scale[:, None]
        if self.cap is not None:
            dz = dz * (1 - (s / self.cap) ** 2)
        zdz = (z * dz).sum(dim=1) / self._divide(env)
        if env.compute == torch.float64:
            env.tensors[self.out], env.tensors[self.zdz] = dz, zdz
            return
        env.tensors[self.out] = dz.to(torch_dtype(self.dtype, _act_dtype(env)))
        env.tensors[self.zdz] = zdz.to(torch.float32)

    def launch(self, env: RunEnv) -> None:
        z, out, zdz = env.tensors[self.logits], env.tensors[self.out], env.tensors[self.zdz]
        rows, cols = z.shape
        if rows == 0:
            return
        block_rows, block_cols = ce_grad_blocks(rows, cols)
        launch_kernel(
            _ce_grad_rows_kernel,
            (cdiv(rows, block_rows),),
            z,
            env.tensors[self.lse],
            env.tensors[self.index],
            env.tensors[self.scale],
            out,
            zdz,
            rows,
            cols,
            z.stride(0),
            z.stride(1),
            out.stride(0),
            out.stride(1),
            self.cap if self.cap is not None else 1.0,
            self._divide(env),
            HAS_CAP=self.cap is not None,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
        )
