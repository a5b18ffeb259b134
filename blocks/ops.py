"""The high-level ops a block's graph is written in (``Linear``, ``RMSNorm``, ``HeadRMSNorm``,
``LayerNorm``, ``SwiGLU``, ``GLU``, ``Activation``, ``Add``, ``Scale``, ``Chunk``, ``RoPE``), and
``Opaque``: a node of a block captured from PyTorch that no block op computes.

Each op names its input and output values, prints its line of the block's reference source, and says
which functional helper it calls. The built-in planner lowers these ops with CODA's rewrite rules;
an op it has no rule for is reported by name.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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

    def derived_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Block inputs of init ``saved`` this op computes from the drawn ones (default: none)."""
        return {}

    def helper_sources(self) -> list[str]:
        """Source text the block's reference shows for this op: its helper function (after
        ``upcast`` when the helper uses it)."""
        source = inspect.getsource(self.helper)
        return ([inspect.getsource(fn.upcast)] if "upcast(" in source else []) + [source]

    def matmuls(self, shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, int, int]]:
        """The matrix products this op performs, as ``(M, N, K)`` (for FLOPs and the GEMMs-alone
        baseline); elementwise ops have none."""
        return []

    def source(self) -> str:
        """This op's line in the reference source."""
        args = [*self.inputs(), *(f"{k}={v!r}" for k, v in self.kwargs().items())]
        return f"{self.out} = {self.helper.__name__}({', '.join(args)})"


class Linear(GraphOp):
    """``out = x @ weight.T (+ bias)`` (``nn.Linear``; weight ``[out_features, in_features]``,
    bias ``[out_features]`` or None)."""

    op: Literal["linear"] = "linear"
    helper: ClassVar = staticmethod(fn.linear)
    x: str
    weight: str
    bias: str | None = None

    def inputs(self) -> list[str]:
        return [self.x, self.weight] + ([self.bias] if self.bias is not None else [])

    def matmuls(self, shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, int, int]]:
        x, w = shapes[self.x], shapes[self.weight]
        return [(math.prod(x[:-1]), w[0], w[1])]


class _RMSFields(GraphOp):
    """The fields of an RMSNorm: ``x``, ``weight``, ``eps``, and the weight ``offset`` and
    ``cast`` order of the family (``functional.rms_norm``)."""

    x: str
    weight: str
    eps: float = Field(1e-6, gt=0)
    offset: float = Field(0.0, allow_inf_nan=False)
    cast: Literal["before_weight", "after_weight"] = "before_weight"

    def inputs(self) -> list[str]:
        return [self.x, self.weight]

    def kwargs(self) -> dict[str, Any]:
        """``eps``, and ``offset`` / ``cast`` where they differ from Llama's."""
        extra = {"offset": self.offset} if self.offset else {}
        if self.cast != "before_weight":
            extra["cast"] = self.cast
        return {"eps": self.eps, **extra}


class RMSNorm(_RMSFields):
    """``out = rms_norm(x, weight, eps)``: ``x̂ · (offset + weight)`` with ``x̂ = x / rms(x)``.

    The defaults are Hugging Face ``LlamaRMSNorm`` (``offset=0``, ``x̂`` cast to x's dtype before
    the weight multiplies it); ``offset=1.0, cast="after_weight"`` is ``GemmaRMSNorm`` (``x̂ · (1 +
    γ)`` formed in fp32, cast once after).
    """

    op: Literal["rmsnorm"] = "rmsnorm"
    helper: ClassVar = staticmethod(fn.rms_norm)


class LayerNorm(GraphOp):
    """``out = layer_norm(x, weight, bias, eps)``: ``nn.LayerNorm`` (GPT-2's ``ln_1``/``ln_2``),
    ``bias`` None for a LayerNorm without one."""

    op: Literal["layernorm"] = "layernorm"
    helper: ClassVar = staticmethod(fn.layer_norm)
    x: str
    weight: str
    bias: str | None = None
    eps: float = Field(1e-5, gt=0)

    def inputs(self) -> list[str]:
        return [self.x, self.weight] + ([self.bias] if self.bias is not None else [])

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


ActivationKind = Literal[
    "gelu", "gelu_tanh", "quick_gelu", "relu2", "relu", "silu", "sigmoid", "tanh", "softcap"
]
GLUActivation = Literal[
    "gelu", "gelu_tanh", "quick_gelu", "relu2", "relu", "silu", "sigmoid", "tanh"
]


class Activation(GraphOp):
    """``out = act(x)`` elementwise (``functional.activation``: Hugging Face's ``ACT2FN``
    semantics); ``softcap`` is ``cap · tanh(x / cap)`` and needs ``cap``."""

    op: Literal["activation"] = "activation"
    helper: ClassVar = staticmethod(fn.activation)
    x: str
    kind: ActivationKind
    cap: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _cap_with_softcap(self) -> Activation:
        if (self.kind == "softcap") != (self.cap is not None):
            raise ValueError(
                f"activation {self.kind!r}: cap is required by softcap and only by it "
                f"(got cap={self.cap!r})"
            )
        return self

    def inputs(self) -> list[str]:
        return [self.x]

    def kwargs(self) -> dict[str, Any]:
        return {"kind": self.kind} | ({"cap": self.cap} if self.cap is not None else {})


class GLU(GraphOp):
    """``out = act(gate) * up``: a gated linear unit (GeGLU with ``gelu_tanh``, as Gemma; SwiGLU
    with ``silu``)."""

    op: Literal["glu"] = "glu"
    helper: ClassVar = staticmethod(fn.glu)
    gate: str
    up: str
    act: GLUActivation

    def inputs(self) -> list[str]:
        return [self.gate, self.up]

    def kwargs(self) -> dict[str, Any]:
        return {"act": self.act}


class Add(GraphOp):
    """``out = a + b`` (a residual connection)."""

    op: Literal["add"] = "add"
    helper: ClassVar = staticmethod(fn.add)
    a: str
    b: str

    def inputs(self) -> list[str]:
        return [self.a, self.b]


class Scale(GraphOp):
    """``out = x * factor`` for a constant ``factor`` (Gemma's ``hidden * sqrt(d)`` embedding
    normaliser, a ``1/sqrt(D)`` scaling)."""

    op: Literal["scale"] = "scale"
    helper: ClassVar = staticmethod(fn.scale)
    x: str
    factor: float = Field(allow_inf_nan=False)

    def inputs(self) -> list[str]:
        return [self.x]

    def kwargs(self) -> dict[str, Any]:
        return {"factor": self.factor}


class Chunk(GraphOp):
    """``out = x.chunk(chunks, dim=-1)[index]``: one equal part of a concatenated projection
    (Phi-3's ``gate_up_proj``: gate is part 0 of 2, up part 1)."""

    op: Literal["chunk"] = "chunk"
    helper: ClassVar = staticmethod(fn.chunk)
    x: str
    chunks: int = Field(ge=2, le=64)
    index: int = Field(ge=0)

    @model_validator(mode="after")
    def _index_in_range(self) -> Chunk:
        if self.index >= self.chunks:
            raise ValueError(f"chunk index {self.index} is not below chunks={self.chunks}")
        return self

    def inputs(self) -> list[str]:
        return [self.x]

    def kwargs(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "index": self.index}


class RoPE(GraphOp):
    """``out = rope(x, cos, sin)``: Hugging Face's ``apply_rotary_pos_emb`` on ``x`` ``[M,
    heads·D]`` (heads concatenated) with cos/sin tables ``[M, D]``, in Hugging Face's rotate-half
    column order."""

    op: Literal["rope"] = "rope"
    helper: ClassVar = staticmethod(fn.rope)
    x: str
    cos: str
    sin: str

    def inputs(self) -> list[str]:
        return [self.x, self.cos, self.sin]

    def helper_sources(self) -> list[str]:
        return [inspect.getsource(fn.rotate_half), inspect.getsource(fn.rope)]


class HeadRMSNorm(_RMSFields):
    """``out = head_rms_norm(x, weight, eps)``: RMSNorm over each head of ``x`` ``[M, heads·D]``
    separately, weight ``[D]`` shared by the heads (Qwen3's and Gemma 3's ``q_norm``/``k_norm``;
    ``offset``/``cast`` as ``RMSNorm``)."""

    op: Literal["head_rmsnorm"] = "head_rmsnorm"
    helper: ClassVar = staticmethod(fn.head_rms_norm)

    def helper_sources(self) -> list[str]:
        return [inspect.getsource(fn.rms_norm), inspect.getsource(fn.head_rms_norm)]


def opaque(*tensors: Any, **attributes: Any) -> Any:
    """A captured node no block op computes: it records the graph and cannot run."""
    raise NotImplementedError("an opaque graph op cannot run (see Opaque)")


class Opaque(GraphOp):
    """A node of a block captured from PyTorch (``Block.from_torch``) that no block op computes,
    kept so the graph stays whole: the aten ``target``, its call as captured (``call_text``,
    tensors by value name), the values it reads (``tensors``), its output ``shape`` (size
    expressions over the block's size names; empty when unknown) and ``dtype`` at capture, and the
    ``reason`` it is opaque. The planner never lowers it (its rule only says why); it never runs
    (the block's reference is the captured function)."""

    op: Literal["opaque"] = "opaque"
    helper: ClassVar = staticmethod(opaque)
    target: str
    tensors: list[str] = []
    call_text: str = ""
    shape: list[str | int] = []
    dtype: str = ""
    reason: str

    def inputs(self) -> list[str]:
        return list(self.tensors)

    def call(self, values: dict[str, Any]) -> Any:
        raise NotImplementedError(
            f"graph op {self.out!r} is opaque ({self.target}): {self.reason}. It records the "
            "captured graph and cannot run: run the block's reference (its captured function) "
            "instead, or rewrite that part of the function with ops a block graph has"
        )

    def helper_sources(self) -> list[str]:
        return []

    def source(self) -> str:
        shape = ", ".join(map(str, self.shape))
        return f"{self.out} = {self.call_text or self.target}  # opaque [{shape}]: {self.reason}"


class _Fields(GraphOp):
    """An op whose helper takes its tensor fields positionally, in ``args`` order."""

    args: ClassVar[tuple[str, ...]] = ()

    def inputs(self) -> list[str]:
        return [getattr(self, name) for name in self.args]


# -- kernel-level ops (docs/algebra.md §6) ---------------------------------------------------------
class Matmul(_Fields):
    """``out = a @ b`` with ``b`` of shape ``[K, N]`` (a plain matrix product)."""

    op: Literal["matmul"] = "matmul"
    helper: ClassVar = staticmethod(fn.matmul)
    args: ClassVar = ("a", "b")
    a: str
    b: str

    def matmuls(self, shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, int, int]]:
        (m, k), (_, n) = shapes[self.a], shapes[self.b]
        return [(m, n, k)]


class ScaleRows(_Fields):
    """``out[i, :] = x[i, :] * r[i]``."""

    op: Literal["scale_rows"] = "scale_rows"
    helper: ClassVar = staticmethod(fn.scale_rows)
    args: ClassVar = ("x", "r")
    x: str
    r: str


class ScaleCols(_Fields):
    """``out[:, j] = x[:, j] * v[j]``."""

    op: Literal["scale_cols"] = "scale_cols"
    helper: ClassVar = staticmethod(fn.scale_cols)
    args: ClassVar = ("x", "v")
    x: str
    v: str


class MeanSquare(_Fields):
    """``out[i] = mean_j x[i, j]²`` (fp32): RMSNorm's statistic."""

    op: Literal["mean_square"] = "mean_square"
    helper: ClassVar = staticmethod(fn.mean_square)
    args: ClassVar = ("x",)
    x: str


class RowRstd(_Fields):
    """``out[i] = rsqrt(mean_j x[i, j]² + eps)`` (fp32): the next RMSNorm's reciprocal."""

    op: Literal["row_rstd"] = "row_rstd"
    helper: ClassVar = staticmethod(fn.row_rstd)
    args: ClassVar = ("x",)
    x: str
    eps: float = Field(1e-6, gt=0)

    def kwargs(self) -> dict[str, Any]:
        return {"eps": self.eps}


class SwiGLUPairs(_Fields):
    """``out[:, k] = silu(x[:, 2k]) * x[:, 2k+1]`` (gate/up interleaved)."""

    op: Literal["swiglu_pairs"] = "swiglu_pairs"
    helper: ClassVar = staticmethod(fn.swiglu_pairs)
    args: ClassVar = ("x",)
    x: str


class PairLayout(_Fields):
    """Reorder each head's columns from rotate-half to adjacent pairs (head width from ``cos``)."""

    op: Literal["pair_layout"] = "pair_layout"
    helper: ClassVar = staticmethod(fn.to_adjacent_pairs)
    args: ClassVar = ("x", "cos")
    x: str
    cos: str


class RoPEPairs(_Fields):
    """RoPE on adjacent column pairs of each head, Hugging Face cos/sin tables ``[M, head_dim]``."""

    op: Literal["rope_pairs"] = "rope_pairs"
    helper: ClassVar = staticmethod(fn.rope_adjacent)
    args: ClassVar = ("x", "cos", "sin")
    x: str
    cos: str
    sin: str


class Concat(GraphOp):
    """``out = cat(parts, dim=-1)``."""

    op: Literal["concat"] = "concat"
    helper: ClassVar = staticmethod(fn.concat)
    parts: list[str] = Field(min_length=2)

    def inputs(self) -> list[str]:
        return list(self.parts)


class TargetLogit(_Fields):
    """``out[i] = logits[i, target[i]]`` (fp32)."""

    op: Literal["target_logit"] = "target_logit"
    helper: ClassVar = staticmethod(fn.select_target)
    args: ClassVar = ("logits", "target")
    logits: str
    target: str


class LogSumExp(_Fields):
    """``out[i] = log Σ_j exp(logits[i, j])`` (fp32)."""

    op: Literal["logsumexp"] = "logsumexp"
    helper: ClassVar = staticmethod(fn.logsumexp)
    args: ClassVar = ("logits",)
    logits: str


class CrossEntropy(_Fields):
    """Per-token cross-entropy loss (fp32, no reduction), Hugging Face's causal-LM loss."""

    op: Literal["cross_entropy"] = "cross_entropy"
    helper: ClassVar = staticmethod(fn.cross_entropy)
    args: ClassVar = ("logits", "target")
    logits: str
    target: str


class ApplyRstd(_Fields):
    """``out = (rstd ⊙ x) ⊙ γ``: an RMSNorm output from its saved statistic."""

    op: Literal["apply_rstd"] = "apply_rstd"
    helper: ClassVar = staticmethod(fn.apply_rstd)
    args: ClassVar = ("x", "rstd", "gamma")
    x: str
    rstd: str
    gamma: str


class RMSNormBackward(_Fields):
    """RMSNorm's input gradient ``rstd ⊙ (dy ⊙ γ − x̂ · c)`` given the row statistic ``c``."""

    op: Literal["rms_norm_backward"] = "rms_norm_backward"
    helper: ClassVar = staticmethod(fn.rms_norm_backward)
    args: ClassVar = ("dy", "x", "rstd", "gamma", "c")
    dy: str
    x: str
    rstd: str
    gamma: str
    c: str


class RMSNormWeightGrad(_Fields):
    """RMSNorm's weight gradient ``Σ_rows dy ⊙ (rstd ⊙ x)``."""

    op: Literal["rms_norm_weight_grad"] = "rms_norm_weight_grad"
    helper: ClassVar = staticmethod(fn.rms_norm_weight_grad)
    args: ClassVar = ("dy", "x", "rstd")
    dy: str
    x: str
    rstd: str


class SwiGLUPairsBackward(_Fields):
    """Gradient of ``swiglu_pairs(z)`` against ``da``, interleaved ``[dg0, du0, dg1, du1, …]``."""

    op: Literal["swiglu_pairs_backward"] = "swiglu_pairs_backward"
    helper: ClassVar = staticmethod(fn.swiglu_pairs_backward)
    args: ClassVar = ("da", "z")
    da: str
    z: str


class RowDot(_Fields):
    """``out[i] = Σ_j a[i, j] · b[i, j]`` (fp32)."""

    op: Literal["row_dot"] = "row_dot"
    helper: ClassVar = staticmethod(fn.row_dot)
    args: ClassVar = ("a", "b")
    a: str
    b: str
