"""coda.planner: the CODA compiler — a block's op graph lowered into a Program by CODA's rewrite
rules (``lower``), one rule per op type in ``rules/`` (``registry.Rule``), and the search that
picks the next candidate from what the sandbox said about the earlier ones (``search``). A block
the rules cannot lower whole is refused with ``NoRules``, which lists every op left unlowered and
carries the ``PartialProgram`` of the rest (``lower_partial`` returns both without raising).

Below it: ``coda.primitives`` (the IR it emits) and ``coda.blocks`` (the graphs it reads). It
imports nothing above it; the search reads sandbox outcomes as plain ``Outcome`` records.
"""

from .lowering import Lowering, NoRules, PartialProgram, lower, lower_partial, refusal
from .registry import Rule, rule_for
from .search import TUNING_CONFIGS, Finish, Outcome, PlanSearch, Proposal, describe
from .state import LoweringOptions, NoRule, PlanState, Unlowered

__all__ = [
    "TUNING_CONFIGS",
    "Finish",
    "Lowering",
    "LoweringOptions",
    "NoRule",
    "NoRules",
    "Outcome",
    "PartialProgram",
    "PlanSearch",
    "PlanState",
    "Proposal",
    "Rule",
    "Unlowered",
    "describe",
    "lower",
    "lower_partial",
    "refusal",
    "rule_for",
]
