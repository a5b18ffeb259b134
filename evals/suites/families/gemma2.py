"""Gemma 2 as plain PyTorch (transformers' ``models/gemma2/modeling_gemma2.py``), over ``[M, d]``
tokens: the sandwich-normed MLP sub-layer of ``Gemma2DecoderLayer`` (``pre_feedforward_layernorm``
and ``post_feedforward_layernorm`` around ``Gemma2MLP``, then the residual) and the last step of
``Gemma2ForCausalLM`` (final norm, LM head, ``final_logit_softcapping``, per-token loss)."""

import torch
import torch.nn.functional as F

from coda.blocks import Block, ShapeSets, TensorSpec, register
from coda.blocks.autodiff import backward_block

RMS_NORM_EPS = 1e-6
FINAL_LOGIT_SOFTCAPPING = 30.0


def gemma2_rms_norm(x, weight, eps=RMS_NORM_EPS):
    """``Gemma2RMSNorm.forward``: normalised in fp32, times ``1 + weight``, cast once."""
    output = x.float()
    output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


def gemma2_mlp(x, pre_gamma, post_gamma, w_gate, w_up, w_down):
    """Gemma 2 MLP sub-layer: out = x + post_norm(down(gelu_tanh(gate(h)) * up(h))),
    h = pre_norm(x); both norms Gemma's (1 + gamma)."""
    residual = x
    h = gemma2_rms_norm(x, pre_gamma)
    h = F.linear(F.gelu(F.linear(h, w_gate), approximate="tanh") * F.linear(h, w_up), w_down)
    h = gemma2_rms_norm(h, post_gamma)
    return residual + h


def gemma2_lm_head_ce(x, gamma, w_lm, target):
    """Gemma 2 final norm + LM head + logit softcap + per-token cross-entropy (fp32, no
    reduction, targets already shifted)."""
    logits = F.linear(gemma2_rms_norm(x, gamma), w_lm)
    logits = logits / FINAL_LOGIT_SOFTCAPPING
    logits = torch.tanh(logits)
    logits = logits * FINAL_LOGIT_SOFTCAPPING
    return F.cross_entropy(logits.float(), target, reduction="none")


hf_gemma2_mlp = register(
    Block.from_torch(
        gemma2_mlp,
        name="hf_gemma2_mlp",
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
            "pre_gamma": TensorSpec(shape=["d"], doc="pre_feedforward_layernorm.weight"),
            "post_gamma": TensorSpec(shape=["d"], doc="post_feedforward_layernorm.weight"),
            "w_gate": TensorSpec(shape=["f", "d"], init="linear_weight", doc="gate_proj.weight"),
            "w_up": TensorSpec(shape=["f", "d"], init="linear_weight", doc="up_proj.weight"),
            "w_down": TensorSpec(shape=["d", "f"], init="linear_weight", doc="down_proj.weight"),
        },
        shapes=ShapeSets(cpu=[{"M": 37, "d": 48, "f": 80}, {"M": 5, "d": 24, "f": 36}]),
    )
)

hf_gemma2_lm_head_ce = register(
    Block.from_torch(
        gemma2_lm_head_ce,
        name="hf_gemma2_lm_head_ce",
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="last hidden states"),
            "gamma": TensorSpec(shape=["d"], doc="model.norm.weight (1 + gamma)"),
            "w_lm": TensorSpec(shape=["V", "d"], init="linear_weight", doc="lm_head.weight"),
            "target": TensorSpec(
                shape=["M"], dtype="int64", init="index", high="V", doc="next-token ids"
            ),
        },
        outputs=["loss"],
        shapes=ShapeSets(cpu=[{"M": 37, "d": 48, "V": 200}, {"M": 5, "d": 24, "V": 77}]),
    )
)

hf_gemma2_mlp_bwd = register(
    backward_block(
        hf_gemma2_mlp,
        name="hf_gemma2_mlp_bwd",
        cotangents={
            "out": TensorSpec(shape=["M", "d"], doc="gradient of out"),
        },
        wrt=["x", "pre_gamma", "post_gamma", "w_gate", "w_up", "w_down"],
    )
)

hf_gemma2_lm_head_ce_bwd = register(
    backward_block(
        hf_gemma2_lm_head_ce,
        name="hf_gemma2_lm_head_ce_bwd",
        cotangents={
            "loss": TensorSpec(shape=["M"], dtype="float32", doc="gradient of the per-token loss"),
        },
        wrt=["x", "gamma", "w_lm"],
    )
)
