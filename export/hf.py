"""Drop-in modules for Hugging Face Llama layers, running CODA Programs forward and backward.

``CodaLlamaMLPBlock(norm, mlp)`` replaces the MLP half of a ``LlamaDecoderLayer`` —
``x + mlp(post_attention_layernorm(x))`` — with the two fused forward kernels and the fused backward
of ``llama_mlp`` / ``llama_mlp_bwd``. It shares the Hugging Face modules' parameters (nothing is
copied), so optimizers, state dicts and weight tying see the same tensors, and their ``.grad``s are
filled by the backward Program.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from torch import nn

from coda.agent.planner import LoweringOptions, lower
from coda.blocks.block import Block
from coda.blocks.llama import llama_mlp_family
from coda.primitives.ir import Program
from coda.sandbox import SandboxOptions, evaluate

from .autograd import ExportedFunction, Tuning, export_autograd


class NotVerified(RuntimeError):
    """The sandbox did not verify a Program the export was asked to use."""


def verified_program(block: Block, options: LoweringOptions | None = None) -> Program:
    """The built-in planner's Program for ``block``, verified by the sandbox (else
    ``NotVerified``)."""
    program = lower(block, options)
    report = evaluate(program, block, SandboxOptions(profile=False, seeds=[0]))
    if not report.verified:
        raise NotVerified(f"{block.name}: {report.render_compact()}")
    return program


def llama_mlp_function(
    eps: float, *, verify: bool = True, saved: bool = True, tune: Tuning = "quick"
) -> ExportedFunction:
    """``f(x, gamma, w_gate, w_up, w_down) -> out`` with autograd, for an RMSNorm epsilon.

    ``saved`` (default): the forward is ``llama_mlp_train``, which also keeps the gate and up
    projections and the SwiGLU output, and the backward ``llama_mlp_bwd_saved`` uses them
    (CODA_MATH §7's schedule);
    otherwise the forward stores nothing extra and ``llama_mlp_bwd`` recomputes the gate/up GEMM
    (less memory, one more GEMM). The Programs come from the built-in planner; with ``verify``
    (default) each is first verified by the sandbox at the block's shape sets, once per process.
    ``tune``: how mainloop configs are tuned for each new shape on a GPU (``export_autograd``).
    """
    function = _llama_mlp_function(eps, verify, saved)
    function.tune = tune
    return function


@lru_cache(maxsize=16)
def _llama_mlp_function(eps: float, verify: bool, saved: bool) -> ExportedFunction:
    family = llama_mlp_family(eps)
    forward_block = family["train" if saved else "forward"]
    backward_block = family["backward_saved" if saved else "backward"]
    if verify:
        forward, backward = verified_program(forward_block), verified_program(backward_block)
    else:
        forward, backward = lower(forward_block), lower(backward_block)
    return export_autograd(forward, backward, backward_block)


def _is_silu(act: Any) -> bool:
    probe = torch.linspace(-4, 4, 17)
    try:
        return bool(torch.allclose(act(probe), nn.functional.silu(probe), atol=1e-6))
    except Exception:  # noqa: BLE001 - any activation that cannot run on a probe is not SiLU
        return False


class CodaLlamaMLPBlock(nn.Module):
    """``x + mlp(norm(x))`` for a Hugging Face ``LlamaRMSNorm`` + ``LlamaMLP``, on CODA kernels.

    ``norm`` is the layer's ``post_attention_layernorm`` and ``mlp`` its ``mlp``; both are kept as
    submodules (parameters shared). ``x`` is ``[..., hidden]``; all parameters must have ``x``'s
    dtype (Programs use one activation dtype). ``verify``: verify the Programs in the sandbox
    when the module is built (default; once per process and epsilon). ``saved``: keep the gate
    and up projections and the SwiGLU output from the forward for the backward (default,
    CODA_MATH §7), or recompute them in the backward (three ``[tokens, intermediate]`` tensors
    less memory, one GEMM more).
    ``tune``: mainloop configs tuned per new shape on a GPU — ``quick`` (default), ``full``,
    ``off`` (``export_autograd``).
    """

    def __init__(
        self,
        norm: nn.Module,
        mlp: nn.Module,
        *,
        verify: bool = True,
        saved: bool = True,
        tune: Tuning = "quick",
    ) -> None:
        super().__init__()
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if getattr(getattr(mlp, proj), "bias", None) is not None:
                raise ValueError(f"mlp.{proj} has a bias; the llama_mlp block has none")
        if not _is_silu(mlp.act_fn):
            raise ValueError(f"mlp.act_fn is {mlp.act_fn!r}; the llama_mlp block uses SiLU")
        self.norm, self.mlp = norm, mlp
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        # Resolved here, not in forward: torch.compile then sees only the custom op.
        self.function = llama_mlp_function(eps, verify=verify, saved=saved, tune=tune)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = [
            self.norm.weight,
            self.mlp.gate_proj.weight,
            self.mlp.up_proj.weight,
            self.mlp.down_proj.weight,
        ]
        mixed = [w for w in weights if w.dtype != x.dtype]
        if mixed:
            raise TypeError(
                f"parameters of dtype {mixed[0].dtype} next to activations of dtype {x.dtype}: "
                "cast the modules to the activation dtype (e.g. model.to(torch.bfloat16))"
            )
        flat = x.reshape(-1, x.shape[-1])
        return self.function(flat, *weights).reshape(x.shape)
