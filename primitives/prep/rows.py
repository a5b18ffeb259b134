"""Writing a prepared weight's rows on the GPU: the rows of up to ``MAX_PARTS`` sources, each in
order or in RoPE-pair order, stacked, scaled column-wise by a norm weight γ — one pass, one launch.

What a fused prep chain — ``rope_pairs`` → ``concat_rows`` → ``fold_norm_weight``
(``prep/fusion.py``) — writes a stack with (``stack_rows``: the attention input's Q, K and V
parts in one launch, forward and backward), and what prep ``fold_norm_weight`` runs alone
(``scale_columns``: one part). Each source weight is read once and the result written once. Each
product is formed in fp32 and rounded once to the output's dtype (the fold's formula, bit for
bit); a gather alone is an exact copy.

The launch's programs along the grid's first axis are the parts' row tiles, part after part: the
kernel derives each part's first program and first output row from the row counts before it, so
a tile never straddles two parts and parts of any row counts share one launch. A stack of more
than ``MAX_PARTS`` parts (``concat_rows`` of stacks) takes one launch per ``MAX_PARTS`` parts.
A part's pair order is computed from its head width in the kernel (``prep/layout.py``'s
``pair_rows`` is the same order in PyTorch), with no index tensor: one copied from host memory per
call would synchronize the stream, and one kept on the device between calls is allocated inside
the memory pool of the CUDA graphs ``torch.compile(mode="reduce-overhead")`` records when its
first call falls there — which cudagraph trees refuse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl

from .. import backend
from ..launch import launch_kernel
from ..sizes import cdiv

# Parts one launch writes: the attention input's Q, K and V (the most a shipped Program stacks)
# and one more. Each part is five kernel arguments; a part the launch does not have is None.
MAX_PARTS = 4
_BLOCK_ROWS, _BLOCK_COLS = 16, 256

# (source, pairs): its rows in order where pairs is 0, else in RoPE-pair order per head of pairs
# rows (new row h·D + 2p + e is row h·D + e·D/2 + p)
Part = tuple[torch.Tensor, int]


@backend.jit
def _part(
    tile,
    start,
    first_row,
    src_ptr,
    pairs,
    n_rows,
    stride_sm,
    stride_sn,
    g_ptr,
    stride_g,
    out_ptr,
    cols,
    stride_om,
    stride_on,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # The part whose row tiles are programs start, start + 1, …: program ``tile`` writes its
    # tile when it is one of them, out[first_row + r, c] = src[s(r), c] · g[c] with s(r) = r, or
    # with pairs = D > 0 the rotate-half row e·D/2 + p of r's head for its row 2p + e. Returns
    # the program after the part's last.
    end = start + (n_rows + BLOCK_ROWS - 1) // BLOCK_ROWS  # by hand: a count of 1 is a constexpr
    if (tile >= start) & (tile < end):
        offs_r = (tile - start) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        offs_c = tl.program_id(axis=1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        mask_r = offs_r < n_rows
        mask_c = offs_c < cols
        mask = mask_r[:, None] & mask_c[None, :]
        src_r = offs_r.to(tl.int64)
        if pairs > 0:
            j = src_r % pairs
            src_r = src_r - j + (j % 2) * (pairs // 2) + j // 2
        w = tl.load(src_ptr + src_r[:, None] * stride_sm + offs_c[None, :] * stride_sn, mask=mask)
        if g_ptr is not None:
            g = tl.load(g_ptr + offs_c * stride_g, mask=mask_c, other=0.0).to(tl.float32)
            w = (w.to(tl.float32) * g[None, :]).to(out_ptr.dtype.element_ty)
        out_r = (first_row + offs_r).to(tl.int64)[:, None]
        tl.store(out_ptr + out_r * stride_om + offs_c[None, :] * stride_on, w, mask=mask)
    return end


@backend.jit
def _assemble_rows_kernel(
    out_ptr,
    cols,
    stride_om,
    stride_on,
    g_ptr,
    stride_g,
    src0,
    pairs0,
    n0,
    stride_sm0,
    stride_sn0,
    src1,
    pairs1,
    n1,
    stride_sm1,
    stride_sn1,
    src2,
    pairs2,
    n2,
    stride_sm2,
    stride_sn2,
    src3,
    pairs3,
    n3,
    stride_sm3,
    stride_sn3,
    NUM_PARTS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # Axis 0: the parts' row tiles, part after part (each part's first program and first output
    # row are the sums over the parts before it); axis 1: column tiles. A part's pairs is 0 when
    # it takes its source's rows in order, g_ptr None without γ, and the arguments of parts from
    # NUM_PARTS on are None (never read).
    tile = tl.program_id(axis=0)
    end = _part(tile, 0, 0, src0, pairs0, n0, stride_sm0, stride_sn0,
                g_ptr, stride_g, out_ptr, cols, stride_om, stride_on,
                BLOCK_ROWS, BLOCK_COLS)  # fmt: skip
    if NUM_PARTS > 1:
        end = _part(tile, end, n0, src1, pairs1, n1, stride_sm1, stride_sn1,
                    g_ptr, stride_g, out_ptr, cols, stride_om, stride_on,
                    BLOCK_ROWS, BLOCK_COLS)  # fmt: skip
    if NUM_PARTS > 2:
        end = _part(tile, end, n0 + n1, src2, pairs2, n2, stride_sm2, stride_sn2,
                    g_ptr, stride_g, out_ptr, cols, stride_om, stride_on,
                    BLOCK_ROWS, BLOCK_COLS)  # fmt: skip
    if NUM_PARTS > 3:
        _part(tile, end, n0 + n1 + n2, src3, pairs3, n3, stride_sm3, stride_sn3,
              g_ptr, stride_g, out_ptr, cols, stride_om, stride_on,
              BLOCK_ROWS, BLOCK_COLS)  # fmt: skip


def stack_rows(parts: Sequence[Part], gamma: torch.Tensor | None = None) -> torch.Tensor:
    """``cat([pair_rows(src, pairs) if pairs else src for src, pairs in parts]) · diag(γ)`` — no
    scaling where ``gamma`` is None — written by the Triton kernel on the sources' device (on
    the CPU only under the interpreter) in one launch per ``MAX_PARTS`` parts.

    Every source is a 2-D tensor of one width, dtype and device (``concat_rows`` checks the first
    two; a stack of sources it would reject is refused here rather than converted)."""
    first = parts[0][0]
    counts = _row_counts(parts, gamma)
    out = torch.empty((sum(counts), first.shape[1]), dtype=first.dtype, device=first.device)
    if len(parts) <= MAX_PARTS:
        _launch(out, parts, counts, gamma)
        return out
    row = 0
    for i in range(0, len(parts), MAX_PARTS):
        group = counts[i : i + MAX_PARTS]
        _launch(out[row : row + sum(group)], parts[i : i + MAX_PARTS], group, gamma)
        row += sum(group)
    return out


def _row_counts(parts: Sequence[Part], gamma: torch.Tensor | None) -> list[int]:
    """Each part's number of rows, after checking that the parts can be stacked in place."""
    first = parts[0][0]
    dtype, device, cols = first.dtype, first.device, first.shape[-1]
    counts = []
    for i, (src, pairs) in enumerate(parts):
        if src.dim() != 2:
            raise ValueError(
                f"stack_rows: part {i} is a {tuple(src.shape)} tensor; stack 2-D weights "
                "[rows, columns]"
            )
        if src.shape[1] != cols or src.dtype != dtype or src.device != device:
            raise ValueError(
                f"stack_rows: part {i} is {tuple(src.shape)} {src.dtype} on {src.device}, but "
                f"part 0 is {tuple(first.shape)} {dtype} on {device}; stack weights of one width, "
                f"dtype and device (convert or move part {i} first)"
            )
        _check_pairs(f"stack_rows: part {i}", pairs, src.shape[0])
        counts.append(src.shape[0])
    if gamma is not None and (gamma.shape != (cols,) or gamma.device != device):
        raise ValueError(
            f"stack_rows: γ is a {tuple(gamma.shape)} tensor on {gamma.device}; give one value "
            f"per column ({cols}) on the sources' device ({device})"
        )
    return counts


def _launch(
    out: torch.Tensor, parts: Sequence[Part], counts: Sequence[int], gamma: torch.Tensor | None
) -> None:
    """One launch writing ``parts`` (at most ``MAX_PARTS``, ``counts`` rows each) into the rows
    of ``out`` in order."""
    cols = out.shape[1]
    tiles = sum(cdiv(n, _BLOCK_ROWS) for n in counts)
    if not tiles or not cols:
        return
    args: list = [out, cols, *out.stride(), gamma, 0 if gamma is None else gamma.stride(0)]
    for (src, pairs), n in zip(parts, counts, strict=True):
        args += (src, pairs, n, *src.stride())
    args += (None,) * (5 * (MAX_PARTS - len(parts)))
    launch_kernel(
        _assemble_rows_kernel,
        (tiles, cdiv(cols, _BLOCK_COLS)),
        *args,
        NUM_PARTS=len(parts),
        BLOCK_ROWS=_BLOCK_ROWS,
        BLOCK_COLS=_BLOCK_COLS,
    )


def assemble_rows(
    out: torch.Tensor, src: torch.Tensor, pairs: int = 0, gamma: torch.Tensor | None = None
) -> None:
    """``out = pair_rows(src, pairs) · diag(γ)`` for a 2-D ``out`` (or a row slice of one) of
    ``src``'s shape, by the Triton kernel on ``out``'s device (on the CPU only under the
    interpreter): a stack of one part written into a given tensor.

    ``pairs=0`` takes ``src``'s rows in order; ``gamma=None`` copies without scaling.
    """
    if src.shape != out.shape:
        raise ValueError(f"assemble_rows: source {tuple(src.shape)} for output {tuple(out.shape)}")
    _check_pairs("assemble_rows", pairs, src.shape[0])
    _launch(out, ((src, pairs),), (out.shape[0],), gamma)


def _check_pairs(what: str, pairs: int, rows: int) -> None:
    """``ValueError`` unless ``pairs`` is 0 or an even head width dividing ``rows``."""
    if pairs and (pairs < 0 or pairs % 2 or rows % pairs):
        raise ValueError(
            f"{what}'s pair order takes heads of {pairs} rows, but it has {rows} rows; give an "
            "even head width that divides its rows (or 0: rows in order)"
        )


def scale_columns(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``w · diag(γ)`` in ``w``'s dtype — each product formed in fp32 and rounded once — in one
    pass of ``assemble_rows``."""
    out = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    assemble_rows(out, w, gamma=gamma)
    return out
