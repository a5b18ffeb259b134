"""Attention-output blocks for the export's drop-ins: ``o_proj`` and the attention residual of a
decoder layer, with or without a post-norm between them, forward and backward.

* ``attn_out``: ``x_out = x + attn @ w_o.T`` (Llama, Mistral, Qwen2/3, Phi-3, Gemma: the layer
  adds ``o_proj``'s output to the residual stream);
* ``gemma2_attn_out``: ``x_out = x + rmsnorm(attn @ w_o.T) · (1 + γ)`` (Gemma 2/3's
  ``post_attention_layernorm``, a ``GemmaRMSNorm``: ``(1 + γ)`` in fp32, cast after);
* ``olmo2_attn_out``: ``x_out = x + rmsnorm(attn @ w_o.T) · γ`` (OLMo 2's
  ``post_attention_layernorm``, an ``Olmo2RMSNorm``: ``γ · x̂`` in fp32, cast after).

Each has a backward (``<name>_bwd``: gradients of ``attn``, ``w_o`` and the post-norm's
``gamma``; the residual ``x``'s is ``dx_out`` itself, so the backward neither takes ``x`` nor
returns ``dx``: ``VJP.passthrough``).
The post-norm forms have an epsilon: another value than ``LLAMA_RMS_EPS`` registers
``<name>_eps<eps>`` and its ``_bwd`` on first use (resolved by name, as the MLP families are);
``attn_out`` has no norm and one family for every epsilon.

Where it pays to hand the next norm its statistic (``llama_attn_out``'s ``RowRstd``), the MLP
half's kernels would have to take ``rstd`` as an input instead of computing it; they do not yet,
so these blocks end at ``x_out``.
"""

from __future__ import annotations

from .autodiff import backward_block
from .block import Block, ShapeSets, TensorSpec
from .llama import _EPS_FAMILIES, _VARIANTS, LLAMA_RMS_EPS, _with_eps
from .ops import Add, Linear, RMSNorm
from .registry import register

# The forms of post_attention_layernorm a post-norm block applies, as RMSNorm fields.
GEMMA2_POST_NORM = {"offset": 1.0, "cast": "after_weight"}  # Gemma2RMSNorm: x̂ · (1 + γ)
OLMO2_POST_NORM = {"cast": "after_weight"}  # Olmo2RMSNorm: (γ · x̂) in fp32, cast after

_INPUTS = {
    "attn": TensorSpec(shape=["M", "Nq"], doc="attention output, heads concatenated"),
    "w_o": TensorSpec(shape=["d", "Nq"], init="linear_weight", doc="o_proj.weight"),
    "x": TensorSpec(shape=["M", "d"], doc="residual stream (the layer's input)"),
}
_GAMMA = TensorSpec(shape=["d"], init="norm_weight", doc="post_attention_layernorm.weight")
_SHAPES = ShapeSets(
    cpu=[
        {"M": 37, "d": 40, "Nq": 64},  # ragged M, d not a multiple of 16
        {"M": 1, "d": 24, "Nq": 48},  # one token
        {"M": 64, "d": 64, "Nq": 64},  # tile multiples
    ],
    gpu=[{"M": 1000, "d": 1000, "Nq": 1024}, {"M": 2048, "d": 2048, "Nq": 2048}],
    bench=[{"M": 16384, "d": 4096, "Nq": 4096}],
)
_COTANGENT = {"x_out": TensorSpec(shape=["M", "d"], doc="gradient of x_out")}

attn_out = register(
    Block(
        name="attn_out",
        description=(
            "Attention output of a decoder layer: x_out = x + attn @ w_o.T (o_proj and the "
            "attention residual)."
        ),
        inputs=_INPUTS,
        graph=[Linear(x="attn", weight="w_o", out="y"), Add(a="x", b="y", out="x_out")],
        outputs=["x_out"],
        shapes=_SHAPES,
    )
)


def _post_norm_block(name: str, norm: dict[str, object], form: str) -> Block:
    return register(
        Block(
            name=name,
            description=(
                f"Attention output with a post-norm: x_out = x + rmsnorm(attn @ w_o.T) {form} "
                "(o_proj, post_attention_layernorm and the attention residual)."
            ),
            inputs={**_INPUTS, "gamma": _GAMMA},
            graph=[
                Linear(x="attn", weight="w_o", out="y"),
                RMSNorm(x="y", weight="gamma", eps=LLAMA_RMS_EPS, out="n", **norm),
                Add(a="x", b="n", out="x_out"),
            ],
            outputs=["x_out"],
            shapes=_SHAPES,
        )
    )


gemma2_attn_out = _post_norm_block(
    "gemma2_attn_out", GEMMA2_POST_NORM, "* (1 + gamma) (GemmaRMSNorm, cast after the weight)"
)
olmo2_attn_out = _post_norm_block(
    "olmo2_attn_out", OLMO2_POST_NORM, "* gamma (Olmo2RMSNorm, cast after the weight)"
)


def _backward(forward: Block) -> Block:
    """``<forward>_bwd``: gradients of ``attn``, ``w_o`` (and ``gamma``). The residual's is
    ``dx_out`` itself (``passthrough``): ``x`` is neither an input (the sandbox could not tell a
    Program that ignores it from one that reads it) nor is ``dx`` an output — the exported
    function hands ``dx_out`` on as ``x``'s gradient, with no copy."""
    return register(
        backward_block(
            forward,
            name=f"{forward.name}_bwd",
            cotangents=_COTANGENT,
            wrt=[n for n in forward.inputs if n != "x"],
            passthrough=["x"],
        )
    )


_ATTN_OUT_KEYS = ("forward", "backward")
_BUILTIN = {b.name: (b, _backward(b)) for b in (attn_out, gemma2_attn_out, olmo2_attn_out)}
attn_out_bwd = _BUILTIN["attn_out"][1]
gemma2_attn_out_bwd = _BUILTIN["gemma2_attn_out"][1]
olmo2_attn_out_bwd = _BUILTIN["olmo2_attn_out"][1]


def attn_out_family(base: str, eps: float) -> dict[str, Block]:
    """``forward`` and ``backward`` of the attention-output block ``base`` (``attn_out``,
    ``gemma2_attn_out`` or ``olmo2_attn_out``) for a post-norm epsilon ``eps``: the built-in
    blocks at ``LLAMA_RMS_EPS`` (and for ``attn_out``, which has no norm, at any epsilon), else
    ``<base>_eps<eps>`` and its ``_bwd``, registered on first use."""
    if base not in _BUILTIN:
        raise ValueError(f"no attention-output block {base!r}: known are {', '.join(_BUILTIN)}")
    if eps == LLAMA_RMS_EPS or base == "attn_out":
        return dict(zip(_ATTN_OUT_KEYS, _BUILTIN[base], strict=True))
    name = f"{base}_eps{eps:g}"
    if name not in _VARIANTS:
        forward = _with_eps(_BUILTIN[base][0], eps, name)
        _VARIANTS[name] = (forward, _backward(forward))
    return dict(zip(_ATTN_OUT_KEYS, _VARIANTS[name], strict=True))


for _base in ("gemma2_attn_out", "olmo2_attn_out"):
    _EPS_FAMILIES[_base] = lambda eps, base=_base: attn_out_family(base, eps)
