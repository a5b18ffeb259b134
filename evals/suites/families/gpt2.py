"""GPT-2's MLP sub-layer as plain PyTorch (transformers' ``models/gpt2/modeling_gpt2.py``:
``ln_2``, ``GPT2MLP`` with GPT-2's own activation ``gelu_new`` — transformers'
``NewGELUActivation`` — and the residual of ``GPT2Block``), over ``[M, d]`` tokens. GPT-2's
``Conv1D`` stores its weight as ``[in, out]`` and computes ``x @ weight + bias``; here the
weights are ``[out, in]`` as ``nn.Linear`` keeps them (``Conv1D.weight.T``), so the projection
is ``F.linear``."""

import math

import torch
import torch.nn.functional as F

from coda.blocks import Block, ShapeSets, TensorSpec, register
from coda.blocks.autodiff import backward_block

LAYER_NORM_EPSILON = 1e-5


def new_gelu(input):
    """``NewGELUActivation.forward``: the tanh approximation of GELU, written out (GPT-2's
    ``gelu_new``)."""
    inner = math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))
    return 0.5 * input * (1.0 + torch.tanh(inner))


def gpt2_mlp(x, ln_weight, ln_bias, w_fc, b_fc, w_proj, b_proj):
    """GPT-2 MLP sub-layer: out = x + c_proj(gelu_new(c_fc(ln_2(x)))), biased projections."""
    residual = x
    hidden_states = F.layer_norm(x, (x.shape[-1],), ln_weight, ln_bias, LAYER_NORM_EPSILON)
    hidden_states = F.linear(hidden_states, w_fc, b_fc)
    hidden_states = new_gelu(hidden_states)
    hidden_states = F.linear(hidden_states, w_proj, b_proj)
    return residual + hidden_states


hf_gpt2_mlp = register(
    Block.from_torch(
        gpt2_mlp,
        name="hf_gpt2_mlp",
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
            "ln_weight": TensorSpec(shape=["d"], init="norm_weight", doc="ln_2.weight"),
            "ln_bias": TensorSpec(shape=["d"], doc="ln_2.bias"),
            "w_fc": TensorSpec(shape=["f", "d"], init="linear_weight", doc="c_fc.weight.T"),
            "b_fc": TensorSpec(shape=["f"], doc="c_fc.bias"),
            "w_proj": TensorSpec(shape=["d", "f"], init="linear_weight", doc="c_proj.weight.T"),
            "b_proj": TensorSpec(shape=["d"], doc="c_proj.bias"),
        },
        shapes=ShapeSets(
            cpu=[
                {"M": 37, "d": 40, "f": 72},  # d not a multiple of 16
                {"M": 1, "d": 24, "f": 40},  # one token
            ],
            gpu=[{"M": 1000, "d": 768, "f": 3072}],
        ),
    )
)

hf_gpt2_mlp_bwd = register(
    backward_block(
        hf_gpt2_mlp,
        name="hf_gpt2_mlp_bwd",
        cotangents={
            "out": TensorSpec(shape=["M", "d"], doc="gradient of out"),
        },
        wrt=["x", "ln_weight", "ln_bias", "w_fc", "b_fc", "w_proj", "b_proj"],
        # no gradient depends on c_proj's bias (it only shifts the output): the backward takes
        # none, or the sandbox could not tell a program that ignores it from one that reads it
        zeros=["b_proj"],
    )
)
