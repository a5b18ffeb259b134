"""The sandbox bounds what a program may make it do: validate sizes every tensor at every shape set
and refuses what is past a cap before anything is allocated; everything that runs the program
(semantics included) runs in the worker, under its timeout and memory cap.

The programs are ``llama_mlp``'s own plus dead weight an LLM could write: a chain of
``concat_rows`` doubling a weight's rows (a few KB of JSON that asks for terabytes), and extra
GEMMs over such a weight with long elementwise epilogues (seconds to minutes of reference
execution at the block's CPU shapes).
"""

from __future__ import annotations

import resource
import time
from typing import Any

import pytest

from coda.blocks import builtin_blocks, get_block
from coda.planner import lower
from coda.sandbox import SandboxOptions, evaluate
from coda.sandbox.report import StageResult
from coda.sandbox.stages import DEFAULT_MAX_TENSOR_GIB, DEFAULT_MAX_TOTAL_GIB, validate

BLOCK = get_block("llama_mlp")
QUICK = {"seeds": [0], "dtypes": ["float32"]}


def with_tall_weight(doublings: int) -> tuple[dict[str, Any], str]:
    """llama_mlp's program plus prep steps that double ``w_up``'s rows ``doublings`` times."""
    program = lower(BLOCK).model_dump(mode="json")
    last = "w_up"
    for i in range(doublings):
        program["prep"].append({"kind": "concat_rows", "tensors": [last, last], "out": f"tall{i}"})
        last = f"tall{i}"
    return program, last


def slow_program(doublings: int = 9, steps: int = 3, maps: int = 12) -> dict[str, Any]:
    """Extra GEMMs ``x @ tallᵀ``, each with a chain of transcendental maps: at the CPU shapes
    the reference executor spends tens of seconds on them (tiles of 64 × 65536 float64)."""
    program, tall = with_tall_weight(doublings)
    expr = "tanh(exp(-T * T) + sigmoid(T) * sqrt(abs(T) + 1.0))"
    for s in range(steps):
        names = ["acc"] + [f"v{j}" for j in range(maps)]
        epilogue: list[dict[str, Any]] = [
            {"op": "map", "expr": expr.replace("T", names[j]), "out": names[j + 1]}
            for j in range(maps)
        ]
        epilogue.append({"op": "store", "src": names[-1], "to": f"waste{s}"})
        program["steps"].append(
            {"kind": "gemm", "name": f"waste_{s}", "a": "x", "b": f"{tall}.T", "epilogue": epilogue}
        )
    return program


def test_a_chain_of_concat_rows_is_refused_at_validate_in_milliseconds() -> None:
    program, _ = with_tall_weight(29)  # 2^29 × w_up's rows: far past any cap
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    report = evaluate(program, BLOCK, SandboxOptions(isolate=False))
    elapsed = time.perf_counter() - start
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert elapsed < 1.0 and grown_mib < 64, (elapsed, grown_mib)
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("validate", "program"), failed
    assert [s.stage for s in report.stages] == ["validate"]
    message = failed.message
    # the first tensor past 32 GiB: 2^20 × w_up's 128 rows × 64 columns × 4 bytes at M=64, d=64
    assert message.startswith("prep[22] (concat_rows): tensor 'tall20' would be")
    assert "would be [268435456, 64] float32 (act) = 64 GiB at M=64, d=64, f=128" in message
    assert "above the sandbox's per-tensor cap of 32 GiB" in message
    assert "concat_rows or interleave_rows of a tensor with itself doubles its rows" in message
    assert "SandboxOptions.max_tensor_gib raises the cap" in message


def test_the_total_cap_names_the_largest_tensors() -> None:
    program, _ = with_tall_weight(12)  # 4096 × 8 KiB elements, doubled and summed: 256 MiB
    results: list[StageResult] = []
    options = SandboxOptions(max_tensor_gib=1.0, max_total_gib=0.25)
    assert validate(program, BLOCK, BLOCK.shapes.cpu, results, options)[0] is None
    message = results[-1].message
    assert message.startswith("the program's tensors would take 256.2 MiB at M=64, d=64, f=128")
    assert "(largest: 'tall11' [524288, 64] float32 (act) = 128 MiB, 'tall10'" in message
    assert "above the sandbox's total cap of 256 MiB" in message
    assert "SandboxOptions.max_total_gib raises the cap" in message
    unbounded = SandboxOptions(max_tensor_gib=None, max_total_gib=None)
    assert validate(program, BLOCK, BLOCK.shapes.cpu, [], unbounded)[0] is not None


def test_a_block_input_over_a_cap_is_named_as_the_block_s_fault() -> None:
    """Past the cap at the block's own shapes, a program can do nothing: the message says so."""
    program = lower(BLOCK)
    huge = [{"M": 1 << 22, "d": 4096, "f": 128}]  # x alone: 64 GiB of float32
    for options in (SandboxOptions(), SandboxOptions(max_tensor_gib=None, max_total_gib=16.0)):
        results: list[StageResult] = []
        validate(program, BLOCK, huge, results, options)
        message = results[-1].message
        assert "'x'" in message and "the block's own tensors at this shape set" in message
        assert "This is a fault of the block's shape sets, not of the program" in message
        assert "concat_rows" not in message


def test_every_builtin_block_fits_the_default_caps_with_room_to_spare() -> None:
    """At its CPU, GPU and bench shape sets, every built-in block's planned program passes caps
    a quarter of the defaults (the largest: llama_lm_head_ce_bwd's 7.8 GiB logit gradient)."""
    tight = SandboxOptions(
        max_tensor_gib=DEFAULT_MAX_TENSOR_GIB / 4, max_total_gib=DEFAULT_MAX_TOTAL_GIB / 4
    )
    checked = 0
    for block in builtin_blocks():
        program = lower(block)
        shapes = block.shapes.cpu + (block.shapes.gpu or []) + (block.shapes.bench or [])
        results: list[StageResult] = []
        validate(program, block, shapes, results, tight)
        assert results[-1].status == "passed", (block.name, results[-1].message)
        checked += 1
    assert checked >= 26


def test_semantics_runs_in_the_worker_and_is_stopped_at_its_timeout() -> None:
    announced: list[str] = []
    start = time.monotonic()
    report = evaluate(
        slow_program(),
        BLOCK,
        SandboxOptions(**QUICK, timeout_s=6),
        on_stage=lambda s: announced.append(f"{s.stage}:{s.status}"),
    )
    assert time.monotonic() - start < 20
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("semantics", "timeout"), failed
    assert "the worker was killed during semantics: timed out after 6 s" in failed.message
    assert "the program's float64 reference run at the block's CPU shapes does not finish" in (
        failed.message
    )
    assert announced == ["validate:passed", "semantics:failed"]


def test_a_semantics_allocation_bomb_ends_as_oom_in_the_worker() -> None:
    # 2^15 × w_up: 2 GiB of float64 in the last prep result alone, 4 GiB in the chain — under the
    # validate caps (they count float32 kernels), over a 1 GiB worker cap when run in float64.
    program, _ = with_tall_weight(15)
    report = evaluate(program, BLOCK, SandboxOptions(**QUICK, memory_limit_mb=1024))
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("semantics", "oom"), failed
    assert "out of memory in the semantics stage (the worker's memory cap is 1024 MiB" in (
        failed.message
    )


@pytest.mark.parametrize("isolate", [True, False])
def test_a_good_program_still_reports_every_stage(isolate: bool) -> None:
    announced: list[str] = []
    report = evaluate(
        lower(BLOCK),
        BLOCK,
        SandboxOptions(**QUICK, isolate=isolate),
        on_stage=lambda s: announced.append(s.stage),
    )
    assert report.verified, report.render_text()
    assert announced == ["validate", "semantics", "compile", "verify", "profile"]
    assert report.stage("semantics").message.startswith("algebra matches the block in float64")
