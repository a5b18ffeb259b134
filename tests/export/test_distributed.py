"""Patched models under DistributedDataParallel and FSDP2 (``fully_shard``), two gloo processes
on the CPU: after one step every rank's loss and every full gradient equal the unpatched model's
under the same wrapper, and so do the loss and state dict after an SGD step — a Llama under
``patch_llama`` plain, with the packed gate/up parameter (sharded by FSDP2 like any other), with
activation checkpointing and with the fused loss, and under ``patch_model`` with the fused loss
a Qwen3 (per-head q/k norms), a Gemma (GeGLU, ``(1 + w)`` norms, scaled and tied embeddings), a
Gemma 2 (the sandwich-norm MLP kernel with gate and up packed, the softcapped loss), a Phi-3
(``qkv_proj`` and ``gate_up_proj`` read as row views of one Parameter; activation
checkpointing) and a Qwen2 (biased attention input) — all variants in one launch per wrapper
(``distributed_steps`` runs the ranks). Also here: the patched modules read the parameters the
model's modules hold at each call, which is what lets FSDP2 swap them, and a model wrapped or
sharded first is refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from coda.export import patch_llama, patch_model
from tests.export.distributed_steps import (
    FAMILIES,
    VARIANTS,
    assert_ranks_match,
    hf_names,
    models,
    run,
    tiny_llama,
    tiny_model,
)

transformers = pytest.importorskip("transformers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)


@pytest.mark.slow
def test_ddp_steps_of_a_patched_llama_match_the_unpatched_model(tmp_path: Path) -> None:
    assert_ranks_match(run("ddp", list(VARIANTS), tmp_path), atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_fsdp2_steps_of_a_patched_llama_match_the_unpatched_model(tmp_path: Path) -> None:
    assert_ranks_match(run("fsdp", list(VARIANTS), tmp_path), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "variant", ["plain", "fuse_gate_up", "phi3_patch_model", "gemma2_patch_model"]
)
def test_the_kernels_read_the_parameters_the_model_holds_at_each_call(variant: str) -> None:
    """New Parameter objects registered on the model's modules — as FSDP2 does around each
    layer's forward and backward, and ``load_state_dict(assign=True)`` does — are the ones the
    kernels read and the ones that get the gradients (not the modules the patch replaced): the
    Llama's separate and packed gate/up weights, Phi-3's row views of ``qkv_proj`` and
    ``gate_up_proj``, Gemma 2's post-norm weight in its MLP kernels, and the fused loss's norm
    and LM head."""
    _, coda = models(VARIANTS[variant])
    other = models(VARIANTS[variant])[0]
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    # new Parameters, tied ones (Gemma 2's embedding and LM head) still one
    coda.load_state_dict(copy.deepcopy(other.state_dict(keep_vars=True)), assign=True)
    ids = torch.randint(0, 64, (2, 7))
    want, got = other(input_ids=ids, labels=ids).loss, coda(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    want.backward()
    got.backward()
    grads = hf_names({n: p.grad for n, p in coda.named_parameters()})
    for name, p in other.named_parameters():
        assert grads[name] is not None, f"{name} got no gradient"
        torch.testing.assert_close(grads[name], p.grad, atol=2e-5, rtol=2e-5, msg=name)


def test_a_model_wrapped_or_sharded_before_patching_is_refused(tmp_path: Path) -> None:
    """A DistributedDataParallel wrapper, or FSDP2's DTensor parameters, built before the patch
    would not see the modules and parameters it replaces: refused, nothing changed."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        wrapped = DistributedDataParallel(tiny_llama())
        refused = "the model is a DistributedDataParallel: patch the model before wrapping"
        with pytest.raises(ValueError, match=refused):
            patch_llama(wrapped, verify=False, tune="off")
        sharded = tiny_llama()
        fully_shard(sharded.model.layers[0])
        with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight'.*"):
            patch_llama(sharded, verify=False, tune="off", fuse_gate_up=True)
        assert type(sharded.model.layers[1].mlp).__name__ == "LlamaMLP"  # untouched
        prefix, config, _ = FAMILIES["phi3"]  # patch_model refuses the same way
        with pytest.raises(ValueError, match=refused):
            patch_model(DistributedDataParallel(tiny_model(prefix, **config)), verify=False)
        sharded = tiny_model(prefix, **config)
        fully_shard(sharded.model.layers[1])
        with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.o_proj\.weight' is a"):
            patch_model(sharded, verify=False, tune="off")
        assert type(sharded.model.layers[0].mlp).__name__ == "Phi3MLP"  # untouched
    finally:
        dist.destroy_process_group()


def test_a_patched_layer_returns_a_tensor_of_its_own_not_a_view() -> None:
    """FSDP2 registers its pre-backward hook on each layer's output and warns when that is a view
    (an in-place op on it would drop the hook): the MLP's ``[tokens, d]`` output comes back in the
    layer's shape as a tensor of its own, as Hugging Face's ``Linear`` output does — in the
    residual, branch-only and autocast paths alike."""
    hf = tiny_llama()
    x = torch.randn(2, 5, 32, requires_grad=True)
    for options in ({}, {"fuse_residual": False}):
        coda = patch_llama(copy.deepcopy(hf), verify=False, tune="off", **options)
        mlp = coda.model.layers[0].mlp
        outs = [mlp(x)] + ([mlp(x, residual=True)] if not options else [])
        with torch.autocast("cpu", dtype=torch.float16):
            outs.append(mlp(x))
        for out in outs:
            assert out.shape == x.shape and out._base is None
        out.sum().backward()  # differentiable as before
        assert x.grad is not None
