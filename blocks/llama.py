"""Llama blocks (Hugging Face ``LlamaMLP`` / ``LlamaRMSNorm`` semantics)."""

from __future__ import annotations

from .block import Block, ShapeSets, TensorSpec
from .ops import Add, Linear, RMSNorm, SwiGLU
from .registry import register

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
