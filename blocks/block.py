"""The block definition API: a small graph of high-level ops, defined once.

From one ``Block`` come: the PyTorch reference (its *source* is generated from the graph and the
functional helpers, shown to LLMs, and exactly that source is what runs), the seeded input factory
(weights scaled like real models), the shape sets the sandbox verifies and benchmarks at, the FLOP
count, and the graph the built-in planner lowers.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, model_validator

from . import functional
from .ops import GraphOp

InitKind = Literal["activation", "linear_weight", "norm_weight", "index", "saved"]


class TensorSpec(BaseModel):
    """A block input: symbolic shape, dtype class, and how the input factory draws it.

    ``init``: ``activation`` ~ N(0, 1); ``linear_weight`` ~ N(0, 1/in_features) for an ``[out, in]``
    weight (keeps every branch's output O(1), so a dropped branch cannot hide under a residual);
    ``norm_weight`` ~ 1 + N(0, 0.1²) (a trained γ, not all ones); ``index`` ~ U{0, …, high−1};
    ``saved``: a forward activation a backward block receives (e.g. the gate projection), computed
    from the other inputs by the graph op that declares it (``GraphOp.derived_inputs``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    shape: list[str | int]
    dtype: Literal["act", "float32", "int64"] = "act"
    init: InitKind = "activation"
    high: str | None = None
    doc: str = ""


class ShapeSets(BaseModel):
    """Bindings of the block's size names. ``cpu``: verified under the interpreter (keep them small,
    include ragged sizes that are not tile multiples); ``gpu``: bf16 verification on a GPU;
    ``bench``: benchmark shapes."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    cpu: list[dict[str, int]] = Field(min_length=1)
    gpu: list[dict[str, int]] = Field(default_factory=list)
    bench: list[dict[str, int]] = Field(default_factory=list)


class Tolerance(BaseModel):
    """The verification rule (docs/sandbox.md, "verify"), per output and dtype.

    Pass when ``max|out − ref64| ≤ ratio · max|torch − ref64| + floor[dtype] · max|ref64|`` and
    ``‖out − ref64‖ / ‖ref64‖ ≤ rel[dtype]``, where ``torch`` is the block's own PyTorch reference
    run in the same dtype and ``ref64`` the float64 reference.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    ratio: float = 2.0
    floor: dict[str, float] = {"float32": 1e-6, "float16": 2e-4, "bfloat16": 2e-3}
    rel: dict[str, float] = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2.5e-2}


class Block(BaseModel):
    """A target block: named inputs, a graph of ops, named outputs, shapes and tolerances."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    description: str
    inputs: dict[str, TensorSpec]
    graph: list[SerializeAsAny[GraphOp]] = Field(min_length=1)
    outputs: list[str] = Field(min_length=1)
    shapes: ShapeSets
    tolerance: Tolerance = Tolerance()

    @model_validator(mode="after")
    def _well_formed(self) -> Block:
        defined = dict.fromkeys(self.inputs, "input")
        used: set[str] = set()
        for i, op in enumerate(self.graph):
            for name in op.inputs():
                if name not in defined:
                    raise ValueError(
                        f"graph[{i}] ({op.op}) reads {name!r}, which is not defined yet"
                    )
                used.add(name)
            if op.out in defined:
                raise ValueError(f"graph[{i}] ({op.op}) redefines {op.out!r}")
            defined[op.out] = op.op
        for out in self.outputs:
            if out not in defined or defined[out] == "input":
                raise ValueError(f"output {out!r} is not computed by the graph")
        unused = sorted(set(self.inputs) - used)
        if unused:
            raise ValueError(f"inputs {unused} are not used by the graph")
        sizes = {d for spec in self.inputs.values() for d in spec.shape if isinstance(d, str)}
        for group in (self.shapes.cpu, self.shapes.gpu, self.shapes.bench):
            for binding in group:
                missing = sorted(sizes - set(binding))
                if missing:
                    raise ValueError(f"shape set {binding} lacks sizes {missing}")
        return self

    @classmethod
    def from_torch(cls, fn: Any, **kwargs: Any) -> Block:
        """A block captured from a plain PyTorch function of its tensors (activations and
        weights), whose reference is that function: ``Block.from_torch(fn, name=..., inputs={
        param: TensorSpec}, shapes=ShapeSets(...), outputs=[...], description=..., tolerance=...)``.
        The planner's graph is read from the function's torch.export graph; what no block op
        computes stays in it as an ``Opaque`` op (``coda.blocks.capture``)."""
        from .capture import from_torch

        return from_torch(fn, **kwargs)

    # -- the reference ---------------------------------------------------------------------------
    def reference_source(self) -> str:
        """Readable PyTorch source of the block: helper functions, then the block function."""
        helpers: list[str] = []
        for op in self.graph:
            helpers += [h for h in op.helper_sources() if h not in helpers]
        parts = ["import torch", "import torch.nn.functional as F", ""]
        parts += helpers
        args = ", ".join(self.inputs)
        body = [f"def {self.name}({args}):", f'    """{self.description}', ""]
        for name, spec in self.inputs.items():
            shape = ", ".join(map(str, spec.shape))
            note = f" — {spec.doc}" if spec.doc else ""
            body.append(f"    {name}: [{shape}] {spec.dtype}{note}")
        body.append('    """')
        body += [f"    {op.source()}" for op in self.graph]
        outs = ", ".join(f"{o!r}: {o}" for o in self.outputs)
        body.append(f"    return {{{outs}}}")
        return "\n".join(parts) + "\n" + "\n".join(body) + "\n"

    def reference(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the graph on ``inputs`` (any dtype; float64 for the ground truth).

        Each op calls the same helper function whose source ``reference_source`` shows, with the
        same arguments as its source line, so what an LLM reads is what runs.
        """
        values = self.values(inputs)
        return {name: values[name] for name in self.outputs}

    def values(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Every value of the graph (inputs, intermediates, outputs) on ``inputs``."""
        values: dict[str, Any] = {name: inputs[name] for name in self.inputs}
        for op in self.graph:
            values[op.out] = op.call(values)
        return values

    # -- inputs and sizes ------------------------------------------------------------------------
    def shape_of(self, name: str, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else sizes[d] for d in self.inputs[name].shape)

    def make_inputs(
        self,
        sizes: dict[str, int],
        dtype: torch.dtype,
        seed: int,
        device: str | torch.device = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Seeded inputs at ``sizes``; floating ``act`` inputs in ``dtype``."""
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for name in self.independent_inputs():
            shape = self.shape_of(name, sizes)
            out[name] = _draw(self.inputs[name], shape, sizes, gen, dtype).to(device)
        return self.with_derived(out)

    def independent_inputs(self) -> list[str]:
        """Inputs drawn on their own; the others (``init="saved"``) are derived from them."""
        return [n for n, spec in self.inputs.items() if spec.init != "saved"]

    def with_derived(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``inputs`` with every saved input (re)computed from the independent ones, so the set is
        consistent — a saved activation is only meaningful next to the inputs it came from."""
        out = {n: inputs[n] for n in self.independent_inputs()}
        for op in self.graph:
            out.update(op.derived_inputs(out))
        missing = [n for n in self.inputs if n not in out]
        if missing:
            raise ValueError(f"block {self.name!r}: no graph op derives the saved inputs {missing}")
        return {n: out[n] for n in self.inputs}

    def program_inputs(self) -> dict[str, dict[str, Any]]:
        """The ``inputs`` field a Program for this block must carry."""
        return {n: {"shape": list(s.shape), "dtype": s.dtype} for n, s in self.inputs.items()}

    def trace(self, sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """Shapes of every value of the graph at ``sizes`` (runs the reference on meta tensors)."""
        values = {
            n: torch.empty(
                self.shape_of(n, sizes),
                device="meta",
                dtype=torch.int64 if s.dtype == "int64" else torch.float32,
            )
            for n, s in self.inputs.items()
        }
        for op in self.graph:
            values[op.out] = op.call(values)
        return {n: tuple(v.shape) for n, v in values.items() if isinstance(v, torch.Tensor)}

    def matmuls(self, sizes: dict[str, int]) -> list[tuple[int, int, int]]:
        """Every matrix product of one call, as ``(M, N, K)``."""
        shapes = self.trace(sizes)
        return [mnk for op in self.graph for mnk in op.matmuls(shapes)]

    def flops(self, sizes: dict[str, int]) -> int:
        """Matrix-product FLOPs of one call (2·M·N·K per product)."""
        return sum(2 * m * n * k for m, n, k in self.matmuls(sizes))


def _draw(
    spec: TensorSpec,
    shape: tuple[int, ...],
    sizes: dict[str, int],
    gen: torch.Generator,
    dtype: torch.dtype,
) -> torch.Tensor:
    if spec.init == "index":
        high = sizes[spec.high] if spec.high else shape[-1]
        return torch.randint(0, high, shape, generator=gen, dtype=torch.int64)
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if spec.init == "linear_weight":
        x = x / math.sqrt(shape[-1])
    elif spec.init == "norm_weight":
        x = 1.0 + 0.1 * x
    return x.to(torch.float32 if spec.dtype == "float32" else dtype)


__all__ = ["Block", "ShapeSets", "TensorSpec", "Tolerance", "functional"]
