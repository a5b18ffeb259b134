"""Aux steps that finish per-tile partials: ``sum_partials`` and ``lse_combine``.

A ``partial_reduce`` in an epilogue leaves one value per row (or column) per tile in a
``[rows, ⌈W/BLOCK⌉]`` buffer; these tiny kernels reduce each row of that buffer:

* ``sum_partials`` — ``out = Σ_b p[:, b]`` (optionally ÷ a size): the row statistic
  ``c = (1/d) Σ_k z·dz`` of RMSNorm's backward (docs/algebra.md §4), or ``dγ`` from partial column
  sums.
* ``lse_combine`` — ``out = log Σ_b exp(p[:, b])`` from the tiles' log-sum-exps (§5), optionally
  minus a per-row vector: ``loss_i = LSE_i − logits[i, t_i]``.
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
from ..sizes import SizeExpr, cdiv, row_tile
from ..sizes import evaluate as evaluate_size
from ..types import TensorInfo, torch_dtype


@backend.jit
def _combine_kernel(
    p_ptr,
    minus_ptr,
    out_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    scale,
    LSE: tl.constexpr,
    HAS_MINUS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program finishes BLOCK_ROWS rows of a partials buffer, BLOCK_COLS partials at a time.
    pid = tl.program_id(axis=0)
    offs_r = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < rows
    row_ptrs = p_ptr + offs_r.to(tl.int64)[:, None] * stride_row
    if LSE:
        # Online log-sum-exp: keep the running max m and s = Σ exp(p − m), rescaling s whenever
        # m grows; a row's first chunk starts from m = -inf, s = 0.
        m = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
        s = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        for start in range(0, cols, BLOCK_COLS):
            offs_c = start + tl.arange(0, BLOCK_COLS)
            mask = mask_r[:, None] & (offs_c < cols)[None, :]
            p = tl.load(row_ptrs + offs_c[None, :] * stride_col, mask=mask, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(p, axis=1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - shift))
            s = s * alpha + tl.sum(tl.exp(p - shift[:, None]), axis=1)
            m = m_new
        # s ≥ 1 on any row with a finite partial; rows past the edge (never stored) have s = 0.
        logs = tl.where(s > 0, tl.log(tl.maximum(s, 1e-30)), float("-inf"))
        result = tl.where(m == float("-inf"), 0.0, m) + logs
    else:
        total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
        for start in range(0, cols, BLOCK_COLS):
            offs_c = start + tl.arange(0, BLOCK_COLS)
            mask = mask_r[:, None] & (offs_c < cols)[None, :]
            total += tl.load(row_ptrs + offs_c[None, :] * stride_col, mask=mask, other=0.0)
        result = tl.sum(total, axis=1) * scale
    if HAS_MINUS:
        result -= tl.load(minus_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    # fp32 throughout; a 16-bit ``out`` rounds once here (to nearest even, as ``Tensor.to``)
    tl.store(out_ptr + offs_r, result.to(out_ptr.dtype.element_ty), mask=mask_r)


def _launch(
    p: torch.Tensor,
    out: torch.Tensor,
    *,
    lse: bool,
    scale: float = 1.0,
    minus: torch.Tensor | None = None,
) -> None:
    rows, cols = p.shape
    block_rows, block_cols = row_tile(rows, cols, max_cols=256, elements=4096)
    launch_kernel(
        _combine_kernel,
        (cdiv(rows, block_rows),),
        p,
        minus if minus is not None else p,
        out,
        rows,
        cols,
        p.stride(0),
        p.stride(1),
        scale,
        LSE=lse,
        HAS_MINUS=minus is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
    )


def sum_partials(p: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    """``out[i] = scale · Σ_b p[i, b]`` in fp32 (``p`` of any strides, ``out`` a contiguous
    vector of any float dtype, rounded once): what a kernel's per-program partial sums need."""
    _launch(p, out, lse=False, scale=scale)


def _partials(env: ProgramEnv, src: str, kinds: tuple[str, ...], step: str) -> TensorInfo:
    info = env.tensor(src, role="src")
    p = info.partials
    if p is None or p.kind not in kinds:
        what = f"partials({p.kind}, axis={p.axis})" if p else info.describe()
        raise ProgramError(
            f"{step} needs partials of kind {' or '.join(kinds)}, but {src!r} is {what}",
            hint=f"produce it with partial_reduce(kind={kinds[0]!r}) in an epilogue",
        )
    return info


class SumPartials(AuxStep):
    """Sum per-tile partials: ``out[i] = Σ_b src[i, b]`` ÷ ``divide_by`` if given. ``src``:
    ``sum``/``sumsq`` partials (``partial_reduce``): along rows a length-M vector, along columns
    (``axis="col"``) one value per column, e.g. ``dγ = Σ_rows dh ⊙ x̂``. ``divide_by``: a size
    expression, e.g. ``"d"`` for RMSNorm backward's ``c = (1/d) Σ_k z·dz`` (a mean over the
    norm's width, not the columns summed). ``dtype``: ``float32`` or ``act`` (e.g. for ``dγ``).
    """

    kind: Literal["sum_partials"] = "sum_partials"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    src: Name
    out: Name
    divide_by: SizeExpr | None = None
    dtype: Literal["float32", "act"] = "float32"

    def check(self, env: ProgramEnv) -> None:
        info = _partials(env, self.src, ("sum", "sumsq"), "sum_partials")
        if self.divide_by is not None and env.size(self.divide_by, what="divide_by") <= 0:
            raise ProgramError(f"divide_by {self.divide_by!r} must be positive")
        env.define(self.out, TensorInfo(info.shape, self.dtype, env.where))

    def _scale(self, env: RunEnv) -> float:
        return 1.0 / evaluate_size(self.divide_by, env.sizes) if self.divide_by else 1.0

    def reference(self, env: RunEnv) -> None:
        total = env.tensors[self.src].to(env.compute).sum(dim=1) * self._scale(env)
        exact = env.compute == torch.float64
        act = _act_dtype(env)
        env.tensors[self.out] = total if exact else total.to(torch_dtype(self.dtype, act))

    def launch(self, env: RunEnv) -> None:
        # a 16-bit ``out`` takes the fp32 sum rounded once, by the kernel's store
        _launch(env.tensors[self.src], env.tensors[self.out], lse=False, scale=self._scale(env))


class LseCombine(AuxStep):
    """Combine per-tile log-sum-exps: ``out[i] = log Σ_b exp(src[i, b])`` (fp32), minus
    ``minus[i]`` if given.

    ``src`` holds ``partial_reduce(kind="lse", axis="row")`` partials of logits, so ``out`` is
    each row's ``logsumexp``. With ``minus`` = the target logits from ``select_column``, ``out``
    is the per-token cross-entropy loss ``LSE_i − logits[i, t_i]``.
    """

    kind: Literal["lse_combine"] = "lse_combine"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    src: Name
    out: Name
    minus: Name | None = None

    def check(self, env: ProgramEnv) -> None:
        info = _partials(env, self.src, ("lse",), "lse_combine")
        if self.minus is not None:
            what = "one value per row of the partials"
            env.vector(self.minus, info.shape[0], role="minus", what=what)
        env.define(self.out, TensorInfo(info.shape, "float32", env.where))

    def reference(self, env: RunEnv) -> None:
        lse = torch.logsumexp(env.tensors[self.src].to(env.compute), dim=1)
        if self.minus is not None:
            lse = lse - env.tensors[self.minus].to(env.compute)
        exact = env.compute == torch.float64
        env.tensors[self.out] = lse if exact else lse.to(torch.float32)

    def launch(self, env: RunEnv) -> None:
        minus = env.tensors[self.minus] if self.minus is not None else None
        _launch(env.tensors[self.src], env.tensors[self.out], lse=True, minus=minus)


def _act_dtype(env: RunEnv) -> torch.dtype:
    """The run's activation dtype: that of any ``act`` input (float32 if there is none)."""
    for name, info in env.infos.items():
        if info.producer == "input" and info.dtype == "act":
            return env.tensors[name].dtype
    return torch.float32
