"""OLMo 2's MLP half (Hugging Face ``Olmo2DecoderLayer``: ``h + post_feedforward_layernorm(mlp(
(h))``), forward and backward, for the export's drop-in.

OLMo 2 normalizes after its sub-layers: its SwiGLU MLP takes the residual stream ``h`` itself (no
pre-norm), and ``post_feedforward_layernorm`` (``Olmo2RMSNorm``: ``w · x̂`` formed in fp32, cast
after the weight) normalizes the MLP's output before the layer adds the residual.

``olmo2_mlp_branch``: ``out = rmsnorm(down(silu(gate(x)) · up(x))) · gamma_post`` — the post-norm
finished by aux ``norm_rows`` from the down projection's partial sums of squares; the layer adds
the residual. With the four blocks the other MLP families have (``forward``, ``backward``,
``train``, ``backward_saved``) and an epsilon in the name for another epsilon than
``LLAMA_RMS_EPS`` (``olmo2_mlp_branch_eps1e-06_train``, resolved by name); the built-in ones use
``LLAMA_RMS_EPS`` so the shipped Programs of every family share the one epsilon
``coda.export.programs`` substitutes.
"""

from __future__ import annotations

from .autodiff import backward_block
from .block import Block, TensorSpec
from .gemma import SANDWICH_CPU_SHAPES
from .llama import (
    _EPS_FAMILIES,
    _KEYS,
    _VARIANTS,
    LLAMA_RMS_EPS,
    MLP_COTANGENT,
    _mlp_training_pair,
    _with_eps,
    llama_mlp,
)
from .ops import Linear, RMSNorm, SwiGLU
from .registry import register

OLMO2_NORM = {"cast": "after_weight"}  # Olmo2RMSNorm: w · x̂ in fp32, cast after the weight
OLMO2_MLP_GRADS = ["x", "w_gate", "w_up", "w_down", "gamma_post"]

olmo2_mlp_branch = register(
    Block(
        name="olmo2_mlp_branch",
        description=(
            "OLMo 2 MLP branch with its post-norm, without the residual add: out = "
            "rmsnorm(down(silu(gate(x)) * up(x))) * gamma_post (no pre-norm: the MLP takes the "
            "residual stream x itself; post_feedforward_layernorm is Olmo2RMSNorm, the weight "
            "applied in fp32 before the cast back). The caller adds x."
        ),
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream (no pre-norm in OLMo 2)"),
            **{k: llama_mlp.inputs[k] for k in ("w_gate", "w_up", "w_down")},
            "gamma_post": TensorSpec(
                shape=["d"], init="norm_weight", doc="post_feedforward_layernorm.weight"
            ),
        },
        graph=[
            Linear(x="x", weight="w_gate", out="g"),
            Linear(x="x", weight="w_up", out="u"),
            SwiGLU(gate="g", up="u", out="a"),
            Linear(x="a", weight="w_down", out="m"),
            RMSNorm(x="m", weight="gamma_post", eps=LLAMA_RMS_EPS, out="out", **OLMO2_NORM),
        ],
        outputs=["out"],
        shapes=llama_mlp.shapes.model_copy(update={"cpu": SANDWICH_CPU_SHAPES}),
    )
)


def _family(forward: Block) -> tuple[Block, ...]:
    """``(forward, backward, train, backward_saved)`` of ``forward``, registered."""
    backward = backward_block(
        forward, name=f"{forward.name}_bwd", cotangents=MLP_COTANGENT, wrt=OLMO2_MLP_GRADS
    )
    training = _mlp_training_pair(forward, forward.name, OLMO2_MLP_GRADS)
    return (forward, register(backward), *training)


_BUILTIN = _family(olmo2_mlp_branch)
olmo2_mlp_branch, olmo2_mlp_branch_bwd, olmo2_mlp_branch_train, olmo2_mlp_branch_bwd_saved = (
    _BUILTIN
)


def olmo2_mlp_family(eps: float) -> dict[str, Block]:
    """The ``olmo2_mlp_branch`` blocks for the post-norm's epsilon: ``forward``, ``backward``
    (gets the forward inputs), ``train`` (also returns g, u and a = silu(g)·u) and
    ``backward_saved`` (gets them). Another epsilon than 1e-5 registers
    ``olmo2_mlp_branch_eps<eps>`` and its ``_bwd``, ``_train``, ``_bwd_saved`` on first use."""
    if eps == LLAMA_RMS_EPS:
        return dict(zip(_KEYS, _BUILTIN, strict=True))
    name = f"olmo2_mlp_branch_eps{eps:g}"
    if name not in _VARIANTS:
        _VARIANTS[name] = _family(_with_eps(olmo2_mlp_branch, eps, name))
    return dict(zip(_KEYS, _VARIANTS[name], strict=True))


_EPS_FAMILIES["olmo2_mlp_branch"] = olmo2_mlp_family
