"""The repair benchmark: Reports must name the node of a Program that a mistake changed.

One run of the whole benchmark (every built-in block × every mutation kind, validate + semantics
in-process: ~15 s on a CPU) backs the score assertions; the rest checks single Reports in
milliseconds.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from coda.blocks import get_block
from coda.evals import repair
from coda.planner import lower
from coda.primitives.errors import ProgramError, json_path
from coda.primitives.ir import Program
from coda.sandbox.report import Report
from coda.sandbox.stages import validate


@pytest.fixture(scope="module")
def score() -> repair.Score:
    """The benchmark as its command runs it (``python -m coda.evals.repair --json``)."""
    done = subprocess.run(
        [sys.executable, "-m", "coda.evals.repair", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    return repair.Score([repair.Outcome(**json.loads(line)) for line in lines])


def test_reports_localise_at_least_nine_in_ten_mutants(score: repair.Score) -> None:
    assert score.share() >= 0.90, score.table()


def test_every_kind_of_mistake_is_caught_at_its_stage(score: repair.Score) -> None:
    """No mutant verifies silently; each fails at the stage its mutation belongs to."""
    assert set(score.kinds()) == set(repair.MUTATIONS), "a mutation applies to no block"
    assert len(repair.MUTATIONS) >= 12
    for outcome in score.outcomes:
        assert outcome.failed_stage is not None, f"{outcome.block} {outcome.kind} passed"
        assert outcome.caught, (outcome.block, outcome.kind, outcome.failed_stage)


def _report(program: dict, block: str) -> Report:
    mutant = repair.Mutant("probe", program, "", "semantics")
    outcome = repair.run_mutant(mutant, get_block(block))
    assert outcome.failed_stage is not None
    return outcome


def test_a_residual_added_twice_is_named_with_its_repair() -> None:
    program = repair.residual_twice(lower(get_block("llama_mlp")).model_dump(mode="json"))
    outcome = _report(program.program, "llama_mlp")
    assert outcome.failed_stage == "semantics"
    assert outcome.reported_loc == "steps[2].epilogue[1]"
    assert "output 'out' does not match the block's reference" in outcome.message
    assert (
        "At fault: steps[2].epilogue[1] — every output matches after this one change: remove "
        "steps[2].epilogue[1] (add_tile)" in outcome.message
    )


def test_a_wrong_eps_is_solved_for() -> None:
    program = repair.wrong_eps(lower(get_block("llama_mlp")).model_dump(mode="json"))
    outcome = _report(program.program, "llama_mlp")
    assert outcome.reported_loc == "steps[0].eps"
    assert "from 1e-06 to 1e-05" in outcome.message


def test_a_type_error_downstream_is_traced_to_its_cause() -> None:
    """A reduction on the wrong axis surfaces two steps later as a vector of the wrong length."""
    mutant = repair.reduction_wrong_axis(lower(get_block("llama_mlp_bwd")).model_dump(mode="json"))
    outcome = _report(mutant.program, "llama_mlp_bwd")
    assert outcome.failed_stage == "validate" and outcome.reported_loc == mutant.loc
    assert "must be a vector of length" in outcome.message  # the symptom is still there
    assert f"set {mutant.loc} to 'row'" in outcome.message


def test_a_computed_but_unstored_value_points_at_its_epilogue() -> None:
    mutant = repair.missing_store(lower(get_block("llama_attn_out")).model_dump(mode="json"))
    outcome = _report(mutant.program, "llama_attn_out")
    assert outcome.reported_loc == mutant.loc
    assert "computes 'x_out' in its epilogue but never stores it" in outcome.message


def test_a_mismatch_no_single_repair_explains_keeps_its_message() -> None:
    """Two independent mistakes: no single edit repairs them, so nothing is blamed."""
    data = lower(get_block("llama_mlp")).model_dump(mode="json")
    data = repair.wrong_eps(data).program
    data = repair.residual_twice(data).program
    outcome = _report(data, "llama_mlp")
    assert outcome.failed_stage == "semantics" and outcome.reported_loc is None
    assert "At fault" not in outcome.message


def test_the_report_carries_the_location_as_data() -> None:
    block = get_block("llama_mlp")
    data = copy.deepcopy(lower(block).model_dump(mode="json"))
    data["steps"][1]["epilogue"][0]["vector"] = "rstd"
    results: list = []
    validate(data, block, block.shapes.cpu, results)
    assert results[-1].loc == "steps[1].epilogue[0].vector"
    report = Report(
        verified=False, block="llama_mlp", program_hash="0", device="cpu", stages=results
    )
    assert "where: steps[1].epilogue[0].vector" in report.render_compact()


def test_locations_become_json_paths() -> None:
    assert json_path("steps[2] (gemm 'down').epilogue[0] (add_tile).tensor") == (
        "steps[2].epilogue[0].tensor"
    )
    assert json_path("") is None
    data = lower(get_block("llama_mlp")).model_dump(mode="json")
    data["steps"][1]["epilogue"][0]["vectr"] = data["steps"][1]["epilogue"][0].pop("vector")
    with pytest.raises(ProgramError) as caught:
        Program.parse(data)
    assert caught.value.path == "steps[1].epilogue[0].vector"


def test_an_output_never_stored_points_at_the_epilogue_that_can_store_it() -> None:
    mutant = repair.missing_store(lower(get_block("gemm_swiglu")).model_dump(mode="json"))
    outcome = _report(mutant.program, "gemm_swiglu")
    assert outcome.failed_stage == "validate" and outcome.reported_loc == "steps[0].epilogue"
    assert "output 'd' names 'd', which no step writes" in outcome.message
    assert "add store(src='acc', to='d') to steps[0].epilogue" in outcome.message
