"""Base classes of the three kinds of IR node, and their automatic registries.

* ``EpilogueOp`` — one primitive applied to the fp32 accumulator tile of a ``GemmEpilogue`` (or to
  values derived from it). Each op declares its dataflow **port** as data and answers three
  questions itself: ``check`` (types and shapes), ``reference`` (PyTorch semantics on whole
  tensors) and ``emit`` (its Triton snippet). Neither the verifier nor codegen switches on op types.
* ``AuxStep`` — a tiny finishing kernel between GEMMs (e.g. ``rstd`` from partial sums of squares).
* ``PrepStep`` — a weight-layout transform of the inputs, run at the start of every call.

Subclassing registers a node: its ``op``/``kind`` literal is collected into the discriminated unions
that ``Program`` is built from, so adding a primitive is one module (plus its test). A node defined
after ``Program`` (a plugin, see ``plugins``) registers the same way; every change to a registry is
announced to listeners (``on_registry_change``), which is how ``ir`` rebuilds its unions. A tag that
is already taken by another class is refused: a plugin can add primitives, never replace one.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict

from .types import TensorInfo

if TYPE_CHECKING:
    from .checking import CheckEnv, ProgramEnv
    from .codegen.context import EmitContext
    from .cute.emit import CuteEmitContext
    from .reference import RefEnv

# Names that would collide with generated code or with the accumulator.
RESERVED = frozenset({"acc", "tl", "triton", "torch", "math"})


# ASCII only: Python folds identifiers by NFKC, so 'ｏ' (U+FF4F) and 'o' are one variable in
# generated code although they are two names in a Program.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BLOCK_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def _check_name(name: str) -> str:
    if not _NAME.fullmatch(name) or keyword.iskeyword(name):
        shown = repr(name) if len(name) <= 40 else repr(name[:37]) + "…"
        raise ValueError(
            f"{shown} is not a valid name: use only the ASCII letters A-Z and a-z, digits and "
            "'_' ([A-Za-z_][A-Za-z0-9_]*), not starting with a digit, and not a Python keyword"
        )
    if len(name) > 64:
        raise ValueError(f"name {name[:20]!r}… is longer than 64 characters")
    return name


def _check_block_name(name: str) -> str:
    if len(name) > 64 or not _BLOCK_NAME.fullmatch(name):
        shown = name if len(name) <= 40 else name[:37] + "..."
        raise ValueError(
            f"{shown!r} is not a valid block name: use at most 64 ASCII letters, digits, '_', "
            "'.' and '-' ([A-Za-z_][A-Za-z0-9_.-]*), as the block is registered"
        )
    return name


Name = Annotated[str, AfterValidator(_check_name)]
"""A tensor or epilogue-value name: an ASCII Python identifier, ≤ 64 characters."""

BlockName = Annotated[str, AfterValidator(_check_block_name)]
"""The name of the block a Program implements: ASCII letters, digits, ``_ . -``, ≤ 64 characters."""


class Node(BaseModel):
    """Common configuration: frozen (hashable, canonical JSON is a cache key), no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Port(StrEnum):
    """How a primitive touches the tile (QuACK's vocabulary): the dataflow port it declares."""

    ROW = "row"  # brings a length-M vector into registers
    COL = "col"  # brings a length-N vector into registers
    TILE = "tile"  # brings an M×N tensor tile into registers
    APPLY = "apply"  # computes new values from values already in registers
    SINK = "sink"  # writes values out (store, partial reductions)


def _literal_default(cls: type[BaseModel], field: str) -> str | None:
    info = cls.model_fields.get(field)
    return info.default if info is not None and isinstance(info.default, str) else None


# -- registries ------------------------------------------------------------------------------------
_LISTENERS: list[Callable[[], None]] = []


def on_registry_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` after every change to a node registry (registration or restore)."""
    _LISTENERS.append(listener)


def _announce() -> None:
    for listener in _LISTENERS:
        listener()


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _register(base: type[Node], cls: type[Node], tag_field: str) -> bool:
    """Add ``cls`` to ``base.registry`` under its ``tag_field`` literal (if it has one).

    Registering the same class again is a no-op; so is re-executing the module that defines it (a
    class with the same qualified name replaces the old one). Another class claiming a taken tag is
    an error: plugins add primitives, they never silently replace one.
    """
    tag = _literal_default(cls, tag_field)
    if tag is None:
        return False  # an abstract family base such as a shared ``_VectorOp``
    registry: dict[str, type[Node]] = base.registry  # type: ignore[attr-defined]
    current = registry.get(tag)
    if current is cls:
        return True
    if current is not None and qualified_name(current) != qualified_name(cls):
        raise TypeError(
            f"{base.__name__} {tag_field}={tag!r} is already registered by "
            f"{qualified_name(current)}; {qualified_name(cls)} must use another {tag_field}"
        )
    registry[tag] = cls
    _announce()
    return True


def register_node(cls: type) -> bool:
    """Register an ``EpilogueOp`` / ``AuxStep`` / ``PrepStep`` subclass that has an ``op``/``kind``
    literal; False for any other class."""
    for base, tag_field in ((EpilogueOp, "op"), (AuxStep, "kind"), (PrepStep, "kind")):
        if isinstance(cls, type) and issubclass(cls, base) and cls is not base:
            return _register(base, cls, tag_field)
    return False


RegistrySnapshot = tuple[dict[str, type], dict[str, type], dict[str, type]]


def snapshot_registries() -> RegistrySnapshot:
    return dict(EpilogueOp.registry), dict(AuxStep.registry), dict(PrepStep.registry)


def restore_registries(snapshot: RegistrySnapshot) -> None:
    """Put the registries back as they were (drops nodes registered since the snapshot)."""
    for registry, saved in zip(
        (EpilogueOp.registry, AuxStep.registry, PrepStep.registry), snapshot, strict=True
    ):
        registry.clear()
        registry.update(saved)
    _announce()


class EpilogueOp(Node):
    """One primitive in an epilogue. Subclasses set ``op`` (a Literal) and ``port``."""

    registry: ClassVar[dict[str, type[EpilogueOp]]] = {}
    port: ClassVar[Port]
    op: str  # each subclass narrows this to a Literal: the union's discriminator

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _register(EpilogueOp, cls, "op")

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

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        """Append the op's lines to a CuTe DSL epilogue (``cute/emit.py``). An op without them
        keeps its step on the Triton kernels."""
        from .cute.emit import CuteUnsupported

        raise CuteUnsupported(f"{self.op} has no CuTe emitter")


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
    # True where ``launch`` does nothing but ``launch_kernel`` calls whose arguments are tensors of
    # ``env`` and values fixed by the tensors' shapes, strides and dtypes: a run plan then replays
    # the recorded launches pinned (``run_plans.record_aux``) instead of calling ``launch`` again.
    # Any step's ``launch``, replayable or not, must at one run signature (the layouts, dtypes
    # and alignments of the tensors it reads) launch the same kernels, grids and meta-parameters
    # on arguments of the same signatures (temporaries it allocates are fresh, hence aligned):
    # a run plan calls a step that is not replayable anew with its launches pinned in order.
    replayable: ClassVar[bool] = False
    # Outputs whose storage may be an input's, {output field: input field}: declared only where
    # the kernel reads each element of that input once and writes the output's element at the
    # same index after reading it, in the same program, and no program reads elements another
    # writes. Whether a run shares is the runtime's decision (``storage_sharing``), not the IR's.
    shares_storage: ClassVar[dict[str, str]] = {}

    kind: str  # each subclass narrows this to a Literal: the step union's discriminator

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _register(AuxStep, cls, "kind")

    def check(self, env: ProgramEnv) -> None:
        raise NotImplementedError

    def reference(self, env: RunEnv) -> None:
        """Compute the step's outputs into ``env.tensors`` with PyTorch (in ``env.compute``)."""
        raise NotImplementedError

    def launch(self, env: RunEnv) -> None:
        """Run the step's Triton kernel into its outputs, already allocated in ``env.tensors``."""
        raise NotImplementedError


class PrepStep(Node):
    """A weight-layout transform, run at the start of every call (chains fused by the runtime).
    Subclasses set ``kind`` (a Literal)."""

    registry: ClassVar[dict[str, type[PrepStep]]] = {}

    kind: str  # each subclass narrows this to a Literal: the prep union's discriminator

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _register(PrepStep, cls, "kind")

    def check(self, env: ProgramEnv) -> None:
        raise NotImplementedError

    def apply(self, env: RunEnv) -> None:
        """Compute the prepared weight into ``env.tensors`` (PyTorch; both executors share it)."""
        raise NotImplementedError
