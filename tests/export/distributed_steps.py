"""One training step of a tiny model, patched and unpatched, under DistributedDataParallel or FSDP2
(``fully_shard``), in ``world`` processes started with ``torch.multiprocessing.spawn``.

Every rank builds the same random model and a patched copy of it for each variant (``VARIANTS``):
a ``LlamaForCausalLM`` under ``patch_llama`` — plain, with the packed gate/up parameter, with
activation checkpointing, with the fused loss — and one model per ``FAMILIES`` entry under
``patch_model`` with the fused loss (Qwen3's per-head q/k norms; Gemma's GeGLU, ``(1 + w)``
norms, embedding scale and tied LM head; Gemma 2's sandwich-norm MLP kernel with gate and up
packed, and its softcapped loss; Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` read as row
views of one Parameter, with activation checkpointing; Qwen2's biased attention input). It
wraps both the same way, runs forward + backward on its own batch, steps SGD and runs the
forward once more; it saves its losses, every parameter's full gradient (under Hugging Face's
names) and its state dict to ``rank<r>.pt``, which ``assert_ranks_match`` compares. Shared by
``tests/export/test_distributed.py`` (gloo, CPU, the Triton interpreter) and
``tests/gpu/test_distributed_gpu.py`` (NCCL).
"""

from __future__ import annotations

import copy
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from coda.export.families import ATTENTION_INPUT, LM_HEAD_LOSS, MLP_HALF

# patch_llama's options per variant; "checkpointing" turns on Hugging Face's (non-reentrant)
# gradient checkpointing in both models instead.
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "fuse_gate_up": {"fuse_gate_up": True},
    "checkpointing": {"checkpointing": True},
    "fused_loss": {"fused_loss": True},
}
CONFIG = {
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
}  # fmt: skip
_ALL = (ATTENTION_INPUT, MLP_HALF, LM_HEAD_LOSS)
# patch_model's families: (Hugging Face class prefix, config beyond CONFIG, the kinds
# patch_model must patch — all of them but where a family's kind stays Hugging Face's by design)
FAMILIES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "qwen3": ("Qwen3", {"head_dim": 8}, _ALL),
    "gemma": ("Gemma", {"head_dim": 8}, _ALL),
    # its attention (softcapped scores, query_pre_attn_scalar) has no recipe: Hugging Face's
    "gemma2": ("Gemma2", {"head_dim": 8}, (MLP_HALF, LM_HEAD_LOSS)),
    "phi3": ("Phi3", {"pad_token_id": 0, "eos_token_id": 2}, _ALL),
    "qwen2": ("Qwen2", {}, _ALL),
}
VARIANTS.update({f"{family}_patch_model": {"family": family} for family in FAMILIES})
# Gemma 2's gate and up packed into one parameter (sharded by FSDP2 like any other); Phi-3's row
# views also taken again when checkpointing recomputes a layer in the backward
VARIANTS["gemma2_patch_model"]["fuse_gate_up"] = True
VARIANTS["phi3_patch_model"]["checkpointing"] = True
LR = 0.5  # large enough that a step applied to the wrong weights shows in the next loss


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    wrap: str,
    variants: list[str],
    out: Path,
    *,
    backend: str = "gloo",
    device: str = "cpu",
    world: int = 2,
) -> list[dict[str, Any]]:
    """Each rank's results (``{variant: {"hf" | "coda": {"losses", "grads"}}}``) of the step
    under ``wrap`` (``"ddp"`` or ``"fsdp"``); a rank's exception is raised here with its
    traceback (``torch.multiprocessing.ProcessRaisedException``)."""
    args = (world, free_port(), backend, device, wrap, variants, str(out))
    mp.spawn(_worker, args=args, nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def assert_ranks_match(ranks: list[dict[str, Any]], *, atol: float, rtol: float) -> None:
    """Per variant and rank: the patched model's losses, gradients and state dict after the step
    equal the unpatched model's, and every rank holds the same (reduced) gradients."""
    for name in ranks[0]:
        for rank, results in enumerate(ranks):
            want, got = results[name]["hf"], results[name]["coda"]
            where = f"{name}, rank {rank}"
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(want["losses"]), atol=atol, rtol=rtol,
                msg=lambda m, where=where: f"{where}: losses before and after the step: {m}",
            )  # fmt: skip
            assert got["grads"].keys() == want["grads"].keys(), where
            for param, g in want["grads"].items():
                assert got["grads"][param] is not None, f"{where}: {param} got no gradient"
                torch.testing.assert_close(
                    got["grads"][param], g, atol=atol, rtol=rtol, msg=f"{where}: {param}"
                )
            assert got["state"].keys() == want["state"].keys(), f"{where}: state-dict keys"
            for key, value in want["state"].items():
                torch.testing.assert_close(
                    got["state"][key], value, atol=atol, rtol=rtol, msg=f"{where}: state {key}"
                )
        first, *others = (results[name]["coda"]["grads"] for results in ranks)
        for other in others:  # the gradients were reduced over the ranks
            for param, g in first.items():
                torch.testing.assert_close(other[param], g, atol=0, rtol=0, msg=param)


def _worker(
    rank: int, world: int, port: int, backend: str, device: str, wrap: str, variants: list, out: str
) -> None:
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),  # the peers of a rank that failed stop waiting
    )
    try:
        where = torch.device(device, rank) if device == "cuda" else torch.device(device)
        if where.type == "cuda":
            torch.cuda.set_device(where)
        results = {name: _compare(VARIANTS[name], wrap, rank, where) for name in variants}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def tiny_llama() -> torch.nn.Module:
    """The same random Llama on every rank, norms away from 1 (a norm applied twice or never
    shows)."""
    return tiny_model("Llama")


def tiny_model(prefix: str, **config: Any) -> torch.nn.Module:
    """The same random ``<prefix>ForCausalLM`` on every rank (``CONFIG``'s widths and
    ``config``), in training mode, every norm weight and bias off its initial value (a norm
    applied twice or never, or a bias dropped, shows)."""
    import transformers

    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    torch.manual_seed(0)
    model = model_cls(config_cls(**CONFIG, **config)).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(0.2 * torch.randn_like(p))
    return model


def _batch(rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-specific token ids ``[2, 7]`` and their labels, two positions ignored (-100)."""
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 7), generator=g)
    labels = ids.clone()
    labels[0, 2] = labels[1, 5] = -100
    return ids.to(device), labels.to(device)


def models(options: dict[str, Any]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(unpatched, patched)`` for one variant's ``options`` (``VARIANTS``): a tiny Llama and
    its ``patch_llama`` copy, or a ``FAMILIES`` model and its ``patch_model`` copy with the fused
    loss (``AssertionError`` unless the report says the family's kinds are patched); with
    ``checkpointing``, Hugging Face's non-reentrant gradient checkpointing on in both."""
    from coda.export import patch_llama, patch_model

    options = dict(options)
    checkpointing = options.pop("checkpointing", False)
    family = options.pop("family", None)
    if family is not None:
        prefix, config, patched = FAMILIES[family]
        hf = tiny_model(prefix, **config)
        coda = copy.deepcopy(hf)
        report = patch_model(coda, verify=False, tune="off", fused_loss=True, **options)
        if not all(report.patched(kind) for kind in patched):
            raise AssertionError(f"patch_model left {family} partly unpatched:\n{report}")
    else:
        hf = tiny_llama()
        coda = patch_llama(copy.deepcopy(hf), verify=False, tune="off", **options)
    if checkpointing:
        for model in (hf, coda):
            kwargs = {"use_reentrant": False}  # the kind DDP and FSDP2 support
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return hf, coda


def _compare(options: dict[str, Any], wrap: str, rank: int, device: torch.device) -> dict:
    hf, coda = models(options)
    ids, labels = _batch(rank, device)
    return {
        name: _step(m.to(device), wrap, ids, labels) for name, m in (("hf", hf), ("coda", coda))
    }


def _step(model: torch.nn.Module, wrap: str, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """Loss, full gradients (Hugging Face's names, on the CPU), SGD step, loss again, and the
    state dict after the step (whole tensors: Hugging Face's keys, the packed gate/up parameter
    saved as its two weights also when sharded)."""
    wrapped = _wrap(model, wrap)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss = wrapped(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = hf_names({n: _full(p.grad) for n, p in model.named_parameters()})
    optimizer.step()
    with torch.no_grad():
        after = wrapped(input_ids=ids, labels=labels).loss
    state = {k: _full(v) for k, v in model.state_dict().items()}
    return {"losses": [loss.item(), after.item()], "grads": grads, "state": state}


def _wrap(model: torch.nn.Module, wrap: str) -> torch.nn.Module:
    """``DistributedDataParallel(model)``, or ``model`` after FSDP2's per-layer then root
    ``fully_shard``."""
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    raise ValueError(f"wrap must be 'ddp' or 'fsdp', not {wrap!r}")


def _full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor on the CPU (FSDP2's gradients and parameters are sharded DTensors)."""
    if tensor is None:
        return None
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().cpu()


def hf_names(grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """``mlp.gate_up_weight``'s gradient as Hugging Face's gate and up gradients (its even and
    odd rows), so both models' gradients have the same names."""
    named = {}
    for name, g in grads.items():
        if name.endswith("mlp.gate_up_weight"):
            prefix = name[: -len("gate_up_weight")]
            named[prefix + "gate_proj.weight"] = None if g is None else g[0::2]
            named[prefix + "up_proj.weight"] = None if g is None else g[1::2]
        else:
            named[name] = g
    return named
