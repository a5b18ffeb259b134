"""The generated CuTe epilogues executed on a CPU (``cute_emulator``: the DSL and QuACK stood in
for, fragments as whole output tiles) against the reference executor: the arithmetic, the pair
members, the loop over pairs, the stores and the masked partial sums, at ragged shapes where
tiles cross the output's edges and vectors past them hold NaN. QuACK's own layouts are the GPU
tests' to check (tests/gpu/test_cute_gpu.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import analyze
from coda.primitives.analysis import bind_sizes
from coda.primitives.cute.emit import generate
from coda.primitives.cute.launch import CuteStep
from coda.primitives.ir import GemmEpilogue, Program
from coda.primitives.reference import execute_reference

from .cute_emulator import emulate_step

PROGRAMS = Path(__file__).parents[2] / "export" / "programs"


def _check_steps(program: Program, inputs: dict[str, torch.Tensor], tile=(4, 8)) -> list[str]:
    """Emulate every covered fused step on the reference's own inputs to it; compare what it
    writes (partial sums summed) with what the reference wrote. Returns the steps checked."""
    info = analyze(program, bind_sizes(program, {n: t.shape for n, t in inputs.items()}))
    ref = execute_reference(program, inputs, info=info)
    checked = []
    for step, name in zip(program.steps, program.step_names(), strict=True):
        if not isinstance(step, GemmEpilogue) or info.gemms[name].vendor:
            continue
        gemm = info.gemms[name]
        dtypes = {n: t.dtype for n, t in ref.items() if t.is_floating_point()}
        source = generate(step, gemm, dtypes)
        a, b = CuteStep(step)._operands(ref)
        got = emulate_step(source, a, b, ref, tile)
        for out, t in gemm.writes.items():
            want = ref[out].double()
            if t.partials is not None:
                have, want = got[f"{out}:sum"], want.sum(-1)
            else:
                have = got[out].double()
            assert not have.isnan().any(), f"{name}: {out} has elements never written"
            scale = want.abs().max().clamp(min=1e-6)
            err = float((have - want).abs().max() / scale)
            assert err < 1e-2, f"{name}: {out} is off by {err:.3g} of its largest value"
        checked.append(name)
    return checked


@pytest.mark.parametrize(
    "name",
    [
        "gemm_partial_swiglu_bwd",
        "gemm_residual_partial_rmsnorm_bwd",
        "gemm_swiglu",
        "gemm_rmsnorm_swiglu",
        "gemm_rmsnorm",
        "gemm_residual_partial_rmsnorm",
    ],
)
def test_the_covered_paper_kernels_compute_their_reference(name: str) -> None:
    block = get_block(name)
    sizes = {"M": 10, "N": 20, "K": 12}  # tiles of 4 × 8 cross both edges
    if any("N2" in spec.shape for spec in block.inputs.values()):
        sizes["N2"] = 40
    inputs = block.make_inputs(sizes, torch.float16, seed=2, device="cpu")
    assert _check_steps(lower(block), inputs)


@pytest.mark.parametrize(
    ("program", "sizes", "steps"),
    [
        ("llama_mlp_train", {"M": 10, "d": 24, "f": 20}, ["gate_up", "down"]),
        ("llama_mlp_bwd_saved", {"M": 10, "d": 24, "f": 20}, ["down_bwd", "gate_up_bwd"]),
        ("gemma_mlp_bwd_saved", {"M": 10, "d": 24, "f": 20}, ["down_bwd", "gate_up_bwd"]),
    ],
)
def test_the_shipped_mlp_steps_compute_their_reference(program: str, sizes: dict, steps) -> None:
    data = json.loads((PROGRAMS / f"{program}.json").read_text())
    prog = Program.model_validate(data["program"])
    block = get_block(program)
    inputs = block.make_inputs(sizes, torch.float16, seed=3, device="cpu")
    assert _check_steps(prog, inputs) == steps


def test_an_unmasked_edge_would_show() -> None:
    """The emulation can fail: with the partial sums' masks taken out, the NaN a vector holds
    past the edge reaches the residual + RMSNorm backward's dγ (its rows past M)."""
    block = get_block("gemm_residual_partial_rmsnorm_bwd")
    sizes = {"M": 10, "N": 20, "K": 12}
    inputs = block.make_inputs(sizes, torch.float16, seed=2, device="cpu")
    program = lower(block)
    info = analyze(program, sizes)
    ref = execute_reference(program, inputs, info=info)
    (step,) = program.steps[:1]
    source = generate(
        step, info.gemms[program.step_names()[0]], {n: t.dtype for n, t in ref.items()}
    )
    unmasked = source.text.replace("F.where(inside_m, ", "(lambda c, v, z: v)(inside_m, ")
    a, b = CuteStep(step)._operands(ref)
    import dataclasses

    got = emulate_step(dataclasses.replace(source, text=unmasked), a, b, ref)
    assert got["dgamma_partials:sum"].isnan().any()
