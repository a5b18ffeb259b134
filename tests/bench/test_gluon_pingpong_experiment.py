"""bench/experiments/gluon_pingpong.py: its kernels compile for sm_90 on a machine without a GPU
(through a stand-in driver) and fit in shared memory; its reference computes what the paper-kernel
blocks it times compute — so the GPU run measures the blocks' semantics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from coda.blocks.kernels import gemm_partial_swiglu_bwd, gemm_residual_partial_rmsnorm
from coda.primitives.offline_target import MAX_PROGRAM_SHARED_BYTES

from . import BENCH, load_script

experiment = load_script("experiments/gluon_pingpong")


def _has_gluon_hopper() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_gluon_hopper(), reason="this Triton has no Gluon Hopper language")
@pytest.mark.parametrize("configs", ["sweep", "prefetch"])
def test_every_two_consumer_config_compiles_for_sm90_and_fits(configs: str) -> None:
    # Compiled in a process of its own without the interpreter (the test process runs Triton's
    # interpreter, which never reaches the sm_90 backend).
    script = BENCH / "experiments" / "gluon_pingpong.py"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run(
        [sys.executable, str(script), "--compile-only", "--configs", configs],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0, r.stderr[-3000:]
    named = {"sweep": experiment.PINGPONG_SWEEP, "prefetch": experiment.PINGPONG_PREFETCH}
    assert [(row["kind"], row["config"]) for row in rows] == list(named[configs])
    for row in rows:
        cfg = row["config"]
        ring = cfg["STAGES"] * (128 * 64 + 128 * 64) * 2  # A and B slots, bf16, BK = 64
        assert ring < row["shared_bytes"] <= MAX_PROGRAM_SHARED_BYTES
        assert row["fits"]


def _block_inputs(block, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    return block.make_inputs(sizes, torch.float64, seed=3)


def test_swiglu_bwd_reference_is_the_blocks() -> None:
    sizes = {"M": 9, "N": 6, "K": 5, "N2": 12}
    inputs = _block_inputs(gemm_partial_swiglu_bwd, sizes)
    want = gemm_partial_swiglu_bwd.reference(inputs)
    got = experiment.reference("swiglu_bwd", inputs["a"], inputs["b"], b_nk=True, z=inputs["z"])
    for name in ("dz", "o", "zdz"):
        torch.testing.assert_close(got[name].double(), want[name].double(), rtol=1e-5, atol=1e-6)


def test_residual_rmsnorm_reference_is_the_blocks() -> None:
    sizes = {"M": 7, "N": 10, "K": 4}
    inputs = _block_inputs(gemm_residual_partial_rmsnorm, sizes)
    want = gemm_residual_partial_rmsnorm.reference(inputs)
    got = experiment.reference(
        "residual_rmsnorm",
        inputs["a"],
        inputs["b"],
        b_nk=False,
        c=inputs["c"],
        gamma=inputs["gamma"],
    )
    torch.testing.assert_close(got["d"].double(), want["d"].double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["o"].double(), want["o"].double(), rtol=1e-5, atol=1e-6)
    ms = got["ss"].double() / sizes["N"]
    torch.testing.assert_close(ms, want["ms"].double(), rtol=1e-5, atol=1e-6)


def test_finished_sums_the_row_partials() -> None:
    partials = torch.arange(12.0).reshape(3, 4)
    out = experiment.finished("swiglu_bwd", {"dz": torch.zeros(1), "partials": partials})
    assert set(out) == {"dz", "zdz"}
    torch.testing.assert_close(out["zdz"], partials.sum(1))


def test_sizes_are_cubes_or_training_shapes() -> None:
    script = experiment
    assert script.parse_size("4096") == (4096, 4096, 4096)
    assert script.parse_size("8192x8192x2048") == (8192, 8192, 2048)
    with pytest.raises(ValueError, match="MxNxK"):
        script.parse_size("8192x2048")
