"""The CuTe backend on a Hopper GPU (skipped where it cannot run: no GPU, not sm_90, or the CuTe
DSL and QuACK not installed). Every fused step it covers runs there — never silently on Triton —
and computes what the Triton kernels and the float32 reference compute, with every output element
written (outputs pre-filled with NaN), at ragged shapes, in bfloat16 and float16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import analyze, compile_program, cute
from coda.primitives.ir import GemmEpilogue, Program
from coda.sandbox import SandboxOptions, evaluate

pytestmark = pytest.mark.skipif(
    not cute.available(), reason=f"the CuTe backend cannot run here: {cute.unavailable_reason()}"
)

KERNELS = [
    "gemm_swiglu",
    "gemm_rmsnorm_swiglu",
    "gemm_partial_swiglu_bwd",
    "gemm_residual_partial_rmsnorm_bwd",
    "gemm_rmsnorm",
    "gemm_residual_partial_rmsnorm",
]
SHAPES = [{"M": 1000, "N": 1024, "K": 1000}, {"M": 2048, "N": 2048, "K": 2048}]
PROGRAMS = Path(__file__).parents[2] / "export" / "programs"


def _sizes(block, sizes: dict[str, int]) -> dict[str, int]:
    sizes = dict(sizes)
    if any("N2" in spec.shape for spec in block.inputs.values()):
        sizes["N2"] = 2 * sizes["N"]
    return sizes


def _errors(got: dict, ref: dict, names) -> dict[str, float]:
    return {
        n: float((got[n].float() - ref[n].float()).abs().max() / ref[n].float().abs().max())
        for n in names
    }


def _assert_matches(block, inputs: dict, got: dict, triton: dict) -> None:
    """Every output written, and within twice the Triton kernels' error (+ 0.002) of the
    float32 reference."""
    ref = block.reference({k: v.float() if v.is_floating_point() else v for k, v in inputs.items()})
    cute_err, triton_err = _errors(got, ref, block.outputs), _errors(triton, ref, block.outputs)
    for out in block.outputs:
        assert not got[out].isnan().any(), f"{out}: an element was never written"
        assert cute_err[out] <= 2 * triton_err[out] + 2e-3, (out, cute_err, triton_err)


def _run(program: Program, sizes: dict[str, int], inputs: dict, backend: str):
    compiled = compile_program(program, analyze(program, sizes))
    compiled.epilogue_backend = backend
    tensors = compiled.run(compiled.prepare(inputs), poison=True)
    torch.cuda.synchronize()
    return compiled, program.select_outputs(tensors, sizes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s['M']}x{s['N']}x{s['K']}")
@pytest.mark.parametrize("name", KERNELS)
def test_paper_kernels_on_cute_match_triton_and_the_reference_gpu(
    name: str, shape: dict, dtype: torch.dtype
) -> None:
    block = get_block(name)
    sizes = _sizes(block, shape)
    program = lower(block)
    inputs = block.make_inputs(sizes, dtype, seed=5, device="cuda")
    on_cute, got = _run(program, sizes, inputs, "cute")
    fused = [
        n
        for n, s in zip(program.step_names(), program.steps, strict=True)
        if isinstance(s, GemmEpilogue)
    ]
    assert all(on_cute.mainloops_used[n] == "cute" for n in fused), on_cute.cute_refusals
    _, triton = _run(program, sizes, inputs, "triton")
    _assert_matches(block, inputs, got, triton)


@pytest.mark.parametrize(
    "name",
    [
        "gemm_residual_partial_rmsnorm_bwd",
        "gemm_rmsnorm",
        "gemm_residual_partial_rmsnorm",
        "gemm_partial_swiglu_bwd",
        "gemm_rmsnorm_swiglu",
    ],
)
def test_the_wide_tile_matches_triton_at_a_ragged_shape_gpu(name: str, monkeypatch) -> None:
    # 128 × 192 tiles run only large products (cute.launch.choose_config); here forced at a ragged
    # shape, so partial tiles at both edges and the partial sums' masks are exercised
    from coda.primitives.cute import launch

    wide = launch.WIDE
    monkeypatch.setattr(launch, "choose_config", lambda gemm: wide)
    block = get_block(name)
    # N = 1088: ragged for 192-column tiles, and half of it (a SwiGLU's output) still a whole
    # number of 16-byte rows for TMA
    sizes = _sizes(block, {"M": 1000, "N": 1088, "K": 1000})
    program = lower(block)
    inputs = block.make_inputs(sizes, torch.bfloat16, seed=7, device="cuda")
    on_cute, got = _run(program, sizes, inputs, "cute")
    assert set(on_cute.mainloops_used.values()) == {"cute"}, on_cute.cute_refusals
    _, triton = _run(program, sizes, inputs, "triton")
    _assert_matches(block, inputs, got, triton)


def _cute_launches_match_triton(name: str, shape: dict, seed: int, launches: int) -> list:
    """Run block ``name``'s lowered Program on the CuTe backend ``launches`` times on the same
    prepared inputs, each into NaN-filled outputs that must match the Triton kernels'; the
    ``CuteLaunch`` actions its run plans replayed."""
    from coda.primitives.cute import launch

    block = get_block(name)
    sizes = _sizes(block, shape)
    program = lower(block)
    inputs = block.make_inputs(sizes, torch.bfloat16, seed=seed, device="cuda")
    compiled = compile_program(program, analyze(program, sizes))
    compiled.epilogue_backend = "cute"
    prepared = compiled.prepare(inputs)
    _, triton = _run(program, sizes, inputs, "triton")
    for _ in range(launches):
        got = program.select_outputs(compiled.run(prepared, poison=True), sizes)
        torch.cuda.synchronize()
        assert set(compiled.mainloops_used.values()) == {"cute"}, compiled.cute_refusals
        _assert_matches(block, inputs, got, triton)
    return [
        a for plan in compiled._run_plans.values() for a in plan.actions
        if isinstance(a, launch.CuteLaunch)
    ]  # fmt: skip


def test_the_dynamic_scheduler_matches_triton_launch_after_launch_gpu(monkeypatch) -> None:
    # clusters take tiles from a counter in global memory that each launch leaves at 0 again
    # (the atomic increments wrap after the last tile): a stale counter would skip tiles, which
    # the NaN-filled outputs of later launches would show
    from coda.primitives.cute import launch

    dynamic = launch.CuteConfig(128, 128, dynamic=True)
    monkeypatch.setattr(launch, "choose_config", lambda gemm: dynamic)
    shape = {"M": 1000, "N": 1088, "K": 1000}
    launches = _cute_launches_match_triton("gemm_partial_swiglu_bwd", shape, seed=9, launches=3)
    counters = [a._counter for a in launches]
    assert counters and all(c is not None and c.item() == 0 for c in counters)


def _overlapped(level: int, tile: tuple[int, int] = (128, 128), cluster_n: int = 1):
    from coda.primitives.cute.launch import CuteConfig

    pingpong = tile == (128, 128)
    return CuteConfig(*tile, 2 // cluster_n, cluster_n, pingpong, epi_overlap=level)


@pytest.mark.parametrize(
    "config",
    [
        _overlapped(1),
        _overlapped(2),
        _overlapped(2, cluster_n=2),
        _overlapped(2, tile=(256, 128)),
        _overlapped(2, tile=(128, 256)),
    ],
    ids=lambda c: f"{c.tile_m}x{c.tile_n}-{c.cluster_m}x{c.cluster_n}-ov{c.epi_overlap}",
)
@pytest.mark.parametrize(
    "name",
    [
        "gemm_partial_swiglu_bwd",
        "gemm_residual_partial_rmsnorm_bwd",
        "gemm_residual_partial_rmsnorm",
    ],
)
def test_the_overlapped_epilogue_matches_triton_launch_after_launch_gpu(
    name: str, config, monkeypatch
) -> None:
    # the loop that reads the next sub-tile's tile loads early (level 1) and stores each
    # sub-tile one sub-tile late (level 2), on ping-pong and cooperative tiles, at a ragged
    # shape with several tiles per CTA: a store issued before its buffer was written, or a
    # buffer overwritten before its store read it, shows as wrong or NaN elements
    from coda.primitives.cute import launch

    monkeypatch.setattr(launch, "choose_config", lambda gemm: config)
    shape = {"M": 4000, "N": 2112, "K": 512}
    used = {a.config for a in _cute_launches_match_triton(name, shape, seed=11, launches=2)}
    assert used == {config}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("name", "steps"),
    [
        ("llama_mlp_train", ("gate_up", "down")),
        ("llama_mlp_bwd_saved", ("down_bwd", "gate_up_bwd")),
    ],
)
def test_the_shipped_llama_mlp_on_cute_matches_triton_gpu(
    name: str, steps: tuple, dtype: torch.dtype
) -> None:
    # the forward's gate/up contracts the accumulator's own [g, u] pairs into three half-wide
    # stores; the backward's steps move pair-wide tiles
    data = json.loads((PROGRAMS / f"{name}.json").read_text())
    program = Program.model_validate(data["program"])
    block = get_block(name)
    sizes = {"M": 1000, "d": 1024, "f": 2816}
    inputs = block.make_inputs(sizes, dtype, seed=3, device="cuda")
    on_cute, got = _run(program, sizes, inputs, "cute")
    assert {on_cute.mainloops_used[n] for n in steps} == {"cute"}, on_cute.cute_refusals
    _, triton = _run(program, sizes, inputs, "triton")
    _assert_matches(block, inputs, got, triton)


def test_a_step_the_backend_does_not_cover_runs_on_triton_and_says_why_gpu() -> None:
    block = get_block("gemm_rope")
    sizes = {"M": 512, "N": 512, "K": 256, "D": 128}
    program = lower(block)
    compiled, _ = _run(
        program, sizes, block.make_inputs(sizes, torch.bfloat16, seed=0, device="cuda"), "cute"
    )
    (step,) = compiled.kernels
    assert compiled.mainloops_used[step] != "cute"
    assert "rope has no CuTe emitter" in compiled.cute_refusals[step]


def test_the_sandbox_verifies_the_swiglu_backward_on_cute_gpu(monkeypatch) -> None:
    monkeypatch.setenv("CODA_EPILOGUE_BACKEND", "cute")
    block = get_block("gemm_partial_swiglu_bwd")
    report = evaluate(lower(block), block, SandboxOptions(profile=False))
    assert report.verified, report.render_text()


@pytest.mark.parametrize("backend", ["cute", "auto"])
def test_tuning_pins_a_checked_choice_per_step_and_the_program_still_matches_gpu(
    backend: str, tmp_path
) -> None:  # noqa: ANN001
    # every CuTe candidate (and under auto the step's Triton kernel, and for the plain steps
    # cuBLAS) timed on the step's tensors, the winner checked against the reference; the tuned
    # Program computes what Triton's does
    from coda.primitives.codegen.tuning import QUICK_SPACE, TuningCache, tune_program
    from coda.primitives.cute.tuning import CuteTuning

    data = json.loads((PROGRAMS / "llama_mlp_bwd_saved.json").read_text())
    program = Program.model_validate(data["program"])
    block = get_block("llama_mlp_bwd_saved")
    sizes = {"M": 1000, "d": 1024, "f": 2816}
    inputs = block.make_inputs(sizes, torch.bfloat16, seed=5, device="cuda")
    compiled = compile_program(program, analyze(program, sizes))
    compiled.epilogue_backend = backend
    prepared = compiled.prepare(inputs)
    results = tune_program(
        compiled, prepared, space=QUICK_SPACE, cache=TuningCache(tmp_path / "t.json")
    )
    for step in ("down_bwd", "gate_up_bwd"):
        result = results[step]
        assert isinstance(result, CuteTuning) and result.times, result
        assert set(compiled.cute_configs) >= {step}
        if backend == "cute":
            assert result.best is not None and "triton" not in result.times
    # the weight gradients (plain products): timed against cuBLAS under auto only
    tensors = compiled.run(prepared, poison=True)
    torch.cuda.synchronize()
    for step in ("w_down_grad", "w_gate_up_grad"):
        if backend == "auto":
            assert isinstance(results[step], CuteTuning) and "cublas" in results[step].times
            ran = compiled.mainloops_used.get(step)
            assert ran == ("cute" if compiled.cute_configs[step] else None), results[step]
        else:
            assert step not in results and step not in compiled.cute_configs
    got = program.select_outputs(tensors, sizes)
    _, triton = _run(program, sizes, inputs, "triton")
    _assert_matches(block, inputs, got, triton)
