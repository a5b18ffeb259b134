"""DistributedDataParallel and FSDP2 (``fully_shard``) over NCCL, one process per GPU on two GPUs:
the comparison of ``tests/export/test_distributed.py`` (each patched model against the unpatched
one, same wrapper, same batches: losses before and after an SGD step, every full gradient, the
state dict) for every variant it runs — the Llama's under ``patch_llama`` and the Qwen3, Gemma,
Gemma 2, Phi-3 and Qwen2 under ``patch_model`` (``distributed_steps.VARIANTS``) — with the
kernels compiled for the GPU. Skipped with fewer than two GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.export.distributed_steps import VARIANTS, assert_ranks_match, run

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
    reason="needs two CUDA GPUs and NCCL",
)
# fp32 throughout: the kernels multiply in full fp32 (not tf32), as PyTorch's fp32 matmul does;
# the two sides still accumulate in different orders, hence fp32's two ulps of tests/helpers.py.
TOL = {"atol": 2e-5, "rtol": 2e-5}


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_patched_model_steps_over_nccl_match_the_unpatched_model(wrap: str, tmp_path: Path) -> None:
    ranks = run(wrap, list(VARIANTS), tmp_path, backend="nccl", device="cuda", world=2)
    assert_ranks_match(ranks, **TOL)
