"""Aux ``unpair_rows``: undo ``rope_pairs`` on a weight gradient, into one tensor or several;
aux ``split_rows``: the same gather with no row permuted (a fused gradient split by rows).

A program whose Q/K weights were permuted into adjacent-pair order (prep ``rope_pairs``) computes
the weight gradient ``dzᵀ y`` in that same order; this step puts the rows back into Hugging Face's
rotate-half order. It moves a weight-sized tensor once (a gather of whole rows: no arithmetic to
fuse), which is small next to the GEMMs that produce it. With ``parts`` it writes consecutive row
ranges of the result into tensors of their own (``dW_q``, ``dW_k``, ``dW_v`` of a fused QKV
gradient) in the same launch: each is a whole contiguous tensor, so a caller that must return
gradients aliasing nothing returns them as they are instead of copying row views of one tensor.
``split_rows`` does that for a fused gradient in Hugging Face's row order (Qwen's ``dW_qkv``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import triton.language as tl

from .. import backend
from ..base import AuxStep, Name, Node, RunEnv
from ..checking import ProgramEnv
from ..errors import ProgramError
from ..launch import launch_kernel
from ..prep.layout import pair_rows
from ..sizes import SizeExpr, cdiv, row_tile
from ..sizes import evaluate as evaluate_size
from ..types import TensorInfo

MAX_PARTS = 4  # output pointers the kernel takes


@backend.jit
def _store_part_rows(out_ptr, tile, r, c, mask, start, end, stride_m, stride_n):
    # The rows start ≤ r < end of a tile (rows r, columns c) into their part, from its row 0.
    keep = mask & ((r >= start) & (r < end))[:, None]
    tl.store(out_ptr + (r - start)[:, None] * stride_m + c * stride_n, tile, mask=keep)


@backend.jit
def _unpair_rows_kernel(
    src_ptr,
    out0_ptr,
    out1_ptr,
    out2_ptr,
    out3_ptr,
    total,
    cols,
    permuted,
    head_dim,
    end0,
    end1,
    end2,
    stride_sm,
    stride_sn,
    stride_0m,
    stride_0n,
    stride_1m,
    stride_1n,
    stride_2m,
    stride_2n,
    stride_3m,
    stride_3n,
    PARTS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program: a BLOCK_ROWS × BLOCK_COLS tile of the un-permuted result, gathered from src
    # once and stored into the part that holds each row (part k: rows end_{k-1} ≤ r < end_k, the
    # ends past the last part equal to total). A tile across a part boundary stores into both,
    # each row once.
    offs_r = tl.program_id(axis=0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_c = tl.program_id(axis=1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    r = offs_r.to(tl.int64)
    half = head_dim // 2
    j = r % head_dim  # rotate-half position e·D/2 + p within its head, from src row 2p + e
    src_r = tl.where(r < permuted, r - j + 2 * (j % half) + j // half, r)
    mask = (offs_r < total)[:, None] & (offs_c < cols)[None, :]
    c = offs_c[None, :]
    tile = tl.load(src_ptr + src_r[:, None] * stride_sm + c * stride_sn, mask=mask)
    _store_part_rows(out0_ptr, tile, r, c, mask, 0, end0, stride_0m, stride_0n)
    if PARTS > 1:
        _store_part_rows(out1_ptr, tile, r, c, mask, end0, end1, stride_1m, stride_1n)
    if PARTS > 2:
        _store_part_rows(out2_ptr, tile, r, c, mask, end1, end2, stride_2m, stride_2n)
    if PARTS > 3:
        _store_part_rows(out3_ptr, tile, r, c, mask, end2, total, stride_3m, stride_3n)


def _blocks(rows: int, cols: int) -> tuple[int, int]:
    """Tile of one program: up to 256 columns, about 8192 elements."""
    return row_tile(rows, cols, max_cols=256, elements=8192, min_cols=16)


class RowPart(Node):
    """The next ``rows`` rows, into ``out``."""

    out: Name
    rows: SizeExpr


def _part_rows(
    kind: str, src: str, info: TensorInfo, parts: list[RowPart], env: ProgramEnv
) -> list[int]:
    """Each part's row count, checked: 1 to ``MAX_PARTS`` parts of at least one row each, adding
    up to the rows of ``src`` (``info``)."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ProgramError(
            f"{kind} of {src!r} has {len(parts)} parts; it writes 1 to {MAX_PARTS}",
            hint="merge neighbouring parts, or split the result further with another step",
        )
    counts = []
    for part in parts:
        count = env.size(part.rows, what=f"{kind} part {part.out!r} rows")
        if count < 1:
            raise ProgramError(
                f"{kind} part {part.out!r} takes {count} rows ({part.rows!r}); each part takes at "
                "least one row"
            )
        counts.append(count)
    total = info.shape[0]
    if sum(counts) != total:
        listed = ", ".join(f"{p.out!r}: {n}" for p, n in zip(parts, counts, strict=True))
        raise ProgramError(
            f"{kind} parts take {sum(counts)} rows ({listed}), but src {src!r} "
            f"({info.describe()}) has {total}",
            hint=f"make the parts' rows add up to {total}, in src's row order",
        )
    return counts


def _define_parts(env: ProgramEnv, info: TensorInfo, names: list[str], counts: list[int]) -> None:
    for name, count in zip(names, counts, strict=True):
        env.define(name, TensorInfo((count, info.shape[1]), info.dtype, env.where))


def _split_reference(env: RunEnv, result: torch.Tensor, parts: list[RowPart]) -> None:
    """Write ``result``'s consecutive row ranges to the parts (reference executors)."""
    counts = [evaluate_size(p.rows, env.sizes) for p in parts]
    for part, rows in zip(parts, result.split(counts), strict=True):
        env.tensors[part.out] = rows


def _gather(src: torch.Tensor, outs: list[torch.Tensor], permuted: int, head_dim: int) -> None:
    """One launch: src's first ``permuted`` rows from pair back to rotate-half order per head of
    ``head_dim`` rows, the rest as they are, the result's rows written into ``outs`` in turn."""
    total, cols = src.shape
    if total == 0 or cols == 0:
        return
    ends = [total] * (MAX_PARTS - 1)  # each part's end row; the last part's, and past it: total
    end = 0
    for i, t in enumerate(outs[:-1]):
        end += t.shape[0]
        ends[i] = end
    pointers = outs + [outs[0]] * (MAX_PARTS - len(outs))  # unread past PARTS
    strides = [s for t in pointers for s in (t.stride(0), t.stride(1))]
    block_rows, block_cols = _blocks(total, cols)
    launch_kernel(
        _unpair_rows_kernel,
        (cdiv(total, block_rows), cdiv(cols, block_cols)),
        src,
        *pointers,
        total,
        cols,
        permuted,
        head_dim,
        *ends,
        src.stride(0),
        src.stride(1),
        *strides,
        PARTS=len(outs),
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
    )


class UnpairRows(AuxStep):
    """Inverse of prep ``rope_pairs`` on the leading ``rows`` rows (default: all; the rest are
    copied): per head of ``head_dim`` rows, row ``e·D/2 + p`` from row ``2p + e`` of ``src``.

    Into ``out``, or split by rows into ``parts`` (1 to 4, rows summing to src's), e.g. a fused
    QKV weight gradient with ``rows="Nq + Nkv"`` into ``[{"out": "dw_q", "rows": "Nq"}, …]``.
    """

    kind: Literal["unpair_rows"] = "unpair_rows"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    src: Name
    head_dim: SizeExpr
    out: Name | None = None
    rows: SizeExpr | None = None
    parts: list[RowPart] | None = None

    def check(self, env: ProgramEnv) -> None:
        info = env.matrix(self.src, role="src")
        head_dim = env.size(self.head_dim, what="unpair_rows head_dim")
        rows = env.size(self.rows, what="unpair_rows rows") if self.rows else info.shape[0]
        if head_dim <= 0 or head_dim % 2 or rows % head_dim or not 0 <= rows <= info.shape[0]:
            raise ProgramError(
                f"unpair_rows: {rows} leading rows of {self.src!r} ({info.describe()}) are not a "
                f"whole number of heads of even width head_dim = {head_dim}"
            )
        if (self.out is None) == (self.parts is None):
            given = "both" if self.out is not None else "neither"
            raise ProgramError(
                f"unpair_rows of {self.src!r} sets {given} of out and parts; set exactly one",
                hint="out: one tensor of src's shape; parts: a list of {out, rows} splitting "
                "src's rows into tensors of their own",
            )
        if self.parts is None:
            counts = [info.shape[0]]
        else:
            counts = _part_rows("unpair_rows", self.src, info, self.parts, env)
        _define_parts(env, info, self._names(), counts)

    def _permuted(self, env: RunEnv, total: int) -> int:
        return evaluate_size(self.rows, env.sizes) if self.rows else total

    def _names(self) -> list[str]:
        return [self.out] if self.out is not None else [p.out for p in self.parts or []]

    def reference(self, env: RunEnv) -> None:
        src = env.tensors[self.src]
        total = src.shape[0]
        head_dim = evaluate_size(self.head_dim, env.sizes)
        unpaired = pair_rows(src, head_dim, self._permuted(env, total), inverse=True)
        if self.parts is None:
            env.tensors[self._names()[0]] = unpaired
        else:
            _split_reference(env, unpaired, self.parts)

    def launch(self, env: RunEnv) -> None:
        src = env.tensors[self.src]
        outs = [env.tensors[n] for n in self._names()]
        permuted = self._permuted(env, src.shape[0])
        _gather(src, outs, permuted, evaluate_size(self.head_dim, env.sizes))


class SplitRows(AuxStep):
    """Row ranges of a 2-D tensor into tensors of their own (``parts`` as ``unpair_rows``'s)."""

    kind: Literal["split_rows"] = "split_rows"
    replayable: ClassVar[bool] = True  # only launch_kernel calls (AuxStep.replayable)
    src: Name
    parts: list[RowPart]

    def check(self, env: ProgramEnv) -> None:
        info = env.matrix(self.src, role="src")
        counts = _part_rows("split_rows", self.src, info, self.parts, env)
        _define_parts(env, info, [p.out for p in self.parts], counts)

    def reference(self, env: RunEnv) -> None:
        _split_reference(env, env.tensors[self.src], self.parts)

    def launch(self, env: RunEnv) -> None:
        outs = [env.tensors[p.out] for p in self.parts]
        _gather(env.tensors[self.src], outs, 0, 2)  # no row permuted: head_dim is unread
