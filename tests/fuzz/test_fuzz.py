"""Property tests: nothing a candidate can be makes the front stages crash.

Bounded and deterministic (a fixed profile: derandomized, ≤ 200 examples each, no deadline, no
example database); ``scripts/fuzz.py`` runs the same strategies for ≥ 10,000 cases.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings

from coda.primitives import ProgramError
from coda.primitives.expr import parse
from coda.sandbox import SandboxOptions, evaluate
from tests.adversarial.programs import BLOCKS, HONEST
from tests.fuzz.harness import run_front
from tests.fuzz.strategies import cases, expressions, json_texts, json_values

PROFILE = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "phases": [Phase.generate],
    "suppress_health_check": list(HealthCheck),
}


@settings(max_examples=120, **PROFILE)
@given(cases(BLOCKS, HONEST))
def test_validate_semantics_compile_never_crash(case: tuple[Any, str]) -> None:
    data, block = case
    outcome = run_front(data, BLOCKS[block])
    assert outcome.status != "crash", f"{outcome.reason}\n{outcome.message}\ninput: {data!r}"
    if outcome.status == "rejected":
        assert outcome.reason.strip(), outcome.message  # a message, not an empty failure


@settings(max_examples=200, **PROFILE)
@given(json_texts() | json_values())
def test_random_json_is_rejected_at_validate_by_name(data: Any) -> None:
    report = evaluate(data, BLOCKS["llama_mlp"], SandboxOptions(isolate=False))
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("validate", "program"), failed
    assert failed.message.startswith("invalid program:") or "llama_mlp" in failed.message


@settings(max_examples=200, **PROFILE)
@given(expressions(["x", "y"]))
def test_expressions_parse_print_and_evaluate_or_are_rejected(source: str) -> None:
    try:
        expr = parse(source)
    except ProgramError as e:
        assert "expression" in str(e), e  # names the expression (or what is wrong with it)
        return
    assert all(name.isidentifier() for name in expr.variables())
    assert "torch" not in expr.to_triton(lambda n: f"v_{n}")
    gen = torch.Generator().manual_seed(0)
    values: dict[str, torch.Tensor] = {}  # a tile [3, 4] or a column vector [1, 4] per name
    shape = lambda n: (3, 4) if len(values) % 2 == 0 else (1, 4)  # noqa: E731
    value = lambda n: values.setdefault(n, torch.randn(shape(n), generator=gen).double())  # noqa: E731
    expr.evaluate(value, torch.float64)
