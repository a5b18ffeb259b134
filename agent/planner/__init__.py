"""The built-in planner: CODA rewrite rules that lower a block graph into Programs."""

from .lowering import LoweringOptions, NoRule, lower

__all__ = ["LoweringOptions", "NoRule", "lower"]
