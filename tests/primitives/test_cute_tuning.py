"""Tuning on the CuTe backend, on a CPU: which candidate wins, Triton as a candidate under
``auto``, a fast wrong config rejected, the choice pinned and cached, each candidate timed on its
own tensors, on the device and on the host. The launches are the generated modules executed by
the CPU emulator (``cute_emulator``), their partial sums written as one tile's; times come from
stand-in timers (the host's is 0 unless a test gives one), so what is checked is the choosing,
not the kernels (tests/gpu/test_cute_gpu.py runs those)."""

from __future__ import annotations

import math

import pytest
import torch

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import analyze, compile_program, cute
from coda.primitives.codegen.tuning import TuningCache, _combined, wrong_steps
from coda.primitives.cute import launch as cute_launch
from coda.primitives.cute.tuning import (
    CANDIDATES,
    CUBLAS,
    DEEP_EPILOGUE,
    PLAIN_CANDIDATES,
    TRITON,
    candidates,
    tune_cute_steps,
    tune_plain_steps,
)

from .cute_emulator import emulate_step

SIZES = {"M": 40, "N": 48, "K": 24, "N2": 96}
FAST, MIDDLE, SLOW, COOPERATIVE = CANDIDATES
ALL = candidates(loads_tiles=True)  # the SwiGLU backward's epilogue loads z


class _Emulated:
    """``CuteLaunch.__call__`` on a CPU: the step's writes from the emulator (partial sums in the
    first tile's column, zeros in the others); ``wrong`` configs add 1 to every value."""

    def __init__(self) -> None:
        self.launches: list[cute_launch.CuteConfig] = []
        self.wrong: set[cute_launch.CuteConfig] = set()

    def __call__(self, launch, tensors, env) -> None:  # noqa: ANN001
        self.launches.append(launch.config)
        a, b = launch.step._operands(tensors)
        got = emulate_step(launch.source, a, b, tensors)
        shift = 1.0 if launch.config in self.wrong else 0.0
        for name, values in got.items():
            if name.endswith(":sum"):
                partials = tensors[name.removesuffix(":sum")]
                partials.zero_()
                partials[:, 0] = values.to(partials.dtype) + shift
            else:
                tensors[name].copy_(values + shift)


@pytest.fixture(autouse=True)
def no_host_time(monkeypatch) -> None:
    """The host timer's default (``timing.host_ms``) synchronizes a GPU: on a CPU, every launch
    costs the host nothing unless a test passes its own ``host_timer``."""
    from coda.primitives.cute import tuning

    monkeypatch.setattr(tuning, "host_ms", lambda fns: dict.fromkeys(fns, 0.0))


@pytest.fixture
def emulated(monkeypatch) -> _Emulated:
    emulator = _Emulated()
    monkeypatch.setattr(cute, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(
        cute_launch.CuteLaunch, "__call__", lambda self, t, env: emulator(self, t, env)
    )
    return emulator


def _setup(backend: str):
    block = get_block("gemm_partial_swiglu_bwd")
    program = lower(block)
    compiled = compile_program(program, analyze(program, SIZES))
    compiled.epilogue_backend = backend
    prepared = compiled.prepare(block.make_inputs(SIZES, torch.float16, seed=0, device="cpu"))
    tensors = compiled.run(prepared)
    assert compiled.mainloops_used["b"] == "cute", compiled.cute_refusals
    return compiled, prepared, tensors


def _timer(times: dict[str, float]):
    """A stand-in for interleaved timing: runs each launch once, reports ``times`` by label
    (CuTe configs by ``str``; 9 ms for a label not given), and records the labels it was
    given."""
    seen: list[list[str]] = []

    def timer(fns):  # noqa: ANN001, ANN202
        seen.append(list(fns))
        for fn in fns.values():
            fn()
        return {label: times.get(label, 9.0) for label in fns}

    timer.seen = seen  # type: ignore[attr-defined]
    return timer


def test_the_fastest_config_is_pinned_and_cached(emulated: _Emulated, tmp_path) -> None:  # noqa: ANN001
    compiled, prepared, tensors = _setup("cute")
    cache = TuningCache(tmp_path / "tuning.json")
    timer = _timer({str(FAST): 1.0, str(MIDDLE): 0.5, str(SLOW): 2.0})
    (result,) = tune_cute_steps(
        compiled, prepared, tensors, ["b"], cache, with_triton=False, timer=timer
    ).values()
    assert timer.seen == [[str(c) for c in ALL]]  # no Triton candidate under "cute"
    assert result.best == MIDDLE and result.ms == 0.5 and not result.cached
    assert compiled.cute_configs == {"b": MIDDLE}
    emulated.launches.clear()
    compiled.run(prepared)
    assert emulated.launches == [MIDDLE]
    # a fresh compiled Program with a fresh cache object reads the choice from the file
    again, prepared2, tensors2 = _setup("cute")
    (cached,) = tune_cute_steps(
        again, prepared2, tensors2, ["b"], TuningCache(tmp_path / "tuning.json"),
        with_triton=False, timer=_timer({}),
    ).values()  # fmt: skip
    assert cached.cached and cached.best == MIDDLE and again.cute_configs == {"b": MIDDLE}
    # the key names the generated CuTe module: another module (an emitter change) tunes anew
    (source,) = again._cute_steps["b"].sources()
    assert source.key in cached.key


def test_under_auto_triton_is_a_candidate_and_can_win(emulated: _Emulated, tmp_path) -> None:  # noqa: ANN001
    compiled, prepared, tensors = _setup("auto")
    timer = _timer({str(FAST): 1.0, str(MIDDLE): 1.1, str(SLOW): 1.2, TRITON: 0.7})
    (result,) = tune_cute_steps(
        compiled, prepared, tensors, ["b"], TuningCache(tmp_path / "t.json"),
        with_triton=True, timer=timer,
    ).values()  # fmt: skip
    assert timer.seen == [[*(str(c) for c in ALL), TRITON]]
    assert result.best is None and result.as_dict()["backend"] == "triton"
    emulated.launches.clear()
    compiled.run(prepared)
    assert emulated.launches == [] and compiled.mainloops_used["b"] != "cute"
    # the same sizes under "cute" only are another choice: another key
    assert len(TuningCache(tmp_path / "t.json").entries) == 1
    assert result.key.startswith("cute+triton@100ms+host|")


def test_a_launch_the_host_issues_slower_than_the_device_runs_costs_its_host_time(
    emulated: _Emulated,
    tmp_path,  # noqa: ANN001
) -> None:
    # FAST runs 0.2 ms on the device but takes the host 0.9 ms to issue; Triton 0.4 and 0.05:
    # in a host-bound step FAST costs 0.9, so Triton wins; where the device times are longer
    # than every host time, they decide alone
    compiled, prepared, tensors = _setup("auto")
    device = _timer({str(FAST): 0.2, str(MIDDLE): 0.6, str(SLOW): 0.7, TRITON: 0.4})
    host = _timer({str(FAST): 0.9, TRITON: 0.05})  # (9 ms for the others)
    cache = TuningCache(tmp_path / "t.json")
    (result,) = tune_cute_steps(
        compiled, prepared, tensors, ["b"], cache, with_triton=True, timer=device, host_timer=host
    ).values()
    assert result.best is None and result.ms == 0.4 and result.host_times[TRITON] == 0.05
    assert host.seen == device.seen  # every candidate the device timed, the host timed
    assert cache.entry(result.key) == {"config": None, "ms": 0.4, "host_ms": 0.05}
    again, prepared2, tensors2 = _setup("auto")
    slow_kernels = _timer({str(FAST): 2.0, str(MIDDLE): 2.5, str(SLOW): 3.0, TRITON: 2.2})
    (result,) = tune_cute_steps(
        again, prepared2, tensors2, ["b"], TuningCache(tmp_path / "u.json"),
        with_triton=True, timer=slow_kernels, host_timer=_timer({str(FAST): 0.9, TRITON: 0.05}),
    ).values()  # fmt: skip
    assert result.best == FAST and result.ms == 2.0


def test_a_fast_wrong_config_is_rejected_for_the_next(emulated: _Emulated, tmp_path) -> None:  # noqa: ANN001
    compiled, prepared, tensors = _setup("cute")
    emulated.wrong.add(FAST)
    timer = _timer({str(FAST): 0.1, str(MIDDLE): 0.5, str(SLOW): 0.3})
    (result,) = tune_cute_steps(
        compiled, prepared, tensors, ["b"], TuningCache(tmp_path / "t.json"),
        with_triton=False, timer=timer,
    ).values()  # fmt: skip
    assert [c for c, _ in result.rejected] == [FAST] and result.best == SLOW
    assert "max |error|" in result.rejected[0][1]


def test_every_config_wrong_leaves_the_step_on_triton(emulated: _Emulated, tmp_path) -> None:  # noqa: ANN001
    compiled, prepared, tensors = _setup("cute")
    emulated.wrong.update(ALL)
    timer = _timer({str(c): 1.0 + i for i, c in enumerate(ALL)})
    (result,) = tune_cute_steps(
        compiled, prepared, tensors, ["b"], TuningCache(tmp_path / "t.json"),
        with_triton=False, timer=timer,
    ).values()  # fmt: skip
    assert result.best is None and len(result.rejected) == len(ALL)
    assert compiled.cute_configs == {"b": None}


def test_each_candidate_launches_into_its_own_tensors(emulated: _Emulated) -> None:
    # 128- and 192-column tiles give partial-sum buffers of other widths: a candidate's launch
    # timed later must not write into what a later candidate allocated
    compiled, _, tensors = _setup("cute")
    compiled.cute_configs["b"] = FAST
    first = compiled.step_launch("b", tensors)
    mine = tensors["zdz_partials"]
    compiled.cute_configs["b"] = SLOW
    compiled.step_launch("b", tensors)
    assert tensors["zdz_partials"] is not mine
    mine.fill_(math.nan)
    first()
    assert not mine.isnan().any()


def test_the_check_combines_partials_of_another_tile(emulated: _Emulated) -> None:
    compiled, prepared, _ = _setup("cute")
    assert wrong_steps(compiled, prepared) == {}  # CuTe's one-column-per-128 vs the reference's
    emulated.wrong.add(cute_launch.choose_config(compiled.info_for(prepared).gemms["b"]))
    assert "b" in wrong_steps(compiled, prepared)


@pytest.mark.parametrize(
    ("kind", "want"), [("sum", [3.0, 7.0]), ("sumsq", [3.0, 7.0]), ("max", [2.0, 4.0])]
)
def test_partials_combine_across_tiles_by_kind(kind: str, want: list[float]) -> None:
    p = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert _combined(p, kind).tolist() == want
    lse = _combined(p, "lse")
    assert torch.allclose(lse, torch.logsumexp(p, dim=1))


def test_deeper_epilogue_candidates_only_for_steps_that_load_tiles() -> None:
    assert candidates(loads_tiles=False) == CANDIDATES
    deep = [c for c in ALL if c not in CANDIDATES]
    assert deep and all(c.epi_stages == DEEP_EPILOGUE and c.tile == (128, 128) for c in deep)
    assert {c._replace(epi_stages=0) for c in deep} <= set(CANDIDATES)
    assert "4 epilogue stages" in str(deep[0]) and "epilogue" not in str(CANDIDATES[0])


@pytest.mark.parametrize(
    "winner",
    [FAST._replace(epi_stages=DEEP_EPILOGUE), COOPERATIVE],
    ids=["deep-epilogue", "cooperative-128x256"],
)
def test_a_later_candidate_can_win_and_the_runs_after_take_it(
    winner, emulated: _Emulated, tmp_path
) -> None:  # noqa: ANN001
    compiled, prepared, tensors = _setup("cute")
    timer = _timer({str(winner): 0.2})
    (result,) = tune_cute_steps(
        compiled, prepared, tensors, ["b"], TuningCache(tmp_path / "t.json"),
        with_triton=False, timer=timer,
    ).values()  # fmt: skip
    assert result.best == winner and compiled.cute_configs == {"b": winner}
    emulated.launches.clear()
    compiled.run(prepared)
    assert emulated.launches == [winner]


def test_the_cooperative_candidate_is_128_by_256_and_keeps_quacks_stages() -> None:
    # two consumer warpgroups share its tile; no deeper-epilogue twin (those are 128 × 128 only)
    assert COOPERATIVE.tile == (128, 256) and not COOPERATIVE.pingpong
    assert "cooperative" in str(COOPERATIVE)
    assert all(c.tile == (128, 128) for c in ALL if c.epi_stages)


def test_candidates_are_timed_in_sustained_windows_by_default(
    emulated: _Emulated, tmp_path, monkeypatch
) -> None:  # noqa: ANN001
    """Without a timer, tuning times in the profiler's 100 ms windows (``timing.sustained_ms``),
    not the 30 ms ones that ranked CuTe first before its clock fell; and choices cached from
    other windows are not reused (the key names the windows)."""
    from coda.primitives import timing

    windows: list[dict] = []

    def do_bench(fn, *, warmup, rep, return_mode):  # noqa: ANN001, ANN202
        windows.append({"warmup": warmup, "rep": rep})
        fn()
        return 1.0

    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    compiled, prepared, tensors = _setup("cute")
    (result,) = tune_cute_steps(
        compiled, prepared, tensors, ["b"], TuningCache(tmp_path / "t.json"), with_triton=False
    ).values()
    assert len(windows) == len(ALL) * timing.SUSTAINED["rounds"]
    assert {w["rep"] for w in windows} == {100} and {w["warmup"] for w in windows} == {25}
    assert "@100ms+host|" in result.key


PLAIN_SIZES = {"M": 40, "d": 32, "f": 48}


def _setup_plain():
    """The shipped ``llama_mlp_bwd_saved`` under ``auto``: its two weight gradients are plain
    products (cuBLAS), its two fused steps Triton's (the emulated CuTe steps are not asked)."""
    import json
    from pathlib import Path

    from coda.primitives.ir import Program

    path = Path(__file__).parents[2] / "export" / "programs" / "llama_mlp_bwd_saved.json"
    program = Program.model_validate(json.loads(path.read_text())["program"])
    block = get_block(program.block)
    compiled = compile_program(program, analyze(program, PLAIN_SIZES))
    compiled.epilogue_backend = "auto"
    for step in compiled.kernels:
        compiled.cute_configs[step] = None  # fused steps on Triton: only the plain ones tuned
    inputs = block.make_inputs(PLAIN_SIZES, torch.float16, seed=0, device="cpu")
    prepared = compiled.prepare(inputs)
    tensors = compiled.run(prepared)
    plain = [n for n, g in compiled.info_for(inputs).gemms.items() if g.vendor]
    assert plain == ["w_down_grad", "w_gate_up_grad"]
    return program, compiled, prepared, tensors, plain


def test_a_plain_step_runs_on_quack_where_it_timed_faster_than_cublas(
    emulated: _Emulated, tmp_path
) -> None:  # noqa: ANN001
    program, compiled, prepared, tensors, plain = _setup_plain()
    first, second = PLAIN_CANDIDATES
    timer = _timer({str(first): 0.5, str(second): 0.8, CUBLAS: 1.0})
    cache = TuningCache(tmp_path / "t.json")
    results = tune_plain_steps(compiled, prepared, tensors, plain, cache, timer=timer)
    assert timer.seen == [[str(first), str(second), CUBLAS]] * 2
    assert all(r.best == first and not r.cached for r in results.values())
    assert {n: compiled.cute_configs[n] for n in plain} == dict.fromkeys(plain, first)
    emulated.launches.clear()
    got = compiled.run(prepared)
    assert emulated.launches == [first, first]
    assert all(compiled.mainloops_used[n] == "cute" for n in plain)
    assert wrong_steps(compiled, prepared) == {}  # the emulated product is the reference's
    for out in ("dw_down", "dw_gu"):  # and cuBLAS's (torch.matmul on a CPU) before tuning
        assert torch.allclose(got[out].float(), tensors[out].float(), atol=1e-2, rtol=1e-2)
    # the choice is cached by step and shape: a second tuning times nothing
    again = tune_plain_steps(compiled, prepared, tensors, plain, cache, timer=_timer({}))
    assert all(r.cached and r.best == first for r in again.values())


def test_cublas_faster_keeps_the_plain_step_on_cublas(emulated: _Emulated, tmp_path) -> None:  # noqa: ANN001
    _, compiled, prepared, tensors, plain = _setup_plain()
    timer = _timer({CUBLAS: 0.5})
    cache = TuningCache(tmp_path / "t.json")
    results = tune_plain_steps(compiled, prepared, tensors, plain, cache, timer=timer)
    for name in plain:
        assert results[name].best is None and compiled.cute_configs[name] is None
        assert results[name].as_dict()["backend"] == "cublas"
    emulated.launches.clear()
    compiled.run(prepared)
    assert emulated.launches == [] and not set(plain) & set(compiled.mainloops_used)


def test_a_fast_wrong_plain_config_gives_way(emulated: _Emulated, tmp_path) -> None:  # noqa: ANN001
    _, compiled, prepared, tensors, plain = _setup_plain()
    first, second = PLAIN_CANDIDATES
    emulated.wrong.add(first)
    timer = _timer({str(first): 0.1, str(second): 0.5, CUBLAS: 1.0})
    results = tune_plain_steps(
        compiled, prepared, tensors, plain, TuningCache(tmp_path / "t.json"), timer=timer
    )
    for result in results.values():
        assert result.best == second
        assert [c for c, _ in result.rejected] == [first]


def test_plain_steps_are_tuned_only_under_auto_where_the_backend_runs(monkeypatch) -> None:
    from coda.primitives import backend
    from coda.primitives.codegen import tuning

    _, compiled, prepared, _, plain = _setup_plain()
    info = compiled.info_for({n: prepared[n] for n in compiled.program.inputs})
    cuda = torch.device("cuda")
    monkeypatch.setattr(cute, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(backend, "INTERPRET", False)
    assert tuning._plain_steps_for_cute(compiled, info, cuda) == plain
    compiled.epilogue_backend = "cute"  # "cute" forces fused steps, not cuBLAS's products
    assert tuning._plain_steps_for_cute(compiled, info, cuda) == []
    compiled.epilogue_backend, compiled.use_vendor = "auto", False
    assert tuning._plain_steps_for_cute(compiled, info, cuda) == []
    compiled.use_vendor = True
    monkeypatch.setattr(cute, "unavailable_reason", lambda device=None: "no GPU")
    assert tuning._plain_steps_for_cute(compiled, info, cuda) == []
