"""Backward blocks: the reference of a block's backward pass is autograd of its forward reference.

``backward_block(forward, ...)`` builds a block whose inputs are the forward block's inputs plus the
gradients of (some of) its outputs (``d<output>``), and whose outputs are the gradients of the
differentiable inputs (``d<input>``). Its graph is one ``vjp`` op — run by ``torch.autograd`` on the
forward block's own reference source, which the backward block's source shows in full — and one
``pick`` per gradient. The built-in planner lowers it from the *forward* graph (``coda.planner``,
its ``vjp`` rule): recompute what the backward needs, fuse each pairwise/norm backward into the
epilogue of the GEMM that produces its input, weight gradients on the vendor GEMM.

A residual input that only enters ``out = x + branch`` gets ``dout`` itself as its gradient
(``passthrough``, proved from the forward graph by ``residual_passthrough``): the backward block
has no output for it, and whoever runs the backward hands ``dout`` on — no copy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable  # noqa: F401  (named in vjp's annotation)
from typing import Any, ClassVar, Literal

import torch

from .block import Block, ShapeSets, TensorSpec, Tolerance
from .ops import Add, GraphOp
from .registry import get_block


def vjp(
    forward: "Callable[..., dict[str, torch.Tensor]]",  # noqa: UP037 (shown and exec'd as source)
    inputs: dict[str, torch.Tensor],
    cotangents: dict[str, torch.Tensor],
    wrt: list[str],
) -> dict[str, torch.Tensor]:
    """Gradients of ``Σ_o ⟨forward(**inputs)[o], cotangents[o]⟩`` with respect to the inputs named
    in ``wrt`` (reverse-mode autograd through the forward reference)."""
    with torch.enable_grad():
        leaves = {
            n: t.detach().requires_grad_(n in wrt) if t.is_floating_point() else t
            for n, t in inputs.items()
        }
        outs = forward(**leaves)
        names = list(cotangents)
        grads = torch.autograd.grad(
            [outs[o] for o in names], [leaves[n] for n in wrt], [cotangents[o] for o in names]
        )
    return dict(zip(wrt, grads, strict=True))


class VJP(GraphOp):
    """``out = vjp(forward, inputs, cotangents, wrt)``: a dict of gradients of the forward block's
    inputs, by autograd of its reference."""

    op: Literal["vjp"] = "vjp"
    helper: ClassVar = staticmethod(vjp)
    forward: str  # the forward block's name
    cotangents: dict[str, str]  # forward output -> the input holding its gradient
    wrt: list[str]  # forward inputs to differentiate
    # Forward graph values the backward block also receives (saved by the forward pass so that a
    # program need not recompute them); autograd recomputes them and ignores these inputs.
    saved: list[str] = []
    # Forward inputs no gradient depends on (the bias of a Linear followed only by linear maps:
    # an affine map's derivatives do not see its offset): not inputs of the backward block, the
    # forward runs on zeros in their place (still differentiated when in ``wrt``).
    zeros: list[str] = []
    # Forward inputs whose gradient is the cotangent of a forward output as is (a residual ``x``
    # of ``out = x + branch``, by ``residual_passthrough``): no output of the backward block; the
    # caller hands that cotangent on (input -> output).
    passthrough: dict[str, str] = {}

    def forward_block(self) -> Block:
        return get_block(self.forward)

    def inputs(self) -> list[str]:
        given = [n for n in self.forward_block().inputs if n not in self.zeros]
        return [*given, *self.saved, *self.cotangents.values()]

    def _zero_dims(self, name: str) -> list[tuple[str, int]]:
        """For each dimension of forward input ``name``, a given input and axis of that size."""
        block = self.forward_block()
        found = []
        for dim in block.inputs[name].shape:
            where = next(
                (
                    (n, axis)
                    for n, spec in block.inputs.items()
                    if n not in self.zeros
                    for axis, d in enumerate(spec.shape)
                    if d == dim
                ),
                None,
            )
            if where is None:
                raise ValueError(f"vjp: no given input has the size {dim!r} of zeroed {name!r}")
            found.append(where)
        return found

    def _forward_inputs(self, values: dict[str, Any]) -> dict[str, Any]:
        """The forward block's inputs from ``values``, zeros for ``zeros`` (the dtype and device
        of the first given input)."""
        block = self.forward_block()
        given = {n: values[n] for n in block.inputs if n not in self.zeros}
        like = next(iter(given.values()))
        for name in self.zeros:
            shape = [given[n].shape[axis] for n, axis in self._zero_dims(name)]
            given[name] = like.new_zeros(shape)
        return {n: given[n] for n in block.inputs}

    def derived_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The saved forward values, from the forward reference on the drawn inputs."""
        if not self.saved:
            return {}
        block = self.forward_block()
        values = block.values(self._forward_inputs(inputs))
        return {n: values[n].detach() for n in self.saved}

    def call(self, values: dict[str, Any]) -> Any:
        block = self.forward_block()
        fwd_inputs = self._forward_inputs(values)
        cot = {o: values[g] for o, g in self.cotangents.items()}
        return vjp(lambda **kw: block.reference(kw), fwd_inputs, cot, list(self.wrt))

    def forward_function(self) -> tuple[str, str]:
        """(name, extra source) of the forward function the source differentiates: the block's
        own function (a graph block's source defines it under the block's name), or for a block
        captured from PyTorch a wrapper returning the user's function's outputs by name."""
        block = self.forward_block()
        named = getattr(block, "outputs_function", None)
        return named() if named is not None else (block.name, "")

    def helper_sources(self) -> list[str]:
        forward = self.forward_block().reference_source()
        body = forward.split("\n\n", 1)[1]  # drop the header; the backward source has imports
        wrapper = self.forward_function()[1]
        return [body, *([wrapper] if wrapper else []), inspect.getsource(vjp)]

    def source(self) -> str:
        block = self.forward_block()
        like = next(n for n in block.inputs if n not in self.zeros)
        inputs = ", ".join(
            f"{n}={like}.new_zeros(({self._zeros_shape(n)}))" if n in self.zeros else f"{n}={n}"
            for n in block.inputs
        )
        cot = ", ".join(f"{o}={g}" for o, g in self.cotangents.items())
        fn = self.forward_function()[0]
        line = f"{self.out} = vjp({fn}, dict({inputs}), dict({cot}), wrt={self.wrt!r})"
        if self.saved:
            line += f"  # {', '.join(self.saved)}: saved by the forward pass (autograd recomputes)"
        if self.zeros:
            line += f"  # {', '.join(self.zeros)}: no gradient depends on them"
        for name, output in self.passthrough.items():
            line += f"; d{name} is {self.cotangents[output]} itself"
        return line

    def _zeros_shape(self, name: str) -> str:
        dims = [f"{n}.shape[{axis}]" for n, axis in self._zero_dims(name)]
        return ", ".join(dims) + ("," if len(dims) == 1 else "")

    def matmuls(self, shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, int, int]]:
        """Each forward product ``(M, N, K)`` has a data gradient ``(M, K, N)`` and a weight
        gradient ``(N, K, M)`` (recomputation, if a program needs it, is not counted)."""
        block = self.forward_block()
        sizes = _sizes_from(block, shapes)
        return [p for m, n, k in block.matmuls(sizes) for p in ((m, k, n), (n, k, m))]


class Pick(GraphOp):
    """``out = src[key]``: one gradient out of a ``vjp`` result."""

    op: Literal["pick"] = "pick"
    helper: ClassVar = staticmethod(dict.__getitem__)
    src: str
    key: str

    def inputs(self) -> list[str]:
        return [self.src]

    def call(self, values: dict[str, Any]) -> Any:
        return values[self.src][self.key]

    def helper_sources(self) -> list[str]:
        return []

    def source(self) -> str:
        return f"{self.out} = {self.src}[{self.key!r}]"


def _sizes_from(block: Block, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for name, spec in block.inputs.items():
        for dim, actual in zip(spec.shape, shapes[name], strict=True):
            if isinstance(dim, str):
                sizes[dim] = actual
    return sizes


def _downstream(forward: Block, value: str) -> set[str]:
    """Every graph value computed (transitively) from ``value``."""
    found = {value}
    for op in forward.graph:
        if found.intersection(op.inputs()):
            found.add(op.out)
    return found - {value}


def residual_passthrough(forward: Block, name: str, cotangents: dict[str, TensorSpec]) -> str:
    """The forward output whose gradient is input ``name``'s as is: ``name`` must enter the graph
    once, as an operand of ``out = name + branch`` (an ``Add`` of two different values), with
    ``out`` a block output given a cotangent of ``name``'s dtype and nothing computed from ``out``
    given one — then ``d name = d out`` exactly (an addition's derivative is the identity, and no
    other path reaches a cotangent). ``ValueError`` naming what differs."""
    readers = [op for op in forward.graph if name in op.inputs()]
    if name not in forward.inputs or len(readers) != 1:
        raise ValueError(
            f"passthrough {name!r}: it must be an input of {forward.name!r} that exactly one "
            f"graph op reads (it is read by {[op.out for op in readers]})"
        )
    add = readers[0]
    if not isinstance(add, Add) or add.a == add.b:
        raise ValueError(
            f"passthrough {name!r}: its reader {add.out!r} is a {type(add).__name__}, not an Add "
            "of it and another value (only a residual add passes its gradient through as is)"
        )
    spec = cotangents.get(add.out)
    if add.out not in forward.outputs or spec is None:
        raise ValueError(
            f"passthrough {name!r}: the sum {add.out!r} must be a block output with a cotangent"
        )
    if spec.dtype != forward.inputs[name].dtype:
        raise ValueError(
            f"passthrough {name!r}: the cotangent of {add.out!r} is {spec.dtype}, the input "
            f"{forward.inputs[name].dtype}; its gradient would need a cast"
        )
    reached = sorted(_downstream(forward, add.out) & set(cotangents))
    if reached:
        raise ValueError(
            f"passthrough {name!r}: {reached} are computed from {add.out!r} and have cotangents, "
            f"so {name!r}'s gradient is more than the cotangent of {add.out!r}"
        )
    return add.out


def backward_block(
    forward: Block,
    *,
    name: str,
    cotangents: dict[str, TensorSpec],
    wrt: list[str],
    saved: dict[str, TensorSpec] | None = None,
    shapes: ShapeSets | None = None,
    tolerance: Tolerance | None = None,
    zeros: list[str] | None = None,
    passthrough: list[str] | None = None,
) -> Block:
    """The backward block of ``forward``: inputs = forward inputs, the ``saved`` forward values
    (drawn consistently: computed by the forward reference), and ``d<output>`` for each output in
    ``cotangents`` (with its spec); outputs ``d<input>`` for each input in ``wrt``.

    ``zeros``: forward inputs no gradient depends on (biases of Linears that only linear maps
    follow), left out of the inputs — the sandbox would rightly refuse a block with an input that
    moves no output; the reference runs the forward on zeros in their place. Not with ``saved``
    (a saved value would depend on them).

    ``passthrough``: residual inputs whose gradient is a cotangent as is (``residual_passthrough``
    checks the forward graph): not in ``wrt``, left out of the inputs as ``zeros`` are, and no
    output ``d<input>`` — the caller hands the cotangent on (``VJP.passthrough``), so the backward
    neither copies nor stores it."""
    passing = {n: residual_passthrough(forward, n, cotangents) for n in passthrough or []}
    if set(passing) & set(wrt):
        raise ValueError(
            f"backward_block {name!r}: {sorted(set(passing) & set(wrt))} pass their gradient "
            "through (passthrough); leave them out of wrt"
        )
    zeros = [*(zeros or []), *(n for n in passing if n not in (zeros or []))]
    if zeros and saved:
        raise ValueError(
            f"backward_block {name!r}: saved forward values depend on the inputs {zeros}, so "
            "they cannot be left out (zeros); give either saved or zeros"
        )
    grads = {f"d{o}": spec for o, spec in cotangents.items()}
    saved_specs = {
        n: spec.model_copy(update={"init": "saved"}) for n, spec in (saved or {}).items()
    }
    graph: list[GraphOp] = [
        VJP(
            forward=forward.name,
            cotangents={o: f"d{o}" for o in cotangents},
            wrt=wrt,
            saved=list(saved_specs),
            zeros=list(zeros),
            passthrough=passing,
            out="grads",
        )
    ]
    graph += [Pick(src="grads", key=n, out=f"d{n}") for n in wrt]
    extra = {"tolerance": tolerance} if tolerance is not None else {}
    return Block(
        name=name,
        description=(
            f"Backward of {forward.name}: gradients of {', '.join(wrt)} given the gradients of "
            f"{', '.join(cotangents)} (autograd of the forward reference)."
        ),
        inputs={
            **{n: s for n, s in forward.inputs.items() if n not in zeros},
            **saved_specs,
            **grads,
        },
        graph=graph,
        outputs=[f"d{n}" for n in wrt],
        shapes=shapes or forward.shapes,
        **extra,
    )
