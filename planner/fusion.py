"""Lowering rules for blocks beyond ``Linear``/``RMSNorm``/``SwiGLU``/``Add``: epilogue fusion over
the block graph (CODA_MATH §1–6).

``lower`` hands every op of a block that uses any other op type to ``handles`` (blocks made only of
the original four ops keep the original rules exactly). The rules here:

* **GEMM + epilogue DAG**: a ``Linear`` or ``Matmul`` becomes a ``gemm`` step; then every op whose
  inputs are in registers (values this epilogue computed) or existing tensors is fused into its
  epilogue, repeatedly, so one GEMM result can feed several consumers (``D`` stored, its row
  statistic, ``D ⊙ γ``). Ops on existing tensors only join when their result is tile-shaped here
  (e.g. ``x̂ ⊙ γ`` next to an RMSNorm backward).
* **statistics as partials + aux**: a row statistic (mean of squares, rstd, log-sum-exp, Σ a·b)
  or a column sum becomes ``partial_reduce`` in the epilogue and a tiny aux step after it; the
  target logit of a Linear's logits is aux ``gather_dot`` (M dot products from the operands),
  of other logits ``select_column``; cross-entropy is a target logit and LSE partials, combined
  by ``lse_combine(minus=target)``.
* **fused QKV with RoPE**: Linears of one input whose results are concatenated — the rotated ones
  through ``pair_layout`` + ``rope_pairs`` first — become one GEMM over ``concat_rows`` of the
  weights (Q/K rows permuted by prep ``rope_pairs``) with ``rope(rotary_cols=…)`` letting V pass
  through.
* gate/up pairs, RMSNorm commutation and statistics from the producer reuse the original rules.
* backward blocks (``vjp`` of a forward block) are lowered by ``backward.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coda.blocks.ops import (
    Add,
    ApplyRstd,
    Concat,
    CrossEntropy,
    GraphOp,
    Linear,
    LogSumExp,
    Matmul,
    MeanSquare,
    PairLayout,
    RMSNorm,
    RMSNormBackward,
    RMSNormWeightGrad,
    RoPEPairs,
    RowDot,
    RowRstd,
    ScaleCols,
    ScaleRows,
    SwiGLU,
    SwiGLUPairs,
    SwiGLUPairsBackward,
    TargetLogit,
)

if TYPE_CHECKING:
    from .lowering import _State

ORIGINAL_OPS = (Linear, RMSNorm, SwiGLU, Add)

SWIGLU_DG = "{da} * x1 * sigmoid(x0) * (1 + x0 * (1 - sigmoid(x0)))"
SWIGLU_DU = "{da} * silu(x0)"


def handles(st: _State, i: int, op: GraphOp) -> bool:
    """Lower graph op ``i`` with the rules here; False leaves it to the original rules."""
    graph = st.block.graph
    saves_pairs = any(  # a training forward returns the gate/up projections for its backward
        isinstance(o, SwiGLU) and {o.gate, o.up} & set(st.block.outputs) for o in graph
    )
    if all(isinstance(o, ORIGINAL_OPS) for o in graph) and not saves_pairs:
        return False
    from . import backward, lowering

    if isinstance(op, Linear | Matmul):
        lower_gemm(st, i, op)
        return True
    if isinstance(op, RMSNorm):
        lowering._check_norm_feeds_gemms(st, i, op)
        return True
    return backward.handles(st, i, op)


# -- the epilogue being built ----------------------------------------------------------------------
@dataclass
class Epilogue:
    """One gemm step's epilogue: graph values in registers, loads, and aux steps that follow it."""

    st: _State
    ops: list[dict[str, Any]] = field(default_factory=list)
    regs: dict[str, str] = field(default_factory=dict)  # graph value -> epilogue value
    computed: list[str] = field(default_factory=list)  # graph values this epilogue computes
    aux: list[dict[str, Any]] = field(default_factory=list)
    # epilogue value -> (a, w, row scale or None) when it is [scale_rows of] acc = a @ w.T: one
    # entry of it per row can then be recomputed from the operands (aux gather_dot)
    products: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)
    _loaded: dict[tuple[str, str], str] = field(default_factory=dict)

    def emit(self, node: dict[str, Any]) -> None:
        self.ops.append(node)

    def define(self, value: str, node: dict[str, Any]) -> None:
        """Emit ``node`` computing graph value ``value`` into an epilogue value of the same name."""
        self.emit({**node, "out": value})
        self.regs[value] = value
        self.computed.append(value)

    def _load(self, kind: str, value: str, node: dict[str, Any]) -> str:
        key = (kind, value)
        if key not in self._loaded:
            name = f"{value}_{kind}"
            self.emit({**node, "out": name})
            self._loaded[key] = name
        return self._loaded[key]

    def tile(self, value: str) -> str:
        """The epilogue value holding graph value ``value`` as a tile (loaded if it is a tensor)."""
        if value in self.regs:
            return self.regs[value]
        return self._load("tile", value, {"op": "load_tile", "tensor": value})

    def row(self, value: str) -> str:
        return self._load("row", value, {"op": "load_row_vector", "vector": value})

    def col(self, value: str) -> str:
        return self._load("col", value, {"op": "load_col_vector", "vector": value})


# -- fusion rules: graph op -> epilogue ops --------------------------------------------------------
def _add(ep: Epilogue, op: Add) -> None:
    a_reg, b_reg = op.a in ep.regs, op.b in ep.regs
    if a_reg != b_reg:
        src, other = (op.a, op.b) if a_reg else (op.b, op.a)
        ep.define(op.out, {"op": "add_tile", "src": ep.regs[src], "tensor": other})
        return
    ep.define(op.out, {"op": "map", "expr": f"{ep.tile(op.a)} + {ep.tile(op.b)}"})


def _scale_rows(ep: Epilogue, op: ScaleRows) -> None:
    ep.define(op.out, {"op": "scale_rows", "src": ep.tile(op.x), "vector": op.r})


def _scale_cols(ep: Epilogue, op: ScaleCols) -> None:
    ep.define(op.out, {"op": "scale_cols", "src": ep.tile(op.x), "vector": op.v})


def _swiglu_pairs(ep: Epilogue, op: SwiGLUPairs) -> None:
    ep.define(op.out, {"op": "swiglu", "src": ep.tile(op.x)})


def _rope(ep: Epilogue, op: RoPEPairs) -> None:
    ep.define(op.out, {"op": "rope", "src": ep.tile(op.x), "cos": op.cos, "sin": op.sin})


def _apply_rstd(ep: Epilogue, op: ApplyRstd) -> None:
    x, r, g = ep.tile(op.x), ep.row(op.rstd), ep.col(op.gamma)
    ep.define(op.out, {"op": "map", "expr": f"{x} * {r} * {g}"})


def _rms_norm_backward(ep: Epilogue, op: RMSNormBackward) -> None:
    # dx = r ⊙ (dy ⊙ γ − x̂ · c) with x̂ = r ⊙ x (CODA_MATH §4)
    dy, x, r, g, c = ep.tile(op.dy), ep.tile(op.x), ep.row(op.rstd), ep.col(op.gamma), ep.row(op.c)
    ep.define(op.out, {"op": "map", "expr": f"{r} * ({dy} * {g} - {r} * {x} * {c})"})


def _swiglu_backward(ep: Epilogue, op: SwiGLUPairsBackward) -> None:
    da = ep.tile(op.da)
    node = {
        "op": "pairwise",
        "src": ep.tile(op.z),
        "expr0": SWIGLU_DG.format(da=da),
        "expr1": SWIGLU_DU.format(da=da),
    }
    ep.define(op.out, node)


def _partials(ep: Epilogue, src: str, kind: str, to: str, axis: str = "row") -> str:
    """The partials buffer of reduction ``kind`` of epilogue value ``src`` along ``axis``: one
    ``partial_reduce`` per distinct reduction (a cross-entropy and the log-sum-exp of the same
    logits share theirs), named ``to`` when this is the first."""
    for node in ep.ops:
        if node["op"] == "partial_reduce" and (node["src"], node["kind"], node["axis"]) == (
            src, kind, axis,
        ):  # fmt: skip
            return node["to"]
    ep.emit({"op": "partial_reduce", "src": src, "kind": kind, "axis": axis, "to": to})
    return to


def _mean_square(ep: Epilogue, op: MeanSquare) -> None:
    p = _partials(ep, ep.tile(op.x), "sumsq", f"{op.out}_partials")
    width = size_expr_of(ep.st, op.x, 1)
    ep.aux.append({"kind": "sum_partials", "src": p, "divide_by": width, "out": op.out})


def _row_rstd(ep: Epilogue, op: RowRstd) -> None:
    p = _partials(ep, ep.tile(op.x), "sumsq", f"{op.out}_partials")
    ep.aux.append({"kind": "rstd", "src": p, "eps": op.eps, "out": op.out})


def _select_target(ep: Epilogue, logits: str, target: str, to: str) -> None:
    """``to[i] = logits[i, target[i]]``: recomputed from the GEMM's operands by aux
    ``gather_dot`` when the logits are ``[r ⊙] a @ w.T`` — M dot products instead of a compare
    and row reduction over every logit in the epilogue (measured: bench/RESULTS.md) — else
    ``select_column`` in the epilogue."""
    src = ep.tile(logits)
    if src in ep.products:
        a, w, scale = ep.products[src]
        node = {"kind": "gather_dot", "a": a, "w": w, "index": target, "out": to}
        ep.aux.append({**node, "scale": scale} if scale else node)
        return
    ep.emit({"op": "select_column", "src": src, "index": target, "to": to})


def _target_logit(ep: Epilogue, op: TargetLogit) -> None:
    _select_target(ep, op.logits, op.target, op.out)


def _logsumexp(ep: Epilogue, op: LogSumExp) -> None:
    p = _partials(ep, ep.tile(op.logits), "lse", f"{op.out}_partials")
    ep.aux.append({"kind": "lse_combine", "src": p, "out": op.out})


def _cross_entropy(ep: Epilogue, op: CrossEntropy) -> None:
    # loss_i = LSE_i − logits[i, t_i]: the target from the tile that holds it, LSE from partials
    target = f"{op.out}_target"
    _select_target(ep, op.logits, op.target, target)
    p = _partials(ep, ep.tile(op.logits), "lse", f"{op.out}_partials")
    ep.aux.append({"kind": "lse_combine", "src": p, "minus": target, "out": op.out})


def _rms_norm_weight_grad(ep: Epilogue, op: RMSNormWeightGrad) -> None:
    # dγ = Σ_rows dy ⊙ x̂: partial column sums per row block, summed by an aux step
    dy, x, r = ep.tile(op.dy), ep.tile(op.x), ep.row(op.rstd)
    prod = f"{op.out}_terms"
    ep.emit({"op": "map", "expr": f"{dy} * {x} * {r}", "out": prod})
    p = _partials(ep, prod, "sum", f"{op.out}_partials", axis="col")
    ep.aux.append({"kind": "sum_partials", "src": p, "dtype": "act", "out": op.out})


def _row_dot(ep: Epilogue, op: RowDot) -> None:
    prod = f"{op.out}_terms"
    ep.emit({"op": "map", "expr": f"{ep.tile(op.a)} * {ep.tile(op.b)}", "out": prod})
    p = _partials(ep, prod, "sum", f"{op.out}_partials")
    ep.aux.append({"kind": "sum_partials", "src": p, "out": op.out})


RULES: dict[type, Callable[[Epilogue, Any], None]] = {
    Add: _add,
    ScaleRows: _scale_rows,
    ScaleCols: _scale_cols,
    SwiGLUPairs: _swiglu_pairs,
    RoPEPairs: _rope,
    ApplyRstd: _apply_rstd,
    RMSNormBackward: _rms_norm_backward,
    SwiGLUPairsBackward: _swiglu_backward,
    MeanSquare: _mean_square,
    RowRstd: _row_rstd,
    TargetLogit: _target_logit,
    LogSumExp: _logsumexp,
    CrossEntropy: _cross_entropy,
    RMSNormWeightGrad: _rms_norm_weight_grad,
    RowDot: _row_dot,
}
# Ops whose result is a per-row/per-column statistic written through partials (not a tile).
SINKS = (MeanSquare, RowRstd, TargetLogit, LogSumExp, CrossEntropy, RMSNormWeightGrad, RowDot)


# -- shapes ----------------------------------------------------------------------------------------
_TRACES: dict[int, tuple[Any, list]] = {}


def _binding_shapes(st: _State) -> list[tuple[dict[str, int], dict[str, tuple[int, ...]]]]:
    """Every value's shape at each CPU and GPU shape set of the block (cached per block object)."""
    cached = _TRACES.get(id(st.block))
    if cached is None or cached[0] is not st.block:
        sets = st.block.shapes.cpu + st.block.shapes.gpu
        cached = (st.block, [(s, st.block.trace(s)) for s in sets])
        _TRACES[id(st.block)] = cached
    return cached[1]


def size_expr_of(st: _State, value: str, dim: int) -> str:
    """A size expression equal to ``value.shape[dim]`` at every shape set of the block."""
    traces = _binding_shapes(st)
    names = sorted(
        {d for spec in st.block.inputs.values() for d in spec.shape if isinstance(d, str)}
    )
    for name in names:
        if all(shapes[value][dim] == sizes[name] for sizes, shapes in traces):
            return name
    widths = {shapes[value][dim] for _, shapes in traces}
    if len(widths) == 1:
        return str(widths.pop())
    raise ValueError(f"no size name of block {st.block.name!r} equals {value}.shape[{dim}]")


def _tile_shaped(st: _State, value: str, gemm_out: str) -> bool:
    """``value`` has the GEMM output's rows and N/2, N or 2N columns at every shape set."""
    for _, shapes in _binding_shapes(st):
        v, g = shapes.get(value), shapes[gemm_out]
        if v is None or len(v) != 2 or v[0] != g[0] or v[1] * 2 not in (g[1], 2 * g[1], 4 * g[1]):
            return False
    return True


# -- one GEMM --------------------------------------------------------------------------------------
def _fusable(st: _State, ep: Epilogue, op: GraphOp, gemm_out: str) -> bool:
    if type(op) not in RULES:
        return False
    inputs = op.inputs()
    if not all(v in ep.regs or v in st.available for v in inputs):
        return False
    if any(v in ep.regs for v in inputs):
        return True
    # Only existing tensors: join this epilogue when the result is a tile of this GEMM's shape.
    return not isinstance(op, SINKS) and _tile_shaped(st, op.out, gemm_out)


def fuse(st: _State, ep: Epilogue, gemm_out: str) -> None:
    """Fuse every op that can run in this epilogue, until none is left."""
    progress = True
    while progress:
        progress = False
        for j, op in enumerate(st.block.graph):
            if j not in st.done and _fusable(st, ep, op, gemm_out):
                RULES[type(op)](ep, op)
                st.done.add(j)
                progress = True


def store_results(st: _State, ep: Epilogue) -> None:
    """Store the computed values something still needs: block outputs, later consumers, norms."""
    for value in ep.computed:
        users = [(j, c) for j, c in st.consumers(value) if j not in st.done]
        if value not in st.block.outputs and not users:
            continue
        ep.emit({"op": "store", "src": ep.regs[value], "to": value})
        st.available.add(value)
        if any(isinstance(c, RMSNorm) for _, c in users):
            partials = f"{value}_sumsq"
            ep.emit(
                {"op": "partial_reduce", "src": ep.regs[value], "kind": "sumsq", "to": partials}
            )
            st.partials[value] = partials
    for node in ep.aux:
        st.available.add(node["out"])


def emit_gemm(
    st: _State, i: int, ep: Epilogue, a: str, b: str, weights: list[str], gemm_out: str
) -> None:
    """Fuse, store and append the gemm step (graph op ``i``) and its aux steps to the program."""
    from .lowering import NoRule, _step_name

    fuse(st, ep, gemm_out)
    store_results(st, ep)
    if not any(node["op"] in ("store", "partial_reduce", "select_column") for node in ep.ops):
        if ep.aux and all(node["kind"] == "gather_dot" for node in ep.aux):
            st.steps.extend(ep.aux)  # only single entries of the product are wanted: no GEMM
            return
        raise NoRule(
            i, st.block.graph[i], f"nothing uses {gemm_out!r}: it is no output and feeds no op"
        )
    st.steps.append(
        {
            "kind": "gemm",
            "name": _step_name(st, weights),
            "a": a,
            "b": b,
            "epilogue": ep.ops,
            "config": st.options.config,
        }
    )
    st.steps.extend(ep.aux)


def lower_gemm(st: _State, i: int, op: Linear | Matmul) -> None:
    """One GEMM (or a fused group of them) and everything its epilogue can absorb."""
    from . import lowering

    if isinstance(op, Matmul):
        for name in (op.a, op.b):
            if name not in st.available:
                raise lowering.NoRule(i, op, f"its input {name!r} is not materialised earlier")
        ep = Epilogue(st)
        ep.regs[op.out] = "acc"
        ep.computed.append(op.out)
        st.done.add(i)
        emit_gemm(st, i, ep, op.a, op.b, [op.out], op.out)
        return
    group = qkv_group(st, i, op)
    if group is not None:
        _lower_qkv(st, group)
        return
    _lower_linear(st, i, op)


def _lower_linear(st: _State, i: int, op: Linear) -> None:
    """A Linear (or a gate/up pair into a SwiGLU): the original rules' operand and pair handling."""
    from . import lowering

    pair = lowering._pair_of(st, i, op)
    ep = Epilogue(st)
    if pair is not None:
        gate, up, glu, indices = pair
        weights = [gate.weight, up.weight]
        node = {"kind": "interleave_rows", "first": gate.weight, "second": up.weight}
        weight = lowering._prep(
            st, ("interleave", *weights), {**node, "out": f"w_{gate.out}_{up.out}"}
        )
        value = f"{gate.out}{up.out}"
    else:
        glu, indices, weights, weight, value = None, [i], [op.weight], op.weight, op.out
    a, scale = lowering._operand(st, i, op, weight)
    cur = "acc"
    if scale is not None:
        weight = scale[1]
        ep.emit({"op": "scale_rows", "src": "acc", "vector": scale[0], "out": value})
        cur = value
    ep.products[cur] = (a, weight, scale[0] if scale is not None else None)
    if glu is not None:
        if {gate.out, up.out} & set(st.block.outputs):
            # the gate and up projections themselves are wanted (saved for a backward pass)
            node = {"op": "split_pairs", "src": cur, "first": gate.out, "second": up.out}
            ep.emit(node)
            for half in (gate.out, up.out):
                ep.regs[half] = half
                ep.computed.append(half)
        ep.emit({"op": "swiglu", "src": cur, "out": glu.out})
        cur, value = glu.out, glu.out
    ep.regs[value] = cur
    ep.computed.append(value)
    st.done.update(indices)
    emit_gemm(st, i, ep, a, f"{weight}.T", weights, value)


# -- fused QKV + RoPE ------------------------------------------------------------------------------
@dataclass
class QKVPart:
    linear: tuple[int, Linear]
    pairs: tuple[int, PairLayout] | None = None
    rope: tuple[int, RoPEPairs] | None = None


@dataclass
class QKVGroup:
    concat: tuple[int, Concat]
    parts: list[QKVPart]


def _only_consumer(st: _State, value: str) -> tuple[int, GraphOp] | None:
    users = st.consumers(value)
    if len(users) != 1 or value in st.block.outputs:
        return None
    return users[0]


def _part_of(st: _State, value: str) -> QKVPart | None:
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


def qkv_group(st: _State, i: int, op: Linear) -> QKVGroup | None:
    """The fused-QKV pattern containing Linear ``i``, if any."""
    value = op.out
    for _ in range(3):  # Linear → [pair_layout → rope_pairs] → concat
        user = _only_consumer(st, value)
        if user is None:
            return None
        if isinstance(user[1], Concat):
            parts = [_part_of(st, p) for p in user[1].parts]
            if any(p is None for p in parts):
                return None
            return QKVGroup(user, parts)  # type: ignore[arg-type]
        value = user[1].out
    return None


def _lower_qkv(st: _State, group: QKVGroup) -> None:
    from . import lowering

    concat_i, concat = group.concat
    first_i, first = group.parts[0].linear
    rotated = [p for p in group.parts if p.rope is not None]
    if any(p.rope is not None for p in group.parts[len(rotated) :]):
        raise lowering.NoRule(
            concat_i, concat, "the rotated parts (Q, K) must come before the unrotated ones (V)"
        )
    if any(p.linear[1].x != first.x for p in group.parts):
        raise lowering.NoRule(concat_i, concat, "its parts project different inputs")
    tables = {(p.rope[1].cos, p.rope[1].sin) for p in rotated}  # type: ignore[union-attr]
    if len(tables) > 1 or any(p.pairs[1].cos != p.rope[1].cos for p in rotated):  # type: ignore[union-attr]
        raise lowering.NoRule(concat_i, concat, "its rotated parts use different cos/sin tables")
    weights = []
    for part in group.parts:
        w = part.linear[1].weight
        if part.rope is not None:
            head = size_expr_of(st, part.rope[1].cos, 1)
            node = {"kind": "rope_pairs", "weight": w, "head_dim": head, "out": f"{w}_pairs"}
            w = lowering._prep(st, ("rope_pairs", w), node)
        weights.append(w)
    fused = lowering._prep(
        st,
        ("concat", *weights),
        {"kind": "concat_rows", "tensors": weights, "out": f"w_{concat.out}"},
    )
    a, scale = lowering._operand(st, first_i, first, fused)
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
    ep.regs[concat.out] = cur
    ep.computed.append(concat.out)
    for part in group.parts:
        for found in (part.linear, part.pairs, part.rope):
            if found is not None:
                st.done.add(found[0])
    st.done.add(concat_i)
    names = [p.linear[1].weight for p in group.parts]
    emit_gemm(st, first_i, ep, a, f"{fused}.T", names, concat.out)
