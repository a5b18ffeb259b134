"""Cross-entropy and its pieces on logits in registers (docs/algebra.md §6), forward and backward.

* ``target_logit``: ``logits[i, t_i]`` — recomputed from the GEMM's operands by aux
  ``gather_dot`` when the logits are ``[r ⊙] a @ w.T`` (M dot products), else ``select_column``
  in the epilogue.
* ``logsumexp``: ``partial_reduce(kind="lse")`` + aux ``lse_combine``.
* ``cross_entropy``: a target logit and LSE partials, combined by ``lse_combine(minus=target)``;
  the loss and a log-sum-exp of the same logits share one ``partial_reduce``.
* **backward** of an LM head ``cross_entropy(h Wᵀ, t)`` with ``h = rmsnorm(x)·γ``: the logits are
  recomputed (their log-sum-exp first, unless the forward saved it), ``dz = (softmax − onehot) ·
  dloss`` in the epilogue, the RMSNorm backward in the epilogue of ``dz W``, and the weight
  gradient as a plain GEMM. A softcap between the head and the loss (Gemma 2's
  ``final_logit_softcapping``, ``s = c · tanh(z / c)``) is recomputed next to the logits in both
  passes, and its derivative ``1 − tanh²(z / c)`` multiplies ``dz``; the norm may scale by Gemma's
  ``1 + γ``; a biased head adds its bias to the recomputed logits, and its gradient is the
  column sums of ``dz``.
"""

from __future__ import annotations

from coda.blocks.ops import Activation, CrossEntropy, Linear, LogSumExp, TargetLogit

from ..backward import BackwardBuilder
from ..epilogue import Epilogue
from ..registry import Rule
from .activation import activation_expr


def select_target(ep: Epilogue, logits: str, target: str, to: str) -> None:
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


class TargetLogitRule(Rule):
    op = TargetLogit
    sink = True

    def fuse(self, ep: Epilogue, op: TargetLogit) -> None:
        select_target(ep, op.logits, op.target, op.out)


class LogSumExpRule(Rule):
    op = LogSumExp
    sink = True

    def fuse(self, ep: Epilogue, op: LogSumExp) -> None:
        p = ep.partials(ep.tile(op.logits), "lse", f"{op.out}_partials")
        ep.aux.append({"kind": "lse_combine", "src": p, "out": op.out})


class CrossEntropyRule(Rule):
    op = CrossEntropy
    sink = True
    backward_of = "an LM head with cross-entropy"
    differentiates_biases = True  # a biased head: d bias = Σ_rows dz

    def fuse(self, ep: Epilogue, op: CrossEntropy) -> None:
        # loss_i = LSE_i − logits[i, t_i]: the target from the tile that holds it, LSE from partials
        target = f"{op.out}_target"
        select_target(ep, op.logits, op.target, target)
        p = ep.partials(ep.tile(op.logits), "lse", f"{op.out}_partials")
        ep.aux.append({"kind": "lse_combine", "src": p, "minus": target, "out": op.out})

    def differentiate(self, b: BackwardBuilder) -> None:
        lm_head_backward(b)


# -- backward of the LM head + cross-entropy -------------------------------------------------------
def saved_logsumexp(b: BackwardBuilder, logits: str) -> str | None:
    """The input holding ``logsumexp(logits)`` when the forward saved it for the backward
    (``llama_lm_head_ce_bwd_saved``), else None (the backward recomputes it)."""
    for op in b.forward.graph:
        if isinstance(op, LogSumExp) and op.logits == logits and op.out in b.op.saved:
            return op.out
    return None


def softcapped_logits(b: BackwardBuilder, ce: CrossEntropy) -> tuple[str, float | None]:
    """(the projection the loss reads, the softcap ``c`` between them or None): Gemma 2's
    ``final_logit_softcapping`` puts ``s = c · tanh(z / c)`` between the LM head and the loss."""
    for op in b.forward.graph:
        if op.out == ce.logits and isinstance(op, Activation):
            if op.kind != "softcap":
                b.fail(
                    f"the loss reads activation {op.kind!r} of the logits; the LM-head backward "
                    "differentiates a softcap there (Gemma 2's final_logit_softcapping) or none"
                )
            return op.x, op.cap
    return ce.logits, None


def head_logits(bias: str | None, cap: float | None) -> tuple[list[dict[str, str]], str]:
    """Epilogue ops giving the logits the loss reads from the projection ``z`` — plus the head's
    bias (``zb``), through a softcap ``c · tanh(· / c)`` (``s``) — and that value's name."""
    ops, logits = [], "z"
    if bias is not None:
        ops.append({"op": "add_col_vector", "src": "z", "vector": bias, "out": "zb"})
        logits = "zb"
    if cap is not None:
        ops.append({"op": "map", "expr": activation_expr("softcap", logits, cap), "out": "s"})
        logits = "s"
    return ops, logits


def lm_head_backward(b: BackwardBuilder) -> None:
    _, ce = b.find(CrossEntropy)
    projection, cap = softcapped_logits(b, ce)
    _, head = b.find(Linear, out=projection)
    norm = b.norm(head.x)
    if ce.out not in b.forward.outputs:
        b.fail("the cross-entropy loss must be the block's output")
    dloss = b.cotangent(ce.out)
    r, folded = b.forward_projection(norm, head.weight)
    logits_ops, s = head_logits(head.bias, cap)  # s: the logits the loss reads
    lse = saved_logsumexp(b, ce.logits)
    if lse is None:
        # pass 1: the logits' log-sum-exp from per-tile partials (the logits are never stored)
        lse_partials = b.name("lse_partials")
        b.gemm(
            "lm_head_lse",
            norm.x,
            f"{folded}.T",
            [
                {"op": "scale_rows", "src": "acc", "vector": r, "out": "z"},
                *logits_ops,
                {"op": "partial_reduce", "src": s, "kind": "lse", "to": lse_partials},
            ],
        )
        lse = b.aux({"kind": "lse_combine", "src": lse_partials, "out": "lse"})
    # pass 2: dz = (softmax(s) − onehot(t)) · dloss [· (1 − tanh²(z / c)) through a softcap], and
    # Σ z·dz (z: the projection without the bias), with the logits recomputed
    dz = b.name("dz")
    stats, partials = b.zdz_partials("z", dz)
    if head.bias is not None:  # d bias = Σ_rows dz
        colsum, bias_partials = b.column_sums(dz, f"d{head.bias}")
        stats.append(colsum)
    grad = f"(exp({s} - lse_row) - target_onehot) * dloss_row"
    if cap is not None:  # d/dz c·tanh(z/c) = 1 − tanh²(z/c) = 1 − (s/c)²
        grad += f" * (1 - (s / {cap!r}) ** 2)"
    b.gemm(
        "lm_head_bwd",
        norm.x,
        f"{folded}.T",
        [
            {"op": "scale_rows", "src": "acc", "vector": r, "out": "z"},
            *logits_ops,
            {"op": "load_row_vector", "vector": lse, "out": "lse_row"},
            {"op": "load_row_vector", "vector": dloss, "out": "dloss_row"},
            {"op": "onehot", "index": ce.target, "out": "target_onehot"},
            {"op": "map", "expr": grad, "out": dz},
            *stats,
            {"op": "store", "src": dz, "to": dz},
        ],
    )
    if head.bias is not None:
        b.output(head.bias, b.summed_columns(bias_partials, f"d{head.bias}"))
    c = b.statistic(partials, norm)
    y = b.norm_backward("lm_head_dx", dz, head.weight, norm, r, c, residual=None)
    b.output(head.weight, b.plain_gemm("lm_head_grad", f"{dz}.T", y, "dw_lm"))
