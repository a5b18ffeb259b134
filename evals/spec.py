"""What an eval runs: providers, the spec (blocks × providers × seeds), and its cells.

``ProviderSpec`` is one ``--providers`` entry: ``builtin``, ``anthropic[:MODEL]``,
``openai[:MODEL][@BASE_URL]`` or ``python:package.module:factory`` (a function
``factory(block) -> Provider`` importable where the cell runs: a custom model adapter, or a
scripted model in tests). ``EvalSpec`` is written to the eval folder's ``eval.json`` when the
eval starts and read back by ``--resume``, so a resumed eval runs exactly the same cells.

A ``Cell`` is one (block, provider, seed). A seed is a replicate index: cell ``k`` of ``n`` is an
independent sample of the same task (LLM providers are sampled at their default temperature; the
built-in planner is deterministic, so its seeds agree). Its ``id`` names its folder and its lines
in ``results.jsonl``.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from coda.agent.loop import Budgets
from coda.agent.providers import Provider, make_provider
from coda.blocks.block import Block
from coda.sandbox.stages import SandboxOptions

ProviderKind = Literal["builtin", "anthropic", "openai", "python"]
_KINDS: tuple[str, ...] = ("builtin", "anthropic", "openai", "python")
_DEFAULT_MODELS = {"builtin": "coda-planner", "anthropic": None, "openai": None}


class SpecError(ValueError):
    """A ``--providers`` entry or eval spec that cannot work; the message says what to change."""


class ProviderSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: ProviderKind
    model: str | None = None  # None: the provider's default model
    base_url: str | None = None

    @classmethod
    def parse(cls, text: str) -> ProviderSpec:
        """``builtin`` | ``anthropic[:MODEL]`` | ``openai[:MODEL][@URL]`` | ``python:MOD:FN``."""
        text = text.strip()
        kind, _, rest = text.partition(":")
        if kind not in _KINDS:
            raise SpecError(
                f"unknown provider {kind!r} in --providers entry {text!r}: choose one of "
                f"{', '.join(_KINDS)} (e.g. builtin, anthropic:claude-sonnet-4-5, "
                "openai:my-model@http://localhost:8000/v1, python:my_module:make_provider)"
            )
        base_url = None
        if kind in ("anthropic", "openai") and "@" in rest:
            rest, _, base_url = rest.partition("@")
        if kind == "builtin" and rest:
            raise SpecError(f"the builtin provider takes no model (got {text!r}): write `builtin`")
        if kind == "python" and rest.count(":") != 1:
            raise SpecError(
                f"{text!r}: write python:package.module:function, where function(block) returns "
                "a Provider"
            )
        return cls(kind=kind, model=rest or _DEFAULT_MODELS.get(kind), base_url=base_url)

    @property
    def label(self) -> str:
        """How results name this provider: ``kind:model`` (the model is the kind's default
        when none was given)."""
        return self.kind if self.model is None else f"{self.kind}:{self.model}"

    def build(self, block: Block) -> Provider:
        """The provider for one cell (raises ``ProviderError`` for a missing key or SDK)."""
        if self.kind == "python":
            module, _, name = (self.model or "").partition(":")
            factory = getattr(importlib.import_module(module), name)
            return factory(block)
        model = None if self.kind == "builtin" else self.model
        return make_provider(self.kind, block, model=model, base_url=self.base_url)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


class Cell(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    block: str
    provider: ProviderSpec
    seed: int

    @property
    def id(self) -> str:
        return f"{self.block}--{slug(self.provider.label)}--s{self.seed}"


class EvalSpec(BaseModel):
    """The cells of an eval and how each one runs (budgets, sandbox options), plus the metric
    parameters (``ks`` for pass@k, ``ps`` for fast_p)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = 1
    suite: str | None = None  # None: an explicit --blocks list
    blocks: list[str] = Field(min_length=1)
    skipped: list[str] = []  # planned suite blocks that did not exist when the eval started
    block_files: dict[str, str] = {}  # block -> the Python file defining it (--block-file)
    providers: list[ProviderSpec] = Field(min_length=1)
    seeds: int = Field(1, ge=1)
    budgets: dict[str, Any] = {}
    sandbox: dict[str, Any] | None = None  # SandboxOptions; None: the device's defaults
    ks: list[int] = [1]
    ps: list[float] = [1.0, 1.5, 2.0]
    created_at: str = ""

    @field_validator("budgets")
    @classmethod
    def _known_budgets(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            Budgets(**value)
        except TypeError as e:
            raise ValueError(f"unknown budget: {e}") from None
        return value

    def cells(self) -> list[Cell]:
        found = [
            Cell(block=b, provider=p, seed=s)
            for b in self.blocks
            for p in self.providers
            for s in range(self.seeds)
        ]
        ids = [c.id for c in found]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise SpecError(f"two cells share the id {dupes[0]!r}: list each provider once")
        return found

    def budgets_obj(self) -> Budgets:
        return Budgets(**self.budgets)

    def sandbox_options(self) -> SandboxOptions | None:
        return None if self.sandbox is None else SandboxOptions(**self.sandbox)

    def pass_ks(self) -> list[int]:
        """The k of pass@k that ``seeds`` samples can estimate (k ≤ n), 1 always included."""
        return sorted({1, *(k for k in self.ks if 1 <= k <= self.seeds)})
