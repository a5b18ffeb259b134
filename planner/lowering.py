"""Lower a block's op graph into a GEMM-epilogue Program with CODA's rewrite rules (CODA_MATH §1–3).

Rules, applied in graph order:

* **GEMM**: every ``Linear`` becomes (part of) a ``gemm`` step ``acc = x @ Wᵀ``.
* **pairwise interleave**: two ``Linear``s of the same input whose outputs meet in a ``SwiGLU``
  become one GEMM over ``interleave_rows(gate, up)`` with ``swiglu`` in its epilogue.
* **row-scale commutation**: a ``Linear`` of ``rmsnorm(x, γ)`` runs on ``x`` itself with
  ``scale_rows(acc, r)``; ``γ`` is folded into the weight (prep ``fold_norm_weight``) and
  ``r = rstd(...)`` is an aux step.
* **statistics from the producer**: when ``x`` is stored by an earlier epilogue, that epilogue also
  writes partial sums of squares and ``rstd`` only finishes them; otherwise (a block input) ``rstd``
  makes one pass over ``x``.
* **γ as a side output** (``LoweringOptions(gamma="side_output")``): when ``x`` is stored by an
  earlier epilogue, that epilogue also stores ``x ⊙ γ`` (``scale_cols``) and the following GEMMs
  read it with their weights unfolded (CODA_MATH §1).
* **residual into the epilogue**: an ``Add`` of the GEMM's result and an available tensor becomes
  ``add_tile``.

An op no rule covers raises ``NoRule`` naming it, so a user's block file gets a clear statement of
what the planner cannot lower.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from coda.blocks.block import Block
from coda.blocks.ops import Add, GraphOp, Linear, RMSNorm, SwiGLU
from coda.primitives.ir import Program

from . import fusion


class NoRule(ValueError):
    """The planner has no rewrite rule for an op of the block graph."""

    def __init__(self, index: int, op: GraphOp, reason: str) -> None:
        self.index, self.op, self.reason = index, op, reason
        super().__init__(f"graph[{index}] {op.op}(out={op.out!r}): no lowering rule — {reason}")


@dataclass(frozen=True)
class LoweringOptions:
    """Choices the planner can vary between candidates (``planner/search.py`` enumerates them).

    ``gamma``: ``fold`` multiplies a norm's γ into the following weights (prep
    ``fold_norm_weight``); ``side_output`` has the epilogue that produces the norm's input also
    store ``x ⊙ γ`` for the following GEMMs — a norm of a block input always folds.
    ``stats``: ``epilogue`` writes partial sums of squares where the norm's input is produced;
    ``pass`` has ``rstd`` read the stored tensor once instead.
    ``config``: the mainloop config of every fused gemm (``"auto"`` or a ``MainloopConfig``).
    """

    gamma: Literal["fold", "side_output"] = "fold"
    stats: Literal["epilogue", "pass"] = "epilogue"
    config: Any = "auto"


@dataclass
class _State:
    block: Block
    options: LoweringOptions
    prep: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    available: set[str] = field(default_factory=set)  # program tensors that exist so far
    done: set[int] = field(default_factory=set)  # graph ops lowered
    partials: dict[str, str] = field(default_factory=dict)  # value -> its sum-of-squares partials
    scaled: dict[str, str] = field(default_factory=dict)  # rmsnorm output -> stored x ⊙ γ
    rstd: dict[str, str] = field(default_factory=dict)  # rmsnorm output -> rstd tensor
    prepared: dict[tuple, str] = field(default_factory=dict)  # prep memo
    outputs: dict[str, Any] = field(default_factory=dict)  # block output -> tensor or view

    def consumers(self, value: str) -> list[tuple[int, GraphOp]]:
        return [(i, op) for i, op in enumerate(self.block.graph) if value in op.inputs()]

    def producer(self, value: str) -> tuple[int, GraphOp] | None:
        return next(((i, op) for i, op in enumerate(self.block.graph) if op.out == value), None)


def lower(block: Block, options: LoweringOptions | None = None) -> Program:
    """The Program CODA's rules give for ``block``; raises ``NoRule`` for an unsupported op."""
    st = _State(block, options or LoweringOptions(), available=set(block.inputs))
    for i, op in enumerate(block.graph):
        if i in st.done:
            continue
        if fusion.handles(st, i, op):  # blocks beyond Linear/RMSNorm/SwiGLU/Add: fusion.py
            continue
        if isinstance(op, Linear):
            _lower_linear(st, i, op)
        elif isinstance(op, RMSNorm):
            _check_norm_feeds_gemms(st, i, op)
        else:
            raise NoRule(i, op, _why_not_fused(st, op))
    data = {
        "block": block.name,
        "inputs": block.program_inputs(),
        "prep": st.prep,
        "steps": st.steps,
        "outputs": {o: st.outputs.get(o, o) for o in block.outputs},
    }
    return Program.parse(data)


def _why_not_fused(st: _State, op: GraphOp) -> str:
    missing = [v for v in op.inputs() if v not in st.available]
    if isinstance(op, Add | SwiGLU) and missing:
        return (
            f"its inputs {missing} are not produced by a GEMM epilogue it can join; the planner "
            "fuses elementwise ops only into the epilogue of the Linear that produces them"
        )
    return (
        "elementwise ops are lowered only inside a GEMM epilogue, and this one follows no "
        "Linear (a standalone elementwise pass has no primitive)"
    )


def _check_norm_feeds_gemms(st: _State, i: int, op: RMSNorm) -> None:
    others = [(j, c) for j, c in st.consumers(op.out) if not isinstance(c, Linear)]
    if others or op.out in st.block.outputs:
        who = f"{others[0][1].op} (graph[{others[0][0]}])" if others else "a block output"
        raise NoRule(
            i,
            op,
            f"its output {op.out!r} feeds {who}; an RMSNorm is lowered only into "
            "the GEMMs that consume it (row-scale commutation)",
        )
    st.done.add(i)


# -- one GEMM --------------------------------------------------------------------------------------
def _pair_of(st: _State, i: int, op: Linear) -> tuple[Linear, Linear, SwiGLU, list[int]] | None:
    """(gate, up, swiglu, op indices) when ``op`` is half of a SwiGLU over one input."""
    users = st.consumers(op.out)
    if len(users) != 1 or not isinstance(users[0][1], SwiGLU):
        return None
    k, glu = users[0]
    other = glu.up if glu.gate == op.out else glu.gate
    found = st.producer(other)
    if (
        found is None
        or not isinstance(found[1], Linear)
        or found[1].x != op.x
        or found[0] in st.done
    ):
        return None
    j, partner = found
    gate, up = (op, partner) if glu.gate == op.out else (partner, op)
    return gate, up, glu, [i, j, k]


def _short(weight: str) -> str:
    short = re.sub(r"(^w_|_weight$|_proj$)", "", weight)
    return short if short.isidentifier() and not keyword.iskeyword(short) else weight


def _step_name(st: _State, weights: list[str]) -> str:
    base = "_".join(_short(w) for w in weights)
    taken = {s.get("name") for s in st.steps}
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}{n}"
    return name


def _prep(st: _State, key: tuple, node: dict[str, Any]) -> str:
    if key not in st.prepared:
        st.prep.append(node)
        st.prepared[key] = node["out"]
    return st.prepared[key]


def _lower_linear(st: _State, i: int, op: Linear) -> None:
    pair = _pair_of(st, i, op)
    if pair is not None:
        gate, up, glu, indices = pair
        weights = [gate.weight, up.weight]
        weight = _prep(
            st,
            ("interleave", gate.weight, up.weight),
            {
                "kind": "interleave_rows",
                "first": gate.weight,
                "second": up.weight,
                "out": f"w_{gate.out}_{up.out}",
            },
        )
        value = f"{gate.out}{up.out}"
    else:
        glu, indices, weights, weight, value = None, [i], [op.weight], op.weight, op.out
    a, scale = _operand(st, i, op, weight)
    if scale is not None:
        weight = scale[1]
    epilogue: list[dict[str, Any]] = []
    cur = "acc"
    if scale is not None:
        epilogue.append({"op": "scale_rows", "src": "acc", "vector": scale[0], "out": value})
        cur = value
    if glu is not None:
        epilogue.append({"op": "swiglu", "src": cur, "out": glu.out})
        cur = value = glu.out
    st.done.update(indices)
    cur, value = _fuse_consumers(st, epilogue, cur, value)
    _store(st, epilogue, cur, value)
    st.steps.append(
        {
            "kind": "gemm",
            "name": _step_name(st, weights),
            "a": a,
            "b": f"{weight}.T",
            "epilogue": epilogue,
            "config": st.options.config,
        }
    )


def _operand(st: _State, i: int, op: Linear, weight: str) -> tuple[str, tuple[str, str] | None]:
    """The A operand, and (rstd tensor, folded weight) when the input is an RMSNorm output."""
    found = st.producer(op.x)
    if found is not None and isinstance(found[1], RMSNorm):
        norm = found[1]
        if norm.x not in st.available:
            raise NoRule(
                found[0], norm, f"its input {norm.x!r} is not materialised before the GEMM"
            )
        r = _ensure_rstd(st, norm)
        if norm.out in st.scaled:
            return st.scaled[norm.out], (r, weight)
        folded = _prep(
            st,
            ("fold", weight, norm.weight),
            {
                "kind": "fold_norm_weight",
                "weight": weight,
                "gamma": norm.weight,
                "out": f"{weight}_folded",
            },
        )
        return norm.x, (r, folded)
    if op.x not in st.available:
        raise NoRule(i, op, f"its input {op.x!r} is not materialised by an earlier step")
    return op.x, None


def _ensure_rstd(st: _State, norm: RMSNorm) -> str:
    if norm.out not in st.rstd:
        src = st.partials.get(norm.x, norm.x)
        out = f"rstd_{norm.out}"
        st.steps.append({"kind": "rstd", "src": src, "eps": norm.eps, "out": out})
        st.rstd[norm.out] = out
    return st.rstd[norm.out]


def _fuse_consumers(
    st: _State, epilogue: list[dict[str, Any]], cur: str, value: str
) -> tuple[str, str]:
    """Fold residual adds of the GEMM's result into its epilogue, as far as they go."""
    while True:
        users = st.consumers(value)
        if len(users) != 1 or value in st.block.outputs:
            return cur, value
        j, user = users[0]
        if not isinstance(user, Add) or j in st.done:
            return cur, value
        other = user.b if user.a == value else user.a
        if other not in st.available:
            return cur, value
        epilogue.append({"op": "add_tile", "src": cur, "tensor": other, "out": user.out})
        st.done.add(j)
        cur = value = user.out


def _store(st: _State, epilogue: list[dict[str, Any]], cur: str, value: str) -> None:
    """Store the chain's result; add partial sums of squares if an RMSNorm reads it later (and
    ``x ⊙ γ`` when γ is a side output)."""
    epilogue.append({"op": "store", "src": cur, "to": value})
    st.available.add(value)
    norms = [c for _, c in st.consumers(value) if isinstance(c, RMSNorm)]
    if norms and st.options.stats == "epilogue":
        partials = f"{value}_sumsq"
        epilogue.append(
            {"op": "partial_reduce", "src": cur, "kind": "sumsq", "axis": "row", "to": partials}
        )
        st.partials[value] = partials
    if st.options.gamma == "side_output":
        for norm in norms:
            scaled = f"{value}_{_short(norm.weight)}"
            epilogue.append({"op": "scale_cols", "src": cur, "vector": norm.weight, "out": scaled})
            epilogue.append({"op": "store", "src": scaled, "to": scaled})
            st.available.add(scaled)
            st.scaled[norm.out] = scaled
