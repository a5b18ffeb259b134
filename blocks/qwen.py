"""Attention inputs in Hugging Face's own column order (``Qwen2Attention``, ``Qwen3Attention``,
``Gemma3Attention``, ``Olmo2Attention`` up to the attention function), forward and backward.

``qwen2_attn_in``: ``h = rmsnorm(x)·γ``; ``q, k, v = h W_qᵀ + b_q, h W_kᵀ + b_k, h W_vᵀ + b_v``;
``q_rot, k_rot = rope(q), rope(k)`` (``apply_rotary_pos_emb``, rotate-half order).
``qwen3_attn_in``: no biases; ``q`` and ``k`` each through a per-head RMSNorm (``q_norm``,
``k_norm``, weight ``[head_dim]``) before RoPE.
``gemma3_attn_in``: ``qwen3_attn_in`` with Gemma's RMSNorm ``x̂ · (1 + w)`` (formed in fp32, cast
once after the weight) for the input norm and the per-head q/k norms (``Gemma3RMSNorm``).
``olmo2_attn_in``: no input norm (OLMo 2 normalizes after its sub-layers): ``q, k, v`` are
projections of ``x`` itself, and ``q``, ``k`` each go through an RMSNorm over the whole projection
(all heads; weights ``[Nq]``, ``[Nkv]``; ``Olmo2RMSNorm``: ``w · x̂`` cast after the weight)
before RoPE.
Outputs ``q_rot``, ``k_rot``, ``v`` separately, ``[tokens, heads·head_dim]`` — exactly the tensors
Hugging Face's attention gets (before its ``view``/``transpose`` into heads). MHA when Nkv == Nq,
GQA when Nkv < Nq.

Backward blocks (``_bwd``) are autograd of these; they get the forward inputs — the biases
excepted: no gradient depends on them (each is followed only by linear maps), so they are left
out (``backward_block(zeros=...)``) — and recompute the projection. The q/k norms need that
projection; Qwen2's backward recomputes it too, because from the saved outputs it would need
the biases, which its gradients must not depend on.

The families come per RMSNorm epsilon (``qwen2_attn_in_family``, …): the built-in blocks use
Llama 3's 1e-5, the epsilon the shipped Programs are written at (Qwen's, Gemma 3's and OLMo 2's
configs use 1e-6: ``qwen2_attn_in_eps1e-06`` and its ``_bwd`` are registered on first use). The
q/k norms share the input norm's epsilon (``config.rms_norm_eps``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .autodiff import backward_block
from .block import Block, ShapeSets, TensorSpec
from .llama import LLAMA_RMS_EPS
from .ops import GraphOp, HeadRMSNorm, Linear, RMSNorm, RoPE
from .registry import register, register_resolver

QKV = (("q", "Nq"), ("k", "Nkv"), ("v", "Nkv"))
GEMMA_NORM = {"offset": 1.0, "cast": "after_weight"}  # Gemma3RMSNorm: x̂ · (1 + w), cast after
OLMO2_NORM = {"cast": "after_weight"}  # Olmo2RMSNorm: w · x̂ in fp32, cast after


@dataclass(frozen=True)
class AttnInKind:
    """One attention input's form: ``model`` (its family, for the description); ``bias``: biased
    projections; ``qk_norm``: none, per-head (``"head"``, weights ``[D]``) or over the whole
    projection (``"whole"``, weights ``[Nq]``/``[Nkv]``); ``input_norm``: an RMSNorm of ``x``
    before the projections; ``norm``: every norm's ``offset``/``cast`` (``RMSNorm``'s fields)."""

    model: str
    shapes: ShapeSets
    bias: bool = False
    qk_norm: Literal["head", "whole"] | None = None
    input_norm: bool = True
    norm: dict[str, Any] = field(default_factory=dict)


def _inputs(kind: AttnInKind) -> dict[str, TensorSpec]:
    inputs = {"x": TensorSpec(shape=["M", "d"], doc="residual stream")}
    if kind.input_norm:
        inputs["gamma"] = TensorSpec(shape=["d"], init="norm_weight", doc="input_layernorm.weight")
    for p, width in QKV:
        inputs[f"w_{p}"] = TensorSpec(
            shape=[width, "d"], init="linear_weight", doc=f"{p}_proj.weight"
        )
    if kind.bias:
        for p, width in QKV:
            inputs[f"b_{p}"] = TensorSpec(shape=[width], doc=f"{p}_proj.bias")
    if kind.qk_norm:
        for p, width in QKV[:2]:
            per_head = kind.qk_norm == "head"
            inputs[f"{p}_norm"] = TensorSpec(
                shape=["D" if per_head else width], init="norm_weight",
                doc=f"{p}_norm.weight ({'per head' if per_head else 'whole projection'})",
            )  # fmt: skip
    inputs["cos"] = TensorSpec(shape=["M", "D"], doc="rotary embedding cos, [tokens, head_dim]")
    inputs["sin"] = TensorSpec(shape=["M", "D"], doc="rotary embedding sin, [tokens, head_dim]")
    return inputs


def _graph(eps: float, kind: AttnInKind) -> list[GraphOp]:
    graph: list[GraphOp] = []
    if kind.input_norm:
        graph.append(RMSNorm(x="x", weight="gamma", eps=eps, out="h", **kind.norm))
    h = "h" if kind.input_norm else "x"
    for p, _ in QKV:
        graph.append(Linear(x=h, weight=f"w_{p}", bias=f"b_{p}" if kind.bias else None, out=p))
    rotated = {"q": "q", "k": "k"}
    if kind.qk_norm:
        norm = HeadRMSNorm if kind.qk_norm == "head" else RMSNorm
        for p in ("q", "k"):
            graph.append(norm(x=p, weight=f"{p}_norm", eps=eps, out=f"{p}_normed", **kind.norm))
            rotated[p] = f"{p}_normed"
    graph += [RoPE(x=rotated[p], cos="cos", sin="sin", out=f"{p}_rot") for p in ("q", "k")]
    return graph


def _description(kind: AttnInKind) -> str:
    """The block's description: its formula, step by step."""
    gemma = kind.norm.get("offset")
    scale = "(1 + gamma)" if gemma else "gamma"
    steps = [f"h = rmsnorm(x) * {scale}"] if kind.input_norm else ["h = x (no input norm)"]
    bias = " + b_{p}" if kind.bias else ""
    steps.append("q, k, v = " + ", ".join(f"h @ w_{p}.T{bias.format(p=p)}" for p, _ in QKV))
    if kind.qk_norm == "head":
        w = "(1 + q_norm), (1 + k_norm)" if gemma else "q_norm, k_norm"
        steps.append(f"q, k = rmsnorm of each head of q, k (over head_dim) times {w}")
    elif kind.qk_norm == "whole":
        steps.append("q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm over the whole projection")
    return (
        f"{kind.model} attention input: {'; '.join(steps)}; q_rot, k_rot = RoPE of q and k "
        "(Hugging Face apply_rotary_pos_emb, rotate-half column order); outputs q_rot, k_rot, v "
        "as [tokens, heads * head_dim]. MHA when Nkv == Nq, GQA when Nkv < Nq."
    )


def _forward(name: str, eps: float, kind: AttnInKind) -> Block:
    return Block(
        name=name,
        description=_description(kind),
        inputs=_inputs(kind),
        graph=_graph(eps, kind),
        outputs=["q_rot", "k_rot", "v"],
        shapes=kind.shapes,
    )


COTANGENTS = {
    "q_rot": TensorSpec(shape=["M", "Nq"], doc="gradient of q_rot"),
    "k_rot": TensorSpec(shape=["M", "Nkv"], doc="gradient of k_rot"),
    "v": TensorSpec(shape=["M", "Nkv"], doc="gradient of v"),
}


def _backward(forward: Block, name: str) -> Block:
    """Autograd of ``forward`` for every input but the rotary tables; biases left out (zeros)."""
    wrt = [n for n in forward.inputs if n not in ("cos", "sin")]
    biases = [n for n in forward.inputs if n.startswith("b_")]
    return backward_block(forward, name=name, cotangents=COTANGENTS, wrt=wrt, zeros=biases or None)


QWEN2_SHAPES = ShapeSets(
    cpu=[
        {"M": 37, "d": 40, "Nq": 48, "Nkv": 16, "D": 16},  # GQA 3:1, ragged M and d
        {"M": 5, "d": 20, "Nq": 40, "Nkv": 40, "D": 20},  # MHA, fewer tokens than a tile
        {"M": 1, "d": 24, "Nq": 36, "Nkv": 12, "D": 12},  # one token, head_dim no power of two
    ],
    gpu=[
        {"M": 1000, "d": 896, "Nq": 896, "Nkv": 128, "D": 64},  # Qwen2-0.5B, ragged M
        {"M": 2048, "d": 1536, "Nq": 1536, "Nkv": 256, "D": 128},  # Qwen2-1.5B
    ],
    bench=[{"M": 16384, "d": 3584, "Nq": 3584, "Nkv": 512, "D": 128}],  # Qwen2-7B
)
# A per-head norm runs in an epilogue sub-tile of whole heads: head widths are powers of two.
QWEN3_SHAPES = ShapeSets(
    cpu=[
        {"M": 37, "d": 40, "Nq": 48, "Nkv": 16, "D": 16},  # GQA 3:1, ragged M and d
        {"M": 5, "d": 20, "Nq": 32, "Nkv": 32, "D": 8},  # MHA, four heads in a sub-tile
        {"M": 3, "d": 24, "Nq": 128, "Nkv": 64, "D": 64},  # heads wider than the default sub-tile
    ],
    gpu=[
        {"M": 1000, "d": 1024, "Nq": 2048, "Nkv": 1024, "D": 128},  # Qwen3-0.6B, ragged M
        {"M": 2048, "d": 2048, "Nq": 2048, "Nkv": 1024, "D": 128},  # Qwen3-1.7B
    ],
    bench=[{"M": 16384, "d": 4096, "Nq": 4096, "Nkv": 1024, "D": 128}],  # Qwen3-8B
)

# Gemma 3's and OLMo 2's: the families suite's shapes (per-head norms need power-of-two heads)
GEMMA3_SHAPES = ShapeSets(
    cpu=[
        {"M": 37, "d": 48, "Nq": 64, "Nkv": 16, "D": 16},  # GQA 4:1, ragged M and d
        {"M": 5, "d": 40, "Nq": 32, "Nkv": 16, "D": 8},  # GQA 2:1
        {"M": 1, "d": 40, "Nq": 32, "Nkv": 32, "D": 8},  # one token, MHA
    ],
    gpu=[
        {"M": 1000, "d": 1152, "Nq": 1024, "Nkv": 256, "D": 256},  # Gemma 3 1B, ragged M
        {"M": 2048, "d": 2560, "Nq": 2048, "Nkv": 1024, "D": 256},  # Gemma 3 4B
    ],
    bench=[{"M": 16384, "d": 2560, "Nq": 2048, "Nkv": 1024, "D": 256}],
)
OLMO2_SHAPES = ShapeSets(
    cpu=[
        {"M": 37, "d": 48, "Nq": 64, "Nkv": 16, "D": 16},  # GQA 4:1, ragged M and d
        {"M": 5, "d": 40, "Nq": 48, "Nkv": 48, "D": 8},  # MHA
        {"M": 1, "d": 40, "Nq": 32, "Nkv": 16, "D": 8},  # one token, GQA 2:1
    ],
    gpu=[
        {"M": 1000, "d": 2048, "Nq": 2048, "Nkv": 2048, "D": 128},  # OLMo 2 1B, ragged M
        {"M": 2048, "d": 4096, "Nq": 4096, "Nkv": 4096, "D": 128},  # OLMo 2 7B
    ],
    bench=[{"M": 16384, "d": 4096, "Nq": 4096, "Nkv": 4096, "D": 128}],
)

KINDS = {
    "qwen2_attn_in": AttnInKind("Qwen2", QWEN2_SHAPES, bias=True),
    "qwen3_attn_in": AttnInKind("Qwen3", QWEN3_SHAPES, qk_norm="head"),
    "gemma3_attn_in": AttnInKind("Gemma 3", GEMMA3_SHAPES, qk_norm="head", norm=GEMMA_NORM),
    "olmo2_attn_in": AttnInKind(
        "OLMo 2", OLMO2_SHAPES, qk_norm="whole", input_norm=False, norm=OLMO2_NORM
    ),
}
_KEYS = ("forward", "backward")

qwen2_attn_in = register(_forward("qwen2_attn_in", LLAMA_RMS_EPS, KINDS["qwen2_attn_in"]))
qwen2_attn_in_bwd = register(_backward(qwen2_attn_in, "qwen2_attn_in_bwd"))
qwen3_attn_in = register(_forward("qwen3_attn_in", LLAMA_RMS_EPS, KINDS["qwen3_attn_in"]))
qwen3_attn_in_bwd = register(_backward(qwen3_attn_in, "qwen3_attn_in_bwd"))
gemma3_attn_in = register(_forward("gemma3_attn_in", LLAMA_RMS_EPS, KINDS["gemma3_attn_in"]))
gemma3_attn_in_bwd = register(_backward(gemma3_attn_in, "gemma3_attn_in_bwd"))
olmo2_attn_in = register(_forward("olmo2_attn_in", LLAMA_RMS_EPS, KINDS["olmo2_attn_in"]))
olmo2_attn_in_bwd = register(_backward(olmo2_attn_in, "olmo2_attn_in_bwd"))

_BUILTIN = {
    "qwen2_attn_in": (qwen2_attn_in, qwen2_attn_in_bwd),
    "qwen3_attn_in": (qwen3_attn_in, qwen3_attn_in_bwd),
    "gemma3_attn_in": (gemma3_attn_in, gemma3_attn_in_bwd),
    "olmo2_attn_in": (olmo2_attn_in, olmo2_attn_in_bwd),
}
_VARIANTS: dict[str, tuple[Block, Block]] = {}


def _family(base: str, eps: float) -> dict[str, Block]:
    """``forward`` and ``backward`` of ``base`` for an RMSNorm epsilon (every norm's: the input
    norm and the q/k norms); another value than 1e-5 registers ``<base>_eps<eps>`` and
    ``<base>_eps<eps>_bwd`` on first use."""
    if eps == LLAMA_RMS_EPS:
        return dict(zip(_KEYS, _BUILTIN[base], strict=True))
    name = f"{base}_eps{eps:g}"
    if name not in _VARIANTS:
        forward = register(_forward(name, eps, KINDS[base]))
        _VARIANTS[name] = (forward, register(_backward(forward, f"{name}_bwd")))
    return dict(zip(_KEYS, _VARIANTS[name], strict=True))


def qwen2_attn_in_family(eps: float) -> dict[str, Block]:
    """``forward`` (``qwen2_attn_in``) and ``backward`` (``qwen2_attn_in_bwd``) at ``eps``."""
    return _family("qwen2_attn_in", eps)


def qwen3_attn_in_family(eps: float) -> dict[str, Block]:
    """``forward`` (``qwen3_attn_in``) and ``backward`` (``qwen3_attn_in_bwd``) at ``eps``."""
    return _family("qwen3_attn_in", eps)


def gemma3_attn_in_family(eps: float) -> dict[str, Block]:
    """``forward`` (``gemma3_attn_in``) and ``backward`` (``gemma3_attn_in_bwd``) at ``eps``."""
    return _family("gemma3_attn_in", eps)


def olmo2_attn_in_family(eps: float) -> dict[str, Block]:
    """``forward`` (``olmo2_attn_in``) and ``backward`` (``olmo2_attn_in_bwd``) at ``eps``."""
    return _family("olmo2_attn_in", eps)


def _resolve_eps_variant(name: str) -> Block | None:
    """``<kind>_eps<eps>[_bwd]`` (``qwen2_attn_in_eps1e-06``, …, any of ``KINDS``) → that block
    (a sandbox worker resolves the same names the same way)."""
    for base in KINDS:
        prefix = f"{base}_eps"
        if not name.startswith(prefix):
            continue
        text = name[len(prefix) :]
        key = "backward" if text.endswith("_bwd") else "forward"
        text = text.removesuffix("_bwd")
        try:
            eps = float(text)
        except ValueError:
            return None
        if 0 < eps <= 1 and f"{eps:g}" == text:
            return _family(base, eps)[key]
    return None


register_resolver(_resolve_eps_variant)
