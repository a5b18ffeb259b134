"""Gemma's MLP sub-layer as plain PyTorch (transformers' ``models/gemma/modeling_gemma.py``:
``GemmaRMSNorm``, ``GemmaMLP`` with ``hidden_act="gelu_pytorch_tanh"``, the residual of
``GemmaDecoderLayer``), over ``[M, d]`` tokens; captured with ``Block.from_torch``."""

import torch
import torch.nn.functional as F

from coda.blocks import Block, ShapeSets, TensorSpec, register
from coda.blocks.autodiff import backward_block

RMS_NORM_EPS = 1e-6


def gemma_rms_norm(x, weight, eps=RMS_NORM_EPS):
    """``GemmaRMSNorm.forward``: normalised in fp32, times ``1 + weight``, cast once at the end."""
    output = x.float()
    output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


def gemma_mlp(x, gamma, w_gate, w_up, w_down):
    """Gemma MLP sub-layer with its pre-norm and residual: out = x + down(gelu_tanh(gate(h)) *
    up(h)), h = GemmaRMSNorm(x) with weight (1 + gamma)."""
    h = gemma_rms_norm(x, gamma)
    gate = F.gelu(F.linear(h, w_gate), approximate="tanh")
    return x + F.linear(gate * F.linear(h, w_up), w_down)


hf_gemma_mlp = register(
    Block.from_torch(
        gemma_mlp,
        name="hf_gemma_mlp",
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
            "gamma": TensorSpec(
                shape=["d"], init="activation", doc="post_attention_layernorm.weight (1 + gamma)"
            ),
            "w_gate": TensorSpec(shape=["f", "d"], init="linear_weight", doc="gate_proj.weight"),
            "w_up": TensorSpec(shape=["f", "d"], init="linear_weight", doc="up_proj.weight"),
            "w_down": TensorSpec(shape=["d", "f"], init="linear_weight", doc="down_proj.weight"),
        },
        shapes=ShapeSets(
            cpu=[{"M": 37, "d": 48, "f": 80}, {"M": 5, "d": 24, "f": 36}],
            gpu=[{"M": 1000, "d": 1024, "f": 2816}],
        ),
    )
)

hf_gemma_mlp_bwd = register(
    backward_block(
        hf_gemma_mlp,
        name="hf_gemma_mlp_bwd",
        cotangents={
            "out": TensorSpec(shape=["M", "d"], doc="gradient of out"),
        },
        wrt=["x", "gamma", "w_gate", "w_up", "w_down"],
    )
)
