"""Every fused step of the shipped Programs that the CuTe backend covers compiles for Hopper
(sm_90a) on a machine without a GPU (``python -m coda.primitives.cute``); skipped where the CuTe
DSL and QuACK are not installed."""

from __future__ import annotations

import importlib.util
import os
import re
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


_STAGES = """
import json, torch
from coda.primitives import analyze
from coda.primitives.cute import epilogue
from coda.primitives.cute.launch import CuteConfig, CuteLaunch, CuteStep
from coda.primitives.ir import Program
from coda.primitives.types import torch_dtype

split = epilogue.CodaEpilogue._compute_stages.__func__
def printed(cls, tile, epi_tile, *args, **kwargs):
    stages = split(cls, tile, epi_tile, *args, **kwargs)
    print("stages", cls.epi_stages, cls.epi_loads, cls.epi_n, "x".join(map(str, epi_tile)), *stages)
    return stages
epilogue.CodaEpilogue._compute_stages = classmethod(printed)
data = json.loads(open({path!r}).read())
program = Program.model_validate(data["program"])
info = analyze(program, {{"M": 256, "d": 256, "f": 256}})
tensors = {{n: torch.empty(t.shape, dtype=torch_dtype(t.dtype, torch.bfloat16))
           for n, t in info.tensors.items() if t.partials is None}}
step = program.steps[0]  # down_bwd: loads g and u, stores dz
runner, gemm = CuteStep(step), info.gemms["down_bwd"]
floats = {{n: t.dtype for n, t in tensors.items() if t.is_floating_point()}}
for stages, loads, width in ((0, 0, 0), (4, 0, 0), (0, 4, 0), (0, 5, 0), (0, 0, 64)):
    asked = CuteConfig(128, 128, 2, 1, True, stages, epi_loads=loads, epi_n=width)
    source, config, writes = runner.plan(gemm, floats, torch.bfloat16, asked)
    for out, shape, dtype in writes:
        tensors[out] = torch.empty(shape, dtype=dtype)
    launch = CuteLaunch(runner, source, gemm.M, gemm.N, config)
    runner.compiled(source, launch.arguments(tensors), config)
"""


@pytest.mark.skipif(not HAVE_DSL, reason="the CuTe DSL and QuACK are not installed")
def test_epilogue_pipelines_and_sub_tiles_take_the_shapes_asked(tmp_path: Path) -> None:
    # QuACK's split for the SwiGLU backward (three tile stores: dz as D, a, and two tile loads)
    # on its 64 x 32 sub-tiles: five A/B stages, four of tile stores, two of tile loads; with
    # epi_stages=4 the loads get four, the stores four and what is left over (five), and the A/B
    # pipeline four; with epi_loads=4 (5) the loads get four (five), the stores two, and the A/B
    # pipeline keeps five; with epi_n=64 the sub-tiles are 64 x 64, each stage twice the bytes:
    # QuACK's split then leaves the A/B pipeline four stages
    code = _STAGES.format(path=str(PROGRAMS / "llama_mlp_bwd_saved.json"))
    env = {**os.environ, "CODA_CACHE_DIR": str(tmp_path), "CUTE_DSL_ARCH": "sm_90a"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr
    stages = [line.split()[1:] for line in r.stdout.splitlines() if line.startswith("stages")]
    expected = [
        ["0", "0", "0", "64x32", "5", "4", "2"],
        ["4", "0", "0", "64x32", "4", "5", "4"],
        ["0", "4", "0", "64x32", "5", "2", "4"],
        ["0", "5", "0", "64x32", "5", "2", "5"],
        ["0", "0", "64", "64x64", "4", "2", "2"],
    ]
    assert stages == expected, r.stdout


@pytest.mark.skipif(not HAVE_DSL, reason="the CuTe DSL and QuACK are not installed")
def test_sigmoid_takes_the_approximate_reciprocal(tmp_path: Path) -> None:
    # The SwiGLU backward's sigmoid as ``rcp.approx``, as QuACK's and Triton's: the correctly
    # rounded ``rcp.rn`` that ``1.0 / y`` compiles to made its epilogue 2.5x the hand-written
    # kernel's machine code, too slow to hide beside a K = 2048 mainloop
    (tmp_path / "ptx").mkdir()  # the DSL writes its PTX only into a folder that exists
    env = {
        "CODA_CACHE_DIR": str(tmp_path / "cache"),
        "CUTE_DSL_ARCH": "sm_90a",
        "CUTE_DSL_KEEP": "ptx",
        "CUTE_DSL_DUMP_DIR": str(tmp_path / "ptx"),
    }
    r = _check(str(PROGRAMS / "llama_mlp_bwd_saved.json"), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    ptx = [p.read_text() for p in (tmp_path / "ptx").rglob("*.ptx")]
    (down_bwd,) = [text for text in ptx if "ex2.approx" in text]  # the step with a sigmoid
    assert "rcp.approx" in down_bwd
    assert "rcp.rn" not in down_bwd and "div.rn" not in down_bwd


_OVERLAP = """
import json, torch
from coda.primitives import analyze
from coda.primitives.cute import epilogue
from coda.primitives.cute.launch import CuteConfig, CuteLaunch, CuteStep
from coda.primitives.ir import GemmEpilogue, Program
from coda.primitives.types import torch_dtype

loop = epilogue.CodaEpilogue._overlapped_epilogue
def traced(self, *args):
    print("overlapped", self.epi_overlap, self.step_name)
    return loop(self, *args)
epilogue.CodaEpilogue._overlapped_epilogue = traced
for path, level, only in {runs!r}:
    program = Program.model_validate(json.loads(open(path).read())["program"])
    info = analyze(program, {{"M": 256, "d": 256, "f": 256}})
    tensors = {{n: torch.empty(t.shape, dtype=torch_dtype(t.dtype, torch.bfloat16))
               for n, t in info.tensors.items() if t.partials is None}}
    for step, name in zip(program.steps, program.step_names()):
        if not isinstance(step, GemmEpilogue) or info.gemms[name].vendor:
            continue
        if only and name not in only:
            continue
        runner, gemm = CuteStep(step), info.gemms[name]
        floats = {{n: t.dtype for n, t in tensors.items() if t.is_floating_point()}}
        asked = CuteConfig(128, 128, 2, 1, epi_overlap=level)
        source, config, writes = runner.plan(gemm, floats, torch.bfloat16, asked)
        for out, shape, dtype in writes:
            tensors[out] = torch.empty(shape, dtype=dtype)
        epilogue.CodaEpilogue.step_name = name
        launch = CuteLaunch(runner, source, gemm.M, gemm.N, config)
        runner.compiled(source, launch.arguments(tensors), config)
        print("compiled", level, name)
"""


@pytest.mark.skipif(not HAVE_DSL, reason="the CuTe DSL and QuACK are not installed")
def test_the_overlapped_loop_compiles_where_a_step_loads_tiles(tmp_path: Path) -> None:
    # epi_overlap: the two backward steps (each loads two tiles) and the down projection's
    # forward (it loads the residual) take the overlapped loop; the gate/up forward loads no
    # tile and keeps QuACK's loop. At level 2 the SwiGLU backward's eight 64 x 32 sub-tiles pass
    # one named barrier each, and one more for the last sub-tile's stores, where level 1 passes
    # two each (QuACK's); its TMA warp keeps one store group fewer in flight before a barrier
    # whose stores trail (wait_group 2 of its four store stages, level 1's 3)
    bwd, fwd = (str(PROGRAMS / f"{n}.json") for n in ("llama_mlp_bwd_saved", "llama_mlp_train"))
    runs = [(bwd, 2, ()), (fwd, 2, ()), (bwd, 1, ("down_bwd",))]
    (tmp_path / "ptx").mkdir()
    env = {
        **os.environ,
        "CODA_CACHE_DIR": str(tmp_path / "cache"),
        "CUTE_DSL_ARCH": "sm_90a",
        "CUTE_DSL_KEEP": "ptx",
        "CUTE_DSL_DUMP_DIR": str(tmp_path / "ptx"),
    }
    code = _OVERLAP.format(runs=runs)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [line for line in lines if line.startswith("overlapped")] == [
        "overlapped 2 down_bwd",
        "overlapped 2 gate_up_bwd",
        "overlapped 2 down",
        "overlapped 1 down_bwd",
    ], r.stdout
    compiled = {"down_bwd", "gate_up_bwd", "gate_up", "down"}
    assert {f"compiled 2 {n}" for n in compiled} | {"compiled 1 down_bwd"} <= set(lines)
    swiglu_bwd = {}  # level -> its PTX (the step with a sigmoid)
    for path in (tmp_path / "ptx").rglob("*.ptx"):
        text = path.read_text()
        if "ex2.approx" in text:
            swiglu_bwd[1 if "N0O1" in path.name else 2] = text
    assert set(swiglu_bwd) == {1, 2}, sorted(p.name for p in (tmp_path / "ptx").rglob("*.ptx"))
    barriers = {k: len(re.findall(r"\bbar(?:rier)?\.sync\b", t)) for k, t in swiglu_bwd.items()}
    assert barriers[1] - barriers[2] == 8 - 1, barriers
    waits = {
        k: re.findall(r"cp\.async\.bulk\.wait_group\.read\s+(\d+)", t)
        for k, t in swiglu_bwd.items()
    }
    assert waits[1].count("3") == 8 and "2" not in waits[1], waits
    assert waits[2].count("2") == 7 and waits[2].count("3") == 1, waits
