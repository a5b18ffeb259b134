"""How a compiled Program chooses and drives the CuTe backend, on a CPU: the choice and its
refusals, and — with the DSL's compile and launch replaced by recorders — the arguments a launch
gets (QuACK's shapes and layouts), one compile per signature, replays, and nothing launched while
launches are being collected. The kernels themselves run in tests/gpu/test_cute_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import analyze, compile_program, cute
from coda.primitives.cute import launch as cute_launch

SIZES = {"M": 40, "N": 48, "K": 24, "N2": 96}


def _compiled(name: str, sizes: dict[str, int], backend: str):
    """Block ``name``'s planned Program compiled for ``sizes`` on ``backend``, and fp16 inputs."""
    block = get_block(name)
    program = lower(block)
    compiled = compile_program(program, analyze(program, sizes))
    compiled.epilogue_backend = backend
    inputs = block.make_inputs(sizes, torch.float16, seed=0, device="cpu")
    return block, program, compiled, inputs


def _swiglu_bwd(backend: str):
    return _compiled("gemm_partial_swiglu_bwd", SIZES, backend)


def test_auto_on_a_cpu_runs_triton_and_says_why() -> None:
    block, program, compiled, inputs = _swiglu_bwd("auto")
    out = program.select_outputs(compiled.run(compiled.prepare(inputs)), SIZES)
    assert compiled.mainloops_used["b"] != "cute"
    assert "cpu" in compiled.cute_refusals["b"]
    ref = block.reference({k: v.float() for k, v in inputs.items()})
    assert torch.allclose(out["o"].float(), ref["o"], atol=2e-2, rtol=2e-2)


def test_a_step_left_on_triton_under_cute_warns_once(recorder) -> None:  # noqa: ANN001
    sizes = {"M": 40, "N": 64, "K": 24, "D": 32}
    _, _, compiled, inputs = _compiled("gemm_rope", sizes, "cute")
    prepared = compiled.prepare(inputs)
    with pytest.warns(UserWarning, match="step 'd' runs on Triton: rope has no CuTe emitter"):
        compiled.run(prepared)
    assert "rope" in compiled.cute_refusals["d"]


def test_cute_asked_for_where_it_cannot_run_is_an_error() -> None:
    _, _, compiled, inputs = _swiglu_bwd("cute")
    with pytest.raises(RuntimeError, match="CODA_EPILOGUE_BACKEND=cute.*cpu"):
        compiled.run(compiled.prepare(inputs))


class _Recorder:
    def __init__(self) -> None:
        self.compiles: list[tuple] = []
        self.launches: list[dict[str, Any]] = []
        self.counters: list[torch.Tensor | None] = []
        self.sources: list[Any] = []

    def compile(self, source, args, config):  # noqa: ANN001
        self.compiles.append((source.key, config))
        return "kernel"

    def run(self, fn, source, args, config, counter=None) -> None:  # noqa: ANN001
        assert fn == "kernel"
        assert (counter is not None) == config.dynamic
        self.launches.append(args)
        self.counters.append(counter)
        self.sources.append(source)


@pytest.fixture
def recorder(monkeypatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(cute, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(cute_launch, "_compile", rec.compile)
    monkeypatch.setattr(cute_launch, "_run", rec.run)
    return rec


def test_a_launch_gets_quack_shapes_and_layouts(recorder: _Recorder) -> None:
    _, _, compiled, inputs = _swiglu_bwd("cute")
    tensors = compiled.run(compiled.prepare(inputs))
    assert compiled.mainloops_used["b"] == "cute" and not compiled.cute_refusals
    (args,) = recorder.launches
    M, N, K = SIZES["M"], SIZES["N"], SIZES["K"]
    assert args["A"].shape == (M, K, 1) and args["A"].stride(1) == 1
    assert args["B"].shape == (N, K, 1) and args["B"].stride(1) == 1  # b is [N, K]: used as Bᵀ
    # dz is [M, 2N] fp16, moved as [M, N] 32-bit words of (dg, du) pairs; so is the loaded z
    assert args["D"].shape == (M, N, 1) and args["D"].dtype == torch.float32
    assert args["D"].data_ptr() == tensors["dz"].data_ptr()
    assert args["t_z"].shape == (M, N, 1) and args["t_z"].dtype == torch.float32
    assert args["s_o"].shape == (M, N, 1) and args["s_o"].dtype == torch.float16
    tiles = -(-N // cute_launch.choose_config(compiled.info_for(inputs).gemms["b"]).tile_n)
    assert args["r_zdz_partials"].shape == (1, M, tiles)
    assert (args["m_bound"], args["n_bound"]) == (M, N)


def test_replays_launch_again_and_compile_once(recorder: _Recorder) -> None:
    _, _, compiled, inputs = _swiglu_bwd("cute")
    prepared = compiled.prepare(inputs)
    for _ in range(3):
        compiled.run(prepared)
    assert len(recorder.launches) == 3 and len(recorder.compiles) == 1


@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("gemm_partial_swiglu_bwd", SIZES),  # pair-wide D and tile, row partials, bounds
        ("gemm_residual_partial_rmsnorm_bwd", {"M": 40, "N": 48, "K": 24}),  # column partials
        ("gemm_swiglu", {"M": 40, "N": 64, "K": 24}),  # a half-wide store, B not transposed
    ],
)
def test_a_replay_views_its_tensors_as_the_first_call_did(
    recorder: _Recorder, name: str, sizes: dict[str, int]
) -> None:
    # the replay makes each view in one as_strided with the first call's sizes and strides; on
    # another call's tensors it must give what working the views out again gives
    block, _, compiled, inputs = _compiled(name, sizes, "cute")
    compiled.run(compiled.prepare(inputs))
    again = block.make_inputs(sizes, torch.float16, seed=1, device="cpu")
    tensors = compiled.run(compiled.prepare(again))
    (plan,) = compiled._run_plans.values()
    (launch,) = [a for a in plan.actions if isinstance(a, cute_launch.CuteLaunch)]
    replayed, fresh = recorder.launches[-1], launch._first_arguments(tensors)
    assert set(fresh) <= set(replayed)
    for arg, want in fresh.items():
        got = replayed[arg]
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        assert got.data_ptr() == want.data_ptr(), arg


def test_a_replayed_weight_gradient_views_its_transposed_operands_as_the_first_call_did(
    recorder: _Recorder,
) -> None:
    # a plain product pinned on QuACK under auto: the weight gradient dzᵀ·h, its A a transpose
    import json
    from pathlib import Path

    from coda.primitives.ir import Program

    path = Path(__file__).parents[2] / "export" / "programs" / "llama_mlp_bwd_saved.json"
    program = Program.model_validate(json.loads(path.read_text())["program"])
    block = get_block(program.block)
    sizes = {"M": 40, "d": 32, "f": 48}
    compiled = compile_program(program, analyze(program, sizes))
    compiled.epilogue_backend = "auto"
    compiled.cute_configs = dict.fromkeys(compiled.kernels)  # fused steps on Triton
    compiled.cute_configs["w_down_grad"] = cute_launch.CuteConfig(128, 256, pingpong=False)
    for seed in (0, 1):
        inputs = block.make_inputs(sizes, torch.float16, seed=seed, device="cpu")
        tensors = compiled.run(compiled.prepare(inputs))
    (plan,) = compiled._run_plans.values()
    (launch,) = [a for a in plan.actions if isinstance(a, cute_launch.CuteLaunch)]
    assert launch.step.step.a.transpose or not launch.step.step.b.transpose
    replayed, fresh = recorder.launches[-1], launch._first_arguments(tensors)
    assert len(recorder.launches) == 2
    for arg, want in fresh.items():
        got = replayed[arg]
        assert (got.shape, got.stride(), got.data_ptr()) == (
            want.shape, want.stride(), want.data_ptr()
        ), arg  # fmt: skip


def test_a_dynamic_config_launches_on_one_zeroed_tile_counter_per_action(recorder) -> None:  # noqa: ANN001
    # the kernel's atomic increments wrap back to 0 after its last tile: one counter, zeroed
    # once, serves every replay of the action; a static config gets none
    _, _, compiled, inputs = _swiglu_bwd("cute")
    compiled.cute_configs["b"] = cute_launch.CuteConfig(128, 128, dynamic=True)
    prepared = compiled.prepare(inputs)
    for _ in range(3):
        compiled.run(prepared)
    first, *rest = recorder.counters
    assert first is not None and first.dtype == torch.int32 and first.tolist() == [0]
    assert all(c is first for c in rest) and len(rest) == 2
    compiled.cute_configs["b"] = cute_launch.CuteConfig(128, 128)
    compiled.run(prepared)
    assert recorder.counters[-1] is None
    assert [c.dynamic for _, c in recorder.compiles] == [True, False]


def test_a_forced_triton_mainloop_runs_on_triton_whatever_the_backend(
    recorder: _Recorder,
) -> None:
    # a forced mainloop names a Triton kernel variant; the CuTe backend has only QuACK's
    for backend in ("cute", "auto"):
        _, _, compiled, inputs = _swiglu_bwd(backend)
        prepared = compiled.prepare(inputs)
        for mainloop in ("pointer", "tma"):
            compiled.mainloop = mainloop
            compiled.run(prepared)
            assert compiled.mainloops_used["b"] == mainloop and recorder.launches == []
        compiled.mainloop = "auto"
        compiled.run(prepared)
        assert compiled.mainloops_used["b"] == "cute" and len(recorder.launches) == 1
        recorder.launches.clear()


def test_the_process_backend_switch_runs_every_program_on_it(
    recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coda.primitives import runtime

    _, _, compiled, inputs = _swiglu_bwd("auto")
    prepared = compiled.prepare(inputs)
    compiled.run(prepared)
    assert compiled.mainloops_used["b"] == "cute" and len(recorder.launches) == 1
    monkeypatch.setattr(runtime, "BACKEND", "triton")
    assert compiled.backend == "triton" and compiled.epilogue_backend == "auto"
    compiled.run(prepared)  # a plan of its own (the run signature holds the backend)
    assert compiled.mainloops_used["b"] != "cute" and len(recorder.launches) == 1
    monkeypatch.setattr(runtime, "BACKEND", None)
    compiled.run(prepared)  # the first plan, replayed
    assert compiled.mainloops_used["b"] == "cute" and len(recorder.launches) == 2


def test_collecting_launches_compiles_and_launches_nothing(recorder: _Recorder) -> None:
    _, _, compiled, inputs = _swiglu_bwd("cute")
    compiled.collect_launches(inputs)
    assert len(recorder.compiles) == 1 and recorder.launches == []


def test_column_partials_reach_quack_transposed(recorder: _Recorder) -> None:
    sizes = {"M": 40, "N": 48, "K": 24}
    _, _, compiled, inputs = _compiled("gemm_residual_partial_rmsnorm_bwd", sizes, "cute")
    tensors = compiled.run(compiled.prepare(inputs))
    (args,) = recorder.launches
    partials = tensors["dgamma_partials"]  # [N, ⌈M / tile_m⌉]
    assert partials.shape[0] == sizes["N"]
    assert args["r_dgamma_partials"].shape == (1, partials.shape[1], sizes["N"])
    assert args["r_dgamma_partials"].data_ptr() == partials.data_ptr()
    assert args["wr_rstd"].shape == (1, sizes["M"]) and args["wc_gamma"].shape == (1, sizes["N"])


def _symbol_values(source: Any, args: dict[str, Any]) -> dict[str, int]:
    """The value each of the compile's symbolic sizes (``launch.Sizes``, here their names) takes
    in a launch's ``args`` (``launch.argument_shapes``, what the compile gives each argument);
    AssertionError where one would take two values — a launch the compiled kernel refuses as a
    shape mismatch."""
    names = cute_launch.Sizes(*cute_launch.Sizes._fields)
    values: dict[str, int] = {}
    for name, symbols in cute_launch.argument_shapes(source, names).items():
        if args[name] is None:  # no D: the kernel writes no accumulator
            continue
        shape = tuple(args[name].shape)
        assert len(symbols) == len(shape), (name, symbols, shape)
        for symbol, size in zip(symbols, shape, strict=True):
            seen = values.setdefault(symbol, size)
            assert seen == size, f"{name}: {symbol} is {size} here and {seen} elsewhere"
    return values


def test_row_and_column_partials_of_one_step_have_their_own_tile_counts(
    recorder: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A biased GeGLU MLP's backward: its SwiGLU-backward step sums rows (per N tile) and columns
    (the biases' gradients, per M tile). With 3 tiles along M and 1 along N the two counts
    differ, and each launch's tensors must bind every symbolic size of the compile to one value
    (one symbol for both counts compiled a kernel that refused the launch)."""
    from coda.blocks import registry
    from tests.planner.test_gemma_training import _biased_bwd, biased_mlp

    monkeypatch.setattr(registry, "_BLOCKS", dict(registry._BLOCKS))
    block = _biased_bwd(biased_mlp(("gate", "up")))
    sizes = {"M": 300, "d": 48, "f": 80}
    program = lower(block)
    compiled = compile_program(program, analyze(program, sizes))
    compiled.epilogue_backend = "cute"
    inputs = block.make_inputs(sizes, torch.float16, seed=0, device="cpu")
    compiled.run(compiled.prepare(inputs))
    both = [
        (source, args)
        for source, args in zip(recorder.sources, recorder.launches, strict=True)
        if {"row_partials", "col_partials"} <= {b.kind for b in source.bindings}
    ]
    assert both, [sorted({b.kind for b in s.bindings}) for s in recorder.sources]
    for source, args in both:
        values = _symbol_values(source, args)
        assert values["m_tiles"] != values["n_tiles"]
    for source, args in zip(recorder.sources, recorder.launches, strict=True):
        _symbol_values(source, args)


def test_a_gate_up_launch_gets_its_half_wide_store(recorder: _Recorder) -> None:
    # D = acc [M, N]; o = silu(g)·u over the accumulator's [g, u] pairs, [M, N/2], stored as
    # its own half-wide tensor; B is [K, N] (not transposed): QuACK takes it as an N×K view
    _, _, compiled, inputs = _compiled("gemm_swiglu", {"M": 40, "N": 64, "K": 24}, "cute")
    tensors = compiled.run(compiled.prepare(inputs))
    assert compiled.mainloops_used["d"] == "cute", compiled.cute_refusals
    (args,) = recorder.launches
    assert args["D"].shape == (40, 64, 1) and args["D"].data_ptr() == tensors["d"].data_ptr()
    assert args["s_o"].shape == (40, 32, 1) and args["s_o"].data_ptr() == tensors["o"].data_ptr()
    assert args["B"].shape == (64, 24, 1) and args["B"].stride(0) == 1


def test_a_tensor_tma_cannot_move_keeps_the_step_on_triton(recorder: _Recorder) -> None:
    sizes = {"M": 40, "N": 44, "K": 23, "N2": 88}  # K · 2 bytes is no multiple of 16
    _, _, compiled, inputs = _compiled("gemm_partial_swiglu_bwd", sizes, "cute")
    compiled.run(compiled.prepare(inputs))
    assert recorder.launches == [] and "16-byte aligned" in compiled.cute_refusals["b"]


def test_tuning_skips_steps_on_cute_and_its_check_leaves_them_alone(recorder: _Recorder) -> None:
    # The recorder launches nothing, so the step's outputs stay NaN: the tuner's check (which
    # compares every tensor, partial sums laid out per the Triton tile included) would call it
    # wrong; a step it did not tune is the sandbox's to verify.
    from coda.primitives.codegen.tuning import tune_program

    _, _, compiled, inputs = _swiglu_bwd("cute")
    results = tune_program(compiled, compiled.prepare(inputs))
    assert "b" not in results and compiled.mainloops_used["b"] == "cute"


@pytest.mark.parametrize(
    "tensor",
    [
        torch.empty(40, 24),
        torch.empty(24, 40).t(),  # column-major
        torch.empty(50, 30)[3:, 5:29],  # a view with an offset and a wider row stride
        torch.empty(0, 8),
    ],
    ids=["row-major", "column-major", "offset view", "empty"],
)
def test_a_matrix_reaches_quack_as_the_unsqueezed_permuted_view(tensor: torch.Tensor) -> None:
    # one view where there were two: the same shape, strides, offset and memory
    want = tensor.unsqueeze(0).permute(1, 2, 0)
    got = cute_launch._as_mk(tensor)
    assert got.shape == want.shape and got.stride() == want.stride()
    assert got.storage_offset() == want.storage_offset() and got.data_ptr() == want.data_ptr()
