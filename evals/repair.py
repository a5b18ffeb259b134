"""The repair benchmark: does a sandbox Report point at the node of a Program that is wrong?

An agent repairs a Program from the Report alone, so a Report must say *where* the Program is
wrong, not only that it is. This benchmark measures that offline, without a model and without
running a kernel: for every built-in block it takes the planner's verified Program, applies each
kind of mistake LLMs make (``MUTATIONS``: a wrong eps, gate and up swapped, a missing
``scale_rows``, ...), runs the sandbox's ``validate`` and ``semantics`` stages in-process, and
scores each mutant's Report:

* **caught** — the Report fails at the stage the mutation belongs to (``validate`` for what the
  type rules see, ``semantics`` for wrong algebra);
* **localised** — caught, and the failing stage names the mutated node: its ``loc`` (a JSON path
  into the Program) is the mutated path or lies under it, or its message contains that path.

A mutant that passes both stages computes what the block computes (an equivalent rewrite): it is
counted apart, not against the Report. A mutation that does not apply to a block (no RMSNorm, no
residual, ...) is skipped for it.

Each mutation is a small function ``(program JSON) -> Mutant | None`` that edits the planner's
Program the way a model's mistake would and says where it edited (``Mutant.loc``) and which stage
must catch it. Run ``python -m coda.evals.repair`` for the table (``--blocks a,b`` for a subset).

This is its own module and command rather than an ``eval --suite``: eval suites run the agent
loop over blocks × providers × seeds and verify kernels; this benchmark has no provider, runs no
kernel, and scores Reports, not candidates.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from coda.blocks import builtin_blocks, get_block
from coda.blocks.block import Block
from coda.planner import NoRule, lower
from coda.primitives import edits
from coda.sandbox.report import StageResult
from coda.sandbox.stages import semantics, validate

Json = dict[str, Any]
SEED = 0  # the semantics stage's drawn shapes: fixed, so the benchmark is reproducible


@dataclass(frozen=True)
class Mutant:
    """A mutated Program, where it was mutated (a JSON path) and the stage that must catch it."""

    kind: str
    program: Json
    loc: str
    stage: str  # "validate" | "semantics"


@dataclass
class Outcome:
    """One mutant's Report, scored."""

    block: str
    kind: str
    loc: str
    stage: str
    failed_stage: str | None  # None: the mutant passed validate and semantics
    reported_loc: str | None
    message: str
    caught: bool
    localised: bool

    @property
    def equivalent(self) -> bool:
        return self.failed_stage is None


@dataclass
class Score:
    outcomes: list[Outcome] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # blocks without a planner Program
    seconds: float = 0.0

    def scored(self, kind: str | None = None) -> list[Outcome]:
        return [o for o in self.outcomes if not o.equivalent and (kind is None or o.kind == kind)]

    def share(self, kind: str | None = None) -> float:
        scored = self.scored(kind)
        return sum(o.localised for o in scored) / len(scored) if scored else 1.0

    def kinds(self) -> list[str]:
        return [k for k in MUTATIONS if any(o.kind == k for o in self.outcomes)]

    def table(self) -> str:
        """A Markdown table: per mutation kind, mutants, caught, localised, equivalents."""
        lines = [
            "| mutation | mutants | caught at the right stage | localised | equivalent |",
            "|---|---|---|---|---|",
        ]
        for kind in self.kinds():
            scored = self.scored(kind)
            eq = sum(o.equivalent for o in self.outcomes if o.kind == kind)
            lines.append(
                f"| {kind} | {len(scored)} | {sum(o.caught for o in scored)} | "
                f"{sum(o.localised for o in scored)} ({self.share(kind):.0%}) | {eq} |"
            )
        scored = self.scored()
        eq = sum(o.equivalent for o in self.outcomes)
        lines.append(
            f"| **all** | {len(scored)} | {sum(o.caught for o in scored)} | "
            f"{sum(o.localised for o in scored)} (**{self.share():.1%}**) | {eq} |"
        )
        return "\n".join(lines)


# -- walking Program JSON ------------------------------------------------------------------------
def _first(program: Json, test: Callable[[str, Json], bool]) -> tuple[str, Json] | None:
    return next(((p, n) for p, n in edits.nodes(program) if test(p, n)), None)


def _epilogue_ops(program: Json) -> Iterator[tuple[int, int, Json]]:
    for i, step in enumerate(program["steps"]):
        for j, op in enumerate(step.get("epilogue", [])):
            yield i, j, op


def _readers(program: Json, tensor: str) -> list[str]:
    """Paths of the gemm steps that read ``tensor`` as an operand."""
    return [
        f"steps[{i}]"
        for i, s in enumerate(program["steps"])
        if s.get("kind") == "gemm" and tensor in (s["a"]["tensor"], s["b"]["tensor"])
    ]


# -- the mistakes ---------------------------------------------------------------------------------
def wrong_eps(p: Json) -> Mutant | None:
    """An eps the block does not use (1e-6 for 1e-5, the two common defaults)."""
    hit = _first(p, lambda _, n: isinstance(n.get("eps"), float))
    if hit is None:
        return None
    path, node = hit
    node["eps"] = 1e-5 if node["eps"] == 1e-6 else 1e-6
    return Mutant("wrong_eps", p, f"{path}.eps", "semantics")


def gate_up_swapped(p: Json) -> Mutant | None:
    """Gate and up interleaved in the wrong order (SwiGLU reads (gate, up) pairs)."""
    hit = _first(p, lambda _, n: n.get("kind") == "interleave_rows")
    if hit is None:
        return None
    path, node = hit
    node["first"], node["second"] = node["second"], node["first"]
    return Mutant("gate_up_swapped", p, f"{path}.first", "semantics")


def missing_scale_rows(p: Json) -> Mutant | None:
    """RMSNorm's per-row rstd forgotten: a ``scale_rows`` dropped from an epilogue."""
    for i, j, op in _epilogue_ops(p):
        if op["op"] == "scale_rows":
            step = p["steps"][i]
            edits.rename_after(p, f"steps[{i}].epilogue[{j}]", op["out"], op["src"])
            del step["epilogue"][j]
            return Mutant("missing_scale_rows", p, f"steps[{i}].epilogue[{j}]", "semantics")
    return None


def wrong_tensor_name(p: Json) -> Mutant | None:
    """A tensor an epilogue op reads, misspelled (``x`` → ``x_in``)."""
    for i, j, op in _epilogue_ops(p):
        for key in ("tensor", "vector"):
            if isinstance(op.get(key), str):
                op[key] = op[key] + "_in"
                return Mutant("wrong_tensor_name", p, f"steps[{i}].epilogue[{j}].{key}", "validate")
    return None


def operand_not_transposed(p: Json) -> Mutant | None:
    """An ``nn.Linear`` weight used as ``w`` instead of ``w.T``."""
    for i, step in enumerate(p["steps"]):
        if step.get("kind") != "gemm" or not step["b"]["transpose"]:
            continue
        decl = p["inputs"].get(step["b"]["tensor"])
        if decl is not None and len(set(decl["shape"])) == 2:  # [out, in] with out ≠ in
            step["b"]["transpose"] = False
            return Mutant("operand_not_transposed", p, f"steps[{i}].b.transpose", "validate")
    return None


def missing_store(p: Json) -> Mutant | None:
    """An epilogue that computes a block output but never stores it."""
    outputs = {v if isinstance(v, str) else v["tensor"] for v in p["outputs"].values()}
    for i, j, op in _epilogue_ops(p):
        if op["op"] == "store" and op["to"] in outputs:
            del p["steps"][i]["epilogue"][j]
            return Mutant("missing_store", p, f"steps[{i}].epilogue", "validate")
    return None


def wrong_dtype(p: Json) -> Mutant | None:
    """An intermediate that a later GEMM multiplies stored as float32 instead of the weights'
    dtype."""
    for i, j, op in _epilogue_ops(p):
        if op["op"] == "store" and op["dtype"] == "auto" and _readers(p, op["to"]):
            op["dtype"] = "float32"
            return Mutant("wrong_dtype", p, f"steps[{i}].epilogue[{j}].dtype", "validate")
    return None


def size_off_by_one(p: Json) -> Mutant | None:
    """A size expression one off (``divide_by: "d"`` → ``"d + 1"``)."""
    hit = _first(p, lambda _, n: isinstance(n.get("divide_by"), str))
    if hit is None:
        return None
    path, node = hit
    node["divide_by"] = f"{node['divide_by']} + 1"
    return Mutant("size_off_by_one", p, f"{path}.divide_by", "semantics")


def residual_twice(p: Json) -> Mutant | None:
    """The residual added twice: an ``add_tile`` repeated right after itself."""
    for i, j, op in _epilogue_ops(p):
        if op["op"] == "add_tile":
            step = p["steps"][i]
            again = {**copy.deepcopy(op), "src": op["out"], "out": op["out"] + "_again"}
            edits.rename_after(p, f"steps[{i}].epilogue[{j}]", op["out"], again["out"])
            step["epilogue"].insert(j + 1, again)
            return Mutant("residual_twice", p, f"steps[{i}].epilogue[{j + 1}]", "semantics")
    return None


def gamma_folded_twice(p: Json) -> Mutant | None:
    """γ folded into the weight twice: a second ``fold_norm_weight`` of the folded weight."""
    for k, node in enumerate(p["prep"]):
        if node["kind"] == "fold_norm_weight":
            again = {**node, "weight": node["out"], "out": node["out"] + "_again"}
            edits.rename_after(p, f"prep[{k}]", node["out"], again["out"])
            p["prep"].insert(k + 1, again)
            return Mutant("gamma_folded_twice", p, f"prep[{k + 1}]", "semantics")
    return None


def reduction_wrong_axis(p: Json) -> Mutant | None:
    """A partial reduction along the other axis (``row`` ↔ ``col``)."""
    for i, j, op in _epilogue_ops(p):
        if op["op"] == "partial_reduce" and op["kind"] == "sum":
            op["axis"] = "col" if op["axis"] == "row" else "row"
            return Mutant("reduction_wrong_axis", p, f"steps[{i}].epilogue[{j}].axis", "validate")
    return None


_LITERAL = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)")


def constant_changed(p: Json) -> Mutant | None:
    """One constant of an elementwise expression changed (``1 - s`` → ``2 - s``)."""
    for i, j, op in _epilogue_ops(p):
        for key in sorted(k for k in op if k.startswith("expr")):
            expr = op[key]
            found = _LITERAL.search(expr or "")
            if found:
                value = float(found.group(1))
                new = "2" if value == 1 else repr(value * 2)
                op[key] = expr[: found.start()] + new + expr[found.end() :]
                return Mutant("constant_changed", p, f"steps[{i}].epilogue[{j}].{key}", "semantics")
    return None


def view_start_shifted(p: Json) -> Mutant | None:
    """A strided output view on the wrong offset (``start: "1"`` ↔ ``"0"``): the gate half of a
    de-interleaved result taken for the up half, or the reverse."""
    for name, value in p["outputs"].items():
        if isinstance(value, dict) and value.get("step") not in (None, 1):
            start = value.get("start") or "0"
            value["start"] = "1" if start == "0" else "0"
            return Mutant("view_start_shifted", p, f"outputs.{name}.start", "semantics")
    return None


def operands_swapped(p: Json) -> Mutant | None:
    """A GEMM's operands in the wrong order (``W @ x`` for ``x @ Wᵀ``)."""
    for i, step in enumerate(p["steps"]):
        if step.get("kind") == "gemm":
            step["a"], step["b"] = step["b"], step["a"]
            return Mutant("operands_swapped", p, f"steps[{i}].a", "validate")
    return None


MUTATIONS: dict[str, Callable[[Json], Mutant | None]] = {
    f.__name__: f
    for f in (
        wrong_eps,
        gate_up_swapped,
        missing_scale_rows,
        wrong_tensor_name,
        operand_not_transposed,
        missing_store,
        wrong_dtype,
        size_off_by_one,
        residual_twice,
        gamma_folded_twice,
        reduction_wrong_axis,
        constant_changed,
        view_start_shifted,
        operands_swapped,
    )
}


# -- scoring --------------------------------------------------------------------------------------
def _components(path: str) -> list[str]:
    return [c for c in re.split(r"\.|(?=\[)", path) if c]


def names(reported: str | None, message: str, expected: str) -> bool:
    """Does a failed stage name ``expected``: its ``loc`` at or under that path, or the path in
    its message?"""
    if reported is not None:
        want = _components(expected)
        if _components(reported)[: len(want)] == want:
            return True
    return expected in message


def run_mutant(mutant: Mutant, block: Block) -> Outcome:
    """validate + semantics on one mutant, in-process; the first failing stage scored."""
    results: list[StageResult] = []
    program, _ = validate(mutant.program, block, block.shapes.cpu, results)
    if program is not None:
        semantics(program, block, block.shapes.cpu, results, seed=SEED)
    failed = next((r for r in results if r.status == "failed"), None)
    caught = failed is not None and failed.stage == mutant.stage
    return Outcome(
        block=block.name,
        kind=mutant.kind,
        loc=mutant.loc,
        stage=mutant.stage,
        failed_stage=failed.stage if failed else None,
        reported_loc=failed.loc if failed else None,
        message=failed.message if failed else "",
        caught=caught,
        localised=caught and names(failed.loc, failed.message, mutant.loc),
    )


def mutants(block: Block) -> list[Mutant]:
    """Every mutation that applies to the planner's Program for ``block``."""
    base = lower(block).model_dump(mode="json")
    made = (mutate(copy.deepcopy(base)) for mutate in MUTATIONS.values())
    return [m for m in made if m is not None]


def run(blocks: list[str] | None = None) -> Score:
    """The benchmark over ``blocks`` (default: every built-in block)."""
    score = Score()
    start = time.perf_counter()
    for block in [get_block(n) for n in blocks] if blocks else builtin_blocks():
        try:
            made = mutants(block)
        except NoRule:
            score.skipped.append(block.name)  # a registered block the planner cannot lower
            continue
        score.outcomes += [run_mutant(m, block) for m in made]
    score.seconds = time.perf_counter() - start
    return score


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coda.evals.repair", description=__doc__)
    parser.add_argument("--blocks", help="a,b,c (default: every built-in block)")
    parser.add_argument("--misses", action="store_true", help="print every mutant not localised")
    parser.add_argument("--json", action="store_true", help="print every outcome as JSON lines")
    args = parser.parse_args(argv)
    score = run(args.blocks.split(",") if args.blocks else None)
    if args.json:
        for o in score.outcomes:
            print(json.dumps(dataclasses.asdict(o)))
        return 0
    print(score.table())
    skipped = f"; skipped (no planner Program): {score.skipped}" if score.skipped else ""
    print(f"\n{len(score.outcomes)} mutants in {score.seconds:.1f} s{skipped}")
    if args.misses:
        for o in score.scored():
            if not o.localised:
                print(
                    f"\n{o.block} {o.kind} at {o.loc} (want {o.stage}): failed at "
                    f"{o.failed_stage}, loc {o.reported_loc}\n  {o.message[:400]}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
