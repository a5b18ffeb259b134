"""The rule registry: one ``Rule`` per block-graph op type, registered by subclassing.

A rule module in ``planner/rules/`` defines a subclass of ``Rule`` with ``op = <GraphOp subclass>``
and overrides what its op needs; defining the class registers it (``rules/__init__.py`` imports
every module of the package, so a new rule is a new module and nothing else). What a rule can
answer for its op:

* ``lower(state, index, op)`` — the op is next in graph order and no earlier GEMM absorbed it
  (``Linear`` starts a GEMM, ``RMSNorm`` checks that only GEMMs read it, a ``vjp`` lowers the
  backward schedule). Return False when the op can only be lowered inside an epilogue.
* ``fuse(epilogue, op)`` — emit the op into the epilogue of the GEMM being built (``Add`` as
  ``add_tile``, a row statistic as ``partial_reduce`` plus an aux step). ``sink = True`` marks ops
  whose result is a per-row or per-column statistic rather than a tile.
* ``on_producer_store(state, epilogue, value, op)`` — an epilogue is storing ``value``, which this
  op reads later: add what the op wants from that epilogue (an RMSNorm's partial sums of squares,
  its ``x ⊙ γ`` side output).
* ``differentiate(backward)`` — the backward schedule of a forward block whose graph contains this
  op (the first such op in graph order decides: SwiGLU → the MLP's, Concat → fused QKV's,
  CrossEntropy → the LM head's); ``backward_of`` says which forward blocks that covers.
* ``unlowered(state, op)`` — why the op could not be lowered where it stands (``NoRule``'s text).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from coda.blocks.ops import GraphOp

if TYPE_CHECKING:
    from .backward import BackwardBuilder
    from .epilogue import Epilogue
    from .state import PlanState

NOT_IN_AN_EPILOGUE = (
    "elementwise ops are lowered only inside a GEMM epilogue, and this one follows no "
    "Linear (a standalone elementwise pass has no primitive)"
)


class Rule:
    """The planner's rewrite rule for one op type (``op``); see the module docstring."""

    op: ClassVar[type[GraphOp]]
    sink: ClassVar[bool] = False
    backward_of: ClassVar[str] = ""  # with ``differentiate``: the forward blocks it covers
    differentiates_biases: ClassVar[bool] = False  # with ``differentiate``: biased Linears too
    registry: ClassVar[dict[type[GraphOp], Rule]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        op = cls.__dict__.get("op")
        if op is None:
            raise TypeError(f"rule {cls.__name__} sets no `op` (the GraphOp subclass it lowers)")
        current = Rule.registry.get(op)
        if current is not None and type(current).__qualname__ != cls.__qualname__:
            raise TypeError(
                f"op {op.__name__} already has rule {type(current).__name__}; rule "
                f"{cls.__name__} would replace it (one rule per op type: extend that one)"
            )
        Rule.registry[op] = cls()

    def lower(self, st: PlanState, index: int, op: Any) -> bool:
        """Lower graph op ``index`` where it stands; False: only an epilogue can absorb it."""
        return False

    def fuse(self, ep: Epilogue, op: Any) -> None:
        """Emit ``op`` into epilogue ``ep`` (its inputs are in registers or existing tensors)."""
        raise NotImplementedError(f"{type(self).__name__} has no epilogue rule")

    @property
    def fuses(self) -> bool:
        """Whether this rule can emit its op into an epilogue."""
        return type(self).fuse is not Rule.fuse

    def on_producer_store(self, st: PlanState, ep: Epilogue, value: str, op: Any) -> None:
        """Epilogue ``ep`` stores ``value``, which ``op`` reads later: add what ``op`` wants
        from it (default: nothing)."""
        return None

    def differentiate(self, backward: BackwardBuilder) -> None:
        """Write the backward schedule of ``backward.forward`` (a block containing this op)."""
        raise NotImplementedError(f"{type(self).__name__} has no backward rule")

    @property
    def differentiates(self) -> bool:
        """Whether this rule gives the backward schedule of a forward block containing its op."""
        return type(self).differentiate is not Rule.differentiate

    def unlowered(self, st: PlanState, op: Any) -> str:
        """Why ``op`` could not be lowered where it stands (``NoRule``'s reason)."""
        return NOT_IN_AN_EPILOGUE


def _load_rules() -> None:
    from . import rules  # noqa: F401  (defining the rule classes registers them)


def rule_for(op: GraphOp | type[GraphOp]) -> Rule | None:
    """The rule registered for ``op``'s type (an op or its class), None when there is none."""
    _load_rules()
    return Rule.registry.get(op if isinstance(op, type) else type(op))


def inputs_not_joined(st: PlanState, op: GraphOp) -> str:
    """Why an elementwise op of GEMM results (``Add``, ``SwiGLU``) was not lowered: its inputs
    that no epilogue it could join produces, else the general reason."""
    missing = [v for v in op.inputs() if v not in st.available]
    if missing:
        return (
            f"its inputs {missing} are not produced by a GEMM epilogue it can join; the planner "
            "fuses elementwise ops only into the epilogue of the Linear that produces them"
        )
    return NOT_IN_AN_EPILOGUE


def backward_rules() -> list[Rule]:
    """The rules that differentiate a forward block, in registration order."""
    _load_rules()
    return [r for r in Rule.registry.values() if r.differentiates]
