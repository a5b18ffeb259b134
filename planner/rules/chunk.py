"""``Chunk``: one equal part of the last axis of a value — Phi-3's fused ``gate_up_proj``, whose
output ``z = h W_guᵀ`` (``W_gu = [W_gate; W_up]``, ``[2f, d]``) is split by ``z.chunk(2, -1)``
into the gate and up halves of a ``SwiGLU``/``GLU``.

* **chunked GLU** (``chunked_glu``, used by the Linear rule): ``Linear → Chunk(2, 0), Chunk(2, 1)
  → SwiGLU/GLU`` becomes one GEMM with the contraction in its epilogue, like two Linears of one
  input (``swiglu.gate_up_pair``). The epilogue contracts adjacent column pairs ``(g_k, u_k)``,
  so the weight's rows are reordered ``[g_0, u_0, g_1, u_1, …]`` — row ``2k + e`` of the GEMM's
  weight is row ``e·f + k`` of ``W_gu``. That is prep ``rope_pairs`` with one "head" as wide as
  the whole weight (``head_dim`` = its ``2f`` rows): one gather, which the prep runtime fuses
  with the norm's γ fold into a single pass over the weight (``prep/fusion.py``), and whose
  inverse, aux ``unpair_rows`` with the same width, writes the backward's weight gradient back
  in ``[gate; up]`` order in one gather. The alternative — rewriting the Linear into two
  Linears on row slices of ``W_gu`` and interleaving those — needs a prep step that slices rows
  and still a second one to interleave them, and on the gradient side a concatenation of the two
  strided halves: two passes where one does. A bias ``[2f]`` is permuted the same way
  (``rope_pairs`` permutes vectors too) and added before the contraction.
* **backward**: the MLP backward of ``swiglu.py`` (``mlp_backward``) over the same permuted
  weight, its interleaved ``dW`` un-permuted by ``unpair_rows`` into ``dW_gate_up``.
* Any other ``Chunk`` has no lowering (no primitive slices a tile's columns); ``unlowered`` says
  which of the conditions above the graph misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coda.blocks.ops import GLU, Chunk, Linear, SwiGLU

from ..registry import Rule
from ..shapes import size_expr_of
from ..state import PlanState
from .glu import glu_expr

SHAPE = (
    "the planner lowers a Chunk only as the gate and up halves of one Linear's output meeting in "
    "a SwiGLU or GLU (Phi-3's gate_up_proj: z = linear(h, w), gate, up = z.chunk(2, -1)), fused "
    "into that GEMM's epilogue"
)


@dataclass(frozen=True)
class ChunkedGLU:
    """``linear``'s output split in two by ``parts`` (part 0, part 1) and contracted by ``glu``;
    ``indices``: the graph ops this absorbs (the Linear, both Chunks, the GLU)."""

    linear: Linear
    parts: tuple[Chunk, Chunk]
    glu: SwiGLU | GLU
    indices: list[int]

    @property
    def gate_first(self) -> bool:
        """Whether part 0 is the gate (Phi-3: ``gate, up = z.chunk(2)``)."""
        return self.glu.gate == self.parts[0].out

    @property
    def halves(self) -> tuple[str, str]:
        """The graph values of part 0 and part 1 (the even and odd columns of the GEMM)."""
        return self.parts[0].out, self.parts[1].out

    def _paired(self, st: PlanState, name: str) -> str:
        rows = size_expr_of(st, self.linear.weight, 0)
        node = {"kind": "rope_pairs", "weight": name, "head_dim": rows, "out": f"{name}_paired"}
        return st.prepare(("halves_paired", name), node)

    def paired_weight(self, st: PlanState) -> str:
        """The weight with its two row halves interleaved (prep ``rope_pairs``, one head)."""
        return self._paired(st, self.linear.weight)

    def paired_bias(self, st: PlanState) -> str | None:
        """The bias permuted like the weight's rows, or None for an unbiased Linear."""
        return None if self.linear.bias is None else self._paired(st, self.linear.bias)

    def contraction(self) -> dict[str, Any]:
        """The epilogue op contracting the pairs (part 0 in ``x0``, part 1 in ``x1``)."""
        if isinstance(self.glu, SwiGLU) and self.gate_first:
            return {"op": "swiglu"}
        act = self.glu.act if isinstance(self.glu, GLU) else "silu"
        gate, up = ("x0", "x1") if self.gate_first else ("x1", "x0")
        return {"op": "pairwise", "expr0": glu_expr(act, gate, up)}


def match(st: PlanState, index: int, op: Linear) -> ChunkedGLU | str:
    """The chunked GLU that Linear ``op`` (graph op ``index``) heads, or why it heads none."""
    if op.out in st.block.outputs:
        return f"the projection {op.out!r} is itself a block output (only its halves may be)"
    users = st.consumers(op.out)
    chunks = [(j, c) for j, c in users if isinstance(c, Chunk)]
    others = [f"{c.op} (graph[{j}])" for j, c in users if not isinstance(c, Chunk)]
    if others:
        return f"the projection {op.out!r} also feeds {', '.join(others)}"
    if any(c.chunks != 2 for _, c in chunks):
        sizes = sorted({c.chunks for _, c in chunks})
        return f"{op.out!r} is split into {sizes} parts, not 2 (a gate half and an up half)"
    if sorted(c.index for _, c in chunks) != [0, 1]:
        taken = sorted(c.index for _, c in chunks)
        return f"the parts taken of {op.out!r} are {taken}, not each of [0, 1] once"
    parts = tuple(c for _, c in sorted(chunks, key=lambda jc: jc[1].index))
    readers = [st.consumers(p.out) for p in parts]
    if any(len(r) != 1 for r in readers) or readers[0][0][0] != readers[1][0][0]:
        return (
            f"the halves {[p.out for p in parts]} of {op.out!r} are not read by exactly one op, "
            "the same SwiGLU or GLU"
        )
    k, glu = readers[0][0]
    if not isinstance(glu, SwiGLU | GLU) or {glu.gate, glu.up} != {p.out for p in parts}:
        return f"the halves of {op.out!r} meet in {glu.op} (graph[{k}]), not as a GLU's gate and up"
    indices = [index, *(j for j, _ in chunks), k]
    if any(j in st.done for j in indices[1:]):
        return f"the halves of {op.out!r} were already lowered elsewhere"
    return ChunkedGLU(op, parts, glu, indices)  # type: ignore[arg-type]


def chunked_glu(st: PlanState, index: int, op: Linear) -> ChunkedGLU | None:
    """The chunked GLU Linear ``op`` heads (lowered as one GEMM), or None."""
    found = match(st, index, op)
    return found if isinstance(found, ChunkedGLU) else None


class ChunkRule(Rule):
    op = Chunk

    def unlowered(self, st: PlanState, op: Chunk) -> str:
        """Why this Chunk was not absorbed into the GEMM of the Linear it splits."""
        found = st.producer(op.x)
        if found is None or not isinstance(found[1], Linear):
            what = "a block input" if found is None else f"{found[1].op} (graph[{found[0]}])"
            return f"it splits {op.x!r}, which is {what}, not a Linear's output; {SHAPE}"
        reason = match(st, *found)
        if isinstance(reason, ChunkedGLU):  # the shape fits, but the Linear was lowered otherwise
            reason = f"the Linear producing {op.x!r} was lowered before its halves could join it"
        return f"{reason}; {SHAPE}"
