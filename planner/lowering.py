"""Lower a block's op graph into a GEMM-epilogue Program with CODA's rewrite rules
(docs/algebra.md §1–7).

``lower`` walks the graph in order; each op not yet absorbed by an earlier GEMM is handed to the
rule registered for its type (``registry.Rule``, one module per op in ``rules/``): a ``Linear``
starts a GEMM whose epilogue absorbs every op it can, an ``RMSNorm`` commutes into the GEMMs that
read it, a ``vjp`` lowers a backward schedule from its forward graph. An op no rule lowers where it
stands raises ``NoRule`` naming it and saying why, so a user's block file gets a clear statement of
what the planner cannot lower.
"""

from __future__ import annotations

from coda.blocks.block import Block
from coda.primitives.ir import Program

from .registry import NOT_IN_AN_EPILOGUE, rule_for
from .state import LoweringOptions, NoRule, PlanState


def lower(block: Block, options: LoweringOptions | None = None) -> Program:
    """The Program CODA's rules give for ``block``; raises ``NoRule`` for an unsupported op."""
    st = PlanState.start(block, options)
    for i, op in enumerate(block.graph):
        if i in st.done:
            continue
        rule = rule_for(op)
        if rule is None or not rule.lower(st, i, op):
            raise NoRule(i, op, rule.unlowered(st, op) if rule else NOT_IN_AN_EPILOGUE)
    return Program.parse(st.program_data())
