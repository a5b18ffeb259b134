"""coda.blocks — target blocks: op graph, PyTorch reference, input factory, shapes, tolerances."""

from .block import Block, ShapeSets, TensorSpec, Tolerance
from .ops import (
    GLU,
    Activation,
    Add,
    Chunk,
    GraphOp,
    HeadRMSNorm,
    LayerNorm,
    Linear,
    Opaque,
    RMSNorm,
    RoPE,
    Scale,
    SwiGLU,
)
from .registry import (
    BlockFileError,
    BlockNotFound,
    builtin_blocks,
    get_block,
    list_blocks,
    load_block_file,
    register,
)

__all__ = [
    "GLU",
    "Activation",
    "Add",
    "Block",
    "BlockFileError",
    "BlockNotFound",
    "Chunk",
    "GraphOp",
    "HeadRMSNorm",
    "Linear",
    "LayerNorm",
    "Opaque",
    "RMSNorm",
    "RoPE",
    "Scale",
    "ShapeSets",
    "SwiGLU",
    "TensorSpec",
    "Tolerance",
    "builtin_blocks",
    "get_block",
    "list_blocks",
    "load_block_file",
    "register",
]
