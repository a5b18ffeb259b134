"""PyTorch semantics of the high-level block ops, following Hugging Face's Llama modules.

These functions are shown verbatim to LLMs as part of a block's reference source, and the block's
reference runs exactly that source. They compute in the input dtype except where Hugging Face does
not (``LlamaRMSNorm`` takes its statistics in fp32 and rounds back before multiplying by γ); given
float64 inputs everything is float64, which is how the sandbox builds its high-precision reference.
"""

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    cast: str = "before_weight",
) -> torch.Tensor:
    """RMSNorm ``(offset + weight) * (x / sqrt(mean(x**2, -1) + eps))``, statistics in (at least)
    fp32. ``cast="before_weight"`` is LlamaRMSNorm (``x̂`` rounded to x's dtype, then times the
    weight); ``cast="after_weight"`` is GemmaRMSNorm (``offset=1``: ``x̂ · (1 + γ)`` formed in
    fp32, rounded once at the end).
    """
    dtype = x.dtype
    xf = x.to(torch.promote_types(dtype, torch.float32))
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    if cast == "after_weight":
        return (xf * (offset + weight.to(xf.dtype))).to(dtype)
    return (offset + weight if offset else weight) * xf.to(dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """``nn.LayerNorm`` over the last dimension: ``(x − mean) / sqrt(var + eps) · weight +
    bias`` (biased variance; PyTorch computes 16-bit inputs in fp32 and rounds once)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """nn.Linear: ``x @ weight.T (+ bias)`` with ``weight`` of shape ``[out, in]``, ``bias``
    ``[out]``."""
    return F.linear(x, weight, bias)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """LlamaMLP's activation: ``silu(gate) * up``."""
    return F.silu(gate) * up


def activation(x: torch.Tensor, kind: str, cap: float | None = None) -> torch.Tensor:
    """Hugging Face's elementwise activations (``ACT2FN``) and Gemma-2's logit softcap: ``gelu``
    (exact, erf), ``gelu_tanh`` (``gelu_pytorch_tanh``), ``quick_gelu`` ``x·σ(1.702x)``, ``relu2``
    ``relu(x)²``, ``relu``, ``silu``, ``sigmoid``, ``tanh`` and ``softcap`` ``cap·tanh(x/cap)``.
    """
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if kind == "relu2":
        return torch.square(F.relu(x))
    if kind == "relu":
        return F.relu(x)
    if kind == "silu":
        return F.silu(x)
    if kind == "sigmoid":
        return torch.sigmoid(x)
    if kind == "tanh":
        return torch.tanh(x)
    if kind == "softcap" and cap is not None:
        return torch.tanh(x / cap) * cap
    raise ValueError(f"unknown activation {kind!r} (softcap needs cap)")


def glu(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """A gated linear unit: ``act(gate) * up`` (SwiGLU with ``silu``, GeGLU with ``gelu_tanh``)."""
    return activation(gate, act) * up


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A residual connection."""
    return a + b


def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor`` for a Python scalar (Gemma's embedding normaliser, an attention scaling)."""
    return x * factor


def chunk(x: torch.Tensor, chunks: int, index: int) -> torch.Tensor:
    """``x.chunk(chunks, dim=-1)[index]``: one part of a concatenated projection (Phi-3's
    ``gate_up_proj`` output is ``[gate | up]``, so gate is ``chunk(z, 2, 0)``)."""
    return x.chunk(chunks, dim=-1)[index]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``rotate_half``: ``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Hugging Face's ``apply_rotary_pos_emb`` on ``x`` of shape ``[M, heads·D]`` with
    ``cos``/``sin`` of shape ``[M, D]``: each head ``h`` becomes ``h·cos + rotate_half(h)·sin``
    (the column order stays Hugging Face's rotate-half order)."""
    rows, head = x.shape[0], cos.shape[-1]
    heads = x.reshape(rows, -1, head)
    out = heads * cos[:, None, :] + rotate_half(heads) * sin[:, None, :]
    return out.reshape(rows, -1)


def head_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    cast: str = "before_weight",
) -> torch.Tensor:
    """``rms_norm`` of each head of ``x`` (``[M, heads·D]``, ``D = len(weight)``) on its own:
    Qwen3's and Gemma 3's ``q_norm``/``k_norm`` over ``head_dim``."""
    rows, head = x.shape[0], weight.shape[-1]
    return rms_norm(x.reshape(rows, -1, head), weight, eps, offset, cast).reshape(rows, -1)


# -- kernel-level semantics (docs/algebra.md §6) ---------------------------------------------------
# Each helper computes in at least fp32 and returns the activation dtype of its main input (or fp32
# for row statistics), so a block's reference in bfloat16 rounds where a PyTorch user's code would.


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32 (float64 stays float64: the sandbox's exact reference)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with ``b`` of shape ``[K, N]``."""
    return a @ b


def scale_rows(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x[i, :] * r[i]`` (e.g. RMSNorm's reciprocal r applied after a GEMM)."""
    return (upcast(x) * r[:, None]).to(x.dtype)


def scale_cols(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``x[:, j] * v[j]`` (e.g. ``D ⊙ γ``)."""
    return (upcast(x) * v).to(x.dtype)


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """Per-row mean of squares, fp32: the RMSNorm statistic."""
    return upcast(x).pow(2).mean(-1)


def row_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row RMSNorm reciprocal ``rsqrt(mean(x**2) + eps)``, fp32 (LlamaRMSNorm's statistic)."""
    return torch.rsqrt(upcast(x).pow(2).mean(-1) + eps)


def swiglu_pairs(z: torch.Tensor) -> torch.Tensor:
    """SwiGLU on adjacent column pairs: ``silu(z[:, 2k]) * z[:, 2k+1]``."""
    return F.silu(z[:, 0::2]) * z[:, 1::2]


def to_adjacent_pairs(x: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Reorder each head's columns (head width = ``cos.shape[-1]``) from Hugging Face's
    rotate-half order to adjacent pairs: ``[x0, x_{D/2}, x1, x_{D/2+1}, …]``."""
    rows, head = x.shape[0], cos.shape[-1]
    return x.reshape(rows, -1, 2, head // 2).transpose(2, 3).reshape(rows, -1)


def rope_adjacent(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent column pairs ``(x, y) = (col 2k, col 2k+1)`` of each head (width D =
    ``cos.shape[-1]``, Hugging Face tables): ``x·c − y·s``, ``y·c + x·s`` with ``c, s`` at
    frequency ``k mod D/2``. Equals ``to_adjacent_pairs(apply_rotary_pos_emb(...))``."""
    rows, head = x.shape[0], cos.shape[-1]
    pairs = x.reshape(rows, -1, head // 2, 2)
    c, s = cos[:, None, : head // 2], sin[:, None, : head // 2]
    first, second = pairs[..., 0], pairs[..., 1]
    out = torch.stack([first * c - second * s, second * c + first * s], dim=-1)
    return out.reshape(rows, -1)


def concat(*parts: torch.Tensor) -> torch.Tensor:
    """Concatenate along the feature (last) dimension, e.g. ``q | k | v``."""
    return torch.cat(parts, dim=-1)


def select_target(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``logits[i, target[i]]``, fp32."""
    return upcast(logits).gather(1, target[:, None])[:, 0]


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """Per-row log-sum-exp, fp32."""
    return torch.logsumexp(upcast(logits), dim=-1)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy in fp32, as Hugging Face's causal-LM loss computes it (upcast logits,
    no reduction; targets already shifted)."""
    return F.cross_entropy(upcast(logits), target, reduction="none")


def apply_rstd(x: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``x̂ ⊙ γ`` with ``x̂ = rstd ⊙ x``: the RMSNorm output from its saved statistic."""
    return (upcast(x) * rstd[:, None] * gamma).to(x.dtype)


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    """RMSNorm's input gradient ``rstd ⊙ (dy ⊙ γ − x̂ · c)`` given the row statistic
    ``c = (1/d) Σ_j y_j dy_j`` (docs/algebra.md §4)."""
    r, cf = rstd[:, None], c[:, None]
    return (r * (upcast(dy) * gamma - upcast(x) * r * cf)).to(dy.dtype)


def rms_norm_weight_grad(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """RMSNorm's weight gradient ``Σ_rows dy ⊙ x̂``."""
    return (upcast(dy) * upcast(x) * rstd[:, None]).sum(0).to(dy.dtype)


def swiglu_pairs_backward(da: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Gradient of ``swiglu_pairs(z)`` against ``da``, interleaved like z: ``dg = da·u·σ(g)·(1 +
    g·(1 − σ(g)))``, ``du = da·silu(g)`` (docs/algebra.md §2)."""
    g, u, d = upcast(z[:, 0::2]), upcast(z[:, 1::2]), upcast(da)
    sig = torch.sigmoid(g)
    dg = d * u * sig * (1 + g * (1 - sig))
    du = d * g * sig
    return torch.stack([dg, du], dim=-1).reshape(z.shape).to(z.dtype)


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row ``Σ_j a_ij b_ij``, fp32 (e.g. ``Σ z·dz``, RMSNorm backward's statistic)."""
    return (upcast(a) * upcast(b)).sum(-1)
