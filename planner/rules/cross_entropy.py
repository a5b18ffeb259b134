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
  gradient as a plain GEMM.
"""

from __future__ import annotations

from coda.blocks.ops import CrossEntropy, Linear, LogSumExp, TargetLogit

from ..backward import BackwardBuilder
from ..epilogue import Epilogue
from ..registry import Rule


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


def lm_head_backward(b: BackwardBuilder) -> None:
    _, ce = b.find(CrossEntropy)
    _, head = b.find(Linear, out=ce.logits)
    norm = b.norm(head.x)
    if ce.out not in b.forward.outputs:
        b.fail("the cross-entropy loss must be the block's output")
    dloss = b.cotangent(ce.out)
    r, folded = b.forward_projection(norm, head.weight)
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
                {"op": "partial_reduce", "src": "z", "kind": "lse", "to": lse_partials},
            ],
        )
        lse = b.aux({"kind": "lse_combine", "src": lse_partials, "out": "lse"})
    # pass 2: dz = (softmax(z) − onehot(t)) · dloss, and Σ z·dz, with the logits recomputed
    dz = b.name("dz")
    stats, partials = b.zdz_partials("z", dz)
    b.gemm(
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
    c = b.statistic(partials, norm)
    y = b.norm_backward("lm_head_dx", dz, head.weight, norm, r, c, residual=None)
    b.output(head.weight, b.plain_gemm("lm_head_grad", f"{dz}.T", y, "dw_lm"))
