"""Every fused step of the shipped Programs that the CuTe backend covers compiles for Hopper
(sm_90a) on a machine without a GPU (``python -m coda.primitives.cute``); skipped where the CuTe
DSL and QuACK are not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).parents[2] / "export" / "programs"
HAVE_DSL = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "quack"))


def _check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coda.primitives.cute", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **(env or {})},
    )


def test_coverage_of_the_shipped_programs_is_reported_without_the_dsl() -> None:
    r = _check(
        "--no-compile", str(PROGRAMS / "llama_mlp_bwd_saved.json"), str(PROGRAMS / "llama_mlp.json")
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "llama_mlp_bwd_saved.json down_bwd: covered" in lines
    assert "llama_mlp_bwd_saved.json gate_up_bwd: covered" in lines
    assert "llama_mlp.json gate_up: covered" in lines  # the accumulator's own pairs contracted
    lines = _check("--no-compile", str(PROGRAMS / "llama_attn_in.json")).stdout.splitlines()
    assert "llama_attn_in.json q_k_v: Triton — rope has no CuTe emitter" in lines


@pytest.mark.skipif(not HAVE_DSL, reason="the CuTe DSL and QuACK are not installed")
def test_the_training_backward_steps_compile_for_sm90a(tmp_path: Path) -> None:
    programs = [str(PROGRAMS / f"{n}.json") for n in ("llama_mlp_bwd_saved", "gemma_mlp_bwd_saved")]
    r = _check(*programs, env={"CODA_CACHE_DIR": str(tmp_path), "CUTE_DSL_ARCH": "sm_90a"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("compiled in") == 4, r.stdout
