"""From an exported aten graph to a block graph: demand-driven matching.

Starting from the function's outputs, each tensor a block value is needed for is matched by the
first recogniser of ``RECOGNISERS`` that reads the subgraph ending at its node as one block op;
the tensors that op reads are then needed in turn. Interior nodes of a match are never values of
their own unless something else needs them. A node no recogniser reads becomes an ``Opaque`` op
(``opaque.py``). ``[M, H, D]`` views are values only through ``heads``: the ``[M, H·D]`` value
they view (also through a ``transpose(0, 1)`` to ``[H, M, D]``), or a head-wise op (``RoPE``,
``HeadRMSNorm``) rooted at them, whose output is flat.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch import fx

from ..ops import GraphOp, Opaque
from . import activations, arith, layout, linear, loss, norms, opaque, rope
from .capture import CaptureError, Traced
from .nodes import Found, op_name, see_through

Recogniser = Callable[[Any, fx.Node], Found | None]

# Tried in order at a node whose value is needed; the first match wins.
RECOGNISERS: list[Recogniser] = [
    norms.rms_norm,
    norms.layer_norm,
    linear.linear,
    loss.cross_entropy,
    activations.activation,
    activations.glu,
    layout.chunk,
    arith.add,
    arith.scale,
]
# Tried at an [M, H, D] node whose flat [M, H·D] value is needed.
HEAD_RECOGNISERS: list[Recogniser] = [norms.head_rms_norm, rope.rope]


class Matcher:
    """The block graph being built: its ops, the value name of each node, and the names taken."""

    def __init__(self, traced: Traced) -> None:
        self.traced = traced
        self.ops: list[GraphOp] = []
        self.names: dict[fx.Node, str] = dict(traced.inputs)
        self.flat: dict[fx.Node, str] = {}
        self.taken: set[str] = set(traced.inputs.values()) | {o for o, _ in traced.outputs}
        self.counts: Counter[str] = Counter()

    # -- values --------------------------------------------------------------------------------
    def value(self, n: fx.Node) -> str:
        """The name of a block value equal to node ``n``, emitting the ops that compute it."""
        n = see_through(n)
        if n in self.names:
            return self.names[n]
        heads = layout.flattened_heads(n)
        if heads is not None and self.can_heads(heads):
            name = self.heads(heads)
        else:
            name = self._recognised(n, RECOGNISERS) or self._opaque(n)
        self.names[n] = name
        return name

    def heads(self, n: fx.Node) -> str:
        """The name of the ``[M, H·D]`` value whose ``[M, H, D]`` view node ``n`` is."""
        n = see_through(n)
        if n in self.flat:
            return self.flat[n]
        src, swapped = layout.heads_source(n), layout.swapped(n)
        if src is not None:
            name: str | None = self.value(src)
        elif swapped is not None:
            name = self.heads(swapped)
        else:
            name = self._recognised(n, HEAD_RECOGNISERS)
        if name is None:
            raise CaptureError(f"no [M, H·D] value for the head view {n.name} that was matched")
        self.flat[n] = name
        return name

    def can_heads(self, n: Any) -> bool:
        """``heads(n)`` would succeed: ``n`` views an ``[M, H·D]`` tensor, or a head-wise op is
        rooted at it."""
        n = see_through(n)
        if n in self.flat or layout.heads_source(n) is not None:
            return True
        swapped = layout.swapped(n)
        if swapped is not None:
            return self.can_heads(swapped)
        return any(r(self, n) is not None for r in HEAD_RECOGNISERS)

    def rows_first(self, n: Any) -> bool:
        """Whether head view ``n`` (``can_heads``) is ``[M, H, D]`` rather than ``[H, M, D]``:
        a view of a flat value is, a ``transpose(0, 1)`` flips it, a head-wise op keeps its
        input's."""
        n = see_through(n)
        if layout.heads_source(n) is not None:
            return True
        swapped = layout.swapped(n)
        if swapped is not None:
            return not self.rows_first(swapped)
        for recognise in HEAD_RECOGNISERS:
            found = recognise(self, n)
            if found is not None:
                return self.rows_first(found.tensors["x"].node)
        return True

    # -- emitting ------------------------------------------------------------------------------
    def _recognised(self, n: fx.Node, recognisers: list[Recogniser]) -> str | None:
        for recognise in recognisers:
            found = recognise(self, n)
            if found is not None:
                return self._emit(found)
        return None

    def _emit(self, found: Found) -> str:
        fields: dict[str, Any] = dict(found.params)
        for field, ref in found.tensors.items():
            fields[field] = self.heads(ref.node) if ref.heads else self.value(ref.node)
        out = self.fresh(found.stem)
        self.ops.append(found.op(out=out, **fields))
        return out

    def _opaque(self, n: fx.Node) -> str:
        tensors = [self.value(t) for t in opaque.tensor_args(n)]
        symbols = self.traced.symbols
        out = self.fresh(op_name(n) or "opaque")
        val = n.meta.get("val")
        self.ops.append(
            Opaque(
                out=out,
                target=opaque.target_of(n),
                tensors=list(dict.fromkeys(tensors)),
                call_text=opaque.call_text(n, self.names, symbols),
                shape=opaque.output_shape(n, symbols),
                dtype=str(getattr(val, "dtype", "")).removeprefix("torch."),
                reason=opaque.reason(n),
            )
        )
        return out

    def fresh(self, stem: str) -> str:
        """A new value name ``stem_k`` (always numbered, so it never equals a field's literal)."""
        while True:
            self.counts[stem] += 1
            name = f"{stem}_{self.counts[stem]}"
            if name not in self.taken:
                self.taken.add(name)
                return name


def build(traced: Traced) -> list[GraphOp]:
    """The block graph of ``traced``: its ops in order, each output under its own name."""
    m = Matcher(traced)
    for _name, node in traced.outputs:
        m.value(node)
    ops = m.ops
    seen: dict[str, str] = {}
    for name, node in traced.outputs:
        current = m.value(node)
        if current in traced.inputs.values():
            raise CaptureError(
                f"output {name!r} is the input {current!r} unchanged: a block output must be "
                "computed; drop it from the outputs"
            )
        if current in seen:
            raise CaptureError(
                f"outputs {seen[current]!r} and {name!r} are the same tensor: return it once"
            )
        seen[current] = name
    for current, name in seen.items():
        ops = [rename(op, current, name) for op in ops]
    return ops


def rename(op: GraphOp, old: str, new: str) -> GraphOp:
    """``op`` with value ``old`` renamed ``new`` (its output, or any tensor it reads)."""
    if old == new:
        return op
    update: dict[str, Any] = {}
    reads = op.inputs()
    for field in type(op).model_fields:
        value = getattr(op, field)
        if value == old and (field == "out" or old in reads):
            update[field] = new
        elif isinstance(value, list) and old in value and old in reads:
            update[field] = [new if v == old else v for v in value]
    if isinstance(op, Opaque) and old in reads:
        update["call_text"] = re.sub(rf"\b{re.escape(old)}\b", new, op.call_text)
    return op.model_copy(update=update)
