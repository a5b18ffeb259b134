"""The built-in planner's search, from Reports to the next candidate: decompositions until one
verifies, stop without timings, and with timings time decompositions then tile configs.

Timings exist only on a GPU, so the timed path is driven here by Reports with profile rows made by
hand; the builtin provider reads them from tool results exactly as it reads real ones.
"""

from __future__ import annotations

import json

import pytest

from coda.agent.providers import BuiltinProvider, ToolResultPart, UserMessage
from coda.blocks import Add, Block, ShapeSets, TensorSpec
from coda.planner import TUNING_CONFIGS, Finish, NoRule, Outcome, PlanSearch, Proposal
from coda.sandbox.report import ProfileRow, Report, StageResult
from tests.agent.scripted import BLOCK

from .test_planner import DECODER_TAIL


def outcome(
    p: Proposal, verified: bool, ms: float | None = None, failure: str = "", tuned: bool = False
) -> Outcome:
    return Outcome(p.program, verified, ms, failure, tuned)


def test_llama_mlp_has_one_decomposition_and_stops_at_the_first_verified() -> None:
    search = PlanSearch(BLOCK)  # its norm reads a block input: γ folds, rstd makes one pass
    assert len(search.decompositions) == 1
    first = search.propose([])
    assert isinstance(first, Proposal) and "CODA's rewrite rules" in first.why
    done = search.propose([outcome(first, True)])
    assert isinstance(done, Finish) and "not measured" in done.reason


def test_a_failed_decomposition_moves_to_the_next() -> None:
    search = PlanSearch(DECODER_TAIL)
    labels = [p.label for p in search.decompositions]
    assert len(labels) == 4 and "γ stored as a side output" in labels[1]
    tried = []
    for k in range(4):
        nxt = search.propose(tried)
        assert isinstance(nxt, Proposal) and nxt.program == search.decompositions[k].program
        tried.append(outcome(nxt, False, failure="verify: 3 of 6 output checks failed"))
        if k:
            assert "failed (verify: 3 of 6" in nxt.why
    end = search.propose(tried)
    assert isinstance(end, Finish) and end.reason.startswith("none of the 4 candidates verified")


def test_with_timings_it_times_decompositions_then_tile_configs() -> None:
    search = PlanSearch(DECODER_TAIL)
    times = [3.0, 2.0, 4.0, 5.0]  # the side-output decomposition is fastest
    tried = []
    for t in times:
        p = search.propose(tried)
        tried.append(outcome(p, True, t))
    configs = []
    while isinstance(p := search.propose(tried), Proposal):
        gemm = next(s for s in p.program.steps if s.kind == "gemm")
        configs.append(gemm.config)
        assert "γ stored as a side output" in p.label and "tile config" in p.why
        tried.append(outcome(p, True, 2.5))
    assert configs == list(TUNING_CONFIGS)
    two_programs = next(c for c in TUNING_CONFIGS if c.programs_per_sm == 2)
    labels = [p.label for p in search.decompositions]
    assert "mainloop auto" in labels[0]
    assert (
        "128×128×64 w4 s3 e2 2/SM"
        in search._with_config(search.decompositions[0], two_programs).label
    )
    # the four decompositions, then every explicit config on the fastest one
    assert f"fastest of {4 + len(TUNING_CONFIGS)} candidates" in p.reason
    assert "2.000 ms" in p.reason


def test_with_tuned_timings_it_finishes_after_the_decompositions() -> None:
    """The sandbox tuned every fused GEMM's config at each benchmark shape: a tile-config
    candidate would only be tuned again to the same configs."""
    search = PlanSearch(DECODER_TAIL)
    tried = []
    for t in [3.0, 2.0, 4.0, 5.0]:
        p = search.propose(tried)
        assert isinstance(p, Proposal) and p.options.config == "auto"
        tried.append(outcome(p, True, t, tuned=True))
    end = search.propose(tried)
    assert isinstance(end, Finish) and end.reason.startswith("fastest of 4 candidates")
    assert "γ stored as a side output" in end.reason and "2.000 ms" in end.reason
    assert "would only repeat that tuning" in end.reason


def test_a_config_that_fails_to_compile_prunes_larger_ones() -> None:
    search = PlanSearch(BLOCK)
    first = search.propose([])
    tried = [outcome(first, True, 1.0)]
    nxt = search.propose(tried)  # the first explicit config: 128×256×64, 3 stages
    tried.append(outcome(nxt, False, failure="compile: out of resources: shared memory"))
    rest = []
    while isinstance(p := search.propose(tried), Proposal):
        rest.append(next(s for s in p.program.steps if s.kind == "gemm").config)
        tried.append(outcome(p, True, 2.0))
    # 256×128×64 s3 needs as much shared memory as the failed one; smaller ones are still tried
    assert TUNING_CONFIGS[1] not in rest and TUNING_CONFIGS[2:] == tuple(rest)


def test_a_block_without_rules_is_refused_by_name() -> None:
    odd = Block(
        name="two_inputs",
        description="a + b",
        inputs={"a": TensorSpec(shape=["M", "d"]), "b": TensorSpec(shape=["M", "d"])},
        graph=[Add(a="a", b="b", out="y")],
        outputs=["y"],
        shapes=ShapeSets(cpu=[{"M": 4, "d": 8}]),
    )
    with pytest.raises(NoRule, match=r"graph\[0\] add\(out='y'\): no lowering rule"):
        BuiltinProvider(odd)


def _report(verified: bool, ms: float | None) -> Report:
    rows = [ProfileRow(sizes={"M": 4096}, dtype="bfloat16", program_ms=ms, gemms_ms=1.0, tflops=1)]
    return Report(
        verified=verified,
        block=BLOCK.name,
        program_hash="x",
        device="test",
        stages=[StageResult(stage="verify", status="passed" if verified else "failed")],
        profile=rows if ms is not None else [],
    )


def test_the_builtin_provider_reads_reports_from_tool_results() -> None:
    provider = BuiltinProvider(BLOCK)
    history: list = []
    first = provider.complete("", history, [])
    (call,) = first.tool_calls
    assert call.name == "submit_program" and call.id == "builtin_1"
    result = ToolResultPart(
        tool_call_id=call.id,
        name=call.name,
        content="VERIFIED",
        data={"candidate": 1, "report": _report(True, 1.5).model_dump(mode="json")},
    )
    history += [first, UserMessage(parts=[result])]
    second = provider.complete("", history, [])
    (call,) = second.tool_calls
    program = json.loads(call.arguments)["program"]
    assert call.name == "submit_program" and call.id == "builtin_2"
    assert program["steps"][1]["config"] == TUNING_CONFIGS[0].model_dump()  # timed: tune tiles
    assert "1.500 ms so far" in second.text
    tuned = _report(True, 1.5)
    tuned = tuned.model_copy(
        update={"profile": [tuned.profile[0].model_copy(update={"tuned": True})]}
    )
    result = result.model_copy(
        update={"data": {"candidate": 1, "report": tuned.model_dump(mode="json")}}
    )
    done = provider.complete("", [first, UserMessage(parts=[result])], [])
    assert [c.name for c in done.tool_calls] == ["finish"]  # tuned in the sandbox: no tiles
