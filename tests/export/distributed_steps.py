"""One training step of a tiny Llama, patched and unpatched, under DistributedDataParallel or FSDP2
(``fully_shard``), in ``world`` processes started with ``torch.multiprocessing.spawn``.

Every rank builds the same random ``LlamaForCausalLM`` and a ``patch_llama`` copy of it for each
variant (``VARIANTS``: the packed gate/up parameter, activation checkpointing, the fused loss; and
a ``Qwen3ForCausalLM`` with its ``patch_model`` copy),
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

# patch_llama's options per variant; "checkpointing" turns on Hugging Face's (non-reentrant)
# gradient checkpointing in both models instead.
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "fuse_gate_up": {"fuse_gate_up": True},
    "checkpointing": {"checkpointing": True},
    "fused_loss": {"fused_loss": True},
    # patch_model on a Qwen3 (per-head q/k norms: its own attention-input kernels)
    "qwen3_patch_model": {"family": "qwen3"},
}
CONFIG = {
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
}  # fmt: skip
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
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return _norms_away_from_one(LlamaForCausalLM(LlamaConfig(**CONFIG)).train())


def tiny_qwen3() -> torch.nn.Module:
    """The same random Qwen3 on every rank (``CONFIG``'s widths, head_dim 8), norms — the q/k
    norms among them — away from 1."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return _norms_away_from_one(Qwen3ForCausalLM(Qwen3Config(**CONFIG, head_dim=8)).train())


def _norms_away_from_one(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every norm weight drawn around 1 (seeded by the caller)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def _batch(rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-specific token ids ``[2, 7]`` and their labels, two positions ignored (-100)."""
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 7), generator=g)
    labels = ids.clone()
    labels[0, 2] = labels[1, 5] = -100
    return ids.to(device), labels.to(device)


def _compare(options: dict[str, Any], wrap: str, rank: int, device: torch.device) -> dict:
    from coda.export import patch_llama, patch_model
    from coda.export.families import ATTENTION_INPUT, LM_HEAD_LOSS, MLP_HALF

    options = dict(options)
    checkpointing = options.pop("checkpointing", False)
    if options.pop("family", None) == "qwen3":
        hf = tiny_qwen3()
        coda = copy.deepcopy(hf)
        report = patch_model(coda, verify=False, tune="off", fused_loss=True)
        if not all(report.patched(kind) for kind in (ATTENTION_INPUT, MLP_HALF, LM_HEAD_LOSS)):
            raise AssertionError(f"patch_model left Qwen3 partly unpatched:\n{report}")
    else:
        hf = tiny_llama()
        coda = patch_llama(copy.deepcopy(hf), verify=False, tune="off", **options)
    ids, labels = _batch(rank, device)
    results = {}
    for name, model in (("hf", hf), ("coda", coda)):
        if checkpointing:
            kwargs = {"use_reentrant": False}  # the kind DDP and FSDP2 support
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        results[name] = _step(model.to(device), wrap, ids, labels)
    return results


def _step(model: torch.nn.Module, wrap: str, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """Loss, full gradients (Hugging Face's names, on the CPU), SGD step, loss again, and the
    state dict after the step (whole tensors: Hugging Face's keys, the packed gate/up parameter
    saved as its two weights also when sharded)."""
    wrapped = _wrap(model, wrap)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss = wrapped(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = _hf_names({n: _full(p.grad) for n, p in model.named_parameters()})
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


def _hf_names(grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
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
