"""OLMo 2's attention projections as plain PyTorch (transformers' ``models/olmo2/
modeling_olmo2.py``), over ``[M, d]`` tokens. OLMo 2 normalises after its sub-layers, so the
attention input has no input norm: ``Olmo2Attention``'s q/k/v projections of the residual
stream, ``q_norm``/``k_norm`` — ``Olmo2RMSNorm`` over the whole projection (all heads), whose
weight multiplies before the cast back — then ``apply_rotary_pos_emb`` (which casts back to the
input's dtype); and the attention output: ``o_proj``, then ``post_attention_layernorm`` and the
residual of ``Olmo2DecoderLayer``."""

import torch
import torch.nn.functional as F

from coda.blocks import Block, ShapeSets, TensorSpec, register
from coda.blocks.autodiff import backward_block

RMS_NORM_EPS = 1e-6


def olmo2_rms_norm(hidden_states, weight, eps=RMS_NORM_EPS):
    """``Olmo2RMSNorm.forward``: statistics in fp32, times the weight, then cast back."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return (weight * hidden_states).to(input_dtype)


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """OLMo 2's ``apply_rotary_pos_emb`` (q, k ``[M, heads, head_dim]``, cos/sin ``[M,
    head_dim]``): Hugging Face's rotation, cast back to q's and k's dtypes."""
    q_type, k_type = q.dtype, k.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(q_type), k_embed.to(k_type)


def olmo2_attn_in(x, w_q, w_k, w_v, q_gamma, k_gamma, cos, sin):
    """OLMo 2 attention input: q, k, v = x @ w_q.T, x @ w_k.T, x @ w_v.T (no input norm); q and
    k RMS-normed over the whole projection (q_norm, k_norm), then rotated by RoPE in Hugging
    Face's rotate-half order, heads concatenated."""
    tokens, head_dim = x.shape[0], cos.shape[-1]
    hidden_shape = (tokens, -1, head_dim)
    query_states = olmo2_rms_norm(F.linear(x, w_q), q_gamma)
    key_states = olmo2_rms_norm(F.linear(x, w_k), k_gamma)
    value_states = F.linear(x, w_v)
    query_states, key_states = apply_rotary_pos_emb(
        query_states.view(hidden_shape), key_states.view(hidden_shape), cos, sin
    )
    return {
        "q": query_states.reshape(tokens, -1),
        "k": key_states.reshape(tokens, -1),
        "v": value_states,
    }


def olmo2_attn_out(attn, w_o, gamma, x):
    """OLMo 2 attention output with its post-norm: x_out = x + rmsnorm(attn @ w_o.T) * gamma."""
    return x + olmo2_rms_norm(F.linear(attn, w_o), gamma)


hf_olmo2_attn_in = register(
    Block.from_torch(
        olmo2_attn_in,
        name="hf_olmo2_attn_in",
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream (no input norm in OLMo 2)"),
            "w_q": TensorSpec(shape=["Nq", "d"], init="linear_weight", doc="q_proj.weight"),
            "w_k": TensorSpec(shape=["Nkv", "d"], init="linear_weight", doc="k_proj.weight"),
            "w_v": TensorSpec(shape=["Nkv", "d"], init="linear_weight", doc="v_proj.weight"),
            "q_gamma": TensorSpec(shape=["Nq"], init="norm_weight", doc="q_norm.weight"),
            "k_gamma": TensorSpec(shape=["Nkv"], init="norm_weight", doc="k_norm.weight"),
            "cos": TensorSpec(shape=["M", "D"], doc="rotary cos, [tokens, head_dim]"),
            "sin": TensorSpec(shape=["M", "D"], doc="rotary sin, [tokens, head_dim]"),
        },
        shapes=ShapeSets(
            cpu=[
                {"M": 37, "d": 48, "Nq": 64, "Nkv": 16, "D": 16},  # GQA 4:1, ragged M and d
                {"M": 5, "d": 40, "Nq": 48, "Nkv": 48, "D": 8},  # MHA
                {"M": 1, "d": 40, "Nq": 32, "Nkv": 16, "D": 8},  # one token, GQA 2:1
            ],
            gpu=[{"M": 1000, "d": 1024, "Nq": 1024, "Nkv": 256, "D": 128}],
        ),
    )
)

hf_olmo2_attn_out = register(
    Block.from_torch(
        olmo2_attn_out,
        name="hf_olmo2_attn_out",
        inputs={
            "attn": TensorSpec(shape=["M", "Nq"], doc="attention output, heads concatenated"),
            "w_o": TensorSpec(shape=["d", "Nq"], init="linear_weight", doc="o_proj.weight"),
            "gamma": TensorSpec(
                shape=["d"], init="norm_weight", doc="post_attention_layernorm.weight"
            ),
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
        },
        outputs=["x_out"],
        shapes=ShapeSets(cpu=[{"M": 37, "d": 40, "Nq": 64}, {"M": 5, "d": 24, "Nq": 48}]),
    )
)

hf_olmo2_attn_in_bwd = register(
    backward_block(
        hf_olmo2_attn_in,
        name="hf_olmo2_attn_in_bwd",
        cotangents={
            "q": TensorSpec(shape=["M", "Nq"], doc="gradient of q"),
            "k": TensorSpec(shape=["M", "Nkv"], doc="gradient of k"),
            "v": TensorSpec(shape=["M", "Nkv"], doc="gradient of v"),
        },
        wrt=["x", "w_q", "w_k", "w_v", "q_gamma", "k_gamma"],
    )
)

hf_olmo2_attn_out_bwd = register(
    backward_block(
        hf_olmo2_attn_out,
        name="hf_olmo2_attn_out_bwd",
        cotangents={
            "x_out": TensorSpec(shape=["M", "d"], doc="gradient of x_out"),
        },
        wrt=["attn", "w_o", "gamma", "x"],
        # no gradient depends on the residual's values (dx = dout): the backward takes none, or
        # the sandbox could not tell a program that ignores it from one that reads it
        zeros=["x"],
    )
)
