"""Mistral's attention projections as plain PyTorch (transformers' ``models/mistral/
modeling_mistral.py``: ``MistralRMSNorm``, ``MistralAttention``'s q/k/v projections with
``apply_rotary_pos_emb``, and ``o_proj`` with the residual of ``MistralDecoderLayer``), over
``[M, d]`` tokens: the attention input (norm, projections, RoPE; the attention itself is not part
of the block) and the attention output."""

import torch
import torch.nn.functional as F

from coda.blocks import Block, ShapeSets, TensorSpec, register
from coda.blocks.autodiff import backward_block

RMS_NORM_EPS = 1e-5


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
    """``MistralRMSNorm.forward``: statistics in fp32, cast back, then the weight."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def mistral_attn_in(x, gamma, w_q, w_k, w_v, cos, sin):
    """Mistral attention input: h = rmsnorm(x) * gamma; q, k, v = h @ w_q.T, h @ w_k.T,
    h @ w_v.T; q and k rotated by RoPE in Hugging Face's rotate-half order, heads concatenated."""
    tokens, head_dim = x.shape[0], cos.shape[-1]
    hidden_shape = (tokens, -1, head_dim)
    h = rms_norm(x, gamma)
    query_states = F.linear(h, w_q).view(hidden_shape)
    key_states = F.linear(h, w_k).view(hidden_shape)
    value_states = F.linear(h, w_v)
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    return {
        "q": query_states.reshape(tokens, -1),
        "k": key_states.reshape(tokens, -1),
        "v": value_states,
    }


def mistral_attn_out(attn, w_o, x):
    """Mistral attention output: x_out = x + attn @ w_o.T (o_proj and the residual)."""
    return x + F.linear(attn, w_o)


hf_mistral_attn_in = register(
    Block.from_torch(
        mistral_attn_in,
        name="hf_mistral_attn_in",
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
            "gamma": TensorSpec(shape=["d"], init="norm_weight", doc="input_layernorm.weight"),
            "w_q": TensorSpec(shape=["Nq", "d"], init="linear_weight", doc="q_proj.weight"),
            "w_k": TensorSpec(shape=["Nkv", "d"], init="linear_weight", doc="k_proj.weight"),
            "w_v": TensorSpec(shape=["Nkv", "d"], init="linear_weight", doc="v_proj.weight"),
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

hf_mistral_attn_out = register(
    Block.from_torch(
        mistral_attn_out,
        name="hf_mistral_attn_out",
        inputs={
            "attn": TensorSpec(shape=["M", "Nq"], doc="attention output, heads concatenated"),
            "w_o": TensorSpec(shape=["d", "Nq"], init="linear_weight", doc="o_proj.weight"),
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
        },
        outputs=["x_out"],
        shapes=ShapeSets(
            cpu=[
                {"M": 37, "d": 40, "Nq": 64},  # d not a multiple of 16
                {"M": 1, "d": 24, "Nq": 48},  # one token
                {"M": 64, "d": 64, "Nq": 64},
            ],
            gpu=[{"M": 1000, "d": 1000, "Nq": 1024}],
        ),
    )
)

hf_mistral_attn_in_bwd = register(
    backward_block(
        hf_mistral_attn_in,
        name="hf_mistral_attn_in_bwd",
        cotangents={
            "q": TensorSpec(shape=["M", "Nq"], doc="gradient of q"),
            "k": TensorSpec(shape=["M", "Nkv"], doc="gradient of k"),
            "v": TensorSpec(shape=["M", "Nkv"], doc="gradient of v"),
        },
        wrt=["x", "gamma", "w_q", "w_k", "w_v"],
    )
)

hf_mistral_attn_out_bwd = register(
    backward_block(
        hf_mistral_attn_out,
        name="hf_mistral_attn_out_bwd",
        cotangents={
            "x_out": TensorSpec(shape=["M", "d"], doc="gradient of x_out"),
        },
        wrt=["attn", "w_o", "x"],
        # no gradient depends on the residual's values (dx = dout): the backward takes none, or
        # the sandbox could not tell a program that ignores it from one that reads it
        zeros=["x"],
    )
)
