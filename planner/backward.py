"""Lowering rules for backward blocks (a ``vjp`` of a forward block, ``blocks/autodiff.py``).

The rules read the *forward* graph and emit the CODA backward schedule (CODA_MATH §2–5, §7). Every
supported forward block starts with an RMSNorm ``h = rmsnorm(x)·γ`` feeding a projection ``z = h W``
(a gate/up pair, a fused QKV with RoPE, or an LM head); its backward is

1. ``z`` and ``dz`` where they meet — the projection GEMM is recomputed (``r ⊙ (x (W·diag γ)ᵀ)``,
   the backward block gets only the forward inputs) and the head's backward runs in an epilogue:
   SwiGLU backward in the epilogue of ``dout W_down`` (with the saved ``z`` loaded next to it),
   RoPE's inverse rotation of ``dqkv``, or ``softmax − onehot`` from a log-sum-exp; that epilogue
   also writes partial sums of ``z·dz`` (``c = Σ z·dz / d``, §4);
2. the RMSNorm backward in the epilogue of ``dh = dz W``: ``dx = r (dh ⊙ γ − x̂ c)`` (+ the
   residual's gradient), ``y = x̂ ⊙ γ`` stored for the weight gradient, partial column sums of
   ``dh ⊙ x̂``;
3. weight gradients ``dzᵀ y`` (and ``doutᵀ a``) as plain GEMMs on the vendor BLAS; interleaved or
   fused weight gradients are split into the block's outputs by views (no copy), and Q/K rows that
   were permuted into RoPE pairs are put back by ``unpair_rows``.

A forward graph of another shape raises ``NoRule`` naming what is not covered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coda.blocks.autodiff import VJP, Pick
from coda.blocks.block import Block
from coda.blocks.ops import (
    Add,
    Concat,
    CrossEntropy,
    GraphOp,
    Linear,
    LogSumExp,
    RMSNorm,
    SwiGLU,
)

from .fusion import SWIGLU_DG, SWIGLU_DU, size_expr_of

if TYPE_CHECKING:
    from .lowering import _State


def handles(st: _State, i: int, op: GraphOp) -> bool:
    if isinstance(op, Pick):
        st.done.add(i)  # a gradient out of the vjp: lowered with it
        return True
    if isinstance(op, VJP):
        lower_vjp(st, i, op)
        return True
    return False


def lower_vjp(st: _State, i: int, op: VJP) -> None:
    from .lowering import NoRule

    forward = op.forward_block()
    b = _Backward(st, i, op, forward)
    kinds = {type(o) for o in forward.graph}
    if SwiGLU in kinds:
        b.mlp()
    elif Concat in kinds:
        b.attention_in()
    elif CrossEntropy in kinds:
        b.lm_head_ce()
    else:
        raise NoRule(
            i,
            op,
            f"no backward rule for forward block {forward.name!r}: the planner differentiates an "
            "RMSNorm followed by a SwiGLU MLP with residual, a fused QKV projection with RoPE, or "
            "an LM head with cross-entropy",
        )
    st.done.add(i)


class _Backward:
    """Builds one backward program; names are kept clear of the block's own inputs."""

    def __init__(self, st: _State, index: int, op: VJP, forward: Block) -> None:
        self.st, self.index, self.op, self.forward = st, index, op, forward
        self.grad_name = {
            p.key: p.out for p in st.block.graph if isinstance(p, Pick) and p.src == op.out
        }

    # -- plumbing ----------------------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        from .lowering import NoRule

        raise NoRule(self.index, self.op, f"forward block {self.forward.name!r}: {reason}")

    def name(self, base: str) -> str:
        taken = set(self.st.block.inputs) | self.st.available
        name = base
        while name in taken:
            name += "_"
        self.st.available.add(name)
        return name

    def find(self, kind: type, **match: str) -> tuple[int, Any]:
        for j, o in enumerate(self.forward.graph):
            if isinstance(o, kind) and all(getattr(o, k) == v for k, v in match.items()):
                return j, o
        self.fail(f"expected a {kind.__name__} with {match or 'any inputs'}")
        raise AssertionError  # unreachable

    def norm(self, consumer_x: str) -> RMSNorm:
        """The RMSNorm producing ``consumer_x``, whose input must be a forward input."""
        _, norm = self.find(RMSNorm, out=consumer_x)
        if norm.x not in self.forward.inputs or norm.weight not in self.forward.inputs:
            self.fail("the RMSNorm's input and weight must be block inputs")
        return norm

    def prep(self, key: tuple, node: dict[str, Any]) -> str:
        from .lowering import _prep

        return _prep(self.st, key, {**node, "out": self.name(node["out"])})

    def gemm(self, name: str, a: str, b: str, epilogue: list[dict[str, Any]]) -> None:
        self.st.steps.append(
            {
                "kind": "gemm",
                "name": name,
                "a": a,
                "b": b,
                "epilogue": epilogue,
                "config": self.st.options.config,
            }
        )

    def plain_gemm(self, name: str, a: str, b: str, out: str) -> str:
        """``out = a @ b`` with only a store: runs on the vendor GEMM."""
        out = self.name(out)
        self.gemm(name, a, b, [{"op": "store", "src": "acc", "to": out}])
        return out

    def aux(self, node: dict[str, Any]) -> str:
        node = {**node, "out": self.name(node["out"])}
        self.st.steps.append(node)
        return node["out"]

    def output(self, wrt: str, value: Any) -> None:
        """Block output ``d<wrt>`` is program tensor (or view) ``value``."""
        if wrt in self.grad_name:
            self.st.outputs[self.grad_name[wrt]] = value

    def cotangent(self, forward_output: str) -> str:
        if forward_output not in self.op.cotangents:
            self.fail(f"the backward block gives no gradient for output {forward_output!r}")
        return self.op.cotangents[forward_output]

    # -- shared pieces -----------------------------------------------------------------------------
    def rstd(self, norm: RMSNorm) -> str:
        """The norm's ``r``: one pass over its input (cheap next to the GEMMs)."""
        return self.aux({"kind": "rstd", "src": norm.x, "eps": norm.eps, "out": f"rstd_{norm.out}"})

    def forward_projection(self, norm: RMSNorm, weight: str) -> tuple[str, str]:
        """(rstd of x, γ folded into ``weight``) for recomputing ``z = r ⊙ (x W_foldedᵀ)``."""
        r = self.rstd(norm)
        node = {"kind": "fold_norm_weight", "weight": weight, "gamma": norm.weight}
        folded = self.prep(("fold", weight, norm.weight), {**node, "out": f"{weight}_folded"})
        return r, folded

    def statistic(self, partials: str, norm: RMSNorm) -> str:
        """``c = Σ z·dz / d`` from the epilogue's partial sums (d = the norm's width)."""
        width = size_expr_of(self.st, norm.x, 1)
        node = {"kind": "sum_partials", "src": partials, "divide_by": width, "out": "c"}
        return self.aux(node)

    def zdz_partials(self, z: str, dz: str) -> tuple[list[dict[str, Any]], str]:
        partials = self.name("zdz_partials")
        return [
            {"op": "map", "expr": f"{z} * {dz}", "out": "zdz_terms"},
            {"op": "partial_reduce", "src": "zdz_terms", "kind": "sum", "to": partials},
        ], partials

    def norm_backward(
        self, name: str, dz: str, weight: str, norm: RMSNorm, r: str, c: str, residual: str | None
    ) -> str:
        """``dh = dz W`` with RMSNorm's backward in its epilogue; returns the stored ``y``."""
        dx, y = self.name("dx"), self.name("y")
        dgamma_partials = self.name("dgamma_partials")
        dx_norm = "dx_norm" if residual else dx
        epilogue = [
            {"op": "load_tile", "tensor": norm.x, "out": "x_tile"},
            {"op": "load_row_vector", "vector": r, "out": "r_row"},
            {"op": "load_col_vector", "vector": norm.weight, "out": "gamma_col"},
            {"op": "load_row_vector", "vector": c, "out": "c_row"},
            # dx = r ⊙ (dh ⊙ γ − x̂ · c), x̂ = r ⊙ x (CODA_MATH §4); acc = dh
            {
                "op": "map",
                "expr": "r_row * (acc * gamma_col - r_row * x_tile * c_row)",
                "out": dx_norm,
            },
        ]
        if residual:
            # the residual branch's gradient joins here: dx = dout + the norm's part
            epilogue.append({"op": "add_tile", "src": dx_norm, "tensor": residual, "out": dx})
        epilogue += [
            {"op": "store", "src": dx, "to": dx},
            # y = x̂ ⊙ γ, the norm's output, for the weight gradient dzᵀ y
            {"op": "map", "expr": "x_tile * r_row * gamma_col", "out": y},
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
        ]
        self.gemm(name, dz, weight, epilogue)
        dgamma = self.aux(
            {"kind": "sum_partials", "src": dgamma_partials, "dtype": "act", "out": "dgamma"}
        )
        self.output(norm.x, dx)
        self.output(norm.weight, dgamma)
        return y

    # -- MLP: x + down(silu(gate(h)) · up(h)), or the branch alone --------------------------------
    def mlp(self) -> None:
        fwd = self.forward
        _, glu = self.find(SwiGLU)
        _, gate = self.find(Linear, out=glu.gate)
        _, up = self.find(Linear, out=glu.up)
        _, down = self.find(Linear, x=glu.out)
        if gate.x != up.x:
            self.fail("gate and up project different inputs")
        norm = self.norm(gate.x)
        add = next((o for o in fwd.graph if isinstance(o, Add) and down.out in o.inputs()), None)
        if add is not None:  # x + mlp(x): the residual's gradient joins the norm's in dx
            if norm.x not in add.inputs() or add.out not in fwd.outputs:
                self.fail("the MLP's output must be added to the norm's input (the residual)")
            dout = self.cotangent(add.out)
        elif down.out in fwd.outputs:  # the branch alone (llama_mlp_branch): dx is the norm's
            dout = self.cotangent(down.out)
        else:
            self.fail("the MLP's output must be a block output, or added to the norm's input")
        interleave = {"kind": "interleave_rows", "first": gate.weight, "second": up.weight}
        w_gu = self.prep(("interleave", gate.weight, up.weight), {**interleave, "out": "w_gu"})
        if {gate.out, up.out} <= set(self.op.saved):
            r = self.rstd(norm)
            a_saved = glu.out if glu.out in self.op.saved else None
            dz, a, partials = self.swiglu_backward_saved(
                dout, down.weight, gate.out, up.out, a_saved
            )
        else:
            r, dz, a, partials = self.swiglu_backward_recomputed(norm, w_gu, dout, down.weight)
        c = self.statistic(partials, norm)
        self.output(down.weight, self.plain_gemm("w_down_grad", f"{dout}.T", a, "dw_down"))
        residual = dout if add is not None else None
        y = self.norm_backward("gate_up_bwd", dz, w_gu, norm, r, c, residual=residual)
        dw_gu = self.plain_gemm("w_gate_up_grad", f"{dz}.T", y, "dw_gu")
        # the interleaved gradient's even rows are the gate's, odd rows the up projection's
        self.output(gate.weight, {"tensor": dw_gu, "dim": 0, "step": 2})
        self.output(up.weight, {"tensor": dw_gu, "dim": 0, "start": "1", "step": 2})

    def swiglu_backward_saved(
        self, dout: str, w_down: str, g: str, u: str, a_saved: str | None = None
    ) -> tuple[str, str, str]:
        """da = dout W_down with SwiGLU's backward next to the saved g and u (N wide each):
        dz = [dg, du] interleaved, partial Σ (g·dg + u·du), and a = silu(g)·u recomputed for the
        down projection's weight gradient — unless the forward saved it too (``a_saved``)."""
        dz, partials = self.name("dz"), self.name("zdz_partials")
        a = a_saved or self.name("a")
        recompute_a = [
            {"op": "map", "expr": "silu(g_tile) * u_tile", "out": a},
            {"op": "store", "src": a, "to": a},
        ]
        self.gemm(
            "down_bwd",
            dout,
            w_down,
            [
                {"op": "load_tile", "tensor": g, "out": "g_tile"},
                {"op": "load_tile", "tensor": u, "out": "u_tile"},
                # d/dg silu(g)·u = u·σ(g)·(1 + g(1 − σ(g))), d/du = silu(g) (CODA_MATH §2)
                {
                    "op": "map",
                    "expr": "acc * u_tile * sigmoid(g_tile) * (1 + g_tile * (1 - sigmoid(g_tile)))",
                    "out": "dg",
                },
                {"op": "map", "expr": "acc * silu(g_tile)", "out": "du"},
                {"op": "join_pairs", "first": "dg", "second": "du", "out": dz},
                {"op": "map", "expr": "g_tile * dg + u_tile * du", "out": "zdz_terms"},
                {"op": "partial_reduce", "src": "zdz_terms", "kind": "sum", "to": partials},
                {"op": "store", "src": dz, "to": dz},
                *([] if a_saved else recompute_a),
            ],
        )
        return dz, a, partials

    def swiglu_backward_recomputed(
        self, norm: RMSNorm, w_gu: str, dout: str, w_down: str
    ) -> tuple[str, str, str, str]:
        """z = r ⊙ (x W_guᵀ) recomputed and stored, then SwiGLU's backward next to it."""
        r, folded = self.forward_projection(norm, w_gu)
        # z = r ⊙ (x W_guᵀ): the saved pre-activation [g0, u0, g1, u1, ...], recomputed
        z = self.name("z")
        self.gemm(
            "gate_up",
            norm.x,
            f"{folded}.T",
            [
                {"op": "scale_rows", "src": "acc", "vector": r, "out": "z_acc"},
                {"op": "store", "src": "z_acc", "to": z},
            ],
        )
        # da = dout W_down; SwiGLU backward next to the loaded z (2N wide): dz, a, Σ z·dz
        dz, a = self.name("dz"), self.name("a")
        stats, partials = self.zdz_partials("z_tile", dz)
        self.gemm(
            "down_bwd",
            dout,
            w_down,
            [
                {"op": "load_tile", "tensor": z, "out": "z_tile"},
                {
                    "op": "pairwise",
                    "src": "z_tile",
                    "expr0": SWIGLU_DG.format(da="acc"),
                    "expr1": SWIGLU_DU.format(da="acc"),
                    "out": dz,
                },
                {"op": "swiglu", "src": "z_tile", "out": a},
                *stats,
                {"op": "store", "src": dz, "to": dz},
                {"op": "store", "src": a, "to": a},
            ],
        )
        return r, dz, a, partials

    # -- attention input: fused QKV + RoPE ---------------------------------------------------------
    def attention_in(self) -> None:
        from .fusion import qkv_group

        _, concat = self.find(Concat)
        first = self.find(Linear)
        # the forward rule's pattern, matched on the forward graph (a planner state of its own)
        group = qkv_group(self.st.__class__(self.forward, self.st.options), *first)
        if group is None or group.concat[1] is not concat or concat.out not in self.forward.outputs:
            self.fail(
                "expected Linears of one normed input, Q/K through pair_layout + rope_pairs, "
                "concatenated into the block's output"
            )
        norm = self.norm(first[1].x)
        dqkv = self.cotangent(concat.out)
        rotated = [p for p in group.parts if p.rope is not None]
        cos, sin = (rotated[0].rope[1].cos, rotated[0].rope[1].sin) if rotated else ("", "")
        weights = []
        for part in group.parts:
            w = part.linear[1].weight
            if part.rope is not None:
                head = size_expr_of(self.st, cos, 1)
                node = {"kind": "rope_pairs", "weight": w, "head_dim": head, "out": f"{w}_pairs"}
                w = self.prep(("rope_pairs", w), node)
            weights.append(w)
        node = {"kind": "concat_rows", "tensors": weights, "out": "w_qkv"}
        w_qkv = self.prep(("concat", *weights), node)
        widths = [size_expr_of(self.st, p.linear[1].weight, 0) for p in group.parts]
        rot_cols = " + ".join(widths[: len(rotated)]) if len(rotated) < len(group.parts) else None
        if concat.out in self.op.saved:
            r, dz, c = self.qkv_backward_saved(norm, concat.out, dqkv, cos, sin, rot_cols)
        else:
            r, dz, c = self.qkv_backward_recomputed(
                norm, w_qkv, dqkv, cos, sin, rot_cols, rotated=bool(rotated)
            )
        y = self.norm_backward("qkv_bwd", dz, w_qkv, norm, r, c, residual=None)
        dw = self.plain_gemm("w_qkv_grad", f"{dz}.T", y, "dw_qkv_pairs" if rotated else "dw_qkv")
        if rotated:
            node = {"kind": "unpair_rows", "src": dw, "head_dim": size_expr_of(self.st, cos, 1)}
            if rot_cols:
                node["rows"] = rot_cols
            dw = self.aux({**node, "out": "dw_qkv"})
        start = "0"
        for part, width in zip(group.parts, widths, strict=True):
            stop = width if start == "0" else f"{start} + {width}"
            view = {"tensor": dw, "dim": 0, "start": start, "stop": stop}
            self.output(part.linear[1].weight, view)
            start = stop

    def qkv_backward_saved(
        self, norm: RMSNorm, qkv: str, dqkv: str, cos: str, sin: str, rot_cols: str | None
    ) -> tuple[str, str, str]:
        """(r, dz, c) from the saved output, in one pass and no GEMM: dz = the inverse rotation of
        dqkv, c = Σ qkv·dqkv / d (a rotation keeps dot products: Σ z·dz = Σ qkv·dqkv)."""
        if not cos:
            self.fail("a saved QKV output is lowered only with RoPE (rope_rows inverts it)")
        r = self.rstd(norm)
        node = {
            "kind": "rope_rows",
            "src": dqkv,
            "cos": cos,
            "sin": sin,
            "inverse": True,
            "dot": qkv,
            "dot_out": self.name("c"),
            "divide_by": size_expr_of(self.st, norm.x, 1),
            "out": "dz",
        }
        if rot_cols:
            node["rotary_cols"] = rot_cols
        return r, self.aux(node), node["dot_out"]

    def qkv_backward_recomputed(
        self,
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
        r, folded = self.forward_projection(norm, w_qkv)
        dz = self.name("dz")
        stats, partials = self.zdz_partials("z", dz)
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
        self.gemm("qkv_rope_bwd", norm.x, f"{folded}.T", epilogue)
        return r, dz, self.statistic(partials, norm)

    # -- LM head + cross-entropy -------------------------------------------------------------------
    def saved_logsumexp(self, logits: str) -> str | None:
        """The input holding ``logsumexp(logits)`` when the forward saved it for the backward
        (``llama_lm_head_ce_bwd_saved``), else None (the backward recomputes it)."""
        for op in self.forward.graph:
            if isinstance(op, LogSumExp) and op.logits == logits and op.out in self.op.saved:
                return op.out
        return None

    def lm_head_ce(self) -> None:
        _, ce = self.find(CrossEntropy)
        _, head = self.find(Linear, out=ce.logits)
        norm = self.norm(head.x)
        if ce.out not in self.forward.outputs:
            self.fail("the cross-entropy loss must be the block's output")
        dloss = self.cotangent(ce.out)
        r, folded = self.forward_projection(norm, head.weight)
        lse = self.saved_logsumexp(ce.logits)
        if lse is None:
            # pass 1: the logits' log-sum-exp from per-tile partials (the logits are never stored)
            lse_partials = self.name("lse_partials")
            self.gemm(
                "lm_head_lse",
                norm.x,
                f"{folded}.T",
                [
                    {"op": "scale_rows", "src": "acc", "vector": r, "out": "z"},
                    {"op": "partial_reduce", "src": "z", "kind": "lse", "to": lse_partials},
                ],
            )
            lse = self.aux({"kind": "lse_combine", "src": lse_partials, "out": "lse"})
        # pass 2: dz = (softmax(z) − onehot(t)) · dloss, and Σ z·dz, with the logits recomputed
        dz = self.name("dz")
        stats, partials = self.zdz_partials("z", dz)
        self.gemm(
            "lm_head_bwd",
            norm.x,
            f"{folded}.T",
            [
                {"op": "scale_rows", "src": "acc", "vector": r, "out": "z"},
                {"op": "load_row_vector", "vector": lse, "out": "lse_row"},
                {"op": "load_row_vector", "vector": dloss, "out": "dloss_row"},
                {"op": "onehot", "index": ce.target, "out": "target_onehot"},
                {
                    "op": "map",
                    "expr": "(exp(z - lse_row) - target_onehot) * dloss_row",
                    "out": dz,
                },
                *stats,
                {"op": "store", "src": dz, "to": dz},
            ],
        )
        c = self.statistic(partials, norm)
        y = self.norm_backward("lm_head_dx", dz, head.weight, norm, r, c, residual=None)
        self.output(head.weight, self.plain_gemm("lm_head_grad", f"{dz}.T", y, "dw_lm"))
