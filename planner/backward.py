"""The builder of backward Programs (a ``vjp`` of a forward block, ``blocks/autodiff.py``).

A backward block is lowered from its *forward* graph (docs/algebra.md §2–5, §7): the rule
of the forward block's head op (``Rule.differentiate``: SwiGLU's, Concat's, CrossEntropy's)
writes the schedule with a ``BackwardBuilder``. Every supported forward block starts with an RMSNorm
``h = rmsnorm(x)·γ`` (or Gemma's ``·(1 + γ)``) feeding a projection ``z = h W``; its backward is

1. ``z`` and ``dz`` where they meet — the projection GEMM is recomputed (``r ⊙ (x (W·diag γ)ᵀ)``,
   the backward block gets only the forward inputs) or read from what the forward saved, and the
   head's backward runs in an epilogue (the head's rule); that epilogue also writes partial sums of
   ``z·dz`` (``c = Σ z·dz / d``, §4: ``zdz_partials``, ``statistic``);
   The norm's statistic ``r`` is an aux ``rstd`` pass over ``x``, or the forward's own when it
   saved it (``rstd``);
2. the RMSNorm backward in the epilogue of ``dh = dz W`` (``norm_backward``):
   ``dx = r (dh ⊙ γ − x̂ c)`` (+ the residual's gradient), ``y = x̂ ⊙ γ`` stored for the weight
   gradient, partial column sums of ``dh ⊙ x̂``;
3. weight gradients ``dzᵀ y`` as plain GEMMs on the vendor BLAS (``plain_gemm``); interleaved or
   fused weight gradients are split into the block's outputs by views (``output``).

A forward graph of another shape raises ``NoRule`` naming what is not covered (``fail``).
"""

from __future__ import annotations

from typing import Any, NoReturn

from coda.blocks.autodiff import VJP, Pick
from coda.blocks.block import Block
from coda.blocks.ops import RMSNorm, RowRstd

from .shapes import size_expr_of
from .state import NoRule, PlanState


class BackwardBuilder:
    """Builds one backward program into ``st``; names are kept clear of the block's own inputs.

    ``op`` is the ``vjp`` node (graph op ``index``), ``forward`` the block it differentiates.
    """

    def __init__(self, st: PlanState, index: int, op: VJP, forward: Block) -> None:
        self.st, self.index, self.op, self.forward = st, index, op, forward
        self.grad_name = {
            p.key: p.out for p in st.block.graph if isinstance(p, Pick) and p.src == op.out
        }

    # -- plumbing ----------------------------------------------------------------------------------
    def fail(self, reason: str) -> NoReturn:
        """Raise ``NoRule`` for the vjp, naming the forward block and what its graph lacks."""
        raise NoRule(self.index, self.op, f"forward block {self.forward.name!r}: {reason}")

    def name(self, base: str) -> str:
        """A fresh program tensor name from ``base`` (``_`` appended while taken)."""
        taken = set(self.st.block.inputs) | self.st.available
        name = base
        while name in taken:
            name += "_"
        self.st.available.add(name)
        return name

    def find(self, kind: type, **match: str) -> tuple[int, Any]:
        """(index, op) of the first forward op of type ``kind`` whose fields equal ``match``."""
        for j, o in enumerate(self.forward.graph):
            if isinstance(o, kind) and all(getattr(o, k) == v for k, v in match.items()):
                return j, o
        self.fail(f"expected a {kind.__name__} with {match or 'any inputs'}")

    def norm(self, consumer_x: str) -> RMSNorm:
        """The RMSNorm producing ``consumer_x``, whose input must be a forward input."""
        _, norm = self.find(RMSNorm, out=consumer_x)
        if norm.x not in self.forward.inputs or norm.weight not in self.forward.inputs:
            self.fail("the RMSNorm's input and weight must be block inputs")
        return norm

    def prep(self, key: tuple, node: dict[str, Any]) -> str:
        """Prep step ``node`` (once per ``key``), its output named clear of the block's."""
        return self.st.prepare(key, {**node, "out": self.name(node["out"])})

    def gemm(self, name: str, a: str, b: str, epilogue: list[dict[str, Any]]) -> None:
        self.st.add_gemm(name, a, b, epilogue)

    def plain_gemm(self, name: str, a: str, b: str, out: str) -> str:
        """``out = a @ b`` with only a store: runs on the vendor GEMM."""
        out = self.name(out)
        self.gemm(name, a, b, [{"op": "store", "src": "acc", "to": out}])
        return out

    def aux(self, node: dict[str, Any]) -> str:
        """Append aux step ``node`` (its output renamed clear of the block's); its output."""
        node = {**node, "out": self.name(node["out"])}
        self.st.steps.append(node)
        return node["out"]

    def weight_gradients(self, node: dict[str, Any], weights: list[str], rows: list[str]) -> None:
        """Append aux ``node`` — ``unpair_rows`` or ``split_rows`` of a fused weight gradient —
        with one part per weight of ``weights`` (``rows`` each, in order), and make each part
        that weight's gradient: a tensor of its own, where row views of one tensor would be
        copied apart by a caller whose results may not alias."""
        names = [self.name(f"d{w}") for w in weights]
        node = {**node, "parts": [{"out": n, "rows": r} for n, r in zip(names, rows, strict=True)]}
        self.st.steps.append(node)
        for weight, name in zip(weights, names, strict=True):
            self.output(weight, name)

    def output(self, wrt: str, value: Any) -> None:
        """Block output ``d<wrt>`` is program tensor (or view) ``value``."""
        if wrt in self.grad_name:
            self.st.outputs[self.grad_name[wrt]] = value

    def cotangent(self, forward_output: str) -> str:
        """The backward block's input holding the gradient of ``forward_output``."""
        if forward_output not in self.op.cotangents:
            self.fail(f"the backward block gives no gradient for output {forward_output!r}")
        return self.op.cotangents[forward_output]

    # -- shared pieces -----------------------------------------------------------------------------
    def rstd(self, norm: RMSNorm) -> str:
        """The norm's ``r``: the backward block's input when the forward saved it (a ``RowRstd``
        of the norm's input with its epsilon, in ``saved``: ``saved_rstd``), else one pass over
        its input (cheap next to the GEMMs, but a launch)."""
        saved = self.saved_rstd(norm)
        if saved is not None:
            return saved
        return self.aux({"kind": "rstd", "src": norm.x, "eps": norm.eps, "out": f"rstd_{norm.out}"})

    def saved_rstd(self, norm: RMSNorm) -> str | None:
        """The saved forward value that is ``norm``'s statistic — a ``RowRstd`` of the norm's
        input with the norm's epsilon, computed in fp32 as the norm's own — or None."""
        return next(
            (
                op.out
                for op in self.forward.graph
                if isinstance(op, RowRstd)
                and op.out in self.op.saved
                and (op.x, op.eps) == (norm.x, norm.eps)
            ),
            None,
        )

    def forward_projection(self, norm: RMSNorm, weight: str) -> tuple[str, str]:
        """(rstd of x, γ folded into ``weight``) for recomputing ``z = r ⊙ (x W_foldedᵀ)``."""
        r = self.rstd(norm)
        node = {"kind": "fold_norm_weight", "weight": weight, "gamma": norm.weight}
        key = ("fold", weight, norm.weight)
        if norm.offset:  # Gemma's x̂ · (1 + γ): the weight scaled by offset + γ
            node["offset"] = norm.offset
            key += (norm.offset,)
        folded = self.prep(key, {**node, "out": f"{weight}_folded"})
        return r, folded

    def statistic(self, partials: str, norm: RMSNorm) -> str:
        """``c = Σ z·dz / d`` from the epilogue's partial sums (d = the norm's width)."""
        width = size_expr_of(self.st, norm.x, 1)
        node = {"kind": "sum_partials", "src": partials, "divide_by": width, "out": "c"}
        return self.aux(node)

    def zdz_partials(self, z: str, dz: str) -> tuple[list[dict[str, Any]], str]:
        """Epilogue ops writing partial row sums of ``z·dz``, and the partials buffer's name."""
        partials = self.name("zdz_partials")
        return [
            {"op": "map", "expr": f"{z} * {dz}", "out": "zdz_terms"},
            {"op": "partial_reduce", "src": "zdz_terms", "kind": "sum", "to": partials},
        ], partials

    def column_sums(self, src: str, base: str) -> tuple[dict[str, Any], str]:
        """An epilogue op writing partial column sums of ``src`` per row block (a bias gradient
        ``Σ_rows dz``), and the partials buffer's name."""
        partials = self.name(f"{base}_partials")
        node = {"op": "partial_reduce", "src": src, "kind": "sum", "axis": "col", "to": partials}
        return node, partials

    def summed_columns(self, partials: str, base: str) -> str:
        """The column sums from ``column_sums``' partials (aux ``sum_partials``, the activation
        dtype, as a bias is)."""
        return self.aux({"kind": "sum_partials", "src": partials, "dtype": "act", "out": base})

    def post_norm_backward(
        self,
        post: RMSNorm,
        a: str,
        w_down: str,
        dh: str,
        extra: list[dict[str, Any]] | None = None,
    ) -> str:
        """The gradient of ``m = a W_downᵀ`` through a post-norm ``p = RMSNorm(m)`` given ``dp =
        dh``: ``dm = r ⊙ (dh ⊙ γ' − r² m · s / d)``, ``s = Σ dh ⊙ γ' ⊙ m`` (γ' = offset + γ).
        ``m`` is recomputed twice, never stored: the first GEMM's epilogue writes partial sums of
        ``m²`` and of ``dh ⊙ γ' ⊙ m`` (``r`` and ``s`` span every N-tile), the second forms ``dm``
        and the partial column sums of ``dγ = Σ_rows dh ⊙ r m`` (and ``extra`` ops on its ``[M, d]``
        tiles, ``dh_tile`` loaded: e.g. the residual's gradient stored). Returns ``dm``."""
        if post.weight not in self.forward.inputs:
            self.fail(f"the post-norm's weight {post.weight!r} must be a block input")
        scale = f"(gamma_col + {post.offset!r})" if post.offset else "gamma_col"
        sumsq, s_partials = self.name("m_sumsq"), self.name("dhm_partials")
        loads = [
            {"op": "load_tile", "tensor": dh, "out": "dh_tile"},
            {"op": "load_col_vector", "vector": post.weight, "out": "gamma_col"},
        ]
        self.gemm(
            "post_norm_stats",
            a,
            f"{w_down}.T",
            [
                {"op": "partial_reduce", "src": "acc", "kind": "sumsq", "to": sumsq},
                *loads,
                {"op": "map", "expr": f"dh_tile * {scale} * acc", "out": "dhm_terms"},
                {"op": "partial_reduce", "src": "dhm_terms", "kind": "sum", "to": s_partials},
            ],
        )
        r = self.aux({"kind": "rstd", "src": sumsq, "eps": post.eps, "out": f"rstd_{post.out}"})
        width = size_expr_of(self.st, dh, 1)
        node = {"kind": "sum_partials", "src": s_partials, "divide_by": width, "out": "c_post"}
        c = self.aux(node)
        dm, dgamma_partials = self.name("dm"), self.name("dgamma_post_partials")
        self.gemm(
            "post_norm_bwd",
            a,
            f"{w_down}.T",
            [
                *loads,
                {"op": "load_row_vector", "vector": r, "out": "r_row"},
                {"op": "load_row_vector", "vector": c, "out": "c_row"},
                {
                    "op": "map",
                    "expr": f"r_row * (dh_tile * {scale} - r_row * r_row * acc * c_row)",
                    "out": dm,
                },
                {"op": "store", "src": dm, "to": dm},
                {"op": "map", "expr": "dh_tile * acc * r_row", "out": "dgamma_terms"},
                {
                    "op": "partial_reduce",
                    "src": "dgamma_terms",
                    "kind": "sum",
                    "axis": "col",
                    "to": dgamma_partials,
                },
                *(extra or []),
            ],
        )
        self.output(post.weight, self.summed_columns(dgamma_partials, f"d{post.weight}"))
        return dm

    def norm_backward(
        self,
        name: str,
        dz: str,
        weight: str,
        norm: RMSNorm,
        r: str,
        c: str,
        residual: str | None,
        extra: list[dict[str, Any]] | None = None,
    ) -> str:
        """``dh = dz W`` with RMSNorm's backward in its epilogue (and ``extra`` ops on the same
        ``[M, d]`` tiles, e.g. a bias gradient's column sums); returns the stored ``y``."""
        dx, y = self.name("dx"), self.name("y")
        dgamma_partials = self.name("dgamma_partials")
        dx_norm = "dx_norm" if residual else dx
        # the norm's scale: γ, or offset + γ (Gemma's 1 + γ; dγ is the same either way)
        scale = f"(gamma_col + {norm.offset!r})" if norm.offset else "gamma_col"
        epilogue = [
            {"op": "load_tile", "tensor": norm.x, "out": "x_tile"},
            {"op": "load_row_vector", "vector": r, "out": "r_row"},
            {"op": "load_col_vector", "vector": norm.weight, "out": "gamma_col"},
            {"op": "load_row_vector", "vector": c, "out": "c_row"},
            # dx = r ⊙ (dh ⊙ γ − x̂ · c), x̂ = r ⊙ x (docs/algebra.md §4); acc = dh
            {
                "op": "map",
                "expr": f"r_row * (acc * {scale} - r_row * x_tile * c_row)",
                "out": dx_norm,
            },
        ]
        if residual:
            # the residual branch's gradient joins here: dx = dout + the norm's part
            epilogue.append({"op": "add_tile", "src": dx_norm, "tensor": residual, "out": dx})
        epilogue += [
            {"op": "store", "src": dx, "to": dx},
            # y = x̂ ⊙ γ, the norm's output, for the weight gradient dzᵀ y
            {"op": "map", "expr": f"x_tile * r_row * {scale}", "out": y},
            {"op": "store", "src": y, "to": y},
            # dγ = Σ_rows dh ⊙ x̂: partial column sums per row block
            {"op": "map", "expr": "acc * x_tile * r_row", "out": "dgamma_terms"},
            {
                "op": "partial_reduce",
                "src": "dgamma_terms",
                "kind": "sum",
                "axis": "col",
                "to": dgamma_partials,
            },
            *(extra or []),
        ]
        self.gemm(name, dz, weight, epilogue)
        dgamma = self.aux(
            {"kind": "sum_partials", "src": dgamma_partials, "dtype": "act", "out": "dgamma"}
        )
        self.output(norm.x, dx)
        self.output(norm.weight, dgamma)
        return y
