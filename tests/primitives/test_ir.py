"""The IR as data: JSON round-trips, builder ≡ JSON, to_python, schema, canonical keys."""

from __future__ import annotations

import json

import pytest

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import AuxStep, EpilogueOp, PrepStep, Program, ProgramBuilder
from coda.primitives.ir import MainloopConfig, Operand


@pytest.fixture(scope="module")
def program() -> Program:
    return lower(get_block("llama_mlp"))


def test_json_round_trip(program: Program) -> None:
    again = Program.parse(program.model_dump_json())
    assert again == program
    assert again.canonical_json() == program.canonical_json()


def test_builder_and_json_give_the_same_program(program: Program) -> None:
    b = ProgramBuilder("llama_mlp", inputs=get_block("llama_mlp").program_inputs())
    b.interleave_rows(first="w_gate", second="w_up", out="w_g_u")
    b.fold_norm_weight("w_g_u", "gamma", "w_g_u_folded")  # positional, in field order
    b.rstd(src="x", eps=1e-5, out="rstd_h")
    g = b.gemm("x", "w_g_u_folded.T", name="gate_up")
    g.scale_rows(src="acc", vector="rstd_h", out="gu").swiglu(src="gu", out="a")
    g.store(src="a", to="a")
    b.gemm("a", "w_down.T", name="down").add_tile(src="acc", tensor="x", out="out").store(
        src="out", to="out"
    )
    b.output("out", "out")
    assert b.build() == program


def test_to_python_rebuilds_exactly(program: Program) -> None:
    namespace: dict = {}
    exec(program.to_python(), namespace)  # noqa: S102
    assert namespace["program"] == program
    configured = program.model_copy(deep=True)
    configured.steps[1].__dict__["config"] = MainloopConfig(block_m=64, num_warps=4)
    exec(configured.to_python(), namespace)  # noqa: S102
    assert namespace["program"].steps[1].config == MainloopConfig(block_m=64, num_warps=4)


def test_operand_shorthand() -> None:
    assert Operand.model_validate("w.T") == Operand(tensor="w", transpose=True)
    assert Operand.model_validate("x") == Operand(tensor="x")


def test_schema_is_a_usable_tool_schema(program: Program) -> None:
    schema = Program.model_json_schema()
    text = json.dumps(schema)  # serialisable as a tool's input schema
    for name in [*EpilogueOp.registry, *AuxStep.registry, *PrepStep.registry]:
        assert f'"{name}"' in text, f"{name} missing from the tool schema"
    # every primitive's docstring reaches the schema (it is the LLM-facing documentation)
    for cls in EpilogueOp.registry.values():
        first_line = cls.__doc__.strip().splitlines()[0]
        assert first_line[:40] in text, cls.__name__


def test_canonical_json_is_a_key(program: Program) -> None:
    reordered = Program.parse(json.loads(program.model_dump_json()))
    assert reordered.canonical_json() == program.canonical_json()
    changed = Program.parse(
        {
            **program.model_dump(mode="json"),
            "steps": [
                *program.model_dump(mode="json")["steps"][:2],
                {
                    **program.model_dump(mode="json")["steps"][2],
                    "config": MainloopConfig().model_dump(),
                },
            ],
        }
    )
    assert changed.canonical_json() != program.canonical_json()


def test_models_are_frozen(program: Program) -> None:
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises ValidationError
        program.block = "other"  # type: ignore[misc]
