"""coda.export — verified Programs as differentiable PyTorch ops and drop-in Hugging Face modules.

* ``export_autograd(forward, backward, backward_block)``: a forward Program and its backward Program
  as ``torch.library`` custom ops with a fake implementation and autograd (``torch.compile`` traces
  around them).
* ``CodaLlamaMLPBlock(norm, mlp)``: ``x + mlp(norm(x))`` for Hugging Face ``LlamaRMSNorm`` +
  ``LlamaMLP`` on the planner's verified ``llama_mlp`` / ``llama_mlp_bwd`` Programs;
  ``fuse_gate_up=True`` keeps gate/up as one interleaved parameter (``PackedRows``).
* ``causal_lm_loss(model, input_ids, labels)`` / ``CodaLlamaLMHeadLoss(norm, lm_head)``: Hugging
  Face's causal-LM loss with the final norm, LM head and cross-entropy fused (no logits stored).
* ``CodaLlamaAttention(attn, norm)`` / ``llama_attn_in_function``: a layer's input norm, Q/K/V
  projections and RoPE as one GEMM (``llama_attn_in``); attention itself stays Hugging Face's.
  ``hf_attn_in_function(kernel, eps)``: Qwen2's (biased), Qwen3's and Gemma 3's (per-head q/k
  norms) and OLMo 2's (no input norm, whole-projection q/k norms) attention inputs, q, k, v
  returned separately in Hugging Face's order (``qwen2_attn_in``, ``qwen3_attn_in``,
  ``gemma3_attn_in``, ``olmo2_attn_in``).
* ``patch_llama(model)``: every decoder layer of a Hugging Face Llama model runs its norms,
  attention input and MLP on CODA kernels, in place (Hugging Face's attention and keys kept),
  the MLP half's residual add inside its kernels (``CodaLlamaDecoderLayer``) — after proving,
  on one recorded forward of the model (``coda.export.probe``), that every module it replaces
  sits where the patched layer computes with it; otherwise ``ValueError``.
* ``patch_model(model)``: the same for any Hugging Face causal LM, per module kind — what a
  recipe (``coda.export.families.RECIPES``) proves a shipped kernel computes exactly is patched
  (Llama, Mistral, Phi-3's fused projections, Qwen2/3, Gemma 1/2/3, OLMo 2, …), the
  rest kept as Hugging Face's; returns a ``PatchReport`` saying "patched" or "kept: <reason>"
  per kind.

The drop-ins run the built-in planner's Programs, shipped verified in ``coda.export.programs``
and checked against the planner's on load (milliseconds, no sandbox worker); ``verify=True``
verifies them in the sandbox instead (``coda.export.resolve``). Modules: ``mlp`` (the MLP
drop-in), ``attention``, ``lm_head``, ``patch``, ``families``, ``probe``; ``checks`` and
``dtypes`` hold what they share; ``autograd`` the custom ops.
"""

from .attention import CodaLlamaAttention, hf_attn_in_function, llama_attn_in_function
from .autograd import ExportedFunction, PackedRows, export_autograd
from .families import PatchReport, patch_model
from .lm_head import (
    CodaLlamaLMHeadLoss,
    causal_lm_loss,
    fuse_causal_lm_loss,
    llama_lm_head_ce_function,
)
from .mlp import CodaLlamaMLPBlock, llama_mlp_function
from .patch import CodaLlamaDecoderLayer, CodaLlamaMLP, DeferredRMSNorm, patch_llama
from .resolve import NotVerified, verified_program

__all__ = [
    "CodaLlamaAttention",
    "CodaLlamaDecoderLayer",
    "CodaLlamaLMHeadLoss",
    "CodaLlamaMLP",
    "CodaLlamaMLPBlock",
    "DeferredRMSNorm",
    "ExportedFunction",
    "NotVerified",
    "PackedRows",
    "PatchReport",
    "causal_lm_loss",
    "export_autograd",
    "fuse_causal_lm_loss",
    "hf_attn_in_function",
    "llama_attn_in_function",
    "llama_lm_head_ce_function",
    "llama_mlp_function",
    "patch_llama",
    "patch_model",
    "verified_program",
]
