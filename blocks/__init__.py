"""coda.blocks — target blocks: op graph, PyTorch reference, input factory, shapes, tolerances."""

from .block import Block, ShapeSets, TensorSpec, Tolerance
from .ops import GLU, Activation, Add, GraphOp, LayerNorm, Linear, RMSNorm, SwiGLU
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
    "GraphOp",
    "Linear",
    "LayerNorm",
    "RMSNorm",
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
