"""Tuning never keeps a config whose results are wrong: winners are checked against the reference
executor and replaced by the next fastest right one (Triton has miscompiled whole configs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import analyze, compile_program
from coda.primitives.codegen.configs import INTERPRETER_DEFAULT
from coda.primitives.codegen.tuning import (
    Trial,
    TuningCache,
    TuningResult,
    _mismatch,
    _settle,
    tune_program,
    wrong_steps,
)
from coda.primitives.runtime import CompiledProgram

SMALL = INTERPRETER_DEFAULT.model_copy(update={"block_m": 16, "block_n": 16, "block_k": 16})
SIZES = {"M": 40, "d": 32, "f": 48}


def _compiled(block: str = "llama_mlp_bwd_saved"):  # noqa: ANN202
    b = get_block(block)
    program = lower(b)
    compiled = compile_program(program, analyze(program, SIZES))
    return compiled, compiled.prepare(b.make_inputs(SIZES, torch.float32, seed=0))


@pytest.fixture
def miscompiled(monkeypatch: pytest.MonkeyPatch) -> set:
    """Configs in the returned set make every fused step write wrong values (a fake miscompile)."""
    bad: set = set()
    run = CompiledProgram._run_gemm

    def corrupting(self, step, gemm, tensors, *args, **kwargs):  # noqa: ANN001, ANN202
        actions = run(self, step, gemm, tensors, *args, **kwargs)
        config = self.config_for(gemm.name, gemm)

        def corrupt(tensors, env) -> None:  # noqa: ANN001  (run by every replay of the step too)
            if config in bad:
                for name in gemm.writes:
                    tensors[name].add_(1.0)

        corrupt(tensors, None)
        return [*actions, corrupt]

    monkeypatch.setattr(CompiledProgram, "_run_gemm", corrupting)
    return bad


def _result(compiled, name: str, configs: list) -> TuningResult:  # noqa: ANN001
    """As the GPU screen leaves it: ``configs`` timed fastest first, the first one pinned."""
    trials = [Trial(c, ms=float(i + 1), final_ms=float(i + 1)) for i, c in enumerate(configs)]
    compiled.configs[name] = configs[0]
    return TuningResult(name, f"key-{name}", configs[0], 1.0, cached=False, trials=trials)


def test_a_right_program_has_no_wrong_steps() -> None:
    compiled, prepared = _compiled()
    assert wrong_steps(compiled, prepared) == {}


def test_fp32_tensors_of_a_16_bit_run_are_held_to_the_run_s_precision() -> None:
    # fp32 row partials of a bf16 run, as the H200 gave them: 1.6e-4 of the largest value off the
    # reference for every config (bf16 inputs' roundings), while a miscompile is off by O(values)
    want = torch.linspace(-44.0, 44.0, 512)
    close = want + 0.007 * torch.sin(torch.arange(512.0))
    assert _mismatch(close, want, torch.bfloat16) == ""
    assert "max |error|" in _mismatch(close, want, torch.float32)
    assert "max |error|" in _mismatch(want.roll(1), want, torch.bfloat16)
    assert "non-finite" in _mismatch(want / 0.0, want, torch.bfloat16)


def test_a_fast_wrong_config_is_replaced_by_the_next_right_one(
    miscompiled: set, tmp_path: Path
) -> None:
    compiled, prepared = _compiled()
    miscompiled.add(SMALL)
    results = {n: _result(compiled, n, [SMALL, INTERPRETER_DEFAULT]) for n in compiled.kernels}
    wrong = wrong_steps(compiled, prepared)
    assert set(wrong) == {"down_bwd", "gate_up_bwd"} and "max |error|" in wrong["down_bwd"]
    cache = TuningCache(tmp_path / "tuning.json")
    _settle(compiled, prepared, results, cache)
    for name, r in results.items():
        assert r.best == INTERPRETER_DEFAULT == compiled.configs[name]
        assert [c for c, _ in r.rejected] == [SMALL]
        assert cache.get(r.key) == INTERPRETER_DEFAULT  # the wrong winner is not what is cached
    assert wrong_steps(compiled, prepared) == {}


def test_a_step_wrong_under_every_config_is_an_error(miscompiled: set, tmp_path: Path) -> None:
    compiled, prepared = _compiled("llama_mlp")
    miscompiled.update({SMALL, INTERPRETER_DEFAULT})
    results = {n: _result(compiled, n, [SMALL]) for n in compiled.kernels}
    with pytest.raises(RuntimeError, match="computes wrong results under every config tried"):
        _settle(compiled, prepared, results, TuningCache(tmp_path / "tuning.json"))


def test_tune_program_checks_its_winners(miscompiled: set, tmp_path: Path) -> None:
    # on the CPU the interpreter's one config "wins"; made wrong, nothing is left to fall back on
    compiled, prepared = _compiled("llama_mlp")
    cache = TuningCache(tmp_path / "tuning.json")
    assert set(tune_program(compiled, prepared, cache=cache)) == {"gate_up", "down"}
    miscompiled.add(INTERPRETER_DEFAULT)
    with pytest.raises(RuntimeError, match="wrong results"):
        tune_program(compiled, prepared, cache=cache)
    tune_program(compiled, prepared, cache=cache, check=False)  # asked not to check: no error


def test_two_programs_per_sm_need_twice_the_pipeline_s_shared_memory() -> None:
    from coda.primitives.codegen.tuning import (
        QUICK_SPACE,
        SMEM_LIMIT,
        Candidate,
        candidate_configs,
        smem_bytes,
    )

    fits = Candidate(128, 128, 64, 4, 3, 2, programs_per_sm=2)  # 2 × 96 KB
    too_big = Candidate(128, 256, 64, 8, 3, 2, programs_per_sm=2)  # 2 × 144 KB
    configs = candidate_configs(
        8192, 8192, 8192, itemsize=2, interpret=False, space=[fits, too_big]
    )
    assert [(c.block_n, c.programs_per_sm) for c in configs] == [(128, 2)]
    assert smem_bytes(configs[0], 2) == 2 * 3 * (128 + 128) * 64 * 2 <= SMEM_LIMIT
    # the quick space keeps its occupancy candidates at the paper-kernel sizes
    quick = candidate_configs(8192, 8192, 8192, itemsize=2, interpret=False, space=QUICK_SPACE)
    assert len(quick) == len(QUICK_SPACE)
    assert {c.programs_per_sm for c in quick} == {1, 2}
    # the old positional 8-field tuples (bench/llama_mlp.py's space) still read as candidates
    (old,) = candidate_configs(
        4096, 4096, 4096, itemsize=2, interpret=False, space=[(128, 256, 64, 8, 3, 2, True, False)]
    )
    assert old.flatten and old.programs_per_sm == 1 and old.maxnreg is None


def test_register_caps_are_validated() -> None:
    from pydantic import ValidationError

    from coda.primitives.ir import MainloopConfig

    assert MainloopConfig(maxnreg=128).maxnreg == 128
    with pytest.raises(ValidationError, match="maxnreg"):
        MainloopConfig(maxnreg=512)
    with pytest.raises(ValidationError, match="programs_per_sm"):
        MainloopConfig(programs_per_sm=3)


@pytest.mark.parametrize("per_sm", [1, 2])
def test_programs_walk_every_tile_when_fewer_programs_than_tiles(
    per_sm: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a GPU the persistent grid is programs_per_sm × SMs; the interpreter normally launches one
    # program per tile. With "3 SMs" each program walks several tiles (the path every GPU launch
    # takes), and the reducing epilogues (row partials of g·dg + u·du, the column sums) must still
    # match the reference executor.
    from coda.primitives import runtime

    monkeypatch.setattr(runtime, "_num_sms", lambda device: 3)
    compiled, prepared = _compiled()
    for name in compiled.kernels:
        compiled.configs[name] = SMALL.model_copy(update={"programs_per_sm": per_sm})
    assert wrong_steps(compiled, prepared) == {}
    grids = {plan.grid for plan in compiled._plans.values()}
    assert grids == {(3 * per_sm,)}


def test_a_trial_reads_as_json_with_the_config_s_non_default_fields() -> None:
    import json

    from coda.primitives.ir import MainloopConfig

    trial = Trial(MainloopConfig(block_n=256, programs_per_sm=2), ms=1.5, final_ms=1.25)
    assert json.loads(json.dumps(trial.as_dict())) == {
        "config": {"block_n": 256, "programs_per_sm": 2},
        "ms": 1.5,
        "final_ms": 1.25,
        "error": "",
    }


def test_a_tuning_result_reads_as_json_with_its_rejections(
    miscompiled: set, tmp_path: Path
) -> None:
    import json

    compiled, prepared = _compiled()
    fast_wrong = SMALL.model_copy(update={"num_stages": 2})
    miscompiled.add(fast_wrong)
    results = {n: _result(compiled, n, [fast_wrong, SMALL]) for n in compiled.kernels}
    _settle(compiled, prepared, results, TuningCache(tmp_path / "t.json"))
    record = json.loads(json.dumps(results["down_bwd"].as_dict()))
    assert record["best"] == SMALL.model_dump(exclude_defaults=True)
    assert [t["final_ms"] for t in record["trials"]] == [1.0, 2.0]
    (rejected,) = record["rejected"]
    assert rejected["config"]["num_stages"] == 2 and "max |error|" in rejected["why"]


def test_a_step_is_tuned_once_per_shape_and_narrowed_for_later_candidates(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A kernel tuned before is not timed again; another candidate's kernel for the same step at
    the same sizes screens only the finalists the first tuning kept (the GPU path, with the
    timings faked: the screen gives each config a time by its place in the space)."""
    import dataclasses
    import json

    from coda.primitives import backend
    from coda.primitives.codegen import tuning
    from coda.primitives.ir import MainloopConfig

    space = [MainloopConfig(block_m=bm, block_n=bn) for bm in (64, 128) for bn in (64, 128, 256)]
    monkeypatch.setattr(tuning, "candidate_configs", lambda *a, **k: list(space))
    screened: list[tuple[str, list]] = []

    failing: set = set()  # configs that fail to compile (for the kernel being tuned)

    def screen(compiled, name, tensors, configs, warmup, rep):  # noqa: ANN001, ANN202
        screened.append((name, list(configs)))
        return [
            Trial(c, None, "out of resources")
            if c in failing
            else Trial(c, float(space.index(c) + 1))
            for c in configs
        ]

    def final(compiled, name, tensors, trials, finalists, warmup, rep):  # noqa: ANN001, ANN202
        top = sorted((t for t in trials if t.ms is not None), key=lambda t: t.ms)[:finalists]
        for t in top:
            t.final_ms = t.ms
        return top[0], top

    monkeypatch.setattr(tuning, "_screen", screen)
    monkeypatch.setattr(tuning, "_final_round", final)
    monkeypatch.setattr(tuning, "compile_ahead_of", lambda collect: None)  # nothing to compile
    cache = TuningCache(tmp_path / "tuning.json")
    block = get_block("llama_mlp")
    inputs = block.make_inputs(SIZES, torch.float32, seed=0)

    def tune(edited: bool) -> dict[str, TuningResult]:
        """Tune llama_mlp's Program; ``edited``: as another candidate whose kernels for the
        same steps differ in their text (here only by a trailing line)."""
        program = lower(block)
        compiled = compile_program(program, analyze(program, SIZES))
        if edited:
            compiled.kernels = {
                n: dataclasses.replace(k, source=k.source + "\n")
                for n, k in compiled.kernels.items()
            }
        prepared = compiled.prepare(inputs)
        tensors = compiled.run(prepared)  # in the interpreter, before it is switched off
        with monkeypatch.context() as m:
            m.setattr(compiled, "run", lambda prepared, **kwargs: tensors)
            m.setattr(backend, "INTERPRET", False)
            return tune_program(compiled, prepared, cache=cache, check=False, finalists=2)

    first = tune(edited=False)
    assert [n for n, _ in screened] == ["gate_up", "down"]
    assert all(configs == space for _, configs in screened)
    assert {r.best for r in first.values()} == {space[0]} and not any(
        r.narrowed for r in first.values()
    )
    screened.clear()
    assert all(r.cached for r in tune(edited=False).values()) and screened == []
    other = tune(edited=True)  # new kernels, the same steps and sizes
    assert [n for n, _ in screened] == ["gate_up", "down"]
    assert all(configs == space[:2] for _, configs in screened)
    assert all(r.narrowed and not r.cached for r in other.values())
    screened.clear()
    tune(edited=True)
    assert screened == []  # its own winners are cached too
    # a third kernel for which none of the finalists compiles: the rest of the space is timed
    failing.update(space[:2])
    screened.clear()
    kept = {k: v for k, v in cache.entries.items() if k.startswith("finalists|")}
    cache.path.write_text(json.dumps(kept))  # the winners forgotten, the finalists kept
    cache.entries = kept
    third = tune(edited=True)
    assert [configs for _, configs in screened] == [space[:2], space[2:]] * 2
    assert all(r.best == space[2] and not r.narrowed for r in third.values())


def test_a_config_is_forced_to_a_slicing_only_where_its_tile_takes_it() -> None:
    from coda.primitives.codegen.configs import GPU_DEFAULT, with_subtiles

    tuned = GPU_DEFAULT.model_copy(update={"block_n": 256, "flatten": True, "programs_per_sm": 2})
    four = with_subtiles(tuned, 4)
    assert four.epilogue_subtiles == 4 and four.epilogue_block_n == 64
    assert four.model_dump(exclude={"epilogue_subtiles"}) == tuned.model_dump(
        exclude={"epilogue_subtiles"}
    )
    with pytest.raises(ValueError, match="leaves 8 columns each, fewer than 16"):
        with_subtiles(SMALL.model_copy(update={"block_n": 32}), 4)
    with pytest.raises(ValueError, match="needs a multiple of 128 .whole heads"):
        with_subtiles(tuned, 4, multiple=128)
    with pytest.raises(ValueError, match=r"must be one of \(1, 2, 4, 8\), got 3"):
        with_subtiles(tuned, 3)


def test_eight_sub_tiles_are_tried_only_where_every_sub_tile_holds_whole_segments() -> None:
    from coda.primitives.codegen.tuning import candidate_configs

    def slicings(multiple: int) -> set[tuple[int, int]]:  # the full space: quick has no 8
        configs = candidate_configs(
            8192, 8192, 8192, itemsize=2, interpret=False, column_multiple=multiple
        )
        return {(c.block_n, c.epilogue_subtiles) for c in configs}

    assert (256, 8) in slicings(1) and (256, 8) in slicings(32)
    # 64-column heads (a head_rmsnorm epilogue): 256 / 8 = 32 cannot hold one, 256 / 4 can
    assert (256, 8) not in slicings(64) and (256, 4) in slicings(64)


def test_finalists_of_another_candidate_space_narrow_nothing(tmp_path: Path) -> None:
    """A step's finalists are kept per candidate space: after a candidate is added (the
    8-sub-tile one), a new kernel of the same step screens the whole space, the new candidate
    with it, not the finalists an older space kept."""
    from coda.primitives.codegen.tuning import (
        QUICK_SPACE,
        Candidate,
        _to_screen,
        candidate_configs,
        related_key,
    )

    def key(space: list | None) -> str:
        return related_key("llama_mlp", "down", "H200", 64, 32, 48, torch.bfloat16, space)

    older, newer = QUICK_SPACE, [*QUICK_SPACE, Candidate(128, 256, 64, 8, 3, 8)]
    assert key(newer) == key([tuple(c) for c in newer]) != key(older)
    assert key(None) != key(QUICK_SPACE)  # the default is the whole Hopper space
    cache = TuningCache(tmp_path / "tuning.json")
    space = candidate_configs(8192, 8192, 8192, itemsize=2, interpret=False, space=newer)
    cache.put_finalists(key(older), space[:2])
    assert _to_screen(cache, key(older), space) == (space[:2], True)
    assert _to_screen(cache, key(newer), space) == (space, False)


class _StandInKernel:
    """A kernel whose compiled form asks ``shared[block_n]`` bytes of shared memory."""

    def __init__(self, shared: dict[int, int]) -> None:
        self.shared = shared

    def __getitem__(self, grid):  # noqa: ANN001, ANN204 - ``kernel[grid](...)``
        return lambda *args, **meta: None

    def warmup(self, *args, grid, **meta):  # noqa: ANN001, ANN201
        from types import SimpleNamespace

        return SimpleNamespace(metadata=SimpleNamespace(shared=self.shared[meta["BLOCK_N"]]))


class _StandInProgram:
    """What ``_screen`` asks of a compiled program: its configs, and one step's launch."""

    def __init__(self, kernel: _StandInKernel) -> None:
        self.kernel, self.configs = kernel, {}

    def run_gemm_step(self, name: str, tensors: dict) -> None:
        from coda.primitives.launch import launch_kernel

        launch_kernel(self.kernel, (1,), BLOCK_N=self.configs[name].block_n)


def test_the_screen_times_no_candidate_whose_programs_cannot_share_an_sm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import triton.testing

    from coda.primitives.codegen.tuning import Candidate, _screen, candidate_configs

    space = [
        Candidate(128, 256, 64, 8, 3, 2),  # one program: any size Triton launches
        Candidate(128, 128, 64, 4, 3, 2, programs_per_sm=2),  # two: each over half the SM
        Candidate(128, 64, 64, 4, 3, 1, programs_per_sm=2),  # two that fit
    ]
    configs = candidate_configs(8192, 8192, 8192, itemsize=2, interpret=False, space=space)
    assert len(configs) == 3  # the pipelines alone fit: only the compiled kernel tells
    program = _StandInProgram(_StandInKernel({256: 200_000, 128: 147_480, 64: 90_000}))
    timed = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: timed.append(fn) or 1.0)
    trials = _screen(program, "down_bwd", {}, configs, warmup=1, rep=1)
    assert [t.ms for t in trials] == [1.0, None, 1.0]
    assert trials[1].error == (
        "2 programs per SM do not fit: the kernel asks 147,480 B of shared memory each"
    )
    assert len(timed) == 4  # two candidates, forward and reverse pass


def test_the_mlp_backward_s_down_step_cannot_run_two_programs_per_sm_on_hopper() -> None:
    """Compiled for sm_90 by the installed Triton: ``down_bwd``'s epilogue (load g and u, write
    dz through shared memory) takes the quick space's two-programs 128 × 128 candidate over half
    an SM's shared memory, the forward ``gate_up`` step's does not — why ``not_resident``
    compiles before it prunes."""
    from coda.primitives.codegen.tuning import QUICK_SPACE, Candidate
    from coda.primitives.ir import MainloopConfig
    from coda.primitives.offline_target import fits
    from tests.helpers import warm_for_hopper

    two = next(c for c in QUICK_SPACE if c.programs_per_sm == 2 and c.block_k == 64)
    config = MainloopConfig(group_m=8, **Candidate(*two)._asdict())
    sizes = {"M": 128, "d": 256, "f": 512}
    shared = {}
    for block, step in (("llama_mlp_bwd_saved", "down_bwd"), ("llama_mlp", "gate_up")):
        b = get_block(block)
        program = lower(b)
        compiled = compile_program(program, analyze(program, sizes))
        compiled.mainloop = "tma"
        for name in compiled.kernels:
            compiled.configs[name] = config
        launches = [
            launch
            for launch in compiled.collect_launches(b.make_inputs(sizes, torch.bfloat16, seed=0))
            if getattr(launch[0], "__name__", "") == f"{step}_kernel"
        ]
        (row,) = warm_for_hopper(launches)
        shared[step] = row["shared"]
    assert not fits(shared["down_bwd"], 2) and fits(shared["down_bwd"], 1), shared
    assert fits(shared["gate_up"], 2), shared
