"""Helpers for eval tests: fast sandbox options, scripted-model provider specs, new evals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coda.evals.results import EvalDir
from coda.evals.spec import EvalSpec, ProviderSpec
from coda.sandbox import SandboxOptions

# The harness is under test here, not the kernels: in process, one seed, one small ragged shape.
FAST_SANDBOX = SandboxOptions(
    isolate=False, seeds=[0], shapes=[{"M": 5, "d": 24, "f": 36}]
).model_dump(mode="json")
BUILTIN = ProviderSpec.parse("builtin")


def model(name: str) -> ProviderSpec:
    """A scripted model of ``tests/evals/models.py`` as a ``python:`` provider."""
    return ProviderSpec.parse(f"python:tests.evals.models:{name}")


def make_eval(path: Path, providers: list[ProviderSpec], seeds: int = 1, **kw: Any) -> EvalDir:
    spec = EvalSpec(
        blocks=["llama_mlp"], providers=providers, seeds=seeds, sandbox=FAST_SANDBOX, **kw
    )
    return EvalDir.create(path, spec)
