"""The backward of a Linear added to the residual, optionally through a post-norm: an attention
output ``out = x + attn W_oᵀ`` (Llama, Mistral) or ``out = x + RMSNorm(attn W_oᵀ)·γ`` (OLMo 2's
post-norm), differentiated from the ``Add`` that ends it (``AddRule.differentiate``).

* the residual passes the gradient through: ``dx = dout``. A backward block that hands it on
  itself (``VJP.passthrough``) gets no ``dx``; otherwise it is stored from the post-norm's GEMM or
  copied by aux ``rescale_rows`` without a vector (a block output is never a block input);
* ``m = attn W_oᵀ`` gets ``dm = dout``, or through the post-norm ``BackwardBuilder.
  post_norm_backward`` (``m`` recomputed in two GEMMs, ``dγ`` as partial column sums);
* ``d attn = dm W_o`` and ``dW_o = dmᵀ attn``: plain GEMMs on the vendor BLAS.
"""

from __future__ import annotations

from coda.blocks.ops import Add, GraphOp, Linear, RMSNorm, RowRstd

from ..backward import BackwardBuilder


def residual_linear_backward(b: BackwardBuilder) -> None:
    """Write the schedule above for a forward graph ``Linear [→ RMSNorm] → Add``."""
    add, linear, post = _residual_linear(b)
    dout = b.cotangent(add.out)
    residual = next(v for v in add.inputs() if v != (post.out if post else linear.out))
    wants_dx = residual in b.grad_name  # not when the caller hands dout on (passthrough)
    dx = b.name(f"d{residual}") if wants_dx else None
    if post is not None:  # dx = dout stored from the post-norm GEMM's [M, d] tiles
        store = [{"op": "store", "src": "dh_tile", "to": dx}] if dx else []
        dm = b.post_norm_backward(post, linear.x, linear.weight, dout, extra=store)
    else:  # no GEMM has [M, d] tiles: one copying pass (outputs are never inputs)
        dm = dout
        if dx:
            b.st.steps.append({"kind": "rescale_rows", "src": dout, "out": dx})
    b.output(linear.x, b.plain_gemm("linear_input_grad", dm, linear.weight, f"d{linear.x}"))
    weight_grad = b.plain_gemm("linear_weight_grad", f"{dm}.T", linear.x, f"d{linear.weight}")
    b.output(linear.weight, weight_grad)
    if dx:
        b.output(residual, dx)


def _residual_linear(b: BackwardBuilder) -> tuple[Add, Linear, RMSNorm | None]:
    """(the Add, the Linear, the post-norm between them or None) of a forward graph that is
    exactly ``m = Linear(a, W)`` [``p = RMSNorm(m)·γ``], ``out = residual + m (or p)`` with block
    inputs ``a``, ``W``, ``γ``, ``residual``, then any ``RowRstd`` of ``out`` (Llama's next-norm
    statistic) whose gradient the backward block does not take; ``fail`` names what differs."""
    fwd = b.forward
    graph = _without_unused_statistics(b)
    kinds = [type(o).__name__ for o in graph]
    if kinds not in (["Linear", "Add"], ["Linear", "RMSNorm", "Add"]):
        b.fail(
            f"its graph is {[type(o).__name__ for o in fwd.graph]}; the residual Linear's "
            "backward covers [Linear, Add] (an attention output) or [Linear, RMSNorm, Add] (with "
            "a post-norm), optionally followed by RowRstd statistics without a gradient"
        )
    linear, *middle, add = graph
    post = middle[0] if middle else None
    branch = post.out if post else linear.out
    if linear.bias is not None:
        b.fail(f"the Linear {linear.out!r} has a bias; this backward takes none")
    if linear.x not in fwd.inputs or linear.weight not in fwd.inputs:
        b.fail(f"the Linear {linear.out!r} must read block inputs (its x and weight)")
    if post is not None and post.x != linear.out:
        b.fail(f"the RMSNorm {post.out!r} must normalise the Linear's output {linear.out!r}")
    others = [v for v in add.inputs() if v != branch]
    if branch not in add.inputs() or len(others) != 1 or others[0] not in fwd.inputs:
        b.fail(
            f"the Add {add.out!r} must add the branch {branch!r} to a block input (the residual)"
        )
    others = sorted(set(b.op.cotangents) - {add.out})
    if others:
        b.fail(
            f"the backward block gives gradients of {others}; the residual Linear's backward "
            f"takes only the gradient of the sum {add.out!r}"
        )
    return add, linear, post


def _without_unused_statistics(b: BackwardBuilder) -> list[GraphOp]:
    """The forward graph less trailing ``RowRstd`` ops whose outputs get no gradient (no
    cotangent in the backward block: they move nothing it computes); a ``RowRstd`` with a
    gradient fails, naming it."""
    graph = list(b.forward.graph)
    while graph and isinstance(graph[-1], RowRstd):
        stat = graph.pop()
        if stat.out in b.op.cotangents:
            b.fail(
                f"the gradient of the statistic {stat.out!r} (RowRstd) is not differentiated; "
                f"give the backward block cotangents for {stat.x!r} only"
            )
    return graph
