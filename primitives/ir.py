"""The typed composition API: a ``Program`` of prep steps, GEMM-epilogue kernels and aux steps.

A Program is what an agent writes (as JSON, against ``Program.model_json_schema()``, which its
system prompt renders) and what the sandbox runs. Everything is a frozen pydantic model
with ``extra="forbid"``; its canonical JSON is its cache key. The op, aux and prep unions are
collected from the registries in ``base`` — nothing here lists primitives by hand. They are resolved
whenever a model's schema is built, and the models are rebuilt whenever a registry changes (a plugin
registered a primitive), so parsing and the JSON schema always cover every registered node.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

from pydantic import Field, GetCoreSchemaHandler, ValidationError, field_validator, model_validator
from pydantic_core import CoreSchema

from . import aux, ops, prep  # noqa: F401  (importing registers every node)
from .base import AuxStep, BlockName, EpilogueOp, Name, Node, PrepStep, on_registry_change
from .errors import ProgramError, did_you_mean
from .sizes import SizeExpr
from .sizes import evaluate as evaluate_size
from .types import DtypeClass


def content_hash(text: str) -> str:
    """The first 12 hex digits of the SHA-256 of ``text`` — of a Program's ``canonical_json()``,
    the key it is known by (Reports, the regression store, the export's shipped Programs)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def _union(classes: list[type], discriminator: str) -> Any:
    if len(classes) == 1:
        return classes[0]
    return Annotated[Union[tuple(classes)], Field(discriminator=discriminator)]  # noqa: UP007


class RegistryUnion:
    """Field-type marker: the discriminated union of a registry's classes *when the schema is
    built* (not when this module was imported), so ``rebuild_models`` picks up new nodes."""

    def __init__(self, classes: Callable[[], list[type]], discriminator: str) -> None:
        self.classes = classes
        self.discriminator = discriminator

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return handler.generate_schema(_union(self.classes(), self.discriminator))


EpilogueOpUnion = Annotated[
    EpilogueOp, RegistryUnion(lambda: [*EpilogueOp.registry.values()], "op")
]
PrepUnion = Annotated[PrepStep, RegistryUnion(lambda: [*PrepStep.registry.values()], "kind")]


class Operand(Node):
    """A GEMM operand: a 2-D program tensor, optionally transposed (no copy: strides swap).

    Shorthand in JSON: ``"x"`` or ``"w.T"`` (an ``nn.Linear`` weight ``[out, in]`` as ``B = w.T``).
    """

    tensor: Name
    transpose: bool = False

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            name, dot_t = (value[:-2], True) if value.endswith(".T") else (value, False)
            return {"tensor": name, "transpose": dot_t}
        return value

    def text(self) -> str:
        return f"{self.tensor}.T" if self.transpose else self.tensor


def _power_of_two(low: int, high: int) -> Any:
    def check(v: int) -> int:
        if v < low or v > high or v & (v - 1):
            raise ValueError(f"must be a power of two between {low} and {high}, got {v}")
        return v

    return check


class MainloopConfig(Node):
    """Explicit tiles and launch parameters of a GEMM mainloop (or use ``"auto"``).

    ``block_m/n/k``: output tile and K step; ``group_m``: grouped tile order (L2 reuse);
    ``num_warps``, ``num_stages``: Triton launch parameters; ``epilogue_subtiles``: the epilogue
    runs on 1, 2, 4 or 8 column slices of the tile in turn, each at least 16 columns wide (fewer
    live registers; a reducing epilogue writes one partial per slice);
    ``flatten``: let Triton pipeline across output tiles of the persistent loop;
    ``warp_specialize``: producer and consumer warps for the persistent loop (Triton ≥ 3.4; a config
    that does not compile is pruned);
    ``programs_per_sm``: persistent programs per SM (2: one's epilogue overlaps the other's
    mainloop);
    ``maxnreg``: cap on registers per thread (``None``: the compiler's), so two programs of a
    register-heavy epilogue fit on one SM.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = Field(8, ge=1, le=64)
    num_warps: int = 8
    num_stages: int = Field(3, ge=1, le=8)
    epilogue_subtiles: Literal[1, 2, 4, 8] = 1
    flatten: bool = False
    warp_specialize: bool = False
    programs_per_sm: Literal[1, 2] = 1
    maxnreg: int | None = Field(None, ge=32, le=255)

    _m = field_validator("block_m", "block_n")(_power_of_two(16, 256))
    _k = field_validator("block_k")(_power_of_two(16, 256))
    _w = field_validator("num_warps")(_power_of_two(1, 16))

    @model_validator(mode="after")
    def _subtiles_fit(self) -> MainloopConfig:
        if self.block_n // self.epilogue_subtiles < 16:
            raise ValueError(
                f"block_n={self.block_n} split into {self.epilogue_subtiles} epilogue sub-tiles "
                "leaves fewer than 16 columns each"
            )
        return self

    @property
    def epilogue_block_n(self) -> int:
        """Columns per epilogue sub-tile; partial reductions along rows use this block width."""
        return self.block_n // self.epilogue_subtiles


class GemmEpilogue(Node):
    """One fused kernel: ``acc = A @ B`` in fp32, then the ``epilogue`` ops on each output tile.

    ``A`` is ``[M, K]`` and ``B`` is ``[K, N]`` after their optional transposes. The epilogue starts
    with one value in registers, ``acc`` (the ``[M, N]`` fp32 accumulator tile), and is an ordered
    list of primitives that read values by name and define new ones (single assignment); program
    tensors are written only by sink ops (``store``, ``partial_reduce``). An epilogue that is just
    ``store(src="acc")`` runs on the vendor GEMM (cuBLAS through torch): nothing to fuse.
    """

    kind: Literal["gemm"] = "gemm"
    name: Name | None = None
    a: Operand
    b: Operand
    epilogue: list[EpilogueOpUnion] = Field(min_length=1, max_length=64)  # type: ignore[valid-type]
    config: Literal["auto"] | MainloopConfig = "auto"

    @property
    def is_plain_store(self) -> bool:
        """Only ``store(src='acc', mode='write')``: dispatched to the vendor GEMM."""
        if len(self.epilogue) != 1:
            return False
        only = self.epilogue[0]
        return only.op == "store" and only.src == "acc" and only.mode == "write"


StepUnion = Annotated[
    Node, RegistryUnion(lambda: [GemmEpilogue, *AuxStep.registry.values()], "kind")
]


class TensorDecl(Node):
    """A block input: symbolic shape (size names such as ``M``, ``d``, or integers) and dtype class.

    ``act`` is the run's activation dtype. Shorthand in JSON: a bare shape list ``["M", "d"]``.
    """

    shape: list[Name | int] = Field(max_length=4)
    dtype: DtypeClass = "act"

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"shape": value} if isinstance(value, list | tuple) else value


class OutputView(Node):
    """A block output that is a slice of a program tensor (a view: nothing is copied).

    ``dim`` 0 slices rows, 1 columns; ``start``/``stop`` are size expressions (``stop`` defaults to
    the whole extent) and ``step`` 1 or 2. E.g. the gate and up halves of an interleaved ``[2f, d]``
    weight gradient: ``{"tensor": "dw_gu", "dim": 0, "step": 2}`` and ``{..., "start": "1",
    "step": 2}``; the K part of a fused QKV output: ``{"tensor": "qkv", "dim": 1, "start": "Nq",
    "stop": "Nq + Nkv"}``.
    """

    tensor: Name
    dim: Literal[0, 1] = 0
    start: SizeExpr = "0"
    stop: SizeExpr | None = None
    step: Literal[1, 2] = 1

    def bounds(self, sizes: dict[str, int], extent: int) -> tuple[int, int]:
        """(start, stop) at one binding; raises ``ProgramError`` when they leave the tensor."""
        start = evaluate_size(self.start, sizes, what="output view start")
        stop = extent if self.stop is None else evaluate_size(self.stop, sizes, what="view stop")
        if not 0 <= start < stop <= extent:
            raise ProgramError(
                f"view [{start}:{stop}] of {self.tensor!r} along dim {self.dim} is empty or "
                f"outside its extent {extent}"
            )
        return start, stop

    def cut(self, sizes: dict[str, int], extent: int) -> tuple[int, int, int, tuple]:
        """``(dim, start, length, index)`` at one binding, of a tensor ``extent`` long along
        ``dim``: the view is ``tensor.narrow(dim, start, length)[index]``."""
        start, stop = self.bounds(sizes, extent)
        index = (slice(None),) * self.dim + (slice(None, None, self.step),)
        return self.dim, start, stop - start, index

    def apply(self, tensor: Any, sizes: dict[str, int]) -> Any:
        """The view of ``tensor`` (a torch tensor) at these sizes."""
        dim, start, length, index = self.cut(sizes, tensor.shape[self.dim])
        return tensor.narrow(dim, start, length)[index]


class Program(Node):
    """A GEMM-epilogue program implementing one block.

    ``inputs``: the block's tensors (exactly as the block declares them). ``prep``: weight-layout
    steps, run at the start of every call. ``steps``: ``gemm`` kernels and aux steps, in order;
    each may read inputs, prep results and tensors written by earlier steps. ``outputs``: block
    output name → program tensor that holds it, or an ``OutputView`` (a row or column slice of
    one).
    """

    block: BlockName
    inputs: dict[Name, TensorDecl]
    prep: list[PrepUnion] = Field(default_factory=list, max_length=32)  # type: ignore[valid-type]
    steps: list[StepUnion] = Field(min_length=1, max_length=32)  # type: ignore[valid-type]
    outputs: dict[Name, Name | OutputView] = Field(min_length=1)

    def output_tensor(self, name: str) -> str:
        """The program tensor behind block output ``name``."""
        value = self.outputs[name]
        return value if isinstance(value, str) else value.tensor

    def select_outputs(self, tensors: dict[str, Any], sizes: dict[str, int]) -> dict[str, Any]:
        """The block outputs from program tensors (views applied at ``sizes``)."""
        out = {}
        for name, value in self.outputs.items():
            if isinstance(value, str):
                out[name] = tensors[value]
            else:
                out[name] = value.apply(tensors[value.tensor], sizes)
        return out

    # -- naming ----------------------------------------------------------------------------------
    def step_names(self) -> list[str]:
        """Each step's name: its ``name`` field, or ``<kind><index>``."""
        return [getattr(s, "name", None) or f"{s.kind}{i}" for i, s in enumerate(self.steps)]

    @model_validator(mode="after")
    def _unique_step_names(self) -> Program:
        names = self.step_names()
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"step names must be unique; repeated: {', '.join(dupes)}")
        return self

    # -- serialisation ---------------------------------------------------------------------------
    def canonical_json(self) -> str:
        """Sorted, compact JSON: the cache key of this program (with generator/Triton versions)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def parse(cls, data: str | bytes | dict[str, Any]) -> Program:
        """Validate JSON (text or decoded) into a Program; every problem in one ``ProgramError``."""
        try:
            if isinstance(data, str | bytes):
                return cls.model_validate_json(data)
            return cls.model_validate(data)
        except ValidationError as e:
            raise ProgramError(format_validation_error(e), path=error_path(e)) from None

    def to_python(self) -> str:
        """Builder calls that rebuild this program exactly (for bug reports and transcripts)."""
        from .builder import program_to_python

        return program_to_python(self)


def rebuild_models() -> None:
    """Rebuild the models whose unions come from the registries (after a registry changed).

    A model elsewhere that embeds ``Program`` or ``GemmEpilogue`` copied their schema when it was
    built: rebuild it too, from a listener registered with ``base.on_registry_change``.
    """
    GemmEpilogue.model_rebuild(force=True)
    Program.model_rebuild(force=True)


on_registry_change(rebuild_models)


def _unknown_tag(err: dict[str, Any]) -> str | None:
    """For a node whose ``op``/``kind`` names none of its list's node kinds: that, with the
    closest spelling and every kind listed once (pydantic's message lists them too); else None."""
    ctx = err.get("ctx") or {}
    tag, expected = ctx.get("tag"), ctx.get("expected_tags")
    if err["type"] != "union_tag_invalid" or tag is None or not expected:
        return None
    names = [t.strip().strip("'") for t in str(expected).split(",")]
    field = str(ctx.get("discriminator", "")).strip("'") or "tag"
    return f"unknown {field} {str(tag)!r}: {did_you_mean(str(tag), names)}"


def error_path(e: ValidationError) -> str | None:
    """The JSON path of pydantic's first error (``steps[3].epilogue``): list indices in brackets,
    the union tag pydantic inserts after an element of ``prep``/``steps``/``epilogue`` dropped."""
    errors = e.errors()
    if not errors:
        return None
    loc = list(errors[0]["loc"])
    path = ""
    for k, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif k >= 2 and isinstance(loc[k - 1], int) and loc[k - 2] in _TAGGED_LISTS:
            continue  # the union's tag, not a field
        else:
            path += f".{part}" if path else str(part)
    return path or None


_TAGGED_LISTS = ("prep", "steps", "epilogue")


def format_validation_error(e: ValidationError, limit: int = 12) -> str:
    """Pydantic's errors as ``location: message`` lines an author can act on."""
    lines = []
    for err in e.errors()[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "(program)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (this model does not take it)"
        lines.append(f"{loc}: {_unknown_tag(err) or msg}")
    if len(e.errors()) > limit:
        lines.append(f"... and {len(e.errors()) - limit} more")
    return "invalid program:\n  " + "\n  ".join(lines)
