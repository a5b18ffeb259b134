"""One GEMM step's epilogue as the rules build it, and how a GEMM is finished: every op that can
run in the epilogue is fused into it (each by its rule's ``fuse``), what something still needs is
stored, and the gemm step and its aux steps are appended to the Program.

An op joins an epilogue when its rule fuses and its inputs are in registers (values this epilogue
computed) or existing tensors, repeatedly, so one GEMM result can feed several consumers (``D``
stored, its row statistic, ``D ⊙ γ``). Ops on existing tensors only join when their result is
tile-shaped here (e.g. ``x̂ ⊙ γ`` next to an RMSNorm backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coda.blocks.ops import GraphOp

from .registry import rule_for
from .shapes import tile_shaped
from .state import NoRule, PlanState


@dataclass
class Epilogue:
    """One gemm step's epilogue: graph values in registers, loads, and aux steps that follow it."""

    st: PlanState
    ops: list[dict[str, Any]] = field(default_factory=list)
    regs: dict[str, str] = field(default_factory=dict)  # graph value -> epilogue value
    computed: list[str] = field(default_factory=list)  # graph values this epilogue computes
    aux: list[dict[str, Any]] = field(default_factory=list)
    # epilogue value -> (a, w, row scale or None) when it is [scale_rows of] acc = a @ w.T: one
    # entry of it per row can then be recomputed from the operands (aux gather_dot)
    products: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)
    loaded: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, value) -> name

    def emit(self, node: dict[str, Any]) -> None:
        self.ops.append(node)

    def define(self, value: str, node: dict[str, Any]) -> None:
        """Emit ``node`` computing graph value ``value`` into an epilogue value of the same name."""
        self.emit({**node, "out": value})
        self.regs[value] = value
        self.computed.append(value)

    def result(self, value: str, reg: str) -> None:
        """Graph value ``value`` is epilogue value ``reg`` (computed here, stored if needed)."""
        self.regs[value] = reg
        self.computed.append(value)

    def _load(self, kind: str, value: str, node: dict[str, Any]) -> str:
        key = (kind, value)
        if key not in self.loaded:
            name = f"{value}_{kind}"
            self.emit({**node, "out": name})
            self.loaded[key] = name
        return self.loaded[key]

    def tile(self, value: str) -> str:
        """The epilogue value holding graph value ``value`` as a tile (loaded if it is a tensor)."""
        if value in self.regs:
            return self.regs[value]
        return self._load("tile", value, {"op": "load_tile", "tensor": value})

    def row(self, value: str) -> str:
        """Row vector ``value`` (one entry per output row), loaded once."""
        return self._load("row", value, {"op": "load_row_vector", "vector": value})

    def col(self, value: str) -> str:
        """Column vector ``value`` (one entry per output column), loaded once."""
        return self._load("col", value, {"op": "load_col_vector", "vector": value})

    def partials(self, src: str, kind: str, to: str, axis: str = "row") -> str:
        """The partials buffer of reduction ``kind`` of epilogue value ``src`` along ``axis``: one
        ``partial_reduce`` per distinct reduction (a cross-entropy and the log-sum-exp of the same
        logits share theirs), named ``to`` when this is the first."""
        for node in self.ops:
            if node["op"] == "partial_reduce" and (node["src"], node["kind"], node["axis"]) == (
                src, kind, axis,
            ):  # fmt: skip
                return node["to"]
        self.emit({"op": "partial_reduce", "src": src, "kind": kind, "axis": axis, "to": to})
        return to


def _fusable(st: PlanState, ep: Epilogue, op: GraphOp, gemm_out: str) -> bool:
    rule = rule_for(op)
    if rule is None or not rule.fuses:
        return False
    inputs = op.inputs()
    if not all(v in ep.regs or v in st.available for v in inputs):
        return False
    if any(v in ep.regs for v in inputs):
        return True
    # Only existing tensors: join this epilogue when the result is a tile of this GEMM's shape.
    return not rule.sink and tile_shaped(st, op.out, gemm_out)


def fuse(st: PlanState, ep: Epilogue, gemm_out: str) -> None:
    """Fuse every op that can run in this epilogue, until none is left."""
    progress = True
    while progress:
        progress = False
        for j, op in enumerate(st.block.graph):
            if j not in st.done and j not in st.skipped and _fusable(st, ep, op, gemm_out):
                rule_for(op).fuse(ep, op)  # type: ignore[union-attr]
                st.done.add(j)
                progress = True


def store_results(st: PlanState, ep: Epilogue) -> None:
    """Store the computed values something still needs (block outputs, later consumers), and let
    each later consumer's rule add what it wants from this epilogue (``on_producer_store``)."""
    for value in ep.computed:
        users = [(j, c) for j, c in st.consumers(value) if j not in st.done]
        if value not in st.block.outputs and not users:
            continue
        ep.emit({"op": "store", "src": ep.regs[value], "to": value})
        st.available.add(value)
        for _, user in users:
            rule = rule_for(user)
            if rule is not None:
                rule.on_producer_store(st, ep, value, user)
    for node in ep.aux:
        st.available.add(node["out"])


def emit_gemm(
    st: PlanState, i: int, ep: Epilogue, a: str, b: str, weights: list[str], gemm_out: str
) -> None:
    """Fuse, store and append the gemm step (graph op ``i``) and its aux steps to the program."""
    fuse(st, ep, gemm_out)
    store_results(st, ep)
    sinks = ("store", "store_rotate_half", "partial_reduce", "select_column")
    if not any(node["op"] in sinks for node in ep.ops):
        if ep.aux and all(node["kind"] == "gather_dot" for node in ep.aux):
            st.steps.extend(ep.aux)  # only single entries of the product are wanted: no GEMM
            return
        raise NoRule(
            i, st.block.graph[i], f"nothing uses {gemm_out!r}: it is no output and feeds no op"
        )
    st.add_gemm(st.step_name(weights), a, b, ep.ops)
    st.steps.extend(ep.aux)
