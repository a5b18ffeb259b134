"""Aux ``rope_rows``: RoPE's rotation of adjacent column pairs on a whole tensor, outside a GEMM.

The epilogue op ``rope`` rotates a GEMM's output tile. The backward of a fused QKV projection with
RoPE needs the inverse rotation of the incoming gradient ``dqkv`` (the A operand of ``dh = dz W``)
and the RMSNorm statistic ``c = Σ z·dz / d``. When the forward's output ``qkv`` is saved, neither
needs the projection again: a rotation preserves dot products pair by pair, so
``Σ z·dz = Σ qkv·dqkv``, and ``dz = R⁻¹ dqkv`` is a pass over ``dqkv`` — instead of recomputing
the ``M × (Nq + 2·Nkv) × d`` GEMM only to host that epilogue.
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
from ..ops.rope import check_rope_tables, rotate_pairs
from ..sizes import SizeExpr, cdiv, row_tile
from ..sizes import evaluate as evaluate_size
from ..types import TensorInfo


@backend.jit
def _rope_rows_kernel(
    src_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    dot_ptr,
    dot_out_ptr,
    rows,
    width,
    rotary_pairs,
    half,
    stride_sm,
    stride_sn,
    stride_cm,
    stride_cn,
    stride_tm,
    stride_tn,
    stride_om,
    stride_on,
    stride_dm,
    stride_dn,
    scale,
    INVERSE: tl.constexpr,
    HAS_DOT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program: BLOCK_ROWS rows, all their columns in chunks of BLOCK_COLS. Each chunk is read
    # and written whole (row-contiguous, vectorizable) and split into its (even, odd) columns in
    # registers: loading the two columns of a pair as two stride-2 gathers is several times slower.
    pid = tl.program_id(axis=0)
    offs_r = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < rows
    r64 = offs_r.to(tl.int64)[:, None]
    total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, width, BLOCK_COLS):
        col = start + tl.arange(0, BLOCK_COLS)
        mask = mask_r[:, None] & (col < width)[None, :]
        z = tl.load(src_ptr + r64 * stride_sm + col[None, :] * stride_sn, mask=mask, other=0.0)
        z = z.to(tl.float32)
        x, y = tl.split(tl.reshape(z, (BLOCK_ROWS, BLOCK_COLS // 2, 2)))
        # Pair k uses frequency k mod D/2; pairs from rotary_pairs on pass through (cos 1, sin 0).
        k = start // 2 + tl.arange(0, BLOCK_COLS // 2)
        freq = (k % half)[None, :]
        rotated = mask_r[:, None] & (k < rotary_pairs)[None, :]
        c = tl.load(cos_ptr + r64 * stride_cm + freq * stride_cn, mask=rotated, other=1.0)
        s = tl.load(sin_ptr + r64 * stride_tm + freq * stride_tn, mask=rotated, other=0.0)
        c, s = c.to(tl.float32), s.to(tl.float32)
        if INVERSE:
            s = -s
        out = tl.reshape(tl.join(x * c - y * s, y * c + x * s), (BLOCK_ROWS, BLOCK_COLS))
        out_ptrs = out_ptr + r64 * stride_om + col[None, :] * stride_on
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
        if HAS_DOT:
            d_ptrs = dot_ptr + r64 * stride_dm + col[None, :] * stride_dn
            total += z * tl.load(d_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DOT:
        tl.store(dot_out_ptr + offs_r, tl.sum(total, axis=1) * scale, mask=mask_r)


def _blocks(rows: int, width: int) -> tuple[int, int]:
    """Rows and columns per chunk: up to 512 columns, about 4096 elements per chunk."""
    return row_tile(rows, width, max_cols=512, elements=4096, min_cols=2)


class RopeRows(AuxStep):
    """Rotate adjacent column pairs of a whole ``[M, W]`` tensor by per-token angles (RoPE), as
    epilogue op ``rope`` does a tile — e.g. ``dqkv`` in a QKV projection's backward
    (``inverse=True``). Pair k = columns ``(2k, 2k+1)``, ``c = cos[i, k mod D/2]``, ``s``
    likewise (``[M, D]`` tables, Hugging Face's); ``out[:, 2k] = x·c − y·s``, ``out[:, 2k+1] = y·c
    + x·s``; ``inverse`` negates ``s``. ``rotary_cols`` (size expression, a multiple of D): the
    leading columns rotated, the rest copied. ``out``: src's shape and dtype. ``dot`` (src's
    shape): also ``dot_out[i] = Σ_j src[i, j] · dot[i, j]`` (fp32) ÷ ``divide_by`` if given — the
    RMSNorm backward's ``c`` with ``dot`` the saved output (rotations keep dot products).
    """

    kind: Literal["rope_rows"] = "rope_rows"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    src: Name
    cos: Name
    sin: Name
    out: Name
    inverse: bool = False
    rotary_cols: SizeExpr | None = None
    dot: Name | None = None
    dot_out: Name | None = None
    divide_by: SizeExpr | None = None

    def check(self, env: ProgramEnv) -> None:
        info = env.matrix(self.src, role="src")
        rows, width = info.shape
        if width % 2:
            raise ProgramError(
                f"rope_rows rotates column pairs, but {self.src!r} ({info.describe()}) has an odd "
                "number of columns"
            )
        head_dim = self._check_tables(env, rows)
        rotated = width
        if self.rotary_cols is not None:
            rotated = env.size(self.rotary_cols, what="rope_rows rotary_cols")
        if not 0 <= rotated <= width or rotated % head_dim:
            raise ProgramError(
                f"rope_rows rotates {rotated} of {self.src!r}'s {width} columns, which is not a "
                f"whole number of heads of width {head_dim} (the width of {self.cos!r})",
                hint="set rotary_cols to the Q and K columns only (e.g. 'Nq + Nkv')",
            )
        env.define(self.out, TensorInfo(info.shape, info.dtype, env.where))
        self._check_dot(env, info)

    def _check_tables(self, env: ProgramEnv, rows: int) -> int:
        def table(name: str) -> TensorInfo:
            return env.matrix(name, role="table")

        doc = f"one per row of {self.src!r}"
        return check_rope_tables(table, self.cos, self.sin, rows, "rope_rows", doc)

    def _check_dot(self, env: ProgramEnv, src: TensorInfo) -> None:
        if self.dot is None:
            if self.dot_out is not None or self.divide_by is not None:
                raise ProgramError(
                    "rope_rows dot_out and divide_by need dot (the tensor to multiply src with)"
                )
            return
        info = env.matrix(self.dot, role="dot")
        if info.shape != src.shape:
            raise ProgramError(
                f"rope_rows dot {self.dot!r} is {info.describe()}, but it must have the shape of "
                f"src {self.src!r}, {src.describe()}"
            )
        if self.dot_out is None:
            raise ProgramError("rope_rows with dot needs dot_out (the name of the row sums)")
        if self.divide_by is not None and env.size(self.divide_by, what="divide_by") <= 0:
            raise ProgramError(f"divide_by {self.divide_by!r} must be positive")
        env.define(self.dot_out, TensorInfo((src.shape[0],), "float32", env.where))

    def _rotated_cols(self, env: RunEnv, width: int) -> int:
        return evaluate_size(self.rotary_cols, env.sizes) if self.rotary_cols else width

    def _scale(self, env: RunEnv) -> float:
        return 1.0 / evaluate_size(self.divide_by, env.sizes) if self.divide_by else 1.0

    def reference(self, env: RunEnv) -> None:
        src = env.tensors[self.src]
        z = src.to(env.compute)
        cos, sin = (env.tensors[n].to(env.compute) for n in (self.cos, self.sin))
        rotated = self._rotated_cols(env, z.shape[1])
        out = rotate_pairs(z, cos, sin, rotated, inverse=self.inverse)
        exact = env.compute == torch.float64
        env.tensors[self.out] = out if exact else out.to(src.dtype)
        if self.dot is not None:
            dot = (z * env.tensors[self.dot].to(env.compute)).sum(dim=1) * self._scale(env)
            env.tensors[self.dot_out] = dot if exact else dot.to(torch.float32)

    def launch(self, env: RunEnv) -> None:
        src, out = env.tensors[self.src], env.tensors[self.out]
        cos, sin = env.tensors[self.cos], env.tensors[self.sin]
        rows, width = src.shape
        if rows == 0:
            return
        dot = env.tensors[self.dot] if self.dot is not None else src  # unread without dot
        dot_out = env.tensors[self.dot_out] if self.dot_out is not None else out
        block_rows, block_cols = _blocks(rows, width)
        launch_kernel(
            _rope_rows_kernel,
            (cdiv(rows, block_rows),),
            src,
            cos,
            sin,
            out,
            dot,
            dot_out,
            rows,
            width,
            self._rotated_cols(env, width) // 2,
            cos.shape[1] // 2,
            src.stride(0),
            src.stride(1),
            cos.stride(0),
            cos.stride(1),
            sin.stride(0),
            sin.stride(1),
            out.stride(0),
            out.stride(1),
            dot.stride(0),
            dot.stride(1),
            self._scale(env),
            INVERSE=self.inverse,
            HAS_DOT=self.dot is not None,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
        )
