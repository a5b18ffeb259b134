"""Phi-3's MLP sub-layer as plain PyTorch (transformers' ``models/phi3/modeling_phi3.py``:
``Phi3RMSNorm``, ``Phi3MLP`` with its fused ``gate_up_proj`` split by ``chunk(2)``, and the
residual of ``Phi3DecoderLayer``), over ``[M, d]`` tokens."""

import torch
import torch.nn.functional as F

from coda.blocks import Block, ShapeSets, TensorSpec, register
from coda.blocks.autodiff import backward_block

RMS_NORM_EPS = 1e-5


def phi3_rms_norm(hidden_states, weight, eps=RMS_NORM_EPS):
    """``Phi3RMSNorm.forward``: statistics in fp32, cast back, then the weight."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def phi3_mlp(x, gamma, w_gate_up, w_down):
    """Phi-3 MLP sub-layer: out = x + down(up * silu(gate)), [gate | up] = gate_up(h),
    h = rmsnorm(x) * gamma."""
    up_states = F.linear(phi3_rms_norm(x, gamma), w_gate_up)
    gate, up_states = up_states.chunk(2, dim=-1)
    up_states = up_states * F.silu(gate)
    return x + F.linear(up_states, w_down)


hf_phi3_mlp = register(
    Block.from_torch(
        phi3_mlp,
        name="hf_phi3_mlp",
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
            "gamma": TensorSpec(
                shape=["d"], init="norm_weight", doc="post_attention_layernorm.weight"
            ),
            "w_gate_up": TensorSpec(
                shape=["f2", "d"], init="linear_weight", doc="gate_up_proj.weight, [gate; up]"
            ),
            "w_down": TensorSpec(shape=["d", "f"], init="linear_weight", doc="down_proj.weight"),
        },
        shapes=ShapeSets(
            cpu=[{"M": 37, "d": 48, "f": 40, "f2": 80}, {"M": 5, "d": 24, "f": 36, "f2": 72}],
            gpu=[{"M": 1000, "d": 1024, "f": 2816, "f2": 5632}],
        ),
    )
)

hf_phi3_mlp_bwd = register(
    backward_block(
        hf_phi3_mlp,
        name="hf_phi3_mlp_bwd",
        cotangents={"out": TensorSpec(shape=["M", "d"], doc="gradient of out")},
        wrt=["x", "gamma", "w_gate_up", "w_down"],
    )
)
