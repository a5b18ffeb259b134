"""Aux steps of the backward of an attention input in Hugging Face's order
(``rmsnorm → Linear q/k/v [+ bias] → [per-head RMSNorm] → RoPE``, separate q, k, v outputs).

``rotary_input_grad`` turns the gradients of the block's outputs (``dq_rot``, ``dk_rot``,
``dv``) into the gradient ``dz`` of the projection ``z = h W_qkvᵀ`` (``[M, Nq + 2·Nkv]``, the
A operand of ``dh = dz W_qkv`` and of the weight gradient ``dzᵀ h``) in one pass over rows, and
the row statistic of the input RMSNorm's backward ``c = Σ z·dz / d`` (docs/algebra.md §4):

* RoPE's backward is its transpose, ``dq = dq_rot ⊙ cos − rotate_half(dq_rot ⊙ sin)`` per head,
  exact on any tables (the inverse rotation only on Hugging Face's, whose halves repeat);
* a per-head RMSNorm (Qwen3's ``q_norm``/``k_norm``, ``q̂ ⊙ w``; Gemma 3's ``q̂ ⊙ (1 + w)``,
  ``head_offset = 1``) needs its input, the projection: then ``z`` is the recomputed projection
  (without bias); its weight gradient ``Σ dqn ⊙ q̂`` over rows and heads (the same with or
  without the offset) comes out too. Where the forward rounds (before or after the weight) does
  not change the backward, computed in fp32 from ``z``. A norm over the part's whole row
  (OLMo 2's, ``whole_norm``) has the same backward with ``D`` the part's width: its kernel takes
  the row's ``Σ z²`` and ``Σ dn ⊙ w ⊙ z`` in a first pass over the part, then forms ``dz``;
* without per-head norms the saved outputs suffice (``saved``): a rotation's transpose keeps dot
  products, ``Σ dq·q = Σ dq_rot·q_rot``, and a bias only shifts z, so
  ``Σ z·dz = Σ out·dout − Σ b·dz`` — no projection GEMM is recomputed.

The biases' gradients are the column sums of each part of ``dz``.

One Triton kernel per part reads its gradient (and ``z`` or the saved output) once and writes its
columns of ``dz``: a program holds a block of rows and walks the part's heads, each loaded as its
two halves (the rotate-half partner of column ``j`` is ``j ± D/2``, in the same registers), so
RoPE's transpose, the per-head norm's statistic and the row dot for ``c`` need no second pass.
Column sums (bias and q/k-norm weight gradients) are written as per-program partials and summed
after the launches.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import triton.language as tl
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from .. import backend
from ..base import AuxStep, Name, RunEnv
from ..checking import ProgramEnv
from ..errors import ProgramError
from ..launch import launch_kernel
from ..ops.rope import check_rope_tables
from ..sizes import SizeExpr, cdiv, next_power_of_2
from ..sizes import evaluate as evaluate_size
from ..types import TensorInfo
from .partials import _act_dtype, sum_partials


@backend.jit
def _rotary_grad_kernel(
    g_ptr,
    z_ptr,
    saved_ptr,
    bias_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    dot_ptr,
    wsum_ptr,
    bsum_ptr,
    rows,
    cols,
    half,
    eps,
    offset,
    stride_gm,
    stride_gn,
    stride_zm,
    stride_zn,
    stride_sm,
    stride_sn,
    stride_cm,
    stride_cn,
    stride_tm,
    stride_tn,
    stride_om,
    stride_on,
    ROTATED: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_NORM: tl.constexpr,
    WHOLE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    FIRST: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program: BLOCK_ROWS rows of one part, its columns in pairs of half-heads (j, j + half):
    # a rotated part's heads are 2·half wide; an unrotated part is walked in the same chunks.
    pid = tl.program_id(axis=0)
    offs_r = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_r = offs_r < rows
    r64 = offs_r.to(tl.int64)[:, None]
    j = tl.arange(0, BLOCK_HALF)
    mask_j = j < half
    mask = mask_r[:, None] & mask_j[None, :]
    dot = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    wsum1 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    wsum2 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
    if ROTATED:
        c1 = tl.load(cos_ptr + r64 * stride_cm + j[None, :] * stride_cn, mask=mask, other=0.0)
        c2 = tl.load(
            cos_ptr + r64 * stride_cm + (j + half)[None, :] * stride_cn, mask=mask, other=0.0
        )
        s1 = tl.load(sin_ptr + r64 * stride_tm + j[None, :] * stride_tn, mask=mask, other=0.0)
        s2 = tl.load(
            sin_ptr + r64 * stride_tm + (j + half)[None, :] * stride_tn, mask=mask, other=0.0
        )
        c1, c2, s1, s2 = c1.to(tl.float32), c2.to(tl.float32), s1.to(tl.float32), s2.to(tl.float32)
    if HAS_NORM and not WHOLE:
        # the per-head norm's scale: w, or offset + w (Gemma 3's 1 + w)
        w1 = tl.load(w_ptr + j, mask=mask_j, other=0.0).to(tl.float32)[None, :] + offset
        w2 = tl.load(w_ptr + j + half, mask=mask_j, other=0.0).to(tl.float32)[None, :] + offset
    if HAS_NORM and WHOLE:  # a norm over the part's whole row: its two row sums first
        ss = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        cw = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        for start in range(0, cols, 2 * half):
            col1 = start + j
            col2 = col1 + half
            in1, in2 = mask_j & (col1 < cols), mask_j & (col2 < cols)
            m1, m2 = mask_r[:, None] & in1[None, :], mask_r[:, None] & in2[None, :]
            a = tl.load(g_ptr + r64 * stride_gm + col1[None, :] * stride_gn, mask=m1, other=0.0)
            b = tl.load(g_ptr + r64 * stride_gm + col2[None, :] * stride_gn, mask=m2, other=0.0)
            a, b = a.to(tl.float32), b.to(tl.float32)
            d1, d2 = a, b
            if ROTATED:
                d1 = a * c1 + b * s2
                d2 = b * c2 - a * s1
            z1 = tl.load(z_ptr + r64 * stride_zm + col1[None, :] * stride_zn, mask=m1, other=0.0)
            z2 = tl.load(z_ptr + r64 * stride_zm + col2[None, :] * stride_zn, mask=m2, other=0.0)
            zb1, zb2 = z1.to(tl.float32), z2.to(tl.float32)
            if HAS_BIAS:
                zb1 += tl.load(bias_ptr + col1, mask=in1, other=0.0).to(tl.float32)[None, :]
                zb2 += tl.load(bias_ptr + col2, mask=in2, other=0.0).to(tl.float32)[None, :]
            w1 = tl.load(w_ptr + col1, mask=in1, other=0.0).to(tl.float32)[None, :] + offset
            w2 = tl.load(w_ptr + col2, mask=in2, other=0.0).to(tl.float32)[None, :] + offset
            ss += tl.sum(zb1 * zb1, axis=1) + tl.sum(zb2 * zb2, axis=1)
            cw += tl.sum(d1 * w1 * zb1, axis=1) + tl.sum(d2 * w2 * zb2, axis=1)
        r_row = tl.rsqrt(ss / cols + eps)
        c_row = cw * r_row / cols  # Σ dn ⊙ w ⊙ ẑ / N
    for start in range(0, cols, 2 * half):
        col1 = start + j
        col2 = col1 + half
        in1, in2 = mask_j & (col1 < cols), mask_j & (col2 < cols)  # padding lanes: j ≥ half
        m1, m2 = mask_r[:, None] & in1[None, :], mask_r[:, None] & in2[None, :]
        a = tl.load(g_ptr + r64 * stride_gm + col1[None, :] * stride_gn, mask=m1, other=0.0)
        b = tl.load(g_ptr + r64 * stride_gm + col2[None, :] * stride_gn, mask=m2, other=0.0)
        a, b = a.to(tl.float32), b.to(tl.float32)
        d1, d2 = a, b
        if ROTATED:  # RoPE's transpose: g·cos − rotate_half(g·sin)
            d1 = a * c1 + b * s2
            d2 = b * c2 - a * s1
        if HAS_Z:
            z1 = tl.load(z_ptr + r64 * stride_zm + col1[None, :] * stride_zn, mask=m1, other=0.0)
            z2 = tl.load(z_ptr + r64 * stride_zm + col2[None, :] * stride_zn, mask=m2, other=0.0)
            z1, z2 = z1.to(tl.float32), z2.to(tl.float32)
        if HAS_BIAS:
            b1 = tl.load(bias_ptr + col1, mask=in1, other=0.0).to(tl.float32)[None, :]
            b2 = tl.load(bias_ptr + col2, mask=in2, other=0.0).to(tl.float32)[None, :]
        if HAS_NORM and WHOLE:  # the whole-row RMSNorm's backward, its row sums known
            zb1, zb2 = z1, z2
            if HAS_BIAS:
                zb1, zb2 = z1 + b1, z2 + b2
            w1 = tl.load(w_ptr + col1, mask=in1, other=0.0).to(tl.float32)[None, :] + offset
            w2 = tl.load(w_ptr + col2, mask=in2, other=0.0).to(tl.float32)[None, :] + offset
            r = r_row[:, None]
            h1, h2 = zb1 * r, zb2 * r
            wsum = wsum_ptr + pid.to(tl.int64) * cols
            tl.store(wsum + col1, tl.sum(tl.where(m1, d1 * h1, 0.0), axis=0), mask=in1)
            tl.store(wsum + col2, tl.sum(tl.where(m2, d2 * h2, 0.0), axis=0), mask=in2)
            d1 = r * (d1 * w1 - h1 * c_row[:, None])
            d2 = r * (d2 * w2 - h2 * c_row[:, None])
        if HAS_NORM and not WHOLE:  # per-head RMSNorm's backward on zb = z (+ b)
            zb1, zb2 = z1, z2
            if HAS_BIAS:
                zb1, zb2 = z1 + b1, z2 + b2
            ms = (tl.sum(zb1 * zb1, axis=1) + tl.sum(zb2 * zb2, axis=1)) / (2 * half)
            r = tl.rsqrt(ms + eps)[:, None]
            h1, h2 = zb1 * r, zb2 * r
            wsum1 += tl.sum(tl.where(m1, d1 * h1, 0.0), axis=0)
            wsum2 += tl.sum(tl.where(m2, d2 * h2, 0.0), axis=0)
            n1, n2 = d1 * w1, d2 * w2
            ch = ((tl.sum(n1 * h1, axis=1) + tl.sum(n2 * h2, axis=1)) / (2 * half))[:, None]
            d1 = r * (n1 - h1 * ch)
            d2 = r * (n2 - h2 * ch)
        d1 = tl.where(m1, d1, 0.0)
        d2 = tl.where(m2, d2, 0.0)
        if HAS_Z:
            dot += tl.sum(z1 * d1, axis=1) + tl.sum(z2 * d2, axis=1)
        else:  # Σ z·dz = Σ out·dout − Σ b·dz from the saved output
            o1 = tl.load(
                saved_ptr + r64 * stride_sm + col1[None, :] * stride_sn, mask=m1, other=0.0
            )
            o2 = tl.load(
                saved_ptr + r64 * stride_sm + col2[None, :] * stride_sn, mask=m2, other=0.0
            )
            dot += tl.sum(o1.to(tl.float32) * a, axis=1) + tl.sum(o2.to(tl.float32) * b, axis=1)
            if HAS_BIAS:
                dot -= tl.sum(b1 * d1, axis=1) + tl.sum(b2 * d2, axis=1)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + r64 * stride_om + col1[None, :] * stride_on, d1.to(out_ty), mask=m1)
        tl.store(out_ptr + r64 * stride_om + col2[None, :] * stride_on, d2.to(out_ty), mask=m2)
        if BIAS_GRAD:
            bsum = bsum_ptr + pid.to(tl.int64) * cols
            tl.store(bsum + col1, tl.sum(d1, axis=0), mask=in1)
            tl.store(bsum + col2, tl.sum(d2, axis=0), mask=in2)
    if HAS_NORM and not WHOLE:
        wsum = wsum_ptr + pid.to(tl.int64) * 2 * half
        tl.store(wsum + j, wsum1, mask=mask_j)
        tl.store(wsum + j + half, wsum2, mask=mask_j)
    if not FIRST:
        dot += tl.load(dot_ptr + offs_r, mask=mask_r, other=0.0)
    tl.store(dot_ptr + offs_r, dot, mask=mask_r)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``rotate_half`` over the last dimension: ``[x1, x2] -> [-x2, x1]``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_transpose(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient through ``rope`` (``out = x·cos + rotate_half(x)·sin`` per head of width D):
    ``g·cos − rotate_half(g·sin)``, for ``g`` ``[M, heads·D]`` and tables ``[M, D]``."""
    rows, head = g.shape[0], cos.shape[-1]
    heads = g.reshape(rows, -1, head)
    out = heads * cos[:, None, :] - rotate_half(heads * sin[:, None, :])
    return out.reshape(rows, -1)


def head_norm_backward(
    dn: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of ``n = ẑ ⊙ w'`` per head (``ẑ = z · rsqrt(mean_head(z²) + eps)``, ``w' =
    offset + w``): ``(dz, dw)`` with ``dz = r (dn ⊙ w' − ẑ c)``, ``c = Σ_head dn ⊙ w' ⊙ ẑ / D``,
    ``dw = Σ_rows,heads dn ⊙ ẑ`` (the offset is a constant: it leaves ``dw`` as it is)."""
    rows, head = z.shape[0], weight.shape[0]
    zh, dh = z.reshape(rows, -1, head), dn.reshape(rows, -1, head)
    r = torch.rsqrt(zh.pow(2).mean(-1, keepdim=True) + eps)
    hat = zh * r
    dnw = dh * (offset + weight)
    c = (dnw * hat).mean(-1, keepdim=True)
    dz = r * (dnw - hat * c)
    return dz.reshape(rows, -1), (dh * hat).sum(dim=(0, 1))


class RotaryInputGrad(AuxStep):
    """``out = dz`` ``[M, Σ N_p]``: an attention input's projection gradient (HF's order) from its
    parts' ``grads`` (the first ``rotated`` through RoPE by ``cos``/``sin`` ``[M, D]``), from ``z``
    (the projection without bias) or ``saved`` (the forward's outputs; needs ``bias``).
    ``dot_out = Σ_j z·dz / divide_by`` (fp32, the input RMSNorm's ``c``; neither without one).
    ``head_norm``, ``eps`` (needs ``z``): per rotated part its q/k RMSNorm weight, ``[D]`` or
    ``[N_p]`` (``whole_norm``), scale ``head_offset + w``; ``norm_grads``, ``bias_grads``: those
    weights' and the biases' gradients (act dtype).
    """

    kind: Literal["rotary_input_grad"] = "rotary_input_grad"
    grads: list[Name]
    rotated: int
    cos: Name
    sin: Name
    out: Name
    dot_out: Name | None = None
    divide_by: SizeExpr | None = None
    z: Name | None = None
    saved: list[Name] | None = None
    bias: list[Name] | None = None
    head_norm: list[Name] | None = None
    eps: float | None = None
    head_offset: float = Field(0.0, allow_inf_nan=False)
    whole_norm: bool = False
    norm_grads: list[Name] | None = None
    bias_grads: list[Name] | None = None

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Per-head norms without an offset (Qwen3's) serialize as before ``head_offset`` and
        ``whole_norm`` existed (their canonical JSON, hence the Program's hash, does not change)."""
        data = handler(self)
        if self.dot_out is None:
            data.pop("dot_out", None)
            data.pop("divide_by", None)
        if not self.head_offset:
            data.pop("head_offset", None)
        if not self.whole_norm:
            data.pop("whole_norm", None)
        return data

    @model_validator(mode="after")
    def _fields_agree(self) -> RotaryInputGrad:
        if (self.z is None) == (self.saved is None):
            raise ValueError(
                "rotary_input_grad needs exactly one of z (the recomputed projection) and saved "
                "(the forward's outputs)"
            )
        if (self.dot_out is None) != (self.divide_by is None):
            raise ValueError(
                "rotary_input_grad's dot_out (the input norm's c) and divide_by (its width) go "
                "together: give both, or neither when there is no input norm"
            )
        if not 0 <= self.rotated <= len(self.grads):
            raise ValueError(f"rotated = {self.rotated} must be between 0 and len(grads)")
        lists = {"saved": self.saved, "bias": self.bias, "bias_grads": self.bias_grads}
        for field, names in lists.items():
            if names is not None and len(names) != len(self.grads):
                raise ValueError(f"{field} must name one tensor per gradient in grads")
        if self.head_norm is not None:
            if self.z is None:
                raise ValueError(
                    "per-head norms (head_norm) need their input: give z, the recomputed "
                    "projection, instead of saved"
                )
            if self.eps is None:
                raise ValueError("head_norm needs eps, the per-head norms' epsilon")
            if len(self.head_norm) != self.rotated:
                raise ValueError("head_norm must name one weight per rotated part")
            if self.norm_grads is not None and len(self.norm_grads) != self.rotated:
                raise ValueError("norm_grads must name one output per head_norm weight")
        elif self.norm_grads is not None:
            raise ValueError("norm_grads are the gradients of head_norm weights: give head_norm")
        elif self.head_offset or self.whole_norm:
            raise ValueError(
                "head_offset and whole_norm describe the norms of head_norm, but there are none: "
                "give head_norm (their weights) or leave them out"
            )
        return self

    # -- checking ----------------------------------------------------------------------------------
    def check(self, env: ProgramEnv) -> None:
        infos = [env.matrix(g, role="grads") for g in self.grads]
        rows = infos[0].shape[0]
        for name, info in zip(self.grads, infos, strict=True):
            if info.shape[0] != rows:
                raise ProgramError(
                    f"rotary_input_grad grads {name!r} is {info.describe()}; every gradient "
                    f"must have the {rows} rows of {self.grads[0]!r}"
                )
        head = check_rope_tables(
            lambda n: env.matrix(n, role="table"), self.cos, self.sin, rows,
            "rotary_input_grad", f"one per row of {self.grads[0]!r}",
        )  # fmt: skip
        for name, info in zip(self.grads[: self.rotated], infos, strict=False):
            if info.shape[1] % head:
                raise ProgramError(
                    f"rotary_input_grad: rotated gradient {name!r} ({info.describe()}) is no "
                    f"whole number of heads of width {head} (the width of {self.cos!r})"
                )
        widths = [info.shape[1] for info in infos]
        self._check_operands(env, rows, widths, head)
        env.define(self.out, TensorInfo((rows, sum(widths)), "act", env.where))
        if self.dot_out is not None and self.divide_by is not None:
            env.define(self.dot_out, TensorInfo((rows,), "float32", env.where))
            if env.size(self.divide_by, what="rotary_input_grad divide_by") <= 0:
                raise ProgramError(f"divide_by {self.divide_by!r} must be positive")
        norm_widths = widths if self.whole_norm else [head] * self.rotated
        for name, width in zip(self.norm_grads or [], norm_widths, strict=False):
            env.define(name, TensorInfo((width,), "act", env.where))
        for name, width in zip(self.bias_grads or [], widths, strict=False):
            env.define(name, TensorInfo((width,), "act", env.where))

    def _check_operands(self, env: ProgramEnv, rows: int, widths: list[int], head: int) -> None:
        if self.z is not None:
            info = env.matrix(self.z, role="z")
            if info.shape != (rows, sum(widths)):
                raise ProgramError(
                    f"rotary_input_grad z {self.z!r} is {info.describe()}; it must be the "
                    f"projection [{rows}, {sum(widths)}] (the parts side by side)"
                )
        for name, grad, width in zip(self.saved or [], self.grads, widths, strict=False):
            info = env.matrix(name, role="saved")
            if info.shape != (rows, width):
                raise ProgramError(
                    f"rotary_input_grad saved {name!r} is {info.describe()}; it must have the "
                    f"shape of its gradient {grad!r}, [{rows}, {width}]"
                )
        for name, width in zip(self.bias or [], widths, strict=False):
            env.vector(name, width, role="bias", what="one per column of its part")
        for name, width in zip(self.head_norm or [], widths, strict=False):
            if self.whole_norm:
                env.vector(name, width, role="head_norm", what="one per column of its part")
            else:
                env.vector(name, head, role="head_norm", what="one per column of a head")

    # -- running -----------------------------------------------------------------------------------
    def _compute(self, env: RunEnv, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every output, in ``dtype``."""

        def get(name: str) -> torch.Tensor:
            return env.tensors[name].to(dtype)

        grads = [get(g) for g in self.grads]
        cos, sin = get(self.cos), get(self.sin)
        widths = [g.shape[1] for g in grads]
        z = get(self.z).split(widths, dim=1) if self.z is not None else None
        bias = [get(b) for b in self.bias] if self.bias else None
        parts, norm_grads = [], []
        for p, grad in enumerate(grads):
            d = rope_transpose(grad, cos, sin) if p < self.rotated else grad
            if self.head_norm is not None and p < self.rotated:
                zb = z[p] + bias[p] if bias else z[p]  # type: ignore[index]
                weight = get(self.head_norm[p])
                d, dw = head_norm_backward(d, zb, weight, self.eps, self.head_offset)  # type: ignore[arg-type]
                norm_grads.append(dw)
            parts.append(d)
        dz = torch.cat(parts, dim=1)
        out = {self.out: dz}
        out.update(zip(self.norm_grads or [], norm_grads, strict=False))
        out.update(zip(self.bias_grads or [], (d.sum(dim=0) for d in parts), strict=False))
        if self.dot_out is None or self.divide_by is None:
            return out
        if z is not None:
            dot = (torch.cat(z, dim=1) * dz).sum(dim=1)
        else:
            saved = [get(s) for s in self.saved]  # type: ignore[union-attr]
            dot = sum((s * g).sum(dim=1) for s, g in zip(saved, grads, strict=True))
            if bias:
                dot = dot - dz @ torch.cat(bias)
        out[self.dot_out] = dot / evaluate_size(self.divide_by, env.sizes)
        return out

    def _dtypes(self, env: RunEnv) -> dict[str, torch.dtype]:
        act = _act_dtype(env)
        grads = [self.out, *(self.norm_grads or []), *(self.bias_grads or [])]
        dtypes = dict.fromkeys(grads, act)
        return dtypes | ({self.dot_out: torch.float32} if self.dot_out is not None else {})

    def reference(self, env: RunEnv) -> None:
        values = self._compute(env, env.compute)
        exact = env.compute == torch.float64
        dtypes = self._dtypes(env)
        for name, value in values.items():
            env.tensors[name] = value if exact else value.to(dtypes[name])

    def launch(self, env: RunEnv) -> None:
        grads = [env.tensors[g] for g in self.grads]
        rows = grads[0].shape[0]
        dz = env.tensors[self.out]
        # without an input norm the kernel's row sums go to a scratch row the Program never reads
        dot = (
            env.tensors[self.dot_out]
            if self.dot_out is not None
            else torch.empty((rows,), device=dz.device, dtype=torch.float32)
        )
        if rows == 0:
            dot.zero_()
            for name in [*(self.norm_grads or []), *(self.bias_grads or [])]:
                env.tensors[name].zero_()
            return
        head = env.tensors[self.cos].shape[1]
        start = 0
        for p, grad in enumerate(grads):
            width = grad.shape[1]
            cols = slice(start, start + width)
            self._launch_part(env, p, grad, dz[:, cols], dot, cols, first=p == 0, head=head)
            start += width
        if self.divide_by is not None:
            dot.mul_(1.0 / evaluate_size(self.divide_by, env.sizes))

    def _launch_part(
        self,
        env: RunEnv,
        p: int,
        grad: torch.Tensor,
        out: torch.Tensor,
        dot: torch.Tensor,
        cols: slice,
        *,
        first: bool,
        head: int,
    ) -> None:
        """One part's columns of ``dz`` (and its share of ``c`` and of the column sums)."""
        rows, width = grad.shape
        rotated = p < self.rotated
        norm = self.head_norm is not None and rotated
        half = head // 2 if rotated else min(max(next_power_of_2(width), 2), 256) // 2
        block_half = max(next_power_of_2(half), 1)
        block_rows = max(1, min(64, 2048 // (2 * block_half), next_power_of_2(rows)))
        programs = cdiv(rows, block_rows)
        z = env.tensors[self.z][:, cols] if self.z is not None else grad
        saved = env.tensors[self.saved[p]] if self.saved is not None else grad
        bias = env.tensors[self.bias[p]] if self.bias is not None else grad
        weight = env.tensors[self.head_norm[p]] if norm else grad  # type: ignore[index]
        norm_width = width if self.whole_norm else head
        wsum = torch.empty(
            (programs, norm_width) if norm else (1,), device=grad.device, dtype=torch.float32
        )
        bsum = torch.empty(
            (programs, width) if self.bias_grads else (1,), device=grad.device, dtype=torch.float32
        )
        cos, sin = env.tensors[self.cos], env.tensors[self.sin]
        launch_kernel(
            _rotary_grad_kernel,
            (programs,),
            grad, z, saved, bias, weight, cos, sin, out, dot, wsum, bsum,
            rows, width, half, float(self.eps or 0.0), float(self.head_offset),
            grad.stride(0), grad.stride(1), z.stride(0), z.stride(1),
            saved.stride(0), saved.stride(1), cos.stride(0), cos.stride(1),
            sin.stride(0), sin.stride(1), out.stride(0), out.stride(1),
            ROTATED=rotated, HAS_Z=self.z is not None, HAS_NORM=norm, WHOLE=self.whole_norm,
            HAS_BIAS=self.bias is not None, BIAS_GRAD=self.bias_grads is not None, FIRST=first,
            BLOCK_ROWS=block_rows, BLOCK_HALF=block_half,
        )  # fmt: skip
        # each program's column sums, summed by the partials kernel into the gradient itself
        if norm:
            sum_partials(wsum.T, env.tensors[self.norm_grads[p]])  # type: ignore[index]
        if self.bias_grads:
            sum_partials(bsum.T, env.tensors[self.bias_grads[p]])
