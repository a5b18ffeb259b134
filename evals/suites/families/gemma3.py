"""Gemma 3's attention input as plain PyTorch (transformers' ``models/gemma3/modeling_gemma3.py``:
``input_layernorm`` — ``Gemma3RMSNorm``, ``x̂ · (1 + w)`` cast once at the end — then
``Gemma3Attention``'s q/k/v projections, its per-head ``q_norm``/``k_norm`` (``Gemma3RMSNorm``
over ``head_dim``, again ``1 + w``) and ``apply_rotary_pos_emb``), over ``[M, d]`` tokens; the
attention itself is not part of the block."""

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


def gemma3_rms_norm(x, weight, eps=RMS_NORM_EPS):
    """``Gemma3RMSNorm.forward``: normalised in fp32, times ``1 + weight``, cast once."""
    output = x.float()
    output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


def gemma3_attn_in(x, gamma, w_q, w_k, w_v, q_gamma, k_gamma, cos, sin):
    """Gemma 3 attention input: h = rmsnorm(x) * (1 + gamma); q, k, v = projections of h; each
    head of q and k RMS-normed over head_dim with weight (1 + q_gamma), (1 + k_gamma), then
    rotated by RoPE in Hugging Face's rotate-half order, heads concatenated."""
    tokens, head_dim = x.shape[0], cos.shape[-1]
    hidden_shape = (tokens, -1, head_dim)
    h = gemma3_rms_norm(x, gamma)
    query_states = gemma3_rms_norm(F.linear(h, w_q).view(hidden_shape), q_gamma)
    key_states = gemma3_rms_norm(F.linear(h, w_k).view(hidden_shape), k_gamma)
    value_states = F.linear(h, w_v)
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    return {
        "q": query_states.reshape(tokens, -1),
        "k": key_states.reshape(tokens, -1),
        "v": value_states,
    }


hf_gemma3_attn_in = register(
    Block.from_torch(
        gemma3_attn_in,
        name="hf_gemma3_attn_in",
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
            "gamma": TensorSpec(shape=["d"], doc="input_layernorm.weight (1 + gamma)"),
            "w_q": TensorSpec(shape=["Nq", "d"], init="linear_weight", doc="q_proj.weight"),
            "w_k": TensorSpec(shape=["Nkv", "d"], init="linear_weight", doc="k_proj.weight"),
            "w_v": TensorSpec(shape=["Nkv", "d"], init="linear_weight", doc="v_proj.weight"),
            "q_gamma": TensorSpec(shape=["D"], doc="q_norm.weight (1 + q_gamma)"),
            "k_gamma": TensorSpec(shape=["D"], doc="k_norm.weight (1 + k_gamma)"),
            "cos": TensorSpec(shape=["M", "D"], doc="rotary cos, [tokens, head_dim]"),
            "sin": TensorSpec(shape=["M", "D"], doc="rotary sin, [tokens, head_dim]"),
        },
        shapes=ShapeSets(
            cpu=[
                {"M": 37, "d": 48, "Nq": 64, "Nkv": 16, "D": 16},  # GQA 4:1, ragged M and d
                {"M": 5, "d": 40, "Nq": 32, "Nkv": 16, "D": 8},  # GQA 2:1
                {"M": 1, "d": 40, "Nq": 32, "Nkv": 32, "D": 8},  # one token, MHA
            ],
            gpu=[{"M": 1000, "d": 1152, "Nq": 1024, "Nkv": 256, "D": 256}],
        ),
    )
)

hf_gemma3_attn_in_bwd = register(
    backward_block(
        hf_gemma3_attn_in,
        name="hf_gemma3_attn_in_bwd",
        cotangents={
            "q": TensorSpec(shape=["M", "Nq"], doc="gradient of q"),
            "k": TensorSpec(shape=["M", "Nkv"], doc="gradient of k"),
            "v": TensorSpec(shape=["M", "Nkv"], doc="gradient of v"),
        },
        wrt=["x", "gamma", "w_q", "w_k", "w_v", "q_gamma", "k_gamma"],
    )
)
