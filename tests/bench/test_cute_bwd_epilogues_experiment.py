"""bench/experiments/cute_bwd_epilogues.py: it loads without the CuTe DSL, its check compares the
product's Programs with the blocks' float32 references (the comparison the GPU run makes for the
QuACK kernels), and — where the DSL is installed — its kernels compile for sm_90a without a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from coda.blocks.registry import get_block

from . import BENCH, load_script

experiment = load_script("experiments/cute_bwd_epilogues")


@pytest.mark.parametrize("name", sorted(experiment.KERNELS))
def test_the_product_program_passes_the_experiments_check(name: str) -> None:
    block = get_block(name)
    sizes = experiment._sizes(name, 37, 48, 29)
    inputs = block.make_inputs(sizes, torch.float32, seed=3, device="cpu")
    errors = experiment.check_outputs(
        block, experiment.triton_runner(block, sizes, inputs)(), inputs
    )
    assert set(errors) == set(block.outputs)
    assert max(errors.values()) < 1e-5


def test_the_check_sees_a_wrong_output() -> None:
    block = get_block("gemm_partial_swiglu_bwd")
    sizes = experiment._sizes(block.name, 37, 48, 29)
    inputs = block.make_inputs(sizes, torch.float32, seed=3, device="cpu")
    got = dict(experiment.triton_runner(block, sizes, inputs)())
    got["zdz"] = got["zdz"] * 1.05
    assert experiment.check_outputs(block, got, inputs)["zdz"] > 0.01


def test_sizes_double_n_only_for_the_pair_kernel() -> None:
    assert experiment._sizes("gemm_partial_swiglu_bwd", 8, 16, 4)["N2"] == 32
    assert "N2" not in experiment._sizes("gemm_residual_partial_rmsnorm_bwd", 8, 16, 4)


@pytest.mark.skipif(
    importlib.util.find_spec("quack") is None or importlib.util.find_spec("cutlass") is None,
    reason="the CuTe DSL and QuACK are not installed",
)
def test_both_kernels_compile_for_sm90a_without_a_gpu() -> None:
    script = BENCH / "experiments" / "cute_bwd_epilogues.py"
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    r = subprocess.run(
        [sys.executable, str(script), "--compile-only", "--configs", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("compiled") == 2
