"""The SwiGLU-backward experiment's patches still apply to the generated kernel, and the ones that
must not change results (strided dz stores) compute the original's dz under the
interpreter — so the GPU run measures what its docstring says."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import analyze, compile_program
from coda.primitives.ir import MainloopConfig

from . import load_script

experiment = load_script("experiments/swiglu_bwd_epilogue")
SIZES = {"M": 40, "d": 32, "f": 48}  # ragged against 32-row tiles and 16-column slices


def _dz(source: str, subtiles: int) -> torch.Tensor:
    block = get_block("llama_mlp_bwd_saved")
    program = lower(block)
    compiled = compile_program(program, analyze(program, SIZES))
    compiled.configs["down_bwd"] = MainloopConfig(
        block_m=32, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1,
        epilogue_subtiles=subtiles,
    )  # fmt: skip
    compiled.kernels["down_bwd"] = dataclasses.replace(compiled.kernels["down_bwd"], source=source)
    compiled.mainloop = "tma_mainloop"  # the patches are of the pointer epilogue, as on the GPU
    inputs = block.make_inputs(SIZES, torch.float32, seed=0, device="cpu")
    return compiled.run(compiled.prepare(inputs))["dz"]


def test_every_patch_applies_to_the_generated_kernel() -> None:
    program = lower(get_block("llama_mlp_bwd_saved"))
    source = compile_program(program, analyze(program, SIZES)).kernels["down_bwd"].source
    texts = experiment.variants(source)
    assert set(texts) == {
        "original", "strided_dz", "no_zdz", "no_dz", "no_loads", "acc_only"
    }  # fmt: skip
    assert "g_tile = tl.load" not in texts["acc_only"]


@pytest.mark.parametrize("subtiles", [1, 2])
@pytest.mark.parametrize("variant", ["strided_dz"])
def test_result_preserving_patches_compute_the_original_dz(variant: str, subtiles: int) -> None:
    program = lower(get_block("llama_mlp_bwd_saved"))
    source = compile_program(program, analyze(program, SIZES)).kernels["down_bwd"].source
    texts = experiment.variants(source)
    torch.testing.assert_close(_dz(texts[variant], subtiles), _dz(source, subtiles))
