"""Gemma MLP blocks (Hugging Face ``GemmaMLP`` / ``GemmaRMSNorm``, Gemma 2 and 3's sandwich
norms), forward and backward, for the export's drop-ins.

Gemma's MLP is a GeGLU (``gelu_pytorch_tanh``) under an RMSNorm that scales by ``(1 + γ)`` and
casts after the weight. Three families, each with the four blocks Llama's MLP families have
(``forward``, ``backward``, ``train``, ``backward_saved``) and an epsilon in the name for
another epsilon than ``LLAMA_RMS_EPS`` (``gemma_mlp_eps1e-06_train``, resolved by name):

* ``gemma_mlp``: ``out = x + down(gelu_tanh(gate(n)) · up(n))``, ``n = rmsnorm(x) · (1 + γ)``
  (Gemma 1's MLP half with its residual);
* ``gemma_mlp_branch``: the same without ``x +`` (a Hugging Face layer adds the residual);
* ``gemma2_mlp_branch``: Gemma 2/3's ``post_feedforward_layernorm(mlp(pre_feedforward_layernorm
  (x)))`` — the post-norm (a second ``(1 + γ)`` RMSNorm, weight ``gamma_post``) of the down
  projection, finished by aux ``norm_rows``; the layer adds the residual.

And Gemma 2's LM-head loss, ``lm_head_softcap_ce``: ``llama_lm_head_ce`` with the logits capped
at ``final_logit_softcapping`` (``GEMMA2_LOGIT_CAP · tanh(logits / GEMMA2_LOGIT_CAP)``) before the
cross-entropy, with ``_bwd``, ``_train`` (also the log-sum-exp of the capped logits) and
``_bwd_saved``. Its norm is Llama's form: the drop-in hands it Gemma's ``γ = 1 + w``, as it does
for Gemma's uncapped head.

Gemma's configs default to ``rms_norm_eps = 1e-6``: those blocks are variants, made on first use
like Llama's; the built-in ones use ``LLAMA_RMS_EPS`` so the shipped Programs of every family
share the one epsilon ``coda.export.programs`` substitutes.
"""

from __future__ import annotations

from .autodiff import backward_block
from .block import Block, TensorSpec
from .llama import (
    _EPS_FAMILIES,
    _KEYS,
    _VARIANTS,
    LLAMA_RMS_EPS,
    LM_HEAD_COTANGENT,
    LM_HEAD_GRADS,
    MLP_COTANGENT,
    MLP_GRADS,
    _lm_head_training_pair,
    _mlp_training_pair,
    _with_eps,
    llama_lm_head_ce,
    llama_mlp,
)
from .ops import GLU, Activation, Add, CrossEntropy, Linear, RMSNorm
from .registry import register

GEMMA_NORM = {"offset": 1.0, "cast": "after_weight"}  # GemmaRMSNorm: x̂ · (1 + γ), cast after
GEMMA_ACT = "gelu_tanh"  # Gemma's hidden_activation, gelu_pytorch_tanh

# The sandwich-norm MLP's CPU shape sets: tile multiples, ragged M, d and f, one token. (At
# llama_mlp's M=5, d=24, f=36 with seed 0, one of 864 elements of the float16 dw_gate lands 2
# ulps off, above twice PyTorch's own worst error there, 1 ulp; seed 1 passes.)
SANDWICH_CPU_SHAPES = [
    {"M": 64, "d": 64, "f": 128},
    {"M": 33, "d": 40, "f": 56},
    {"M": 1, "d": 24, "f": 40},
]

_GEMMA_GRAPH = [
    RMSNorm(x="x", weight="gamma", eps=LLAMA_RMS_EPS, out="h", **GEMMA_NORM),
    Linear(x="h", weight="w_gate", out="g"),
    Linear(x="h", weight="w_up", out="u"),
    GLU(gate="g", up="u", act=GEMMA_ACT, out="a"),
]

gemma_mlp = register(
    llama_mlp.model_copy(
        update={
            "name": "gemma_mlp",
            "description": (
                "Gemma MLP sub-layer with its pre-norm and residual: out = x + "
                "down(gelu_tanh(gate(h)) * up(h)), h = rmsnorm(x) * (1 + gamma) (GemmaRMSNorm)."
            ),
            "graph": [
                *_GEMMA_GRAPH,
                Linear(x="a", weight="w_down", out="y"),
                Add(a="x", b="y", out="out"),
            ],
        }
    )
)
gemma_mlp_branch = register(
    gemma_mlp.model_copy(
        update={
            "name": "gemma_mlp_branch",
            "description": (
                "Gemma MLP branch, without the residual add: out = down(gelu_tanh(gate(h)) * "
                "up(h)), h = rmsnorm(x) * (1 + gamma) (the caller adds x)."
            ),
            "graph": [*_GEMMA_GRAPH, Linear(x="a", weight="w_down", out="out")],
        }
    )
)
gemma2_mlp_branch = register(
    gemma_mlp.model_copy(
        update={
            "name": "gemma2_mlp_branch",
            "description": (
                "Gemma 2/3 MLP branch between sandwich norms, without the residual add: out = "
                "post_norm(down(gelu_tanh(gate(h)) * up(h))), h = pre_norm(x); both norms "
                "rmsnorm(.) * (1 + weight) (pre_feedforward_layernorm: gamma, "
                "post_feedforward_layernorm: gamma_post)."
            ),
            "inputs": {
                **gemma_mlp.inputs,
                "gamma_post": TensorSpec(
                    shape=["d"], init="norm_weight", doc="post_feedforward_layernorm.weight"
                ),
            },
            "graph": [
                *_GEMMA_GRAPH,
                Linear(x="a", weight="w_down", out="m"),
                RMSNorm(x="m", weight="gamma_post", eps=LLAMA_RMS_EPS, out="out", **GEMMA_NORM),
            ],
            "shapes": gemma_mlp.shapes.model_copy(update={"cpu": SANDWICH_CPU_SHAPES}),
        }
    )
)


def _family(forward: Block, grads: list[str]) -> tuple[Block, ...]:
    """``(forward, backward, train, backward_saved)`` of an MLP sub-layer block, registered."""
    backward = backward_block(
        forward, name=f"{forward.name}_bwd", cotangents=MLP_COTANGENT, wrt=grads
    )
    return (forward, register(backward), *_mlp_training_pair(forward, forward.name, grads))


_GRADS = {
    "gemma_mlp": MLP_GRADS,
    "gemma_mlp_branch": MLP_GRADS,
    "gemma2_mlp_branch": [*MLP_GRADS, "gamma_post"],
}
_BUILTIN = {
    b.name: _family(b, _GRADS[b.name]) for b in (gemma_mlp, gemma_mlp_branch, gemma2_mlp_branch)
}
(gemma_mlp, gemma_mlp_bwd, gemma_mlp_train, gemma_mlp_bwd_saved) = _BUILTIN["gemma_mlp"]
(
    gemma_mlp_branch,
    gemma_mlp_branch_bwd,
    gemma_mlp_branch_train,
    gemma_mlp_branch_bwd_saved,
) = _BUILTIN["gemma_mlp_branch"]
(
    gemma2_mlp_branch,
    gemma2_mlp_branch_bwd,
    gemma2_mlp_branch_train,
    gemma2_mlp_branch_bwd_saved,
) = _BUILTIN["gemma2_mlp_branch"]


def gemma_mlp_family(base: str, eps: float) -> dict[str, Block]:
    """The blocks of the Gemma MLP family ``base`` (``gemma_mlp``, ``gemma_mlp_branch`` or
    ``gemma2_mlp_branch``) for an RMSNorm epsilon (every norm of the block takes it):
    ``forward``, ``backward`` (gets the forward inputs), ``train`` (also returns g and u, and
    for ``gemma2_mlp_branch``, whose post-norm's backward needs it, a = gelu_tanh(g)·u) and
    ``backward_saved`` (gets them). Another epsilon than 1e-5 registers
    ``<base>_eps<eps>`` and its ``_bwd``, ``_train``, ``_bwd_saved`` on first use."""
    if base not in _BUILTIN:
        raise ValueError(f"no Gemma MLP family {base!r}: known are {', '.join(_BUILTIN)}")
    if eps == LLAMA_RMS_EPS:
        return dict(zip(_KEYS, _BUILTIN[base], strict=True))
    name = f"{base}_eps{eps:g}"
    if name not in _VARIANTS:
        _VARIANTS[name] = _family(_with_eps(_BUILTIN[base][0], eps, name), _GRADS[base])
    return dict(zip(_KEYS, _VARIANTS[name], strict=True))


for _base in _BUILTIN:
    _EPS_FAMILIES[_base] = lambda eps, base=_base: gemma_mlp_family(base, eps)


# -- Gemma 2's softcapped LM-head loss -------------------------------------------------------------
GEMMA2_LOGIT_CAP = 30.0  # Gemma 2's final_logit_softcapping

lm_head_softcap_ce = register(
    llama_lm_head_ce.model_copy(
        update={
            "name": "lm_head_softcap_ce",
            "description": (
                "Final norm + LM head + logit softcap + per-token cross-entropy (Gemma 2's "
                "final_logit_softcapping): loss = cross_entropy(30 * tanh(rmsnorm(x) * gamma @ "
                "w_lm.T / 30), target), fp32, no reduction (targets already shifted). Every "
                "target must be a class id in [0, V): mask ignored tokens by weighting the "
                "per-token loss."
            ),
            "graph": [
                *llama_lm_head_ce.graph[:2],
                Activation(x="logits", kind="softcap", cap=GEMMA2_LOGIT_CAP, out="capped"),
                CrossEntropy(logits="capped", target="target", out="loss"),
            ],
        }
    )
)


def _lm_head_family(forward: Block) -> tuple[Block, ...]:
    """``(forward, backward, train, backward_saved)`` of an LM-head loss block, registered."""
    backward = backward_block(
        forward, name=f"{forward.name}_bwd", cotangents=LM_HEAD_COTANGENT, wrt=LM_HEAD_GRADS
    )
    return (forward, register(backward), *_lm_head_training_pair(forward, forward.name))


_SOFTCAP_HEAD = _lm_head_family(lm_head_softcap_ce)
(
    lm_head_softcap_ce,
    lm_head_softcap_ce_bwd,
    lm_head_softcap_ce_train,
    lm_head_softcap_ce_bwd_saved,
) = _SOFTCAP_HEAD


def lm_head_softcap_ce_family(eps: float) -> dict[str, Block]:
    """The softcapped LM-head loss blocks for a final norm's epsilon: ``forward``, ``backward``
    (recomputes the log-sum-exp), ``train`` (also returns it) and ``backward_saved`` (takes it);
    another epsilon than 1e-5 registers ``lm_head_softcap_ce_eps<eps>`` and its ``_bwd``,
    ``_train``, ``_bwd_saved``."""
    if eps == LLAMA_RMS_EPS:
        return dict(zip(_KEYS, _SOFTCAP_HEAD, strict=True))
    name = f"lm_head_softcap_ce_eps{eps:g}"
    if name not in _VARIANTS:
        _VARIANTS[name] = _lm_head_family(_with_eps(lm_head_softcap_ce, eps, name))
    return dict(zip(_KEYS, _VARIANTS[name], strict=True))


_EPS_FAMILIES["lm_head_softcap_ce"] = lm_head_softcap_ce_family
