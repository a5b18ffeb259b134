"""Qwen2 as plain PyTorch (transformers' ``models/qwen2/modeling_qwen2.py``), over ``[M, d]``
tokens: the attention input (``Qwen2RMSNorm``, ``Qwen2Attention``'s biased q/k/v projections and
``apply_rotary_pos_emb``; the attention itself is not part of the block) and the MLP sub-layer
(``post_attention_layernorm``, ``Qwen2MLP`` with ``hidden_act="silu"``, the residual of
``Qwen2DecoderLayer``), the MLP also at one token (decoding)."""

import torch
import torch.nn.functional as F

from coda.blocks import Block, ShapeSets, TensorSpec, register
from coda.blocks.autodiff import backward_block

RMS_NORM_EPS = 1e-6


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's ``apply_rotary_pos_emb`` (q, k ``[M, heads, head_dim]``, cos/sin
    ``[M, head_dim]``)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def rms_norm(hidden_states, weight, eps=RMS_NORM_EPS):
    """``Qwen2RMSNorm.forward``: statistics in fp32, cast back, then the weight."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def qwen2_attn_in(x, gamma, w_q, b_q, w_k, b_k, w_v, b_v, cos, sin):
    """Qwen2 attention input: h = rmsnorm(x) * gamma; q, k, v = biased projections of h; q and
    k rotated by RoPE in Hugging Face's rotate-half order, heads concatenated."""
    tokens, head_dim = x.shape[0], cos.shape[-1]
    hidden_shape = (tokens, -1, head_dim)
    h = rms_norm(x, gamma)
    query_states = F.linear(h, w_q, b_q).view(hidden_shape)
    key_states = F.linear(h, w_k, b_k).view(hidden_shape)
    value_states = F.linear(h, w_v, b_v)
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    return {
        "q": query_states.reshape(tokens, -1),
        "k": key_states.reshape(tokens, -1),
        "v": value_states,
    }


def qwen2_mlp(x, gamma, w_gate, w_up, w_down):
    """Qwen2 MLP sub-layer with its pre-norm and residual: out = x + down(silu(gate(h)) *
    up(h)), h = rmsnorm(x) * gamma."""
    residual = x
    hidden_states = rms_norm(x, gamma)
    act = F.silu(F.linear(hidden_states, w_gate))
    hidden_states = F.linear(act * F.linear(hidden_states, w_up), w_down)
    return residual + hidden_states


hf_qwen2_attn_in = register(
    Block.from_torch(
        qwen2_attn_in,
        name="hf_qwen2_attn_in",
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
            "gamma": TensorSpec(shape=["d"], init="norm_weight", doc="input_layernorm.weight"),
            "w_q": TensorSpec(shape=["Nq", "d"], init="linear_weight", doc="q_proj.weight"),
            "b_q": TensorSpec(shape=["Nq"], doc="q_proj.bias"),
            "w_k": TensorSpec(shape=["Nkv", "d"], init="linear_weight", doc="k_proj.weight"),
            "b_k": TensorSpec(shape=["Nkv"], doc="k_proj.bias"),
            "w_v": TensorSpec(shape=["Nkv", "d"], init="linear_weight", doc="v_proj.weight"),
            "b_v": TensorSpec(shape=["Nkv"], doc="v_proj.bias"),
            "cos": TensorSpec(shape=["M", "D"], doc="rotary cos, [tokens, head_dim]"),
            "sin": TensorSpec(shape=["M", "D"], doc="rotary sin, [tokens, head_dim]"),
        },
        shapes=ShapeSets(
            cpu=[
                {"M": 37, "d": 48, "Nq": 64, "Nkv": 16, "D": 16},  # GQA 4:1, ragged M and d
                {"M": 5, "d": 40, "Nq": 48, "Nkv": 16, "D": 8},  # GQA 3:1
                {"M": 1, "d": 40, "Nq": 32, "Nkv": 32, "D": 8},  # one token, MHA
            ],
            gpu=[{"M": 1000, "d": 1024, "Nq": 1024, "Nkv": 256, "D": 128}],
        ),
    )
)

hf_qwen2_mlp = register(
    Block.from_torch(
        qwen2_mlp,
        name="hf_qwen2_mlp",
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
            "gamma": TensorSpec(
                shape=["d"], init="norm_weight", doc="post_attention_layernorm.weight"
            ),
            "w_gate": TensorSpec(shape=["f", "d"], init="linear_weight", doc="gate_proj.weight"),
            "w_up": TensorSpec(shape=["f", "d"], init="linear_weight", doc="up_proj.weight"),
            "w_down": TensorSpec(shape=["d", "f"], init="linear_weight", doc="down_proj.weight"),
        },
        shapes=ShapeSets(
            cpu=[
                {"M": 37, "d": 40, "f": 72},  # ragged M and d
                {"M": 1, "d": 24, "f": 56},  # one token (decoding)
            ],
            gpu=[{"M": 1000, "d": 896, "f": 4864}, {"M": 1, "d": 896, "f": 4864}],
        ),
    )
)

hf_qwen2_attn_in_bwd = register(
    backward_block(
        hf_qwen2_attn_in,
        name="hf_qwen2_attn_in_bwd",
        cotangents={
            "q": TensorSpec(shape=["M", "Nq"], doc="gradient of q"),
            "k": TensorSpec(shape=["M", "Nkv"], doc="gradient of k"),
            "v": TensorSpec(shape=["M", "Nkv"], doc="gradient of v"),
        },
        wrt=["x", "gamma", "w_q", "b_q", "w_k", "b_k", "w_v", "b_v"],
        # no gradient depends on the biases' values: the backward takes none (they are zeros in
        # the forward its reference differentiates), or the sandbox could not tell a program
        # that ignores them from one that reads them
        zeros=["b_q", "b_k", "b_v"],
    )
)

hf_qwen2_mlp_bwd = register(
    backward_block(
        hf_qwen2_mlp,
        name="hf_qwen2_mlp_bwd",
        cotangents={
            "out": TensorSpec(shape=["M", "d"], doc="gradient of out"),
        },
        wrt=["x", "gamma", "w_gate", "w_up", "w_down"],
    )
)
