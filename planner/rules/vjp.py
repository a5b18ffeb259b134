"""``vjp`` and ``pick``: a backward block is lowered from its forward graph. The first op of the
forward graph whose rule differentiates (``Rule.differentiate``) writes the schedule with a
``BackwardBuilder``; each ``pick`` (one gradient out of the vjp) is lowered with it.
"""

from __future__ import annotations

from coda.blocks.autodiff import VJP, Pick
from coda.blocks.ops import Linear

from ..backward import BackwardBuilder
from ..registry import Rule, backward_rules, rule_for
from ..state import NoRule, PlanState


class VJPRule(Rule):
    op = VJP

    def lower(self, st: PlanState, index: int, op: VJP) -> bool:
        forward = op.forward_block()
        head = next(
            (r for r in map(rule_for, forward.graph) if r is not None and r.differentiates), None
        )
        biased = [f.out for f in forward.graph if isinstance(f, Linear) and f.bias is not None]
        if biased and (head is None or not head.differentiates_biases):
            raise NoRule(
                index,
                op,
                f"forward block {forward.name!r} has biased Linears {biased}: the backward rules "
                "differentiate bias-free Linears only, but for "
                + ", ".join(r.backward_of for r in backward_rules() if r.differentiates_biases)
                + " (drop the bias or write the backward block)",
            )
        if head is None:
            covered = [r.backward_of for r in backward_rules()]
            listed = ", or ".join(
                [", ".join(covered[:-1]), covered[-1]] if covered[1:] else covered
            )
            raise NoRule(
                index,
                op,
                f"no backward rule for forward block {forward.name!r}: the planner differentiates "
                + listed,
            )
        head.differentiate(BackwardBuilder(st, index, op, forward))
        st.done.add(index)
        return True


class PickRule(Rule):
    op = Pick

    def lower(self, st: PlanState, index: int, op: Pick) -> bool:
        st.done.add(index)  # a gradient out of the vjp: lowered with it
        return True
