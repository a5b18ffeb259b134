"""coda.export — verified Programs as differentiable PyTorch ops and drop-in Hugging Face modules.

* ``export_autograd(forward, backward, backward_block)``: a forward Program and its backward Program
  as ``torch.library`` custom ops with a fake implementation and autograd (``torch.compile`` traces
  around them).
* ``CodaLlamaMLPBlock(norm, mlp)``: ``x + mlp(norm(x))`` for Hugging Face ``LlamaRMSNorm`` +
  ``LlamaMLP`` on the planner's verified ``llama_mlp`` / ``llama_mlp_bwd`` Programs;
  ``fuse_gate_up=True`` keeps gate/up as one interleaved parameter (``PackedRows``).
"""

from .autograd import ExportedFunction, PackedRows, export_autograd
from .hf import CodaLlamaMLPBlock, NotVerified, llama_mlp_function, verified_program

__all__ = [
    "CodaLlamaMLPBlock",
    "ExportedFunction",
    "NotVerified",
    "PackedRows",
    "export_autograd",
    "llama_mlp_function",
    "verified_program",
]
