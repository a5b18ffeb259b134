"""What the rules share while one block is lowered: ``PlanState`` (the Program being built and what
is known about the block graph so far), the ``LoweringOptions`` that vary between candidates,
``NoRule``, the error a rule raises for an op it cannot lower, and ``Unlowered``, the record of
one op the planner left unlowered (``NoRules``, in ``lowering.py``, lists them all).

Rules read and extend a ``PlanState`` through its attributes and methods only; the state knows no
rule.
"""

from __future__ import annotations

import copy
import keyword
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from coda.blocks.block import Block
from coda.blocks.ops import GraphOp, Linear


class NoRule(ValueError):
    """The planner has no rewrite rule for an op of the block graph."""

    def __init__(self, index: int, op: GraphOp, reason: str) -> None:
        self.index, self.op, self.reason = index, op, reason
        super().__init__(f"graph[{index}] {op.op}(out={op.out!r}): no lowering rule — {reason}")


@dataclass(frozen=True)
class Unlowered:
    """One graph op the planner did not lower: graph op ``index`` and why.

    ``after`` is None when a rule could not lower the op itself (``reason``: the rule's text, or
    that no rule exists for its type). Otherwise the op was never judged: it reads a value that
    graph op ``after`` could not produce, or is lowered only together with that op.
    """

    index: int
    op: GraphOp
    reason: str
    after: int | None = None

    def line(self) -> str:
        """``graph[i] op(out='v'): no lowering rule — why`` (or ``not judged — why``)."""
        verdict = "no lowering rule" if self.after is None else "not judged"
        return f"graph[{self.index}] {self.op.op}(out={self.op.out!r}): {verdict} — {self.reason}"

    def to_json(self) -> dict[str, Any]:
        """The record as JSON data (``--json`` and the agent's prompt)."""
        data = {"index": self.index, "op": self.op.op, "out": self.op.out, "reason": self.reason}
        return {**data, "after": self.after} if self.after is not None else data


@dataclass(frozen=True)
class LoweringOptions:
    """Choices the planner can vary between candidates (``planner/search.py`` enumerates them).

    ``gamma``: ``fold`` multiplies a norm's γ into the following weights (prep
    ``fold_norm_weight``); ``side_output`` has the epilogue that produces the norm's input also
    store ``x ⊙ γ`` for the following GEMMs — a norm of a block input then folds; ``rows`` has
    an aux ``norm_rows`` pass write the norm's output ``r ⊙ x ⊙ γ`` itself, which the following
    GEMMs read with their weights as they are and no row scale (``[M, d]`` written per call
    against the fold's ``[N, d]`` read and written: the cheaper one below ``M = 2N``).
    ``stats``: ``epilogue`` writes partial sums of squares where the norm's input is produced;
    ``pass`` has ``rstd`` read the stored tensor once instead.
    ``config``: the mainloop config of every fused gemm (``"auto"`` or a ``MainloopConfig``).
    """

    gamma: Literal["fold", "side_output", "rows"] = "fold"
    stats: Literal["epilogue", "pass"] = "epilogue"
    config: Any = "auto"


def short_name(weight: str) -> str:
    """``w_gate`` / ``gate_proj`` / ``gate_weight`` → ``gate``: the part of a weight's name that
    names steps and side outputs (the full name when the short one is no identifier)."""
    short = re.sub(r"(^w_|_weight$|_proj$)", "", weight)
    return short if short.isidentifier() and not keyword.iskeyword(short) else weight


@dataclass
class PlanState:
    """The Program under construction for ``block`` and what the rules have learnt so far.

    ``prep``/``steps``/``outputs`` become the Program's fields. ``available``: program tensors
    that exist at this point of the schedule (block inputs, stored results, aux outputs).
    ``done``: indices of graph ops already lowered (a rule that absorbs an op marks it).
    ``skipped``: indices of graph ops left unlowered (no epilogue may absorb them later).
    ``partials``: value → the buffer of its row sums of squares, written by the epilogue that
    stored it. ``scaled``: RMSNorm output → the stored ``x ⊙ γ`` its GEMMs read. ``rstd``:
    RMSNorm output → its rstd tensor. ``prepared``: prep memo (``prepare``).
    """

    block: Block
    options: LoweringOptions
    prep: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    available: set[str] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    skipped: set[int] = field(default_factory=set)
    partials: dict[str, str] = field(default_factory=dict)
    scaled: dict[str, str] = field(default_factory=dict)
    rstd: dict[str, str] = field(default_factory=dict)
    prepared: dict[tuple, str] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, block: Block, options: LoweringOptions | None = None) -> PlanState:
        """A fresh state: nothing lowered, the block's inputs available."""
        return cls(block, options or LoweringOptions(), available=set(block.inputs))

    def snapshot(self) -> dict[str, Any]:
        """Everything a rule may change, copied: ``restore`` undoes an op whose rule raised
        ``NoRule`` halfway (after appending an aux step, say), so lowering can go on without it."""
        return {
            f.name: copy.deepcopy(getattr(self, f.name))
            for f in fields(self)
            if f.name not in ("block", "options")
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Back to the state ``snapshot`` was taken in."""
        for name, value in snapshot.items():
            setattr(self, name, value)

    # -- the graph ---------------------------------------------------------------------------------
    def consumers(self, value: str) -> list[tuple[int, GraphOp]]:
        """(index, op) of every graph op reading ``value``, in graph order."""
        return [(i, op) for i, op in enumerate(self.block.graph) if value in op.inputs()]

    def producer(self, value: str) -> tuple[int, GraphOp] | None:
        """(index, op) of the graph op writing ``value``; None for a block input."""
        return next(((i, op) for i, op in enumerate(self.block.graph) if op.out == value), None)

    def only_consumer(self, value: str) -> tuple[int, GraphOp] | None:
        """The single op reading ``value`` when it has exactly one and is no block output."""
        users = self.consumers(value)
        if len(users) != 1 or value in self.block.outputs:
            return None
        return users[0]

    def require_gemm_readers(self, index: int, op: GraphOp, what: str, how: str) -> None:
        """``NoRule`` unless only Linears read ``op``'s output and it is no block output: a norm is
        lowered only into the GEMMs that consume it (``what``: the op as the message names it,
        e.g. "an RMSNorm"; ``how``: the rewrite that applies it there)."""
        others = [(j, c) for j, c in self.consumers(op.out) if not isinstance(c, Linear)]
        if others or op.out in self.block.outputs:
            who = f"{others[0][1].op} (graph[{others[0][0]}])" if others else "a block output"
            raise NoRule(
                index,
                op,
                f"its output {op.out!r} feeds {who}; {what} is lowered only into the GEMMs that "
                f"consume it ({how})",
            )

    # -- the Program -------------------------------------------------------------------------------
    def prepare(self, key: tuple, node: dict[str, Any]) -> str:
        """The output of prep step ``node``, added once per ``key`` (two GEMMs folding the same γ
        into the same weight share one prepared tensor)."""
        if key not in self.prepared:
            self.prep.append(node)
            self.prepared[key] = node["out"]
        return self.prepared[key]

    def step_name(self, weights: list[str]) -> str:
        """A gemm step name from its weights' short names, numbered when taken."""
        base = "_".join(short_name(w) for w in weights)
        taken = {s.get("name") for s in self.steps}
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}{n}"
        return name

    def add_gemm(self, name: str, a: str, b: str, epilogue: list[dict[str, Any]]) -> None:
        """Append a gemm step ``acc = a @ b`` with ``epilogue`` and the options' mainloop config."""
        self.steps.append(
            {
                "kind": "gemm",
                "name": name,
                "a": a,
                "b": b,
                "epilogue": epilogue,
                "config": self.options.config,
            }
        )

    def program_data(self) -> dict[str, Any]:
        """The Program, as the JSON data ``Program.parse`` reads."""
        return {
            "block": self.block.name,
            "inputs": self.block.program_inputs(),
            "prep": self.prep,
            "steps": self.steps,
            "outputs": {o: self.outputs.get(o, o) for o in self.block.outputs},
        }
