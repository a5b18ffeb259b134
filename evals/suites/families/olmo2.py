"""OLMo 2's attention output as plain PyTorch (transformers' ``models/olmo2/modeling_olmo2.py``:
``o_proj``, then ``post_attention_layernorm`` — ``Olmo2RMSNorm``, whose weight multiplies before
the cast back — and the residual of ``Olmo2DecoderLayer``), over ``[M, d]`` tokens."""

import torch
import torch.nn.functional as F

from coda.blocks import Block, ShapeSets, TensorSpec, register

RMS_NORM_EPS = 1e-6


def olmo2_rms_norm(hidden_states, weight, eps=RMS_NORM_EPS):
    """``Olmo2RMSNorm.forward``: statistics in fp32, times the weight, then cast back."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return (weight * hidden_states).to(input_dtype)


def olmo2_attn_out(attn, w_o, gamma, x):
    """OLMo 2 attention output with its post-norm: x_out = x + rmsnorm(attn @ w_o.T) * gamma."""
    return x + olmo2_rms_norm(F.linear(attn, w_o), gamma)


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
