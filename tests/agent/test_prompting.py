"""The prompts are generated from the code: every registered primitive is in the catalogue with its
own docstring and fields, the worked example verifies, the task shows what the block needs."""

from __future__ import annotations

import inspect
import json

import pytest

from coda.agent.prompting import (
    _example_block,
    describe_primitive,
    example_program,
    lookup,
    primitives,
    structure,
    system_prompt,
    task_prompt,
)
from coda.agent.tools import tool_specs
from coda.primitives import Program
from coda.primitives.base import AuxStep, EpilogueOp, PrepStep
from coda.sandbox import SandboxOptions, evaluate

from .scripted import BLOCK, FAST

REGISTERED = [
    *(("epilogue op", n, c) for n, c in EpilogueOp.registry.items()),
    *(("aux step", n, c) for n, c in AuxStep.registry.items()),
    *(("prep step", n, c) for n, c in PrepStep.registry.items()),
]


def what_the_model_sees() -> str:
    """Everything sent with every request: the system prompt and the tool definitions."""
    tools = [s.model_dump() for s in tool_specs()]
    return system_prompt() + "\n" + json.dumps(tools, ensure_ascii=False)


# Measured on 2026-12-01, before the catalogue became the only place a Program's fields are
# described: the system prompt was 24,970 characters and the tool definitions 35,350 (as the
# Anthropic adapter sends them, JSON), sent again on every turn.
CONTEXT_CHARS_BEFORE = 24_970 + 35_350


def test_the_context_is_at_most_half_of_what_it_was() -> None:
    tools = [
        {"name": t.name, "description": t.description, "input_schema": t.input_schema}
        for t in tool_specs()
    ]
    chars = len(system_prompt()) + len(json.dumps(tools))
    assert chars <= 0.5 * CONTEXT_CHARS_BEFORE, chars


@pytest.mark.parametrize("family,name,cls", REGISTERED, ids=[r[1] for r in REGISTERED])
def test_every_registered_primitive_is_fully_described(family: str, name: str, cls: type) -> None:
    """Its name, every field (with the tag it is written under) and its docstring's opening
    paragraph reach the model, in one catalogue entry."""
    seen = what_the_model_sees()
    heading = f"### `{name}` — {family}"
    assert seen.count(heading) == 1
    entry = seen[seen.index(heading) :].split("\n### ", 1)[0]
    opening = inspect.cleandoc(cls.__doc__).split("\n\n", 1)[0]
    assert opening in entry  # its own docstring
    tag = "op" if family == "epilogue op" else "kind"
    assert f'`{{"{tag}": "{name}"' in entry
    schema = cls.model_json_schema()
    for field in schema["properties"]:
        optional = "" if field in schema.get("required", []) or field == tag else "?"
        assert f'"{field}"{optional}: ' in entry, field
    assert name in describe_primitive(name)


def test_the_submit_schema_does_not_repeat_the_catalogue() -> None:
    schema = json.dumps(tool_specs()[0].input_schema)
    assert "$defs" not in schema and "scale_rows" not in schema and len(schema) < 300


def test_the_catalogue_is_exactly_the_registries() -> None:
    assert sorted(d.name for d in primitives()) == sorted(n for _, n, _ in REGISTERED)


def test_the_worked_example_parses_and_verifies() -> None:
    program = Program.parse(example_program())
    report = evaluate(program, _example_block(), SandboxOptions(isolate=False, seeds=[0]))
    assert report.verified, report.render_text()
    assert json.dumps(example_program()["steps"][1]["epilogue"][0]) in system_prompt()


def test_the_task_prompt_carries_source_header_shapes_and_device() -> None:
    text = task_prompt(BLOCK, FAST)
    assert BLOCK.reference_source().strip() in text
    assert '"inputs": {' in text and '"w_down": {"shape": ["d", "f"], "dtype": "act"}' in text
    assert '{"M": 67, "d": 48, "f": 80}' in text and '{"M": 64' not in text  # FAST's shapes only
    assert "Timings are NOT measured" in text


def test_the_task_prompt_hands_over_no_part_of_a_program_the_planner_finds_whole() -> None:
    text = task_prompt(BLOCK, FAST)
    assert "could not lower" not in text and '"steps"' not in text
    assert "tensor.\n\n## Shapes, dtypes and tolerance" in text


def test_describe_primitive_suggests_the_closest_name() -> None:
    with pytest.raises(KeyError, match="did you mean 'partial_reduce'"):
        lookup("partial_reduction")
    text = describe_primitive("gemm")
    assert "JSON schema:" in text and '"epilogue"' in text


def test_tool_descriptions_come_from_the_tool_models() -> None:
    specs = {s.name: s for s in tool_specs()}
    assert specs["submit_program"].description.startswith("Submit a Program")
    assert specs["describe_primitive"].input_schema["required"] == ["name"]
    assert specs["finish"].input_schema["properties"]["reason"]["type"] == "string"


def test_every_node_of_the_program_schema_has_a_catalogue_entry() -> None:
    """The tool schema does not carry the Program's ``$defs``: each needs an entry in the prompt."""
    documented = {d.model.__name__ for d in [*primitives(), *structure()]}
    nodes = set(Program.model_json_schema()["$defs"])
    assert nodes <= documented, nodes - documented
    prompt = system_prompt()
    assert all(d.heading() in prompt for d in structure())


def test_authored_program_without_prep_round_trips() -> None:
    """A Program with no prep steps (the default) prints without one and parses back equal."""
    from coda.agent.prompting import authored
    from coda.primitives.ir import Program

    data = {
        "block": "b",
        "inputs": {"x": ["M", "d"], "w": ["d", "d"]},
        "steps": [
            {
                "kind": "gemm",
                "a": "x",
                "b": "w.T",
                "epilogue": [{"op": "store", "src": "acc", "to": "y"}],
            }
        ],
        "outputs": {"y": "y"},
    }
    program = Program.model_validate(data)
    text = authored(program)
    assert "prep" not in text
    assert Program.model_validate(text) == program
