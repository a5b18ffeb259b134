"""Base classes of the three kinds of IR node, and their automatic registries.

* ``EpilogueOp`` — one primitive applied to the fp32 accumulator tile of a ``GemmEpilogue`` (or to
  values derived from it). Each op declares its dataflow **port** as data and answers three
  questions itself: ``check`` (types and shapes), ``reference`` (PyTorch semantics on whole
  tensors) and ``emit`` (its Triton snippet). Neither the verifier nor codegen switches on op types.
* ``AuxStep`` — a tiny finishing kernel between GEMMs (e.g. ``rstd`` from partial sums of squares).
* ``PrepStep`` — a weight-layout transform run once per weight, not per call.

Subclassing registers a node: its ``op``/``kind`` literal is collected into the discriminated unions
that ``Program`` is built from, so adding a primitive is one module (plus its test).
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict

from .types import TensorInfo

if TYPE_CHECKING:
    from .checking import CheckEnv, ProgramEnv
    from .codegen.context import EmitContext
    from .reference import RefEnv

# Names that would collide with generated code or with the accumulator.
RESERVED = frozenset({"acc", "tl", "triton", "torch", "math"})


def _check_name(name: str) -> str:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(
            f"{name!r} is not a valid name: use letters, digits and '_', not starting with a "
            "digit, and not a Python keyword"
        )
    if len(name) > 64:
        raise ValueError(f"name {name[:20]!r}… is longer than 64 characters")
    return name


Name = Annotated[str, AfterValidator(_check_name)]
"""A tensor or epilogue-value name: a Python identifier, ≤ 64 characters."""


class Node(BaseModel):
    """Common configuration: frozen (hashable, canonical JSON is a cache key), no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Port(str, Enum):
    """How a primitive touches the tile (QuACK's vocabulary): the dataflow port it declares."""

    ROW = "row"  # brings a length-M vector into registers
    COL = "col"  # brings a length-N vector into registers
    TILE = "tile"  # brings an M×N tensor tile into registers
    APPLY = "apply"  # computes new values from values already in registers
    SINK = "sink"  # writes values out (store, partial reductions)


def _literal_default(cls: type[BaseModel], field: str) -> str | None:
    info = cls.model_fields.get(field)
    return info.default if info is not None and isinstance(info.default, str) else None


class EpilogueOp(Node):
    """One primitive in an epilogue. Subclasses set ``op`` (a Literal) and ``port``."""

    registry: ClassVar[dict[str, type[EpilogueOp]]] = {}
    port: ClassVar[Port]

    op: str  # each subclass narrows this to a Literal: the union's discriminator

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        name = _literal_default(cls, "op")
        if name is not None:
            EpilogueOp.registry[name] = cls

    @property
    def name(self) -> str:
        return self.op

    def describe(self) -> str:
        """``swiglu(src='z', out='a')`` — how the op is named in banners and messages."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.model_dump().items() if k != "op")
        return f"{self.name}({args})"

    def check(self, env: CheckEnv) -> None:
        """Type-check against the values and tensors visible here; define what the op produces."""
        raise NotImplementedError

    def reference(self, env: RefEnv) -> None:
        """Apply the op's semantics to whole tensors (the PyTorch reference executor)."""
        raise NotImplementedError

    def emit(self, ctx: EmitContext) -> None:
        """Append the op's Triton lines to the kernel being generated."""
        raise NotImplementedError


@dataclass
class RunEnv:
    """Program tensors while a program runs (either executor), with their analysed types."""

    tensors: dict[str, torch.Tensor]
    infos: dict[str, TensorInfo]
    compute: torch.dtype = torch.float32  # float64 in the exact reference executor
    sizes: dict[str, int] = field(default_factory=dict)  # the binding of the symbolic sizes


class AuxStep(Node):
    """A tiny finishing kernel between GEMMs. Subclasses set ``kind`` (a Literal)."""

    registry: ClassVar[dict[str, type[AuxStep]]] = {}

    kind: str  # each subclass narrows this to a Literal: the step union's discriminator

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        name = _literal_default(cls, "kind")
        if name is not None:
            AuxStep.registry[name] = cls

    def check(self, env: ProgramEnv) -> None:
        raise NotImplementedError

    def reference(self, env: RunEnv) -> None:
        """Compute the step's outputs into ``env.tensors`` with PyTorch (in ``env.compute``)."""
        raise NotImplementedError

    def launch(self, env: RunEnv) -> None:
        """Run the step's Triton kernel into its outputs, already allocated in ``env.tensors``."""
        raise NotImplementedError


class PrepStep(Node):
    """A weight-layout transform, run once per weight. Subclasses set ``kind`` (a Literal)."""

    registry: ClassVar[dict[str, type[PrepStep]]] = {}

    kind: str  # each subclass narrows this to a Literal: the prep union's discriminator

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        name = _literal_default(cls, "kind")
        if name is not None:
            PrepStep.registry[name] = cls

    def check(self, env: ProgramEnv) -> None:
        raise NotImplementedError

    def apply(self, env: RunEnv) -> None:
        """Compute the prepared weight into ``env.tensors`` (PyTorch; both executors share it)."""
        raise NotImplementedError
