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

Both casting conventions (``cast``: Llama rounds ``x̂`` before the weight, Gemma after) lower to
the same Program: the kernel forms ``r ⊙ (x W'ᵀ)`` in fp32 and rounds once, and the sandbox checks
it against the block's reference of either convention.

* **a norm of a whole projection before RoPE** (``norm_before_rotation``, OLMo 2's ``q_norm`` /
  ``k_norm`` over ``heads·D`` columns, lowered with the RoPE chain of ``rope.py``): no tile sees a
  whole row, so the epilogue writes partial sums of squares of the projection, multiplies by γ
  (permuted like the weight) and rotates; ``r`` is a row scale, which commutes with the rotation
  (``rope(r ⊙ q ⊙ γ) = r ⊙ rope(q ⊙ γ)``) while γ does not — so ``rstd`` finishes ``r`` and aux
  ``rescale_rows`` applies it to the stored result (kept in float32 until then, rounded once).

Any other RMSNorm whose output anything but a GEMM reads (or that is a block output) has no
lowering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coda.blocks.ops import Linear, RMSNorm

from ..epilogue import Epilogue
from ..registry import Rule
from ..state import NoRule, PlanState, short_name


class RMSNormRule(Rule):
    op = RMSNorm

    def lower(self, st: PlanState, index: int, op: RMSNorm) -> bool:
        """Check that only GEMMs read the norm (each commutes it into its epilogue)."""
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
        if st.options.gamma == "side_output" and not op.offset:
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
    into the weight) or its stored ``x ⊙ γ`` side output (the weight as is)."""
    found = st.producer(op.x)
    if found is not None and isinstance(found[1], RMSNorm):
        norm = found[1]
        if norm.x not in st.available:
            raise NoRule(
                found[0], norm, f"its input {norm.x!r} is not materialised before the GEMM"
            )
        r = ensure_rstd(st, norm)
        if norm.out in st.scaled:
            return st.scaled[norm.out], (r, weight)
        return norm.x, (r, fold(st, norm, weight))
    if op.x not in st.available:
        raise NoRule(index, op, f"its input {op.x!r} is not materialised by an earlier step")
    return op.x, None


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
