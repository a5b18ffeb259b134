"""The high-level ops a block's graph is written in (``Linear``, ``RMSNorm``, ``SwiGLU``, ``Add``).

Each op names its input and output values, prints its line of the block's reference source, and says
which functional helper it calls. The built-in planner lowers these ops with CODA's rewrite rules;
an op it has no rule for is reported by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from . import functional as fn


class GraphOp(BaseModel):
    """One node of a block graph. Subclasses set ``op`` (a Literal) and ``helper``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    registry: ClassVar[dict[str, type[GraphOp]]] = {}
    helper: ClassVar[Callable[..., Any]]

    op: str
    out: str

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        default = cls.model_fields["op"].default
        if isinstance(default, str):
            GraphOp.registry[default] = cls

    def inputs(self) -> list[str]:
        """Value names this op reads, in call order."""
        raise NotImplementedError

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the helper call (e.g. ``eps``)."""
        return {}

    def call(self, values: dict[str, Any]) -> Any:
        """Apply the helper to ``values`` (tensors by name); used for shape tracing."""
        return self.helper(*[values[n] for n in self.inputs()], **self.kwargs())

    def source(self) -> str:
        """This op's line in the reference source."""
        args = [*self.inputs(), *(f"{k}={v!r}" for k, v in self.kwargs().items())]
        return f"{self.out} = {self.helper.__name__}({', '.join(args)})"


class Linear(GraphOp):
    """``out = x @ weight.T`` (``nn.Linear``, no bias; weight ``[out_features, in_features]``)."""

    op: Literal["linear"] = "linear"
    helper: ClassVar = staticmethod(fn.linear)
    x: str
    weight: str

    def inputs(self) -> list[str]:
        return [self.x, self.weight]


class RMSNorm(GraphOp):
    """``out = rms_norm(x, weight, eps)`` with Hugging Face ``LlamaRMSNorm`` semantics."""

    op: Literal["rmsnorm"] = "rmsnorm"
    helper: ClassVar = staticmethod(fn.rms_norm)
    x: str
    weight: str
    eps: float = Field(1e-6, gt=0)

    def inputs(self) -> list[str]:
        return [self.x, self.weight]

    def kwargs(self) -> dict[str, Any]:
        return {"eps": self.eps}


class SwiGLU(GraphOp):
    """``out = silu(gate) * up``."""

    op: Literal["swiglu"] = "swiglu"
    helper: ClassVar = staticmethod(fn.swiglu)
    gate: str
    up: str

    def inputs(self) -> list[str]:
        return [self.gate, self.up]


class Add(GraphOp):
    """``out = a + b`` (a residual connection)."""

    op: Literal["add"] = "add"
    helper: ClassVar = staticmethod(fn.add)
    a: str
    b: str

    def inputs(self) -> list[str]:
        return [self.a, self.b]
