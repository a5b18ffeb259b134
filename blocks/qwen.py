"""Qwen2 and Qwen3 attention inputs (Hugging Face ``Qwen2Attention`` / ``Qwen3Attention`` up to
the attention function), forward and backward, in Hugging Face's own column order.

``qwen2_attn_in``: ``h = rmsnorm(x)·γ``; ``q, k, v = h W_qᵀ + b_q, h W_kᵀ + b_k, h W_vᵀ + b_v``;
``q_rot, k_rot = rope(q), rope(k)`` (``apply_rotary_pos_emb``, rotate-half order).
``qwen3_attn_in``: no biases; ``q`` and ``k`` each through a per-head RMSNorm (``q_norm``,
``k_norm``, weight ``[head_dim]``) before RoPE. Outputs ``q_rot``, ``k_rot``, ``v`` separately,
``[tokens, heads·head_dim]`` — exactly the tensors Hugging Face's attention gets (before its
``view``/``transpose`` into heads). MHA when Nkv == Nq, GQA when Nkv < Nq.

Backward blocks (``_bwd``) are autograd of these; they get the forward inputs — the biases
excepted: no gradient depends on them (each is followed only by linear maps), so they are left
out (``backward_block(zeros=...)``) — and recompute the projection. Qwen3's per-head norms need
that projection; Qwen2's backward recomputes it too, because from the saved outputs it would need
the biases, which its gradients must not depend on.

The families come per RMSNorm epsilon (``qwen2_attn_in_family``, ``qwen3_attn_in_family``): the
built-in blocks use Llama 3's 1e-5, the epsilon the shipped Programs are written at (Qwen's
configs use 1e-6: ``qwen2_attn_in_eps1e-06`` and its ``_bwd`` are registered on first use). In
Qwen3 the q/k norms share the input norm's epsilon (``config.rms_norm_eps``).
"""

from __future__ import annotations

from .autodiff import backward_block
from .block import Block, ShapeSets, TensorSpec
from .llama import LLAMA_RMS_EPS
from .ops import GraphOp, HeadRMSNorm, Linear, RMSNorm, RoPE
from .registry import register, register_resolver

QKV = (("q", "Nq"), ("k", "Nkv"), ("v", "Nkv"))


def _inputs(*, bias: bool, qk_norm: bool) -> dict[str, TensorSpec]:
    inputs = {
        "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
        "gamma": TensorSpec(shape=["d"], init="norm_weight", doc="input_layernorm.weight"),
    }
    for p, width in QKV:
        inputs[f"w_{p}"] = TensorSpec(
            shape=[width, "d"], init="linear_weight", doc=f"{p}_proj.weight"
        )
    if bias:
        for p, width in QKV:
            inputs[f"b_{p}"] = TensorSpec(shape=[width], doc=f"{p}_proj.bias")
    if qk_norm:
        for p in ("q", "k"):
            inputs[f"{p}_norm"] = TensorSpec(
                shape=["D"], init="norm_weight", doc=f"{p}_norm.weight (per head)"
            )
    inputs["cos"] = TensorSpec(shape=["M", "D"], doc="rotary embedding cos, [tokens, head_dim]")
    inputs["sin"] = TensorSpec(shape=["M", "D"], doc="rotary embedding sin, [tokens, head_dim]")
    return inputs


def _graph(eps: float, *, bias: bool, qk_norm: bool) -> list[GraphOp]:
    graph: list[GraphOp] = [RMSNorm(x="x", weight="gamma", eps=eps, out="h")]
    for p, _ in QKV:
        graph.append(Linear(x="h", weight=f"w_{p}", bias=f"b_{p}" if bias else None, out=p))
    rotated = {"q": "q", "k": "k"}
    if qk_norm:
        for p in ("q", "k"):
            graph.append(HeadRMSNorm(x=p, weight=f"{p}_norm", eps=eps, out=f"{p}_normed"))
            rotated[p] = f"{p}_normed"
    graph += [RoPE(x=rotated[p], cos="cos", sin="sin", out=f"{p}_rot") for p in ("q", "k")]
    return graph


def _forward(name: str, eps: float, *, bias: bool, qk_norm: bool, shapes: ShapeSets) -> Block:
    what = (
        "q, k, v = h @ w_q.T + b_q, h @ w_k.T + b_k, h @ w_v.T + b_v"
        if bias
        else "q, k, v = h @ w_q.T, h @ w_k.T, h @ w_v.T; q, k = q_norm(q), k_norm(k) per head"
    )
    return Block(
        name=name,
        description=(
            f"{'Qwen2' if bias else 'Qwen3'} attention input: h = rmsnorm(x) * gamma; {what}; "
            "q_rot, k_rot = RoPE of q and k (Hugging Face apply_rotary_pos_emb, rotate-half "
            "column order); outputs q_rot, k_rot, v as [tokens, heads * head_dim]. MHA when "
            "Nkv == Nq, GQA when Nkv < Nq."
        ),
        inputs=_inputs(bias=bias, qk_norm=qk_norm),
        graph=_graph(eps, bias=bias, qk_norm=qk_norm),
        outputs=["q_rot", "k_rot", "v"],
        shapes=shapes,
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

_KINDS = {
    "qwen2_attn_in": {"bias": True, "qk_norm": False, "shapes": QWEN2_SHAPES},
    "qwen3_attn_in": {"bias": False, "qk_norm": True, "shapes": QWEN3_SHAPES},
}
_KEYS = ("forward", "backward")

qwen2_attn_in = register(_forward("qwen2_attn_in", LLAMA_RMS_EPS, **_KINDS["qwen2_attn_in"]))
qwen2_attn_in_bwd = register(_backward(qwen2_attn_in, "qwen2_attn_in_bwd"))
qwen3_attn_in = register(_forward("qwen3_attn_in", LLAMA_RMS_EPS, **_KINDS["qwen3_attn_in"]))
qwen3_attn_in_bwd = register(_backward(qwen3_attn_in, "qwen3_attn_in_bwd"))

_BUILTIN = {
    "qwen2_attn_in": (qwen2_attn_in, qwen2_attn_in_bwd),
    "qwen3_attn_in": (qwen3_attn_in, qwen3_attn_in_bwd),
}
_VARIANTS: dict[str, tuple[Block, Block]] = {}


def _family(base: str, eps: float) -> dict[str, Block]:
    """``forward`` and ``backward`` of ``base`` for an RMSNorm epsilon (every norm's: the input
    norm and Qwen3's q/k norms); another value than 1e-5 registers ``<base>_eps<eps>`` and
    ``<base>_eps<eps>_bwd`` on first use."""
    if eps == LLAMA_RMS_EPS:
        return dict(zip(_KEYS, _BUILTIN[base], strict=True))
    name = f"{base}_eps{eps:g}"
    if name not in _VARIANTS:
        forward = register(_forward(name, eps, **_KINDS[base]))
        _VARIANTS[name] = (forward, register(_backward(forward, f"{name}_bwd")))
    return dict(zip(_KEYS, _VARIANTS[name], strict=True))


def qwen2_attn_in_family(eps: float) -> dict[str, Block]:
    """``forward`` (``qwen2_attn_in``) and ``backward`` (``qwen2_attn_in_bwd``) at ``eps``."""
    return _family("qwen2_attn_in", eps)


def qwen3_attn_in_family(eps: float) -> dict[str, Block]:
    """``forward`` (``qwen3_attn_in``) and ``backward`` (``qwen3_attn_in_bwd``) at ``eps``."""
    return _family("qwen3_attn_in", eps)


def _resolve_eps_variant(name: str) -> Block | None:
    """``qwen2_attn_in_eps<eps>[_bwd]`` / ``qwen3_…`` → that block (a sandbox worker resolves the
    same names the same way)."""
    for base in _KINDS:
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
