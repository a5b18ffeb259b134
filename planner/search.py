"""The built-in planner's search: given the Reports so far, which candidate to try next.

The candidates are Programs that CODA's rules give for the block under different
``LoweringOptions`` (``lowering.py``):

* **decompositions** — γ folded into the next weight or stored as a side output by the producing
  epilogue; norm statistics as partial sums in the producing epilogue or one pass over the stored
  tensor. Options that change nothing for a block (e.g. a norm of a block input) give the same
  Program and are tried once. The third γ option, a row pass writing the norm's output
  (``gamma="rows"``), is not searched: with timings every decomposition costs a verify and a
  tuning on the GPU (``synthesize --block llama_mlp`` would take about twice its time); the
  export's MLP Programs use it by its byte count (docs/algebra.md §1).
* **mainloop configs** — explicit tile shapes for every fused GEMM (``TUNING_CONFIGS``).

How it chooses (``PlanSearch.propose``), in order:

1. Until a candidate verifies, try the decompositions one by one; a failure (its Report's stage and
   message) moves on to the next. If none verifies, finish and say how each failed.
2. Once one verifies without timings (a CPU: the profile stage does not measure), stop there:
   nothing could tell a later candidate is faster, and all verified candidates are equally correct.
3. With timings (a GPU): time every decomposition, then every tile config on the fastest one; a
   config that fails to compile prunes the configs needing at least as much shared memory. Finish
   with the fastest verified candidate. When the sandbox tuned the fastest one's mainloop configs
   itself (``SandboxOptions.tune``, the default: its profile rows say ``tuned``), every fused GEMM
   already ran the fastest config of its tuning space at each benchmark shape, whatever config
   the Program named: tile-config candidates would repeat that tuning (and its verify), so the
   search finishes after the decompositions.

Everything is a pure function of the history, so a resumed or replayed run makes the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from coda.blocks.block import Block
from coda.primitives.ir import MainloopConfig, Program

from .lowering import lower
from .state import LoweringOptions, NoRule

# Explicit tiles tried on the fastest decomposition when timings exist (``auto`` is tried first).
# The shapes of Triton's persistent-matmul tutorial configs for Hopper-class GPUs, and one with two
# programs per SM (an epilogue that reduces overlaps the other program's mainloop; see
# bench/RESULTS.md, run 2026-11-30g); which wins depends on the shapes and the epilogue, which is
# why they are measured rather than chosen.
TUNING_CONFIGS: tuple[MainloopConfig, ...] = (
    MainloopConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3),
    MainloopConfig(block_m=256, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    MainloopConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4),
    MainloopConfig(
        block_m=128,
        block_n=128,
        block_k=64,
        group_m=8,
        num_warps=4,
        num_stages=3,
        epilogue_subtiles=2,
        programs_per_sm=2,
    ),
    MainloopConfig(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4),
    MainloopConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4),
)

_GAMMA = ("fold", "side_output")
_STATS = ("epilogue", "pass")


@dataclass(frozen=True)
class Proposal:
    """Submit ``program``; ``label`` names the candidate, ``why`` says why it comes next."""

    program: Program
    options: LoweringOptions
    label: str
    why: str = ""


@dataclass(frozen=True)
class Outcome:
    """What a Report said about a submitted program."""

    program: Program
    verified: bool
    time_ms: float | None = None  # summed over the profiled shapes; None when not measured
    failure: str = ""  # "<stage>: <first line of its message>" when it failed
    tuned: bool = False  # the sandbox tuned its mainloop configs at every profiled shape


@dataclass(frozen=True)
class Finish:
    reason: str


def describe(program: Program) -> str:
    """A short label of the choices a lowered program made."""
    notes = []
    if any(p.kind == "fold_norm_weight" for p in program.prep):
        notes.append("γ folded into the weight")
    if any(op.op == "scale_cols" for s in program.steps if s.kind == "gemm" for op in s.epilogue):
        notes.append("γ stored as a side output")
    normed = {s.out for s in program.steps if s.kind in ("norm_rows", "rms_rows")}
    if any(s.a.tensor in normed for s in program.steps if s.kind == "gemm"):
        notes.append("the norm written by a row pass")
    partials = {
        op.to
        for s in program.steps
        if s.kind == "gemm"
        for op in s.epilogue
        if op.op == "partial_reduce"
    }
    for s in program.steps:
        if s.kind == "rstd":
            where = "epilogue partials" if s.src in partials else "one pass"
            notes.append(f"{s.out} from {where} over {s.src}")
        elif s.kind == "rms_rows":
            notes.append(f"{s.stat_out or 'rstd'} in the row pass over {s.src}")
    configs = {
        "auto" if s.config == "auto" else _config_text(s.config)
        for s in program.steps
        if s.kind == "gemm"
    }
    notes.append("mainloop " + ", ".join(sorted(configs)))
    return "; ".join(notes)


def _config_text(c: MainloopConfig) -> str:
    text = f"{c.block_m}×{c.block_n}×{c.block_k} w{c.num_warps} s{c.num_stages}"
    if c.epilogue_subtiles > 1:
        text += f" e{c.epilogue_subtiles}"
    if c.programs_per_sm > 1:
        text += f" {c.programs_per_sm}/SM"
    return text


def _smem(c: MainloopConfig) -> int:
    """Relative shared memory one program's pipeline needs: (A tile + B tile) × stages (a
    launch fails on what one program needs, however many share the SM)."""
    return (c.block_m + c.block_n) * c.block_k * c.num_stages


class PlanSearch:
    """Proposes candidates for ``block``; raises ``NoRule`` when CODA's rules cannot lower it."""

    def __init__(self, block: Block, configs: tuple[MainloopConfig, ...] = TUNING_CONFIGS) -> None:
        self.block = block
        self.configs = configs
        self.decompositions = self._decompositions()

    def _decompositions(self) -> list[Proposal]:
        found: dict[str, Proposal] = {}
        # order: the default rules first, then γ as a side output, then a stats pass
        for i, (stats, gamma) in enumerate(product(_STATS, _GAMMA)):
            options = LoweringOptions(gamma=gamma, stats=stats)
            try:
                program = lower(self.block, options)
            except NoRule:
                if i == 0:
                    raise  # the default rules cannot lower the block: say which op
                continue
            found.setdefault(
                program.canonical_json(), Proposal(program, options, describe(program))
            )
        return list(found.values())

    def _with_config(self, base: Proposal, config: MainloopConfig) -> Proposal:
        options = replace(base.options, config=config)
        program = lower(self.block, options)
        return Proposal(program, options, describe(program))

    def propose(self, outcomes: list[Outcome]) -> Proposal | Finish:
        """The next candidate, or why the search is over."""
        tried = {o.program.canonical_json(): o for o in outcomes}
        verified = [o for o in outcomes if o.verified]
        untried = [p for p in self.decompositions if p.program.canonical_json() not in tried]
        n = len(self.decompositions)
        if not verified:
            if untried:
                k = n - len(untried) + 1
                why = (
                    "the first candidate: CODA's rewrite rules"
                    if not outcomes
                    else f"the last candidate failed ({outcomes[-1].failure}); next decomposition"
                )
                return replace(untried[0], why=f"{why} ({k} of {n})")
            return Finish(self._no_success(outcomes))
        timed = [o for o in verified if o.time_ms is not None]
        if not timed:
            return Finish(
                f"verified: {describe(verified[0].program)}. Timings are not measured on this "
                "device, so no later candidate could be shown faster; stopping at the first "
                "verified candidate."
            )
        if untried:
            return replace(untried[0], why="time every verified decomposition")
        best = min(timed, key=lambda o: o.time_ms)
        if best.tuned:
            return Finish(
                f"fastest of {len(outcomes)} candidates: {describe(best.program)} at "
                f"{best.time_ms:.3f} ms (summed over the profiled shapes); every decomposition "
                "was timed, and the sandbox tuned each fused GEMM's mainloop config at every "
                "benchmark shape, so explicit tile configs would only repeat that tuning."
            )
        return self._next_config(outcomes, tried, best)

    def _next_config(
        self, outcomes: list[Outcome], tried: dict[str, Outcome], best: Outcome
    ) -> Proposal | Finish:
        base = self._decomposition_of(best)
        pruned = self._pruned(outcomes)
        for config in self.configs:
            if any(_smem(config) >= _smem(bad) for bad in pruned):
                continue
            candidate = self._with_config(base, config)
            if candidate.program.canonical_json() not in tried:
                return replace(
                    candidate,
                    why=f"tile config on the fastest decomposition ({best.time_ms:.3f} ms so far)",
                )
        return Finish(
            f"fastest of {len(outcomes)} candidates: {describe(best.program)} at "
            f"{best.time_ms:.3f} ms (summed over the profiled shapes); every decomposition and "
            "tile config was tried."
        )

    def _decomposition_of(self, outcome: Outcome) -> Proposal:
        """The decomposition a submitted program is (or is a tile config of)."""
        key = outcome.program.canonical_json()
        for base in self.decompositions:
            variants = [base, *(self._with_config(base, c) for c in self.configs)]
            if any(v.program.canonical_json() == key for v in variants):
                return base
        return self.decompositions[0]

    def _pruned(self, outcomes: list[Outcome]) -> list[MainloopConfig]:
        """Explicit configs whose candidates failed to compile (out of resources, typically)."""
        bad = []
        for o in outcomes:
            if o.verified or not o.failure.startswith("compile"):
                continue
            bad += [
                s.config
                for s in o.program.steps
                if s.kind == "gemm" and isinstance(s.config, MainloopConfig)
            ]
        return bad

    def _no_success(self, outcomes: list[Outcome]) -> str:
        lines = [f"none of the {len(outcomes)} candidates verified:"]
        lines += [f"  {describe(o.program)} — {o.failure or 'not verified'}" for o in outcomes]
        return "\n".join(lines)
