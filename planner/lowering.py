"""Lower a block's op graph into a GEMM-epilogue Program with CODA's rewrite rules
(docs/algebra.md §1–7).

``lower_partial`` walks the graph in order; each op not yet absorbed by an earlier GEMM is handed
to the rule registered for its type (``registry.Rule``, one module per op in ``rules/``): a
``Linear`` starts a GEMM whose epilogue absorbs every op it can, an ``RMSNorm`` commutes into the
GEMMs that read it, a ``vjp`` lowers a backward schedule from its forward graph.

An op no rule lowers where it stands does not stop the walk: its rule's ``NoRule`` is recorded,
whatever the rule had added is undone, and its output counts as lost, so every later op is judged
on its own — an op that reads a lost value is recorded as not judged, naming the op that could not
produce it. The result (``Lowering``) is the whole Program, or every op left unlowered plus the
``PartialProgram`` of what was lowered; ``lower`` raises ``NoRules`` listing them, so a user's
block file gets one statement of everything the planner cannot lower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coda.blocks.block import Block
from coda.blocks.ops import GraphOp
from coda.primitives.ir import Program

from .registry import rule_for
from .state import LoweringOptions, NoRule, PlanState, Unlowered


@dataclass(frozen=True)
class PartialProgram:
    """The part of a block the rules lowered: ``program`` computes graph values ``computes`` (the
    block outputs it reaches, then the values the unlowered ops read), and ``block`` is the block
    with exactly those outputs, which the sandbox checks it against (``validate`` passes; the
    later stages do too unless an input only the unlowered ops read moves none of ``computes``,
    which the semantics stage's input screen reports). The program keeps the block's name and
    inputs: the rest of the block is written on top of it."""

    program: Program
    block: Block

    @property
    def computes(self) -> list[str]:
        return list(self.program.outputs)


@dataclass(frozen=True)
class Lowering:
    """What the rules made of a block: ``program`` when every op lowered, else ``unlowered`` (in
    graph order) and the ``partial`` Program of the rest (None when nothing was lowered)."""

    program: Program | None
    unlowered: tuple[Unlowered, ...] = ()
    partial: PartialProgram | None = None


class NoRules(NoRule):
    """The planner cannot lower every op of the block: ``unlowered`` lists each op left, in graph
    order, and ``partial`` is the Program of the ops it did lower (or None). ``index``, ``op`` and
    ``reason`` are the first op a rule could not lower, as ``NoRule`` gives them."""

    def __init__(self, unlowered: tuple[Unlowered, ...], partial: PartialProgram | None) -> None:
        first = next(u for u in unlowered if u.after is None)
        self.index, self.op, self.reason = first.index, first.op, first.reason
        self.unlowered, self.partial = unlowered, partial
        if len(unlowered) == 1:
            message = first.line()
        else:
            lines = [f"{len(unlowered)} graph ops are not lowered:"]
            message = "\n  ".join(lines + [u.line() for u in unlowered])
        ValueError.__init__(self, message)

    def to_json(self) -> dict[str, Any]:
        """Every op left and the partial Program (its JSON and what it computes), as data."""
        partial = None
        if self.partial is not None:
            partial = {
                "computes": self.partial.computes,
                "program": self.partial.program.model_dump(mode="json"),
            }
        return {"unlowered": [u.to_json() for u in self.unlowered], "partial_program": partial}


def no_rule_for(op: GraphOp) -> str:
    """``NoRule``'s reason for an op whose type has no rule."""
    return (
        f"no rule for op {op.op!r}: the planner has no rewrite rule for this op type (write the "
        "Program with an LLM provider, or teach the planner with a Rule in planner/rules/)"
    )


def lower(block: Block, options: LoweringOptions | None = None) -> Program:
    """The Program CODA's rules give for ``block``; raises ``NoRules`` (a ``NoRule``) listing
    every op they cannot lower."""
    result = lower_partial(block, options)
    if result.program is None:
        raise NoRules(result.unlowered, result.partial)
    return result.program


def lower_partial(block: Block, options: LoweringOptions | None = None) -> Lowering:
    """Lower every op the rules can; see the module docstring."""
    st, unlowered = _walk(block, options)
    if not unlowered:
        return Lowering(Program.parse(st.program_data()))
    return Lowering(None, unlowered, _partial(st, unlowered))


def refusal(block: Block, options: LoweringOptions | None = None) -> NoRules | None:
    """The ``NoRules`` that ``lower`` would raise for ``block`` (returned, not raised), or None
    when the rules lower it whole — without building that whole Program."""
    st, unlowered = _walk(block, options)
    return NoRules(unlowered, _partial(st, unlowered)) if unlowered else None


def _walk(block: Block, options: LoweringOptions | None) -> tuple[PlanState, tuple[Unlowered, ...]]:
    """Lower the graph in order, past every op that cannot be lowered: the state, and the ops
    left (in graph order)."""
    st = PlanState.start(block, options)
    left: dict[int, Unlowered] = {}
    lost: dict[str, int] = {}  # graph value -> the graph op that could not produce it
    for i, op in enumerate(block.graph):
        if i in st.done or i in left:
            continue
        reads_lost = next((v for v in op.inputs() if v in lost), None)
        if reads_lost is not None:
            j = lost[reads_lost]
            reason = f"it reads {reads_lost!r}, which graph[{j}] could not produce"
            _leave(st, left, lost, Unlowered(i, op, reason, after=j))
            continue
        before = st.snapshot()
        try:
            _lower_op(st, i, op)
        except NoRule as e:
            st.restore(before)
            _record(st, left, lost, i, op, e)
    return st, tuple(left[i] for i in sorted(left))


def _lower_op(st: PlanState, i: int, op: GraphOp) -> None:
    """Lower graph op ``i`` with its rule; ``NoRule`` when it cannot be lowered where it stands."""
    rule = rule_for(op)
    if rule is None:
        raise NoRule(i, op, no_rule_for(op))
    if not rule.lower(st, i, op):
        raise NoRule(i, op, rule.unlowered(st, op))


def _leave(
    st: PlanState, left: dict[int, Unlowered], lost: dict[str, int], record: Unlowered
) -> None:
    """Leave ``record``'s op unlowered: its output is lost, and no later epilogue absorbs it."""
    left.setdefault(record.index, record)
    lost.setdefault(record.op.out, record.index)
    st.done.discard(record.index)
    st.skipped.add(record.index)


def _record(
    st: PlanState, left: dict[int, Unlowered], lost: dict[str, int], i: int, op: GraphOp, e: NoRule
) -> None:
    """Graph op ``i`` raised ``e``, which may name another op (a norm whose input is missing, the
    concat of a fused QKV group): that op is left with ``e``'s reason, and op ``i`` after it."""
    _leave(st, left, lost, Unlowered(e.index, e.op, e.reason))
    if e.index == i:
        return
    if e.op.out in op.inputs():
        reason = f"it reads {e.op.out!r}, which graph[{e.index}] could not produce"
    else:
        reason = f"it is lowered only together with graph[{e.index}], which could not be lowered"
    _leave(st, left, lost, Unlowered(i, op, reason, after=e.index))


def _partial(st: PlanState, unlowered: tuple[Unlowered, ...]) -> PartialProgram | None:
    """The Program of what was lowered, its outputs the block outputs it computes and the values
    the unlowered ops read; None when it computes nothing."""
    if not st.steps:
        return None
    lowered = {op.out for i, op in enumerate(st.block.graph) if i in st.done}
    wanted = [*st.block.outputs, *(v for u in unlowered for v in u.op.inputs())]
    computes = [
        v for v in dict.fromkeys(wanted) if v in lowered and (v in st.available or v in st.outputs)
    ]
    if not computes:
        return None
    data = {**st.program_data(), "outputs": {v: st.outputs.get(v, v) for v in computes}}
    block = st.block.model_copy(update={"outputs": computes})
    return PartialProgram(Program.parse(data), block)
