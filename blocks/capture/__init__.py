"""Blocks from plain PyTorch: ``Block.from_torch(fn, ...)`` exports a function of the block's
tensors with torch.export (``capture.py``), reads its aten graph as block ops with one recogniser
module per family (``norms``, ``linear``, ``activations``, ``rope``, ``loss``, ``layout``,
``arith``; ``matcher.py`` drives them) and keeps whatever none of them reads as ``Opaque`` ops
(``opaque.py``). The block's reference is the function itself (``captured.py``)."""

from .capture import CaptureError
from .captured import CapturedBlock, from_torch

__all__ = ["CaptureError", "CapturedBlock", "from_torch"]
