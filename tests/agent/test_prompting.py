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


@pytest.mark.parametrize("family,name,cls", REGISTERED, ids=[r[1] for r in REGISTERED])
def test_every_registered_primitive_is_in_the_catalogue(family: str, name: str, cls: type) -> None:
    prompt = system_prompt()
    heading = f"### `{name}` — {family}"
    assert heading in prompt
    entry = prompt[prompt.index(heading) :].split("\n### ", 1)[0]
    assert inspect.cleandoc(cls.__doc__).splitlines()[0] in entry  # its own docstring
    required = cls.model_json_schema().get("required", [])
    for field in required:
        assert f"`{field}`: " in entry and "required" in entry
    assert name in describe_primitive(name)


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
