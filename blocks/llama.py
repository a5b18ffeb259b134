"""Llama blocks (Hugging Face ``LlamaMLP`` / ``LlamaRMSNorm`` / ``LlamaAttention`` projections /
causal-LM loss semantics), forward and backward.

The layer boundary is shifted so every norm sits between two GEMMs (docs/algebra.md §7):
``llama_attn_out`` ends a sub-layer with the residual and the next norm's statistic;
``llama_attn_in`` and ``llama_mlp`` start one with a norm; ``llama_lm_head_ce`` is the last.
Backward blocks are autograd of these.
"""

from __future__ import annotations

from .autodiff import VJP, Pick, backward_block
from .block import Block, ShapeSets, TensorSpec
from .ops import (
    GLU,
    Add,
    Concat,
    CrossEntropy,
    Linear,
    LogSumExp,
    PairLayout,
    RMSNorm,
    RoPEPairs,
    RowRstd,
    SwiGLU,
)
from .registry import register, register_resolver

LLAMA_RMS_EPS = 1e-5  # Llama 3's rms_norm_eps

llama_mlp = register(
    Block(
        name="llama_mlp",
        description=(
            "Llama MLP sub-layer with its pre-norm and residual: "
            "out = x + down(silu(gate(h)) * up(h)), h = rmsnorm(x) * gamma."
        ),
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream, M tokens of width d"),
            "gamma": TensorSpec(
                shape=["d"], init="norm_weight", doc="post_attention_layernorm.weight"
            ),
            "w_gate": TensorSpec(shape=["f", "d"], init="linear_weight", doc="gate_proj.weight"),
            "w_up": TensorSpec(shape=["f", "d"], init="linear_weight", doc="up_proj.weight"),
            "w_down": TensorSpec(shape=["d", "f"], init="linear_weight", doc="down_proj.weight"),
        },
        graph=[
            RMSNorm(x="x", weight="gamma", eps=LLAMA_RMS_EPS, out="h"),
            Linear(x="h", weight="w_gate", out="g"),
            Linear(x="h", weight="w_up", out="u"),
            SwiGLU(gate="g", up="u", out="a"),
            Linear(x="a", weight="w_down", out="y"),
            Add(a="x", b="y", out="out"),
        ],
        outputs=["out"],
        shapes=ShapeSets(
            cpu=[
                {"M": 64, "d": 64, "f": 128},  # tile multiples
                {"M": 67, "d": 48, "f": 80},  # ragged M, d, and 2f
                {"M": 37, "d": 45, "f": 70},  # odd d: ragged K of gate/up and N of down
                {"M": 5, "d": 24, "f": 36},  # fewer tokens than one tile
            ],
            gpu=[
                {"M": 1024, "d": 1024, "f": 2816},
                {"M": 1000, "d": 1000, "f": 2744},  # ragged
                {"M": 4096, "d": 2048, "f": 8192},
            ],
            bench=[
                {"M": 16384, "d": 2048, "f": 8192},
                {"M": 16384, "d": 4096, "f": 14336},
            ],
        ),
    )
)

llama_attn_in = register(
    Block(
        name="llama_attn_in",
        description=(
            "Llama attention input: h = rmsnorm(x) * gamma; q, k, v = h @ w_q.T, h @ w_k.T, "
            "h @ w_v.T; q and k rotated by RoPE (Hugging Face apply_rotary_pos_emb) and "
            "returned in the per-head adjacent-pair column order [r0, r_{D/2}, r1, r_{D/2+1}, "
            "...] that a fused kernel writes (attention scores are unchanged: q and k share "
            "it); qkv = [q | k | v]. MHA when Nkv == Nq, GQA when Nkv < Nq."
        ),
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
            "gamma": TensorSpec(shape=["d"], init="norm_weight", doc="input_layernorm.weight"),
            "w_q": TensorSpec(shape=["Nq", "d"], init="linear_weight", doc="q_proj.weight"),
            "w_k": TensorSpec(shape=["Nkv", "d"], init="linear_weight", doc="k_proj.weight"),
            "w_v": TensorSpec(shape=["Nkv", "d"], init="linear_weight", doc="v_proj.weight"),
            "cos": TensorSpec(shape=["M", "D"], doc="LlamaRotaryEmbedding cos, [tokens, head_dim]"),
            "sin": TensorSpec(shape=["M", "D"], doc="LlamaRotaryEmbedding sin, [tokens, head_dim]"),
        },
        graph=[
            RMSNorm(x="x", weight="gamma", eps=LLAMA_RMS_EPS, out="h"),
            Linear(x="h", weight="w_q", out="q"),
            Linear(x="h", weight="w_k", out="k"),
            Linear(x="h", weight="w_v", out="v"),
            PairLayout(x="q", cos="cos", out="q_pairs"),
            PairLayout(x="k", cos="cos", out="k_pairs"),
            RoPEPairs(x="q_pairs", cos="cos", sin="sin", out="q_rot"),
            RoPEPairs(x="k_pairs", cos="cos", sin="sin", out="k_rot"),
            Concat(parts=["q_rot", "k_rot", "v"], out="qkv"),
        ],
        outputs=["qkv"],
        shapes=ShapeSets(
            cpu=[
                {"M": 37, "d": 48, "Nq": 64, "Nkv": 16, "D": 16},  # GQA 4:1, ragged M and d
                {"M": 64, "d": 64, "Nq": 64, "Nkv": 64, "D": 16},  # MHA, tile multiples
                {"M": 5, "d": 40, "Nq": 48, "Nkv": 16, "D": 8},  # GQA 3:1, fewer tokens than a tile
            ],
            gpu=[
                {"M": 1000, "d": 1024, "Nq": 1024, "Nkv": 256, "D": 128},
                {"M": 2048, "d": 2048, "Nq": 2048, "Nkv": 2048, "D": 128},
            ],
            bench=[{"M": 16384, "d": 4096, "Nq": 4096, "Nkv": 1024, "D": 128}],
        ),
    )
)

llama_attn_out = register(
    Block(
        name="llama_attn_out",
        description=(
            "Llama attention output: x_out = x + attn @ w_o.T (o_proj + residual), and the next "
            "RMSNorm's statistic rstd = rsqrt(mean(x_out**2) + eps) (fp32)."
        ),
        inputs={
            "attn": TensorSpec(shape=["M", "Nq"], doc="attention output, heads concatenated"),
            "w_o": TensorSpec(shape=["d", "Nq"], init="linear_weight", doc="o_proj.weight"),
            "x": TensorSpec(shape=["M", "d"], doc="residual stream"),
        },
        graph=[
            Linear(x="attn", weight="w_o", out="y"),
            Add(a="x", b="y", out="x_out"),
            RowRstd(x="x_out", eps=LLAMA_RMS_EPS, out="rstd"),
        ],
        outputs=["x_out", "rstd"],
        shapes=ShapeSets(
            cpu=[
                {"M": 37, "d": 48, "Nq": 64},
                {"M": 64, "d": 64, "Nq": 64},
                {"M": 5, "d": 40, "Nq": 56},
            ],
            gpu=[{"M": 1000, "d": 1000, "Nq": 1024}, {"M": 2048, "d": 2048, "Nq": 2048}],
            bench=[{"M": 16384, "d": 4096, "Nq": 4096}],
        ),
    )
)

llama_lm_head_ce = register(
    Block(
        name="llama_lm_head_ce",
        description=(
            "Llama final norm + LM head + per-token cross-entropy: loss = cross_entropy("
            "rmsnorm(x) * gamma @ w_lm.T, target), fp32, no reduction (targets already shifted). "
            "Every target must be a class id in [0, V): there is no ignore_index; mask ignored "
            "tokens by weighting the per-token loss (their dloss = 0 in the backward)."
        ),
        inputs={
            "x": TensorSpec(shape=["M", "d"], doc="last hidden states"),
            "gamma": TensorSpec(shape=["d"], init="norm_weight", doc="model.norm.weight"),
            "w_lm": TensorSpec(shape=["V", "d"], init="linear_weight", doc="lm_head.weight"),
            "target": TensorSpec(
                shape=["M"], dtype="int64", init="index", high="V", doc="next-token ids"
            ),
        },
        graph=[
            RMSNorm(x="x", weight="gamma", eps=LLAMA_RMS_EPS, out="h"),
            Linear(x="h", weight="w_lm", out="logits"),
            CrossEntropy(logits="logits", target="target", out="loss"),
        ],
        outputs=["loss"],
        shapes=ShapeSets(
            cpu=[
                {"M": 37, "d": 48, "V": 200},
                {"M": 64, "d": 64, "V": 128},
                {"M": 5, "d": 40, "V": 333},
            ],
            gpu=[{"M": 1000, "d": 1024, "V": 32000}, {"M": 2048, "d": 2048, "V": 50000}],
            bench=[{"M": 16384, "d": 4096, "V": 128256}],
        ),
    )
)

# -- backward --------------------------------------------------------------------------------------
llama_mlp_bwd = register(
    backward_block(
        llama_mlp,
        name="llama_mlp_bwd",
        cotangents={"out": TensorSpec(shape=["M", "d"], doc="gradient of out")},
        wrt=["x", "gamma", "w_gate", "w_up", "w_down"],
    )
)

ATTN_IN_GRADS = ["x", "gamma", "w_q", "w_k", "w_v"]
ATTN_IN_COTANGENT = {"qkv": TensorSpec(shape=["M", "Nqkv"], doc="gradient of qkv")}
# The forward's own output, kept for the backward (q, k, v are views of it): the backward then
# needs no recomputation of the QKV projection (llama_attn_in_bwd_saved).
ATTN_IN_SAVED = {"qkv": TensorSpec(shape=["M", "Nqkv"], doc="the forward's output qkv")}
llama_attn_in_bwd = register(
    backward_block(
        llama_attn_in,
        name="llama_attn_in_bwd",
        cotangents=ATTN_IN_COTANGENT,
        wrt=ATTN_IN_GRADS,
        shapes=ShapeSets(
            cpu=[{**s, "Nqkv": s["Nq"] + 2 * s["Nkv"]} for s in llama_attn_in.shapes.cpu],
            gpu=[{**s, "Nqkv": s["Nq"] + 2 * s["Nkv"]} for s in llama_attn_in.shapes.gpu],
            bench=[{**s, "Nqkv": s["Nq"] + 2 * s["Nkv"]} for s in llama_attn_in.shapes.bench],
        ),
    )
)


def norm_statistic(forward: Block) -> tuple[RowRstd, TensorSpec] | None:
    """The statistic of ``forward``'s pre-norm (its one RMSNorm of a block input) as a graph op —
    ``rstd_<norm output> = row_rstd(x, eps)``, fp32, one value per row — and its spec as a saved
    input; None when the block has no such norm (OLMo 2's MLP). A training forward returns it,
    and its backward takes it (the planner's ``BackwardBuilder.rstd``) instead of reading ``x``
    once more to recompute it: the forward's own aux ``rstd`` output, bit for bit."""
    norms = [op for op in forward.graph if isinstance(op, RMSNorm) and op.x in forward.inputs]
    if len(norms) != 1:
        return None
    norm = norms[0]
    rows = forward.inputs[norm.x].shape[:1]
    op = RowRstd(x=norm.x, eps=norm.eps, out=f"rstd_{norm.out}")
    spec = TensorSpec(
        shape=rows,
        dtype="float32",
        doc=f"rsqrt(mean({norm.x}²) + eps) per row, the pre-norm's statistic saved by the forward",
    )
    return op, spec


def _with_statistic(forward: Block, name: str, outputs: list[str], what: str) -> Block:
    """``forward`` as the training forward ``name``: ``outputs`` (values it saves for the
    backward), and its pre-norm's statistic after them (``norm_statistic``), if it has one."""
    stat = norm_statistic(forward)
    graph, extra = list(forward.graph), ""
    if stat is not None:
        graph.append(stat[0])
        outputs = [*outputs, stat[0].out]
        extra = f" and {stat[0].out} = the pre-norm's rstd (fp32)"
    return forward.model_copy(
        update={
            "name": name,
            "description": f"{forward.description} Training forward: also returns {what}{extra}"
            " for the backward.",
            "graph": graph,
            "outputs": outputs,
        }
    )


def _saved_statistic(train: Block) -> dict[str, TensorSpec]:
    """The saved-input spec of ``train``'s pre-norm statistic (none without one)."""
    stat = norm_statistic(train)
    return {stat[0].out: stat[1]} if stat is not None and stat[0].out in train.outputs else {}


def _attn_in_training_pair(forward: Block, name: str) -> tuple[Block, Block]:
    """``<name>_train`` (the forward that also returns its input norm's statistic ``rstd_h``)
    and ``<name>_bwd_saved`` (the backward that takes it and the forward's output ``qkv``
    instead of recomputing the QKV projection and the statistic)."""
    train = register(_with_statistic(forward, f"{name}_train", ["qkv"], "qkv (its output)"))
    saved = backward_block(
        train,
        name=f"{name}_bwd_saved",
        cotangents=ATTN_IN_COTANGENT,
        wrt=ATTN_IN_GRADS,
        saved={**ATTN_IN_SAVED, **_saved_statistic(train)},
        shapes=llama_attn_in_bwd.shapes,  # with Nqkv, as the built-in backward's
    )
    return train, register(saved)


llama_attn_in_train, llama_attn_in_bwd_saved = _attn_in_training_pair(
    llama_attn_in, "llama_attn_in"
)

LM_HEAD_GRADS = ["x", "gamma", "w_lm"]
LM_HEAD_COTANGENT = {
    "loss": TensorSpec(shape=["M"], dtype="float32", doc="gradient of the per-token loss")
}
llama_lm_head_ce_bwd = register(
    backward_block(
        llama_lm_head_ce,
        name="llama_lm_head_ce_bwd",
        cotangents=LM_HEAD_COTANGENT,
        wrt=LM_HEAD_GRADS,
    )
)

LM_HEAD_SAVED = {
    "lse": TensorSpec(
        shape=["M"], dtype="float32", doc="log-sum-exp of each row's logits, saved by the forward"
    )
}


def _lm_head_training_pair(forward: Block, name: str) -> tuple[Block, Block]:
    """``<name>_train`` (the forward that also returns each row's log-sum-exp ``lse`` — from the
    partials its loss already reduces, so at no extra cost) and ``<name>_bwd_saved`` (the backward
    that receives it instead of recomputing the logits once more just for it: one GEMM of
    ``M × V × d`` fewer per training step). ``lse`` is of the logits the loss reads (after a
    softcap, if the forward has one)."""
    logits = next(op.logits for op in forward.graph if isinstance(op, CrossEntropy))
    train = register(
        forward.model_copy(
            update={
                "name": f"{name}_train",
                "description": forward.description
                + " Training forward: also returns lse = logsumexp(logits) per row (fp32) for "
                "the backward.",
                "graph": [*forward.graph, LogSumExp(logits=logits, out="lse")],
                "outputs": ["loss", "lse"],
            }
        )
    )
    saved = backward_block(
        train,
        name=f"{name}_bwd_saved",
        cotangents=LM_HEAD_COTANGENT,
        wrt=LM_HEAD_GRADS,
        saved=LM_HEAD_SAVED,
    )
    return train, register(saved)


llama_lm_head_ce_train, llama_lm_head_ce_bwd_saved = _lm_head_training_pair(
    llama_lm_head_ce, "llama_lm_head_ce"
)


MLP_GRADS = ["x", "gamma", "w_gate", "w_up", "w_down"]
MLP_COTANGENT = {"out": TensorSpec(shape=["M", "d"], doc="gradient of out")}
# The gated activation's output a = act(g)·u is not saved: the backward's first GEMM loads the
# g and u tiles for the activation's derivative anyway and writes a beside dz from them (one
# more tile stored in the backward, against one [M, f] tensor per layer held from the forward
# to the backward — a third of what the MLP keeps for it).
MLP_SAVED = {
    "g": TensorSpec(shape=["M", "f"], doc="gate_proj(h), saved by the forward pass"),
    "u": TensorSpec(shape=["M", "f"], doc="up_proj(h), saved by the forward pass"),
}
# A post-norm after the down projection (Gemma 2's sandwich, OLMo 2) needs a in the backward
# before any epilogue has read g and u: its statistic comes from the down projection's output.
MLP_SAVED_WITH_A = {
    **MLP_SAVED,
    "a": TensorSpec(shape=["M", "f"], doc="act(g) * u, saved by the forward pass"),
}


def _normed_after_down(forward: Block) -> bool:
    """Whether an RMSNorm reads the down projection's output (the projection of the gated
    unit's output): a post-norm, as in Gemma 2's sandwich or OLMo 2 — the post-norm the
    planner's MLP backward rule looks for (``planner/rules/swiglu.py``, ``_mlp_output``)."""
    glu_out = {op.out for op in forward.graph if isinstance(op, SwiGLU | GLU)}
    down = {op.out for op in forward.graph if isinstance(op, Linear) and op.x in glu_out}
    return any(isinstance(op, RMSNorm) and op.x in down for op in forward.graph)


def _mlp_training_pair(
    forward: Block, name: str, wrt: list[str] = MLP_GRADS
) -> tuple[Block, Block]:
    """``<name>_train`` (the forward that also returns g and u, and its pre-norm's statistic
    ``rstd_h`` where it has one) and ``<name>_bwd_saved`` (the backward that receives them
    instead of recomputing the gate/up GEMM and the statistic, and recomputes the activation's
    output a = act(g)·u in the epilogue that reads g and u), with the gradients of ``wrt``.
    With a post-norm after the down projection a is saved too (``MLP_SAVED_WITH_A``)."""
    kept = MLP_SAVED_WITH_A if _normed_after_down(forward) else MLP_SAVED
    what = "g = gate(h), u = up(h)" + (" and a = act(g) * u" if "a" in kept else "")
    train = register(_with_statistic(forward, f"{name}_train", ["out", *kept], what))
    statistic = _saved_statistic(train)
    saved = backward_block(
        train if statistic else forward,
        name=f"{name}_bwd_saved",
        cotangents=MLP_COTANGENT,
        wrt=wrt,
        saved={**kept, **statistic},
    )
    return train, register(saved)


llama_mlp_train, llama_mlp_bwd_saved = _mlp_training_pair(llama_mlp, "llama_mlp")

# The same sub-layer without its residual add, for a residual stream kept in another dtype than
# the GEMMs run in (Hugging Face under torch.autocast: fp32 hidden states, bf16 projections): the
# caller adds x in its own dtype.
llama_mlp_branch = register(
    llama_mlp.model_copy(
        update={
            "name": "llama_mlp_branch",
            "description": (
                "Llama MLP branch of a sub-layer, without the residual add: "
                "out = down(silu(gate(h)) * up(h)), h = rmsnorm(x) * gamma (the caller adds x, "
                "e.g. in float32 under torch.autocast)."
            ),
            "graph": [*llama_mlp.graph[:-2], Linear(x="a", weight="w_down", out="out")],
        }
    )
)
llama_mlp_branch_bwd = register(
    backward_block(
        llama_mlp_branch, name="llama_mlp_branch_bwd", cotangents=MLP_COTANGENT, wrt=MLP_GRADS
    )
)
llama_mlp_branch_train, llama_mlp_branch_bwd_saved = _mlp_training_pair(
    llama_mlp_branch, "llama_mlp_branch"
)

_FAMILIES = {
    "llama_mlp": (llama_mlp, llama_mlp_bwd, llama_mlp_train, llama_mlp_bwd_saved),
    "llama_mlp_branch": (
        llama_mlp_branch,
        llama_mlp_branch_bwd,
        llama_mlp_branch_train,
        llama_mlp_branch_bwd_saved,
    ),
}
_KEYS = ("forward", "backward", "train", "backward_saved")


def _with_eps(block: Block, eps: float, name: str) -> Block:
    """``block`` with its RMSNorm's epsilon set to ``eps``, registered as ``name``."""
    graph = [
        op.model_copy(update={"eps": eps}) if isinstance(op, RMSNorm) else op for op in block.graph
    ]
    return register(block.model_copy(update={"name": name, "graph": graph}))


def llama_mlp_family(eps: float, *, residual: bool = True) -> dict[str, Block]:
    """The llama_mlp blocks for an RMSNorm epsilon: ``forward``, ``backward`` (gets the forward
    inputs), ``train`` (forward that also returns g, u) and ``backward_saved`` (gets them).

    ``residual=False``: the ``llama_mlp_branch`` family instead (no residual add; the caller adds
    x). Llama 3 uses eps = 1e-5: the built-in ``llama_mlp``, ``llama_mlp_bwd``,
    ``llama_mlp_train``, ``llama_mlp_bwd_saved`` (and ``llama_mlp_branch[...]``). Another value
    (Hugging Face's ``LlamaConfig`` defaults to 1e-6) registers ``llama_mlp_eps<eps>`` (or
    ``llama_mlp_branch_eps<eps>``) and its ``_bwd``, ``_train``, ``_bwd_saved`` on first use.
    """
    base = "llama_mlp" if residual else "llama_mlp_branch"
    if eps == LLAMA_RMS_EPS:
        return dict(zip(_KEYS, _FAMILIES[base], strict=True))
    name = f"{base}_eps{eps:g}"
    if name not in _VARIANTS:
        forward = _with_eps(_FAMILIES[base][0], eps, name)
        backward = backward_block(
            forward, name=f"{name}_bwd", cotangents=MLP_COTANGENT, wrt=MLP_GRADS
        )
        _VARIANTS[name] = (forward, register(backward), *_mlp_training_pair(forward, name))
    return dict(zip(_KEYS, _VARIANTS[name], strict=True))


def llama_lm_head_ce_family(eps: float) -> dict[str, Block]:
    """The LM-head loss blocks for a final norm's epsilon: ``forward`` (``llama_lm_head_ce``),
    ``backward`` (``llama_lm_head_ce_bwd``: gets the forward inputs, recomputes the log-sum-exp),
    ``train`` (forward that also returns ``lse``) and ``backward_saved`` (gets it). Another
    epsilon than 1e-5 registers ``llama_lm_head_ce_eps<eps>`` and its ``_bwd``, ``_train``,
    ``_bwd_saved``."""
    if eps == LLAMA_RMS_EPS:
        blocks = (
            llama_lm_head_ce, llama_lm_head_ce_bwd, llama_lm_head_ce_train,
            llama_lm_head_ce_bwd_saved,
        )  # fmt: skip
        return dict(zip(_KEYS, blocks, strict=True))
    name = f"llama_lm_head_ce_eps{eps:g}"
    if name not in _VARIANTS:
        forward = _with_eps(llama_lm_head_ce, eps, name)
        backward = backward_block(
            forward, name=f"{name}_bwd", cotangents=LM_HEAD_COTANGENT, wrt=LM_HEAD_GRADS
        )
        _VARIANTS[name] = (forward, register(backward), *_lm_head_training_pair(forward, name))
    return dict(zip(_KEYS, _VARIANTS[name], strict=True))


def llama_attn_in_family(eps: float) -> dict[str, Block]:
    """``forward`` (``llama_attn_in``), ``backward`` (``llama_attn_in_bwd``: gets the forward
    inputs, recomputes the projection), ``train`` (``llama_attn_in_train``: also returns the
    input norm's statistic ``rstd_h``) and ``backward_saved`` (``llama_attn_in_bwd_saved``: also
    gets the forward's output ``qkv`` and ``rstd_h``) for an input norm's epsilon; another value
    than 1e-5 registers ``llama_attn_in_eps<eps>``, ``_bwd``, ``_train`` and ``_bwd_saved``."""
    if eps == LLAMA_RMS_EPS:
        builtin = (llama_attn_in, llama_attn_in_bwd, llama_attn_in_train, llama_attn_in_bwd_saved)
        return dict(zip(_KEYS, builtin, strict=True))
    name = f"llama_attn_in_eps{eps:g}"
    if name not in _VARIANTS:
        forward = _with_eps(llama_attn_in, eps, name)
        backward = backward_block(
            forward,
            name=f"{name}_bwd",
            cotangents=ATTN_IN_COTANGENT,
            wrt=ATTN_IN_GRADS,
            shapes=llama_attn_in_bwd.shapes,  # with Nqkv, as the built-in backward's
        )
        _VARIANTS[name] = (forward, register(backward), *_attn_in_training_pair(forward, name))
    return dict(zip(_KEYS, _VARIANTS[name], strict=True))


_VARIANTS: dict[str, tuple[Block, ...]] = {}
_SUFFIXES = {"": "forward", "_bwd": "backward", "_train": "train", "_bwd_saved": "backward_saved"}
# Block families with an epsilon in their names, by base name: how to make one for an epsilon.
_EPS_FAMILIES = {
    "llama_mlp": llama_mlp_family,
    "llama_mlp_branch": lambda eps: llama_mlp_family(eps, residual=False),
    "llama_lm_head_ce": llama_lm_head_ce_family,
    "llama_attn_in": llama_attn_in_family,
}


def _resolve_eps_variant(name: str) -> Block | None:
    """``<family>_eps<eps>[_bwd|_train|_bwd_saved]`` → that block, for the families of
    ``_EPS_FAMILIES`` (a sandbox worker resolves the same names the same way)."""
    for base, family in _EPS_FAMILIES.items():
        prefix = f"{base}_eps"
        if not name.startswith(prefix):
            continue
        for suffix in sorted(_SUFFIXES, key=len, reverse=True):
            text = name[len(prefix) :]
            if suffix and not text.endswith(suffix):
                continue
            text = text.removesuffix(suffix) if suffix else text
            try:
                eps = float(text)
            except ValueError:
                continue
            if 0 < eps <= 1 and f"{eps:g}" == text:
                return family(eps).get(_SUFFIXES[suffix])
    return None


register_resolver(_resolve_eps_variant)


def _resolve_gradient_block(name: str) -> Block | None:
    """``<LM-head loss block>_grad`` → ``lm_head_gradient_block`` of that block (any epsilon,
    softcapped or not; a sandbox worker resolves the same names the same way)."""
    from .registry import BlockNotFound, get_block

    if not name.endswith("_grad"):
        return None
    try:
        forward = get_block(name.removesuffix("_grad"))
    except BlockNotFound:
        return None
    heads = any(isinstance(op, CrossEntropy) for op in forward.graph)
    return lm_head_gradient_block(forward) if heads and "w_lm" in forward.inputs else None


register_resolver(_resolve_gradient_block)

# Gemma's and OLMo 2's MLP families (coda.blocks.gemma, coda.blocks.olmo2) build on these blocks
# and register with them, as do the attention-output blocks (coda.blocks.attn_out).
from . import attn_out, gemma, olmo2  # noqa: E402, F401


def lm_head_gradient_block(forward: Block) -> Block:
    """``<forward>_grad``: an LM-head loss block's per-token ``loss`` together with the gradients
    of ``Σ_i dloss_i · loss_i`` for ``x``, ``gamma`` and ``w_lm`` (``dloss``: the per-token
    weights, float32) — the loss and its gradient in one pass, for a loss that is the last op of
    a training step (its backward then only scales by the incoming gradient). The reference is
    the forward's, and autograd of it. Registered on first use."""
    name = f"{forward.name}_grad"
    if name in _VARIANTS:
        return _VARIANTS[name][0]
    vjp = VJP(forward=forward.name, cotangents={"loss": "dloss"}, wrt=LM_HEAD_GRADS, out="grads")
    block = forward.model_copy(
        update={
            "name": name,
            "description": forward.description
            + " With its gradient: also dx, dgamma, dw_lm, the gradients of sum(dloss * loss).",
            "inputs": {**forward.inputs, "dloss": LM_HEAD_COTANGENT["loss"]},
            "graph": [
                *forward.graph,
                vjp,
                *(Pick(src="grads", key=n, out=f"d{n}") for n in LM_HEAD_GRADS),
            ],
            "outputs": ["loss", *(f"d{n}" for n in LM_HEAD_GRADS)],
        }
    )
    _VARIANTS[name] = (register(block),)
    return block
