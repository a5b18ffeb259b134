"""RoPE and the fused QKV projection (docs/algebra.md §5), forward and backward.

* ``rope_pairs`` of a tile in registers fuses into the epilogue as ``rope``.
* **fused QKV with RoPE** (``qkv_group`` / ``lower_qkv``, started by the Linear rule): Linears of
  one input whose results are concatenated — the rotated ones through ``pair_layout`` +
  ``rope_pairs`` first — become one GEMM over ``concat_rows`` of the weights (Q/K rows permuted
  by prep ``rope_pairs``) with ``rope(rotary_cols=…)`` letting V pass through. A ``Concat`` that
  is not such a group has no lowering.
* **RoPE in Hugging Face's order** (``rotary_chain`` / ``lower_rotary``, started by the Linear
  rule): ``Linear → [HeadRMSNorm | RMSNorm] → RoPE``, each value read only by the next op, is one
  GEMM over prep ``rope_pairs`` of the weight (and of the bias and norm weight), whose epilogue
  rotates adjacent pairs with ``rope_full`` (the graph op's meaning on any tables: both halves
  read) and writes each column back to its rotate-half position with ``store_rotate_half``.
  Why not rotate half-heads in registers: that needs a tile holding whole heads (BLOCK_N a
  multiple of head_dim: impossible for head_dim 80 or 96, and a constraint on every tile
  config), while the pair order works at any head_dim and tile, and the permuted store costs
  only different store addresses. The bias is added before the rotation, a ``HeadRMSNorm`` runs
  in the epilogue (``head_rmsnorm.py``), an ``RMSNorm`` of the whole projection finishes after
  it (``rmsnorm.norm_before_rotation``); each such projection is a GEMM of its own.
* **separate Q, K, V outputs in one GEMM** (``separate_qkv`` / ``lower_separate_qkv``): when every
  Linear of the normed input is unbiased and goes straight to a RoPE output or is an output
  itself (Llama, Mistral), one GEMM over ``concat_rows`` of the (Q/K paired) weights rotates the
  Q/K columns (``rotary_cols``) and stores all three side by side in Hugging Face's order; the
  outputs are column views of that tensor (nothing is copied).
* **backward** of ``concat(rope(q), rope(k), v)`` of ``h = rmsnorm(x)·γ``: the inverse rotation of
  ``dqkv`` (in the epilogue of the recomputed projection, or one ``rope_rows`` pass over the saved
  output), the RMSNorm backward in the epilogue of ``dz W_qkv``, the weight gradient as a plain
  GEMM whose Q/K rows ``unpair_rows`` puts back, writing each weight's gradient as a tensor of its
  own (``parts``: no row views of one tensor for a caller to copy apart).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coda.blocks.ops import (
    Concat,
    GraphOp,
    HeadRMSNorm,
    Linear,
    PairLayout,
    RMSNorm,
    RoPE,
    RoPEPairs,
)

from ..backward import BackwardBuilder
from ..epilogue import Epilogue, emit_gemm
from ..registry import Rule
from ..shapes import size_expr_of
from ..state import NoRule, PlanState
from .head_rmsnorm import head_norm_in_epilogue
from .rmsnorm import commute, norm_before_rotation


def paired_rows(prepare: Callable[[tuple, dict[str, Any]], str], tensor: str, head: str) -> str:
    """``tensor``'s rows (a weight's; a bias or norm weight's entries) taken from rotate-half to
    adjacent-pair order within each ``head``-wide head (prep ``rope_pairs``), prepared once per
    tensor through ``prepare`` (``PlanState.prepare`` or ``BackwardBuilder.prep``)."""
    node = {"kind": "rope_pairs", "weight": tensor, "head_dim": head, "out": f"{tensor}_pairs"}
    return prepare(("rope_pairs", tensor), node)


class RoPEPairsRule(Rule):
    op = RoPEPairs

    def fuse(self, ep: Epilogue, op: RoPEPairs) -> None:
        ep.define(op.out, {"op": "rope", "src": ep.tile(op.x), "cos": op.cos, "sin": op.sin})


class ConcatRule(Rule):
    op = Concat
    backward_of = "a fused QKV projection with RoPE"

    def differentiate(self, b: BackwardBuilder) -> None:
        attention_in_backward(b)


class RoPERule(Rule):
    op = RoPE
    backward_of = (
        "an attention input in Hugging Face's order (RMSNorm, q/k/v Linears with or without "
        "biases, optional per-head q/k norms, RoPE; separate outputs)"
    )
    differentiates_biases = True

    def differentiate(self, b: BackwardBuilder) -> None:
        from .rotary_backward import rotary_input_backward  # it imports this module

        rotary_input_backward(b)

    def unlowered(self, st: PlanState, op: RoPE) -> str:
        return (
            "RoPE is lowered only in the epilogue of the Linear producing its input x, directly "
            "or through one HeadRMSNorm or RMSNorm, when nothing else reads the Linear's (or the "
            f"norm's) output and it is no block output; here {_chain_break(st, op.x)}"
        )


def _chain_break(st: PlanState, value: str) -> str:
    """Where the chain ``Linear → [norm] → RoPE`` ending in ``value`` breaks, in words."""
    found = st.producer(value)
    if found is None:
        return f"{value!r} is a block input, which no Linear produces"
    readers = [f"{c.op} (graph[{j}])" for j, c in st.consumers(value)]
    if value in st.block.outputs:
        return f"{value!r} is a block output (the rotation would change it): drop it from outputs"
    if len(readers) > 1:
        return f"{value!r} is read by {', '.join(readers)}: only the RoPE may read it"
    if isinstance(found[1], HeadRMSNorm | RMSNorm):
        return _chain_break(st, found[1].x)
    if not isinstance(found[1], Linear):
        return f"{value!r} comes from {found[1].op} (graph[{found[0]}]), not from a Linear"
    return f"the chain from {found[1].op} (graph[{found[0]}]) did not form"


# -- RoPE in Hugging Face's rotate-half order ------------------------------------------------------
@dataclass
class RotaryChain:
    """``Linear → [norm] → RoPE`` (each as (graph index, op)), each value read only by the next."""

    linear: tuple[int, Linear]
    norm: tuple[int, HeadRMSNorm | RMSNorm] | None
    rope: tuple[int, RoPE]


def rotary_chain(st: PlanState, i: int, op: Linear) -> RotaryChain | None:
    """The chain from Linear ``op`` (graph op ``i``) to a ``RoPE`` of its output, if any."""
    user = st.only_consumer(op.out)
    norm = None
    if user is not None and isinstance(user[1], HeadRMSNorm | RMSNorm) and user[1].x == op.out:
        norm, user = user, st.only_consumer(user[1].out)
    x = norm[1].out if norm is not None else op.out
    if user is None or not isinstance(user[1], RoPE) or user[1].x != x:
        return None
    return RotaryChain((i, op), norm, user)  # type: ignore[arg-type]


def separate_qkv(st: PlanState, i: int, op: Linear) -> list[QKVPart] | None:
    """Q, K, V as separate outputs of one fused GEMM, when Linear ``op`` (graph op ``i``) starts
    such a group: every Linear of ``op.x`` is unbiased and either a block output nothing reads
    (V) or the input of a ``RoPE`` (no norm between) whose output is a block output nothing reads
    (Q, K); at least two parts, one rotated, one cos/sin pair. Rotated parts come first."""
    linears = [(j, c) for j, c in st.consumers(op.x) if isinstance(c, Linear)]
    if len(linears) < 2 or linears[0][0] != i or any(c.bias for _, c in linears):
        return None
    rotated, plain = [], []
    for j, lin in linears:
        chain = rotary_chain(st, j, lin)
        if chain is not None and chain.norm is None and _final(st, chain.rope[1].out):
            rotated.append(QKVPart((j, lin), rope=chain.rope))  # type: ignore[arg-type]
        elif _final(st, lin.out):
            plain.append(QKVPart((j, lin)))
        else:
            return None
    tables = {(p.rope[1].cos, p.rope[1].sin) for p in rotated}  # type: ignore[index, union-attr]
    return [*rotated, *plain] if rotated and len(tables) == 1 else None


def _final(st: PlanState, value: str) -> bool:
    """``value`` is a block output and no op reads it."""
    return value in st.block.outputs and not st.consumers(value)


def lower_separate_qkv(st: PlanState, parts: list[QKVPart]) -> None:
    """One GEMM over ``concat_rows`` of the weights (Q/K rows paired) whose epilogue rotates the
    Q/K columns (``rope_full``) and stores Q, K, V side by side in Hugging Face's order
    (``store_rotate_half``); the block's outputs are column views of that tensor."""
    first_i, first = parts[0].linear
    rotated = [p for p in parts if p.rope is not None]
    rope = rotated[0].rope[1]  # type: ignore[index]
    head = size_expr_of(st, rope.cos, 1)
    weights = []
    for part in parts:
        w = part.linear[1].weight
        if part.rope is not None:
            w = paired_rows(st.prepare, w, head)
        weights.append(w)
    outs = [p.rope[1].out if p.rope is not None else p.linear[1].out for p in parts]
    name = "_".join(outs)
    fused = st.prepare(
        ("concat", *weights), {"kind": "concat_rows", "tensors": weights, "out": f"w_{name}"}
    )
    a, scale = commute(st, first_i, first, fused)
    ep = Epilogue(st)
    cur = "acc"
    if scale is not None:
        fused, cur = scale[1], f"{name}_z"
        ep.emit({"op": "scale_rows", "src": "acc", "vector": scale[0], "out": cur})
    widths = [size_expr_of(st, p.linear[1].weight, 0) for p in parts]
    extra = {"rotary_cols": " + ".join(widths[: len(rotated)])} if len(rotated) < len(parts) else {}
    node = {"op": "rope_full", "src": cur, "cos": rope.cos, "sin": rope.sin, **extra}
    ep.emit({**node, "out": f"{name}_pairs"})
    ep.emit(
        {"op": "store_rotate_half", "src": f"{name}_pairs", "to": name, "head_dim": head, **extra}
    )
    start = "0"
    for out, width in zip(outs, widths, strict=True):
        stop = width if start == "0" else f"{start} + {width}"
        st.outputs[out] = {"tensor": name, "dim": 1, "start": start, "stop": stop}
        start = stop
    for part in parts:
        for found in (part.linear, part.rope):
            if found is not None:
                st.done.add(found[0])
    emit_gemm(st, first_i, ep, a, f"{fused}.T", [p.linear[1].weight for p in parts], name)


def lower_rotary(st: PlanState, chain: RotaryChain) -> None:
    """One GEMM over ``rope_pairs(W)``: [row scale of the input norm] → [bias] → [norm] → ``rope``
    → ``store_rotate_half`` (and, for a norm over the whole projection, its finishing aux steps)."""
    i, lin = chain.linear
    rope = chain.rope[1]
    head = size_expr_of(st, rope.cos, 1)

    def paired(tensor: str) -> str:
        return paired_rows(st.prepare, tensor, head)

    weight = paired(lin.weight)
    a, scale = commute(st, i, lin, weight)
    ep = Epilogue(st)
    cur = "acc"
    if scale is not None:
        weight, cur = scale[1], f"{lin.out}_z"
        ep.emit({"op": "scale_rows", "src": "acc", "vector": scale[0], "out": cur})
    if lin.bias is not None:
        node = {"op": "add_col_vector", "src": cur, "vector": paired(lin.bias)}
        cur = f"{lin.out}_biased"
        ep.emit({**node, "out": cur})
    store: dict[str, Any] = {"to": rope.out}
    if chain.norm is not None:
        norm = chain.norm[1]
        if isinstance(norm, HeadRMSNorm):
            cur = head_norm_in_epilogue(ep, chain.norm, cur, head, paired)  # type: ignore[arg-type]
        else:
            cur, store = norm_before_rotation(ep, norm, cur, paired, rope.out)
    rotated = f"{rope.out}_pairs"
    ep.emit({"op": "rope_full", "src": cur, "cos": rope.cos, "sin": rope.sin, "out": rotated})
    ep.emit({"op": "store_rotate_half", "src": rotated, "head_dim": head, **store})
    for found in (chain.linear, chain.norm, chain.rope):
        if found is not None:
            st.done.add(found[0])
    emit_gemm(st, i, ep, a, f"{weight}.T", [lin.weight], rope.out)
    st.available.add(rope.out)


# -- fused QKV + RoPE ------------------------------------------------------------------------------
@dataclass
class QKVPart:
    """One concatenated part: its Linear, and for a rotated part its pair_layout and rope_pairs
    (each as (graph index, op))."""

    linear: tuple[int, Linear]
    pairs: tuple[int, PairLayout] | None = None
    rope: tuple[int, RoPEPairs | RoPE] | None = None


@dataclass
class QKVGroup:
    concat: tuple[int, Concat]
    parts: list[QKVPart]


def _part_of(st: PlanState, value: str) -> QKVPart | None:
    """Trace a concatenated part back: [Linear] → [PairLayout → RoPEPairs]."""
    found = st.producer(value)
    if found is not None and isinstance(found[1], RoPEPairs):
        rope = found
        inner = st.producer(rope[1].x)
        if inner is None or not isinstance(inner[1], PairLayout):
            return None
        lin = st.producer(inner[1].x)
        if lin is None or not isinstance(lin[1], Linear):
            return None
        return QKVPart(lin, inner, rope)  # type: ignore[arg-type]
    if found is not None and isinstance(found[1], Linear):
        return QKVPart(found)  # type: ignore[arg-type]
    return None


def qkv_group(st: PlanState, i: int, op: Linear) -> QKVGroup | None:
    """The fused-QKV pattern containing Linear ``op`` (graph op ``i``), if any."""
    value = op.out
    for _ in range(3):  # Linear → [pair_layout → rope_pairs] → concat
        user: tuple[int, GraphOp] | None = st.only_consumer(value)
        if user is None:
            return None
        if isinstance(user[1], Concat):
            parts = [_part_of(st, p) for p in user[1].parts]
            if any(p is None for p in parts):
                return None
            return QKVGroup(user, parts)  # type: ignore[arg-type]
        value = user[1].out
    return None


def lower_qkv(st: PlanState, group: QKVGroup) -> None:
    """One GEMM over the concatenated (Q/K rows paired) weights with ``rope`` in its epilogue."""
    concat_i, concat = group.concat
    first_i, first = group.parts[0].linear
    rotated = [p for p in group.parts if p.rope is not None]
    if any(p.rope is not None for p in group.parts[len(rotated) :]):
        raise NoRule(
            concat_i, concat, "the rotated parts (Q, K) must come before the unrotated ones (V)"
        )
    if any(p.linear[1].x != first.x for p in group.parts):
        raise NoRule(concat_i, concat, "its parts project different inputs")
    biased = [p.linear[1].out for p in group.parts if p.linear[1].bias is not None]
    if biased:
        raise NoRule(
            concat_i,
            concat,
            f"its parts {biased} are biased Linears: fused QKV concatenates weights only (the "
            "biases would have to be concatenated and RoPE-paired too); drop the biases",
        )
    tables = {(p.rope[1].cos, p.rope[1].sin) for p in rotated}  # type: ignore[union-attr]
    if len(tables) > 1 or any(p.pairs[1].cos != p.rope[1].cos for p in rotated):  # type: ignore[union-attr]
        raise NoRule(concat_i, concat, "its rotated parts use different cos/sin tables")
    weights = []
    for part in group.parts:
        w = part.linear[1].weight
        if part.rope is not None:
            w = paired_rows(st.prepare, w, size_expr_of(st, part.rope[1].cos, 1))
        weights.append(w)
    fused = st.prepare(
        ("concat", *weights),
        {"kind": "concat_rows", "tensors": weights, "out": f"w_{concat.out}"},
    )
    a, scale = commute(st, first_i, first, fused)
    ep = Epilogue(st)
    cur = "acc"
    if scale is not None:
        fused = scale[1]
        ep.emit({"op": "scale_rows", "src": "acc", "vector": scale[0], "out": f"{concat.out}_z"})
        cur = f"{concat.out}_z"
    if rotated:
        cos, sin = next(iter(tables))
        node = {"op": "rope", "src": cur, "cos": cos, "sin": sin, "out": concat.out}
        if len(rotated) < len(group.parts):
            widths = [size_expr_of(st, p.linear[1].weight, 0) for p in rotated]
            node["rotary_cols"] = " + ".join(widths)
        ep.emit(node)
        cur = concat.out
    ep.result(concat.out, cur)
    for part in group.parts:
        for found in (part.linear, part.pairs, part.rope):
            if found is not None:
                st.done.add(found[0])
    st.done.add(concat_i)
    names = [p.linear[1].weight for p in group.parts]
    emit_gemm(st, first_i, ep, a, f"{fused}.T", names, concat.out)


# -- backward of the attention input: fused QKV + RoPE ---------------------------------------------
def attention_in_backward(b: BackwardBuilder) -> None:
    _, concat = b.find(Concat)
    first = b.find(Linear)
    # the forward rule's pattern, matched on the forward graph (a planner state of its own)
    group = qkv_group(PlanState(b.forward, b.st.options), *first)
    if group is None or group.concat[1] is not concat or concat.out not in b.forward.outputs:
        b.fail(
            "expected Linears of one normed input, Q/K through pair_layout + rope_pairs, "
            "concatenated into the block's output"
        )
    norm = b.norm(first[1].x)
    dqkv = b.cotangent(concat.out)
    rotated = [p for p in group.parts if p.rope is not None]
    cos, sin = (rotated[0].rope[1].cos, rotated[0].rope[1].sin) if rotated else ("", "")  # type: ignore[index]
    weights = []
    for part in group.parts:
        w = part.linear[1].weight
        if part.rope is not None:
            w = paired_rows(b.prep, w, size_expr_of(b.st, cos, 1))
        weights.append(w)
    node = {"kind": "concat_rows", "tensors": weights, "out": "w_qkv"}
    w_qkv = b.prep(("concat", *weights), node)
    widths = [size_expr_of(b.st, p.linear[1].weight, 0) for p in group.parts]
    rot_cols = " + ".join(widths[: len(rotated)]) if len(rotated) < len(group.parts) else None
    if concat.out in b.op.saved:
        r, dz, c = _backward_saved(b, norm, concat.out, dqkv, cos, sin, rot_cols)
    else:
        r, dz, c = _backward_recomputed(
            b, norm, w_qkv, dqkv, cos, sin, rot_cols, rotated=bool(rotated)
        )
    y = b.norm_backward("qkv_bwd", dz, w_qkv, norm, r, c, residual=None)
    dw = b.plain_gemm("w_qkv_grad", f"{dz}.T", y, "dw_qkv_pairs" if rotated else "dw_qkv")
    if not rotated:
        _row_views(b, group.parts, widths, dw)
        return
    # one gather puts the Q/K rows back and writes each weight's gradient as a tensor of its own
    node = {"kind": "unpair_rows", "src": dw, "head_dim": size_expr_of(b.st, cos, 1)}
    if rot_cols:
        node["rows"] = rot_cols
    b.weight_gradients(node, [p.linear[1].weight for p in group.parts], widths)


def _row_views(b: BackwardBuilder, parts: list, widths: list[str], dw: str) -> None:
    """Each part's weight gradient as a row view of the fused ``dw``."""
    start = "0"
    for part, width in zip(parts, widths, strict=True):
        stop = width if start == "0" else f"{start} + {width}"
        b.output(part.linear[1].weight, {"tensor": dw, "dim": 0, "start": start, "stop": stop})
        start = stop


def _backward_saved(
    b: BackwardBuilder,
    norm: RMSNorm,
    qkv: str,
    dqkv: str,
    cos: str,
    sin: str,
    rot_cols: str | None,
) -> tuple[str, str, str]:
    """(r, dz, c) from the saved output, in one pass and no GEMM: dz = the inverse rotation of
    dqkv, c = Σ qkv·dqkv / d (a rotation keeps dot products: Σ z·dz = Σ qkv·dqkv)."""
    if not cos:
        b.fail("a saved QKV output is lowered only with RoPE (rope_rows inverts it)")
    r = b.rstd(norm)
    node = {
        "kind": "rope_rows",
        "src": dqkv,
        "cos": cos,
        "sin": sin,
        "inverse": True,
        "dot": qkv,
        "dot_out": b.name("c"),
        "divide_by": size_expr_of(b.st, norm.x, 1),
        "out": "dz",
    }
    if rot_cols:
        node["rotary_cols"] = rot_cols
    return r, b.aux(node), node["dot_out"]


def _backward_recomputed(
    b: BackwardBuilder,
    norm: RMSNorm,
    w_qkv: str,
    dqkv: str,
    cos: str,
    sin: str,
    rot_cols: str | None,
    *,
    rotated: bool,
) -> tuple[str, str, str]:
    """(r, dz, c): z = r ⊙ (x W_qkvᵀ) recomputed next to dqkv, dz = the inverse rotation of
    dqkv in that GEMM's epilogue, with partial sums of z·dz for c."""
    r, folded = b.forward_projection(norm, w_qkv)
    dz = b.name("dz")
    stats, partials = b.zdz_partials("z", dz)
    rope = {"op": "rope", "src": "dqkv_tile", "cos": cos, "sin": sin, "inverse": True}
    if rot_cols:
        rope["rotary_cols"] = rot_cols
    epilogue = [
        {"op": "scale_rows", "src": "acc", "vector": r, "out": "z"},
        {"op": "load_tile", "tensor": dqkv, "out": "dqkv_tile"},
        {**rope, "out": dz} if rotated else {"op": "map", "expr": "dqkv_tile", "out": dz},
        *stats,
        {"op": "store", "src": dz, "to": dz},
    ]
    b.gemm("qkv_rope_bwd", norm.x, f"{folded}.T", epilogue)
    return r, dz, b.statistic(partials, norm)
