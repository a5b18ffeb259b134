"""Where a Program's algebra goes wrong: the node whose repair makes the outputs match.

When the semantics stage finds an output that differs from the block's reference, the output
alone does not say which step is wrong (a residual added twice, an eps that is not the block's,
gate and up in the wrong order all show up as a mismatch of ``out``). ``localize`` looks for the
smallest repair: it tries single-node edits of the Program (``coda.primitives.edits``: remove a
node, swap two tensor fields, flip a choice, insert a row or column scale, change a size
expression or a view's start) and solves for each numeric constant (an ``eps``, a literal of an
expression) by Gauss–Newton on the outputs' residual. The first repair under which every output
matches the block's float64 reference on the failing run — and again at a second shape set, so a
coincidence at one shape does not count — names the node, its field, and the change.

Everything runs in float64 on the CPU at the failing run's sizes: milliseconds per candidate, a
second or two for the largest built-in backward Program, and only when semantics fails.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from coda.blocks.block import Block
from coda.primitives import edits
from coda.primitives.analysis import analyze
from coda.primitives.ir import Program
from coda.primitives.reference import execute_reference, outputs_of

Json = dict[str, Any]
REL_TOL = 1e-9  # as the semantics stage: a repaired program matches to float64 reassociation
SOLVE_TOL = 1e-8  # a solved constant is exact to finite-difference precision
SOLVE_STEPS = 8
_LITERAL = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)")


@dataclass(frozen=True)
class Finding:
    """The repair that makes the outputs match: the JSON path it edits and what it does."""

    path: str
    what: str


@dataclass
class _Run:
    """One semantic run (sizes, float64 inputs, the reference's outputs) to test repairs on."""

    sizes: dict[str, int]
    inputs: dict[str, torch.Tensor]
    want: dict[str, torch.Tensor]

    def residual(self, data: Json) -> torch.Tensor | None:
        """got − want over every output, flattened (None if the Program does not run here)."""
        try:
            program = Program.model_validate(data)  # a candidate, not a submission: no parse
            analyze(program, self.sizes)
            got = outputs_of(program, execute_reference(program, self.inputs, exact=True))
        except Exception:  # noqa: BLE001 - a candidate repair may fail in any way: not this one
            return None
        parts = []
        for name, want in self.want.items():
            if tuple(got[name].shape) != tuple(want.shape):
                return None
            parts.append((got[name].double() - want.double()).flatten())
        return torch.cat(parts)

    def error(self, data: Json) -> float:
        """Relative error of all outputs together (inf if the Program does not run)."""
        r = self.residual(data)
        if r is None or not bool(torch.isfinite(r).all()):
            return float("inf")
        scale = max(
            float(torch.cat([w.double().flatten() for w in self.want.values()]).norm()), 1e-300
        )
        return float(r.norm()) / scale


def localize(program: Program, runs: list[_Run]) -> Finding | None:
    """The first single-node repair that makes every output match on every run, or None."""
    data = program.model_dump(mode="json")
    first = runs[0]
    for cand in _candidates(program, data, first.sizes):
        if all(run.error(cand.program) <= REL_TOL for run in runs):
            return Finding(cand.path, cand.what)
    for path, what, solve in _constants(data):
        found = solve(first)
        if found is not None and all(run.error(found) <= SOLVE_TOL for run in runs[1:]):
            return Finding(path, what(found))
    return None


def make_run(block: Block, sizes: dict[str, int], inputs: dict[str, torch.Tensor]) -> _Run:
    """A run at ``sizes`` on ``inputs`` (float64), with the block's reference outputs."""
    return _Run(dict(sizes), inputs, block.reference(inputs))


def _candidates(program: Program, data: Json, sizes: dict[str, int]) -> Iterator[edits.Candidate]:
    info = analyze(program, sizes)
    tensors = set(info.tensors)
    vectors = [n for n, t in info.tensors.items() if t.partials is None and len(t.shape) == 1]
    size_names = sorted(
        {d for decl in program.inputs.values() for d in decl.shape if isinstance(d, str)}
    )
    yield from edits.removals(data)
    yield from edits.swaps(data, tensors)
    yield from edits.flips(program)
    yield from edits.size_changes(data, size_names)
    for side in ("row", "col"):
        yield from edits.insertions(data, dict.fromkeys(vectors, side))


# -- constants ------------------------------------------------------------------------------------
Solver = Callable[[_Run], Json | None]


def _constants(data: Json) -> Iterator[tuple[str, Callable[[Json], str], Solver]]:
    """``(path, describe, solve)`` for every float field and every literal of an expression."""
    for path, node in edits.nodes(data):
        for key, value in node.items():
            if isinstance(value, float):
                where = f"{path}.{key}"
                yield where, _describe_field(where, node, key), _solver(data, path, key, None)
            elif key.startswith("expr") and isinstance(value, str):
                for k, m in enumerate(_LITERAL.finditer(value)):
                    where = f"{path}.{key}"
                    describe = _describe_literal(where, path, key, m.group(1), k)
                    yield where, describe, _solver(data, path, key, k)


def _describe_field(where: str, node: Json, key: str) -> Callable[[Json], str]:
    def describe(found: Json) -> str:
        value = _value(found, where.rsplit(".", 1)[0], key, None)
        return f"set {where} from {node[key]!r} to {value:.6g} (solved from the block's reference)"

    return describe


def _describe_literal(where: str, path: str, key: str, text: str, k: int) -> Callable[[Json], str]:
    def describe(found: Json) -> str:
        value = _value(found, path, key, k)
        return (
            f"set the constant {text} in {where} to {value:.6g} (solved from the block's reference)"
        )

    return describe


def _value(data: Json, path: str, key: str, k: int | None) -> float:
    node = dict(edits.nodes(data))[path]
    if k is None:
        return float(node[key])
    return float(list(_LITERAL.finditer(node[key]))[k].group(1))


def _with_value(data: Json, path: str, key: str, k: int | None, value: float) -> Json:
    out = copy.deepcopy(data)
    node = dict(edits.nodes(out))[path]
    if k is None:
        node[key] = value
    else:
        m = list(_LITERAL.finditer(node[key]))[k]
        node[key] = node[key][: m.start()] + repr(abs(value)) + node[key][m.end() :]
    return out


def _solver(data: Json, path: str, key: str, k: int | None) -> Solver:
    """Gauss–Newton in one variable: the value of this constant that best fits the reference."""

    def solve(run: _Run) -> Json | None:
        c = _value(data, path, key, k)
        for _ in range(SOLVE_STEPS):
            current = _with_value(data, path, key, k, c)
            r0 = run.residual(current)
            if r0 is None:
                return None
            h = max(abs(c), 1e-12) * 1e-6
            r1 = run.residual(_with_value(data, path, key, k, c + h))
            if r1 is None:
                return None
            jac = (r1 - r0) / h
            denom = float(jac @ jac)
            if denom == 0.0:
                return None
            step = float(jac @ r0) / denom
            c = c - step
            if not c > 0 and (k is not None or key == "eps"):
                return None  # literals are unsigned (a sign is an operator); eps is positive
            if abs(step) <= 1e-12 * abs(c):
                break  # converged
        final = _with_value(data, path, key, k, c)
        return final if run.error(final) <= SOLVE_TOL else None

    return solve
