"""coda.export — verified Programs as differentiable PyTorch ops and drop-in Hugging Face modules.

* ``export_autograd(forward, backward, backward_block)``: a forward Program and its backward Program
  as ``torch.library`` custom ops with a fake implementation and autograd (``torch.compile`` traces
  around them).
* ``CodaLlamaMLPBlock(norm, mlp)``: ``x + mlp(norm(x))`` for Hugging Face ``LlamaRMSNorm`` +
  ``LlamaMLP`` on the planner's verified ``llama_mlp`` / ``llama_mlp_bwd`` Programs;
  ``fuse_gate_up=True`` keeps gate/up as one interleaved parameter (``PackedRows``).
* ``causal_lm_loss(model, input_ids, labels)`` / ``CodaLlamaLMHeadLoss(norm, lm_head)``: Hugging
  Face's causal-LM loss with the final norm, LM head and cross-entropy fused (no ``[tokens,
  vocabulary]`` logits: in training, three GEMM passes over row chunks, the gradient computed in
  the forward — ``lm_head_chunks``).
* ``CodaLlamaAttention(attn, norm)`` / ``llama_attn_in_function``: a layer's input norm, Q/K/V
  projections and RoPE as one GEMM (``llama_attn_in``); attention itself stays Hugging Face's.
  ``hf_attn_in_function(kernel, eps)``: Qwen2's (biased), Qwen3's and Gemma 3's (per-head q/k
  norms) and OLMo 2's (no input norm, whole-projection q/k norms) attention inputs, q, k, v
  returned separately in Hugging Face's order (``qwen2_attn_in``, ``qwen3_attn_in``,
  ``gemma3_attn_in``, ``olmo2_attn_in``).
* ``CodaAttentionOutput(o_proj, post_norm)`` / ``attention_output_function``: a layer's
  ``x + o_proj(a)`` (``attn_out``), or ``x + post_attention_layernorm(o_proj(a))`` through Gemma
  2/3's or OLMo 2's post-norm (``gemma2_attn_out``, ``olmo2_attn_out``), as one GEMM with the
  residual (and the norm) in its epilogue; the layer hands it the attention before ``o_proj``
  (``DeferredOProj``) and the residual.
* ``patch_llama(model)``: every decoder layer of a Hugging Face Llama model runs its norms,
  attention input, attention output and MLP on CODA kernels, in place (Hugging Face's attention
  and keys kept), the residual adds inside the kernels (``CodaLlamaDecoderLayer``) — after proving,
  on one recorded forward of the model (``coda.export.probe``), that every module it replaces
  sits where the patched layer computes with it; otherwise ``ValueError``.
* ``patch_model(model)``: the same for any Hugging Face causal LM, per module kind — what a
  recipe (``coda.export.families.RECIPES``) proves a shipped kernel computes exactly is patched
  (Llama, Mistral, Phi-3's fused projections, Qwen2/3, Gemma 1/2/3, OLMo 2, …), the
  rest kept as Hugging Face's; returns a ``PatchReport`` saying "patched" or "kept: <reason>"
  per kind.
* ``capture_train_step(model, optimizer, example_batch)``: a whole training step (forward,
  backward, a capturable optimizer's update) replayed from a CUDA graph per batch shape —
  ``loss = step(batch)`` — for any model, patched or not; what cannot be captured faithfully is
  refused with ``CaptureError`` (``train_step``).

The drop-ins run the built-in planner's Programs, shipped verified in ``coda.export.programs``
and checked against the planner's on load (milliseconds, no sandbox worker); ``verify=True``
verifies them in the sandbox instead (``coda.export.resolve``). Modules: ``mlp`` (the MLP
drop-in), ``attention``, ``attn_out``, ``lm_head``, ``patch``, ``families``, ``probe``,
``train_step``;
``checks`` and ``dtypes`` hold what they share; ``autograd`` the custom ops.
"""

from .attention import CodaLlamaAttention, hf_attn_in_function, llama_attn_in_function
from .attn_out import CodaAttentionOutput, DeferredOProj, attention_output_function
from .autograd import ExportedFunction, PackedRows, export_autograd, kernels_used
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
from .train_step import CapturedTrainStep, CaptureError, capture_train_step

__all__ = [
    "CaptureError",
    "CapturedTrainStep",
    "CodaAttentionOutput",
    "CodaLlamaAttention",
    "CodaLlamaDecoderLayer",
    "CodaLlamaLMHeadLoss",
    "CodaLlamaMLP",
    "CodaLlamaMLPBlock",
    "DeferredOProj",
    "DeferredRMSNorm",
    "ExportedFunction",
    "NotVerified",
    "PackedRows",
    "PatchReport",
    "attention_output_function",
    "capture_train_step",
    "causal_lm_loss",
    "export_autograd",
    "fuse_causal_lm_loss",
    "hf_attn_in_function",
    "kernels_used",
    "llama_attn_in_function",
    "llama_lm_head_ce_function",
    "llama_mlp_function",
    "patch_llama",
    "patch_model",
    "verified_program",
]
