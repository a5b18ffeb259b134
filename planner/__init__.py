"""The built-in planner: CODA rewrite rules that lower a block graph into Programs
(``lowering``), and the search that picks the next candidate from the Reports so far (``search``).
"""

from .lowering import LoweringOptions, NoRule, lower
from .search import TUNING_CONFIGS, Finish, Outcome, PlanSearch, Proposal, describe

__all__ = [
    "TUNING_CONFIGS",
    "Finish",
    "LoweringOptions",
    "NoRule",
    "Outcome",
    "PlanSearch",
    "Proposal",
    "describe",
    "lower",
]
