"""``RMSNorm``: lowered into the GEMMs that read it, never as a pass of its own
(docs/algebra.md §1–3).

* **row-scale commutation** (``commute``): a GEMM of ``rmsnorm(x, γ)`` runs on ``x`` itself with
  ``scale_rows(acc, r)``; ``γ`` is folded into the weight (prep ``fold_norm_weight``) and
  ``r = rstd(...)`` is an aux step before the GEMM.
* **statistics from the producer** (``on_producer_store``): when ``x`` is stored by an earlier
  epilogue, that epilogue also writes partial sums of squares and ``rstd`` only finishes them;
  otherwise (a block input, or ``LoweringOptions(stats="pass")``) ``rstd`` makes one pass over
  ``x``.
* **γ as a side output** (``LoweringOptions(gamma="side_output")``): when ``x`` is stored by an
  earlier epilogue, that epilogue also stores ``x ⊙ γ`` (``scale_cols``) and the following GEMMs
  read it with their weights unfolded (docs/algebra.md §1). A norm with an ``offset`` (Gemma's
  ``x̂ · (1 + γ)``) always folds ``offset + γ`` into the weights instead.
* **the norm in a row pass** (``LoweringOptions(gamma="rows")``): after ``rstd``, aux
  ``norm_rows`` writes ``h = r ⊙ x ⊙ (offset + γ)`` (fp32, rounded once) and the following GEMMs
  read ``h`` with their weights as they are and no row scale — ``[M, d]`` written per call
  instead of the fold's ``[N, d]`` read and written, cheaper below ``M = 2N`` tokens (a Llama
  MLP's ``N = 2f``: 16384 at 1B widths). Where ``r`` would be one pass over ``x`` (no epilogue
  wrote its partial sums), aux ``rms_rows`` forms ``r`` and ``h`` in one launch instead
  (``stat_out`` keeps ``r`` under its name, for a backward).

Both casting conventions (``cast``: Llama rounds ``x̂`` before the weight, Gemma after) lower to
the same Program: the kernel forms ``r ⊙ (x W'ᵀ)`` in fp32 and rounds once, and the sandbox checks
it against the block's reference of either convention.

* **a norm of a whole projection before RoPE** (``norm_before_rotation``, OLMo 2's ``q_norm`` /
  ``k_norm`` over ``heads·D`` columns, lowered with the RoPE chain of ``rope.py``): no tile sees a
  whole row, so the epilogue writes partial sums of squares of the projection, multiplies by γ
  (permuted like the weight) and rotates; ``r`` is a row scale, which commutes with the rotation
  (``rope(r ⊙ q ⊙ γ) = r ⊙ rope(q ⊙ γ)``) while γ does not — so ``rstd`` finishes ``r`` and aux
  ``rescale_rows`` applies it to the stored result (kept in float32 until then, rounded once).

* **post-norm** (``apply_post_norm``): a norm of a value an earlier step stored (a GEMM's output,
  whose row spans every N-tile: Gemma's ``post_feedforward_layernorm``, OLMo 2's norms) that
  something other than a GEMM reads: the producing epilogue writes partial sums of squares,
  ``rstd`` finishes them, and aux ``norm_rows`` forms ``residual + r ⊙ y ⊙ (offset + γ)`` — each
  ``Add`` of the norm to a stored tensor is absorbed as that residual (and a ``RowRstd`` of the
  sum, the next norm's statistic, as its ``rstd_out``); the norm alone is materialised only for a
  block output or another reader.

An RMSNorm of a block input whose output anything but a GEMM reads (or that is a block output) has
no lowering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coda.blocks.ops import Add, GraphOp, Linear, RMSNorm, RowRstd

from ..epilogue import Epilogue
from ..registry import Rule
from ..shapes import binding_shapes
from ..state import NoRule, PlanState, short_name


class RMSNormRule(Rule):
    op = RMSNorm

    def lower(self, st: PlanState, index: int, op: RMSNorm) -> bool:
        """A post-norm is finished by aux steps now; otherwise check that only GEMMs read the norm
        (each commutes it into its epilogue)."""
        if is_post_norm(st, op):
            apply_post_norm(st, index, op)
        else:
            st.require_gemm_readers(index, op, "an RMSNorm", "row-scale commutation")
        st.done.add(index)
        return True

    def on_producer_store(self, st: PlanState, ep: Epilogue, value: str, op: RMSNorm) -> None:
        """The epilogue storing the norm's input also writes its partial sums of squares (and
        ``x ⊙ γ`` when γ is a side output)."""
        src = ep.regs[value]
        if st.options.stats == "epilogue" and value not in st.partials:
            partials = f"{value}_sumsq"
            ep.emit(
                {"op": "partial_reduce", "src": src, "kind": "sumsq", "axis": "row", "to": partials}
            )
            st.partials[value] = partials
        if st.options.gamma == "side_output" and not op.offset and not is_post_norm(st, op):
            scaled = f"{value}_{short_name(op.weight)}"
            ep.emit({"op": "scale_cols", "src": src, "vector": op.weight, "out": scaled})
            ep.emit({"op": "store", "src": scaled, "to": scaled})
            st.available.add(scaled)
            st.scaled[op.out] = scaled


def ensure_rstd(st: PlanState, norm: RMSNorm) -> str:
    """The norm's rstd tensor: an aux ``rstd`` step over its input's partials (when an epilogue
    wrote them) or over the input itself, added once."""
    if norm.out not in st.rstd:
        src = st.partials.get(norm.x, norm.x)
        out = f"rstd_{norm.out}"
        st.steps.append({"kind": "rstd", "src": src, "eps": norm.eps, "out": out})
        st.rstd[norm.out] = out
    return st.rstd[norm.out]


def commute(
    st: PlanState, index: int, op: Linear, weight: str
) -> tuple[str, tuple[str, str] | None]:
    """The A operand of Linear ``op`` (graph op ``index``) over ``weight``, and (rstd tensor,
    the weight to use instead) when its input is an RMSNorm output: the norm's input (γ folded
    into the weight) or its stored ``x ⊙ γ`` side output (the weight as is) — or the norm's
    output itself and None (no row scale) when a step wrote it already (a post-norm materialised
    for another reader) or, with ``gamma="rows"``, from a row pass written now."""
    found = st.producer(op.x)
    if found is not None and isinstance(found[1], RMSNorm):
        norm = found[1]
        if norm.out in st.available:  # written already: a row pass, or a post-norm's own
            return norm.out, None
        if norm.x not in st.available:
            raise NoRule(
                found[0], norm, f"its input {norm.x!r} is not materialised before the GEMM"
            )
        r = ensure_rstd(st, norm)
        if norm.out in st.scaled:
            return st.scaled[norm.out], (r, weight)
        if st.options.gamma == "rows":
            return normed_rows(st, norm, r), None
        return norm.x, (r, fold(st, norm, weight))
    if op.x not in st.available:
        raise NoRule(index, op, f"its input {op.x!r} is not materialised by an earlier step")
    return op.x, None


def normed_rows(st: PlanState, norm: RMSNorm, r: str) -> str:
    """The norm's output ``r ⊙ x ⊙ (offset + γ)``, written by one aux ``norm_rows`` (later
    GEMMs reading the norm find it available and read it as is). Where ``r`` is the aux ``rstd``
    just added over the norm's input itself (no epilogue wrote partial sums of it), one aux
    ``rms_rows`` replaces both: ``r`` and the row pass in one launch, ``r`` kept under its
    name."""
    node = {**norm_rows_node(norm, r), "out": norm.out}
    if st.steps and st.steps[-1] == {"kind": "rstd", "src": norm.x, "eps": norm.eps, "out": r}:
        st.steps.pop()  # one aux rms_rows: r and the row pass in one launch
        node = {key: value for key, value in node.items() if key != "rstd"}
        node |= {"kind": "rms_rows", "eps": norm.eps, "stat_out": r}
    st.steps.append(node)
    st.available.add(norm.out)
    return norm.out


def norm_rows_node(norm: RMSNorm, r: str) -> dict[str, Any]:
    """The fields of an aux ``norm_rows`` forming ``r ⊙ x ⊙ (offset + γ)`` for ``norm`` (its
    ``out``, and any ``residual``, are the caller's)."""
    node: dict[str, Any] = {"kind": "norm_rows", "src": norm.x, "rstd": r, "weight": norm.weight}
    if norm.offset:
        node["offset"] = norm.offset
    return node


def fold(st: PlanState, norm: RMSNorm, weight: str) -> str:
    """``weight`` with the norm's ``offset + γ`` folded into its columns (prep
    ``fold_norm_weight``, added once per weight and scale)."""
    node = {"kind": "fold_norm_weight", "weight": weight, "gamma": norm.weight}
    if norm.offset:
        node["offset"] = norm.offset
    key = ("fold", weight, norm.weight) + ((norm.offset,) if norm.offset else ())
    return st.prepare(key, {**node, "out": f"{weight}_folded"})


def norm_before_rotation(
    ep: Epilogue, norm: RMSNorm, cur: str, paired: Callable[[str], str], out: str
) -> tuple[str, dict[str, Any]]:
    """RMSNorm of the projection ``cur`` (in pair order) ahead of RoPE, with ``r`` deferred: the
    epilogue value to rotate (``cur ⊙ (offset + γ)``, γ paired by ``paired``) and the store of
    the rotated tile (float32, unscaled); aux ``rstd`` + ``rescale_rows`` then write ``out``."""
    partials = ep.partials(cur, "sumsq", f"{norm.out}_sumsq")
    r = f"rstd_{norm.out}"
    ep.aux.append({"kind": "rstd", "src": partials, "eps": norm.eps, "out": r})
    g = ep.col(paired(norm.weight))
    factor = f"({norm.offset} + {g})" if norm.offset else g
    weighted = f"{norm.out}_weighted"
    ep.emit({"op": "map", "expr": f"{cur} * {factor}", "out": weighted})
    unscaled = f"{out}_unscaled"
    ep.aux.append({"kind": "rescale_rows", "src": unscaled, "vector": r, "out": out})
    return weighted, {"to": unscaled, "dtype": "float32"}


# -- post-norm: the norm of a stored GEMM output, finished by aux steps ---------------------------
def is_post_norm(st: PlanState, norm: RMSNorm) -> bool:
    """The norm reads a value an earlier graph op produces (not a block input) and something
    other than a GEMM reads its output (or it is a block output)."""
    if st.producer(norm.x) is None:
        return False
    readers = [c for _, c in st.consumers(norm.out)]
    return norm.out in st.block.outputs or any(not isinstance(c, Linear) for c in readers)


def _residual_of(st: PlanState, add: GraphOp, value: str) -> str | None:
    """The other operand of ``Add`` ``add`` of ``value`` when it is a stored tensor of
    ``value``'s shape (the residual stream), else None."""
    if not isinstance(add, Add) or add.a == add.b:
        return None
    other = add.b if add.a == value else add.a
    if other not in st.available or not _same_shape(st, other, value):
        return None
    return other


def _same_shape(st: PlanState, a: str, b: str) -> bool:
    return all(shapes[a] == shapes[b] for _, shapes in binding_shapes(st))


def _next_statistic(st: PlanState, value: str) -> dict[str, object]:
    """``rstd_out`` / ``rstd_eps`` of a ``RowRstd`` of ``value`` (the next norm's statistic, as a
    layer boundary hands it on), absorbed into the ``norm_rows`` that writes ``value``."""
    for j, reader in st.consumers(value):
        if isinstance(reader, RowRstd) and j not in st.done:
            st.done.add(j)
            st.available.add(reader.out)
            return {"rstd_out": reader.out, "rstd_eps": reader.eps}
    return {}


def apply_post_norm(st: PlanState, index: int, norm: RMSNorm) -> None:
    """``r`` from the partial sums of squares the producing epilogue wrote (or one pass over the
    stored input), then one aux ``norm_rows`` per ``Add`` of the norm to a stored tensor (its
    residual; the Add is absorbed) and one for the norm itself when a block output or another
    op that no GEMM is needs it. GEMMs reading the norm commute it as usual."""
    if norm.x not in st.available:
        raise NoRule(
            index,
            norm,
            f"its input {norm.x!r} is not materialised before the norm (a post-norm reads a "
            "stored GEMM output)",
        )
    node = norm_rows_node(norm, ensure_rstd(st, norm))
    standalone = norm.out in st.block.outputs
    for j, reader in st.consumers(norm.out):
        if j in st.done or isinstance(reader, Linear):
            continue
        residual = _residual_of(st, reader, norm.out)
        if residual is None:
            standalone = True
            continue
        step = {**node, "residual": residual, "out": reader.out}
        st.steps.append({**step, **_next_statistic(st, reader.out)})
        st.available.add(reader.out)
        st.done.add(j)
    if standalone:
        st.steps.append({**node, "out": norm.out, **_next_statistic(st, norm.out)})
        st.available.add(norm.out)
