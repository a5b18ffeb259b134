"""coda.planner: the CODA compiler — a block's op graph lowered into a Program by CODA's rewrite
rules (``lower``), one rule per op type in ``rules/`` (``registry.Rule``), and the search that
picks the next candidate from what the sandbox said about the earlier ones (``search``).

Below it: ``coda.primitives`` (the IR it emits) and ``coda.blocks`` (the graphs it reads). It
imports nothing above it; the search reads sandbox outcomes as plain ``Outcome`` records.
"""

from .lowering import lower
from .registry import Rule, rule_for
from .search import TUNING_CONFIGS, Finish, Outcome, PlanSearch, Proposal, describe
from .state import LoweringOptions, NoRule, PlanState

__all__ = [
    "TUNING_CONFIGS",
    "Finish",
    "LoweringOptions",
    "NoRule",
    "Outcome",
    "PlanSearch",
    "PlanState",
    "Proposal",
    "Rule",
    "describe",
    "lower",
    "rule_for",
]
