"""The ten GEMM-epilogue kernels of the CODA paper's appendix (docs/algebra.md §6), each as a block.

Kernel-level semantics: ``A`` is ``[M, K]``; ``B`` is ``[K, N]`` for ``A B`` and ``[N, K]`` for
``A Bᵀ`` (an ``nn.Linear`` weight); pairs are adjacent columns ``(2k, 2k+1)`` (gate/up
interleaved, RoPE partners adjacent). Partial statistics are per-tile buffers whose width depends
on the tile size a program runs with, so each block outputs them *finished* (``ms`` = mean of
squares, ``lse``, ``dgamma``, ``zdz`` = Σ z·dz): the program writes the partials in the epilogue
and a tiny aux step combines them, and that pair is what is verified.
"""

from __future__ import annotations

from .block import Block, ShapeSets, TensorSpec
from .ops import (
    Add,
    ApplyRstd,
    Linear,
    LogSumExp,
    Matmul,
    MeanSquare,
    RMSNormBackward,
    RMSNormWeightGrad,
    RoPEPairs,
    RowDot,
    ScaleCols,
    ScaleRows,
    SwiGLUPairs,
    SwiGLUPairsBackward,
    TargetLogit,
)
from .registry import register

A = TensorSpec(shape=["M", "K"], doc="activations")
B = TensorSpec(shape=["K", "N"], init="linear_weight", doc="weight [K, N]")
B_T = TensorSpec(shape=["N", "K"], init="linear_weight", doc="weight [N, K] (used as Bᵀ)")
RSTD = TensorSpec(shape=["M"], dtype="float32", init="norm_weight", doc="RMSNorm reciprocal r")
GAMMA = TensorSpec(shape=["N"], init="norm_weight", doc="norm weight γ")
COS = TensorSpec(shape=["M", "D"], doc="Hugging Face cos table [M, head_dim]")
SIN = TensorSpec(shape=["M", "D"], doc="Hugging Face sin table [M, head_dim]")
TARGET = TensorSpec(shape=["M"], dtype="int64", init="index", high="N", doc="target column")

# CPU: ragged M and K, N not a tile multiple (but even, and a multiple of the head width D).
CPU = [
    {"M": 37, "N": 48, "K": 29, "D": 16},
    {"M": 64, "N": 64, "K": 32, "D": 16},
    {"M": 5, "N": 80, "K": 70, "D": 8},
]
GPU = [{"M": 1000, "N": 1024, "K": 1000, "D": 128}, {"M": 2048, "N": 2048, "K": 2048, "D": 128}]
BENCH = [
    {"M": 4096, "N": 4096, "K": 4096, "D": 128},
    {"M": 8192, "N": 8192, "K": 8192, "D": 128},
]


def _shapes(*, head_dim: bool, double_n: bool) -> ShapeSets:
    """The shape sets, with the head width ``D`` only where RoPE needs it and ``N2 = 2·N`` where
    a saved pair tensor is twice as wide as the GEMM's output."""

    def bind(sets: list[dict[str, int]]) -> list[dict[str, int]]:
        out = []
        for s in sets:
            sizes = {k: v for k, v in s.items() if k != "D" or head_dim}
            out.append({**sizes, "N2": 2 * s["N"]} if double_n else sizes)
        return out

    return ShapeSets(cpu=bind(CPU), gpu=bind(GPU), bench=bind(BENCH))


def _kernel(
    name: str, description: str, inputs: dict[str, TensorSpec], graph: list, outputs: list[str]
) -> Block:
    sizes = {d for spec in inputs.values() for d in spec.shape if isinstance(d, str)}
    shapes = _shapes(head_dim="D" in sizes, double_n="N2" in sizes)
    return register(
        Block(
            name=name,
            description=description,
            inputs=inputs,
            graph=graph,
            outputs=outputs,
            shapes=shapes,
        )
    )


gemm_residual_partial_rmsnorm = _kernel(
    "gemm_residual_partial_rmsnorm",
    "D = A B + C; the mean of squares of each row of D (from per-tile partials); O = D ⊙ γ.",
    {"a": A, "b": B, "c": TensorSpec(shape=["M", "N"], doc="residual"), "gamma": GAMMA},
    [
        Matmul(a="a", b="b", out="ab"),
        Add(a="ab", b="c", out="d"),
        MeanSquare(x="d", out="ms"),
        ScaleCols(x="d", v="gamma", out="o"),
    ],
    ["d", "ms", "o"],
)

gemm_rmsnorm = _kernel(
    "gemm_rmsnorm",
    "D = r ⊙ (A B): an RMSNorm applied as a row scale after the GEMM.",
    {"a": A, "b": B, "rstd": RSTD},
    [Matmul(a="a", b="b", out="ab"), ScaleRows(x="ab", r="rstd", out="d")],
    ["d"],
)

gemm_swiglu = _kernel(
    "gemm_swiglu",
    "D = A B (gate/up columns interleaved); O = silu(G) ⊙ U on adjacent pairs.",
    {"a": A, "b": B},
    [Matmul(a="a", b="b", out="d"), SwiGLUPairs(x="d", out="o")],
    ["d", "o"],
)

gemm_rmsnorm_swiglu = _kernel(
    "gemm_rmsnorm_swiglu",
    "D = r ⊙ (A B); O = silu(G) ⊙ U on adjacent pairs.",
    {"a": A, "b": B, "rstd": RSTD},
    [
        Matmul(a="a", b="b", out="ab"),
        ScaleRows(x="ab", r="rstd", out="d"),
        SwiGLUPairs(x="d", out="o"),
    ],
    ["d", "o"],
)

gemm_rope = _kernel(
    "gemm_rope",
    "D = A B (RoPE partners in adjacent columns); O = RoPE(D) per head of width D_head.",
    {"a": A, "b": B, "cos": COS, "sin": SIN},
    [Matmul(a="a", b="b", out="d"), RoPEPairs(x="d", cos="cos", sin="sin", out="o")],
    ["d", "o"],
)

gemm_rmsnorm_rope = _kernel(
    "gemm_rmsnorm_rope",
    "D = r ⊙ (A B); O = RoPE(D) on adjacent pairs.",
    {"a": A, "b": B, "rstd": RSTD, "cos": COS, "sin": SIN},
    [
        Matmul(a="a", b="b", out="ab"),
        ScaleRows(x="ab", r="rstd", out="d"),
        RoPEPairs(x="d", cos="cos", sin="sin", out="o"),
    ],
    ["d", "o"],
)

gemm_partial_cross_entropy = _kernel(
    "gemm_partial_cross_entropy",
    "Z = A B; the target logit Z[i, t_i]; log-sum-exp of each row (from per-tile partials).",
    {"a": A, "b": B, "target": TARGET},
    [
        Matmul(a="a", b="b", out="z"),
        TargetLogit(logits="z", target="target", out="target_logit"),
        LogSumExp(logits="z", out="lse"),
    ],
    ["z", "target_logit", "lse"],
)

gemm_rmsnorm_partial_cross_entropy = _kernel(
    "gemm_rmsnorm_partial_cross_entropy",
    "Z = r ⊙ (A B); the target logit; log-sum-exp of each row (from per-tile partials).",
    {"a": A, "b": B, "rstd": RSTD, "target": TARGET},
    [
        Matmul(a="a", b="b", out="ab"),
        ScaleRows(x="ab", r="rstd", out="z"),
        TargetLogit(logits="z", target="target", out="target_logit"),
        LogSumExp(logits="z", out="lse"),
    ],
    ["z", "target_logit", "lse"],
)

gemm_residual_partial_rmsnorm_bwd = _kernel(
    "gemm_residual_partial_rmsnorm_bwd",
    "D = A Bᵀ (the gradient of an RMSNorm's output); O_out = O + (D ⊙ γ − x̂ · c) · r; "
    "C_out = x̂ ⊙ γ; dγ = Σ_rows D ⊙ x̂ (from per-tile partials), with x̂ = r ⊙ x.",
    {
        "a": A,
        "b": B_T,
        "gamma": GAMMA,
        "x": TensorSpec(shape=["M", "N"], doc="the norm's input"),
        "rstd": RSTD,
        "c": TensorSpec(shape=["M"], dtype="float32", doc="row statistic (1/d) Σ y·dy"),
        "o": TensorSpec(shape=["M", "N"], doc="gradient accumulated so far (residual branch)"),
    },
    [
        Linear(x="a", weight="b", out="d"),
        RMSNormBackward(dy="d", x="x", rstd="rstd", gamma="gamma", c="c", out="dx_norm"),
        Add(a="o", b="dx_norm", out="o_out"),
        ApplyRstd(x="x", rstd="rstd", gamma="gamma", out="c_out"),
        RMSNormWeightGrad(dy="d", x="x", rstd="rstd", out="dgamma"),
    ],
    ["o_out", "c_out", "dgamma"],
)

gemm_partial_swiglu_bwd = _kernel(
    "gemm_partial_swiglu_bwd",
    "D = A Bᵀ (the gradient of the SwiGLU output); dZ = [dG, dU] interleaved from the saved Z = "
    "[G, U]; recompute O = silu(G) ⊙ U; zdz = Σ_k (G dG + U dU) per row (from per-tile partials).",
    {"a": A, "b": B_T, "z": TensorSpec(shape=["M", "N2"], doc="saved [G, U], interleaved")},
    [
        Linear(x="a", weight="b", out="d"),
        SwiGLUPairsBackward(da="d", z="z", out="dz"),
        SwiGLUPairs(x="z", out="o"),
        RowDot(a="z", b="dz", out="zdz"),
    ],
    ["dz", "o", "zdz"],
)

KERNELS = [
    gemm_residual_partial_rmsnorm,
    gemm_rmsnorm,
    gemm_swiglu,
    gemm_rmsnorm_swiglu,
    gemm_rope,
    gemm_rmsnorm_rope,
    gemm_partial_cross_entropy,
    gemm_rmsnorm_partial_cross_entropy,
    gemm_residual_partial_rmsnorm_bwd,
    gemm_partial_swiglu_bwd,
]
