"""Writing a prepared weight's rows on the GPU: gathered from a source in a given order, scaled
column-wise by a norm weight γ, placed into a slice of the output — one pass, one launch.

What prep ``fold_norm_weight`` runs alone (``scale_columns``), and what a fused prep chain —
``rope_pairs`` → ``concat_rows`` → ``fold_norm_weight`` (``prep/fusion.py``) — runs once per part,
so each source weight is read once and the result written once. Each product is formed in fp32
and rounded once to the output's dtype (the fold's formula, bit for bit); a gather alone is an
exact copy.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .. import backend
from ..launch import launch_kernel
from ..sizes import cdiv


@backend.jit
def _assemble_rows_kernel(
    src_ptr,
    rows_ptr,
    g_ptr,
    out_ptr,
    n_rows,
    cols,
    stride_sm,
    stride_sn,
    stride_g,
    stride_om,
    stride_on,
    HAS_ROWS: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # One program: a BLOCK_ROWS × BLOCK_COLS tile of out[r, c] = src[rows[r], c] · g[c].
    offs_r = tl.program_id(axis=0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_c = tl.program_id(axis=1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask_r = offs_r < n_rows
    mask_c = offs_c < cols
    mask = mask_r[:, None] & mask_c[None, :]
    if HAS_ROWS:
        src_r = tl.load(rows_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)
    else:
        src_r = offs_r.to(tl.int64)
    w = tl.load(src_ptr + src_r[:, None] * stride_sm + offs_c[None, :] * stride_sn, mask=mask)
    if HAS_GAMMA:
        g = tl.load(g_ptr + offs_c * stride_g, mask=mask_c, other=0.0).to(tl.float32)
        w = (w.to(tl.float32) * g[None, :]).to(out_ptr.dtype.element_ty)
    out_r = offs_r.to(tl.int64)[:, None]
    tl.store(out_ptr + out_r * stride_om + offs_c[None, :] * stride_on, w, mask=mask)


def assemble_rows(
    out: torch.Tensor,
    src: torch.Tensor,
    rows: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
) -> None:
    """``out[r] = src[rows[r]] · diag(γ)`` for every row of ``out`` (a 2-D tensor or a row slice
    of one), by the Triton kernel on ``out``'s device (on the CPU only under the interpreter).

    ``rows=None`` takes ``src``'s rows in order; ``gamma=None`` copies without scaling.
    """
    n_rows, cols = out.shape
    if rows is not None and rows.shape != (n_rows,):
        raise ValueError(f"assemble_rows: {rows.shape[0]} row indices for {n_rows} output rows")
    if src.shape[1] != cols or (rows is None and src.shape[0] != n_rows):
        raise ValueError(f"assemble_rows: source {tuple(src.shape)} for output {tuple(out.shape)}")
    if out.numel() == 0:
        return
    block_rows, block_cols = 16, 256
    grid = (cdiv(n_rows, block_rows), cdiv(cols, block_cols))
    launch_kernel(
        _assemble_rows_kernel,
        grid,
        src,
        src if rows is None else rows,  # never read without HAS_ROWS
        src if gamma is None else gamma,  # never read without HAS_GAMMA
        out,
        n_rows,
        cols,
        src.stride(0),
        src.stride(1),
        0 if gamma is None else gamma.stride(0),
        out.stride(0),
        out.stride(1),
        HAS_ROWS=rows is not None,
        HAS_GAMMA=gamma is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
    )


def scale_columns(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``w · diag(γ)`` in ``w``'s dtype — each product formed in fp32 and rounded once — in one
    pass of ``assemble_rows``."""
    out = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    assemble_rows(out, w, gamma=gamma)
    return out
