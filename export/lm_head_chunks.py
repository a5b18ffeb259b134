"""The LM-head loss in training: three GEMM passes over row chunks, the gradient in the forward.

The loss is the last op of a training step, so its gradient can be computed with it (as
Liger-Kernel's fused linear cross-entropy does) and the backward only scales by the incoming
gradient — a kernel that reads it on the device and leaves the gradients untouched when it is 1
(``primitives/scale_in_place.py``). Per chunk of rows, one Program (``gradient_program``,
verified against the block ``<family>_grad``: loss and the gradients of ``Σ dloss · loss``) runs

0. prep: the norm's γ folded into the chunk's rows, ``x ⊙ γ`` (``[rows, d]``, rounded once):
   ``(x̂ ⊙ γ) Wᵀ = diag(r) · ((x ⊙ γ) Wᵀ)``, so the GEMMs read the LM head weight ``W`` itself
   and no ``[V, d]`` copy ``W · diag(γ)`` is made (nor a ``[V, d]`` pass per step);
1. the LM head GEMM ``(x ⊙ γ) Wᵀ``, its epilogue scaling rows by ``r``, reducing each row's
   log-sum-exp and storing the logits ``z`` rounded to the activation dtype (what Hugging Face's
   ``lm_head`` returns before the loss upcasts it); ``gather_dot`` the target logits;
2. aux ``ce_grad_rows``: ``dz = (softmax − onehot) · dloss`` (through Gemma 2's softcap: times
   ``1 − (s / cap)²``) from those stored logits, and ``c = Σ z·dz / d`` for the norm's backward —
   one read of the logits where a second GEMM recomputed them. Nothing reads the logits after
   it, so the runtime writes ``dz`` over them (``primitives/storage_sharing.py``): one ``[rows,
   V]`` buffer, not two;
3. ``dz W`` with the final RMSNorm's backward in its epilogue (``dx``, ``dγ`` partials, and
   ``y = x̂ ⊙ γ``);

and the weight gradient ``dzᵀ y`` accumulates across chunks in the gradient buffer (cuBLAS
``addmm``: the Program's last, plain GEMM, run with ``beta = 1``). Only a chunk's logits (then
its gradient, in the same memory) exist at a time — the whole batch's ``[tokens, vocabulary]``
only where they are small (``chunk_rows``).

``gradient_program(train, backward, cap)`` composes the chunk Program from the family's two
verified Programs (the training forward and the saved-``lse`` backward, whose fold of γ into
``W`` it moves onto the rows); ``chunked_lm_head_loss`` runs it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from coda.blocks.block import Block
from coda.blocks.llama import lm_head_gradient_block
from coda.primitives.ir import Program
from coda.primitives.prep.fusion import names_in
from coda.primitives.scale_in_place import scale_unless_one

from .autograd import _Runner
from .programs import FAMILIES
from .resolve import NotVerified, dropin_programs

LOGITS = "head_logits"  # the stored projection z, [rows, V], activation dtype
FOLDED_ROWS = "x_folded"  # the chunk's rows with γ folded in, x ⊙ γ, [rows, d] (_fold_into_rows)
# the row count the weight-gradient GEMM's reduction needs to run near peak (see chunk_rows)
MIN_CHUNK_ROWS = 1024
# a batch whose logits have no more elements than this is one chunk (see chunk_rows): 128 MiB
# of bf16 logits, half a floor chunk's at Llama 3's vocabulary (1024 × 128256)
ONE_CHUNK_LOGITS = 1 << 26


def chunk_rows(tokens: int, vocab: int, width: int) -> int:
    """Rows per chunk: the whole batch when its logits have at most ``ONE_CHUNK_LOGITS``
    elements; otherwise Liger-Kernel's rule — a chunk's logits about as large as the hidden
    states, ``tokens / ⌈V / d⌉`` rounded up to a power of two — but at least
    ``MIN_CHUNK_ROWS``.

    The floor keeps the GEMMs efficient: a chunk is the reduction dimension of the weight
    gradient ``dzᵀ y`` (``[V, rows] @ [rows, d]``), which reads and writes the whole ``[V, d]``
    accumulator once per chunk: ``2·rows·V·d`` FLOPs against ``4·V·d`` bytes (bf16), ``rows /
    2`` FLOP/byte, against an H200's ~200 (990 TFLOP/s bf16, 4.8 TB/s). At Liger's 512 rows for
    a Llama 1B (V = 32000, d = 2048, 8192 tokens) the accumulator's traffic takes ~80% of the
    product's compute time; at 1024 rows ~40%, and each chunk's GEMMs still fill the GPU (the
    head's ``[rows, V]`` output: 2000 tiles of 128 × 128). Memory stays bounded: 1024 rows of a
    256000 vocabulary (Gemma 2) are 0.5 GB of bf16 logits, over which their gradient is written
    (one buffer), where the whole batch of 8192 tokens would be 4.2 GB; beside it a chunk holds
    only ``[rows, d]`` tensors (``x ⊙ γ``, ``dx``, ``y``) and the ``[V, d]`` weight gradient,
    no prepared copy of the weight.

    A small batch is one chunk: its training step is bound by the host's time to issue it, not
    by the GPU (bench/RESULTS.md, 2048 tokens), and every chunk costs the host a Program call,
    a weight-gradient product and a copy of its ``dx`` rows, and the GPU one more pass over the
    ``[V, d]`` accumulator — while the whole batch's logits are at most 128 MiB (2048 tokens of
    a 32000 vocabulary), small beside the weights and the optimizer's state of any model with
    that head."""
    if tokens * vocab <= ONE_CHUNK_LOGITS:
        return max(tokens, 1)
    liger = -(-tokens // -(-vocab // max(width, 1)))
    return max(MIN_CHUNK_ROWS, 1 << max(liger - 1, 0).bit_length())


def gradient_program(train: Program, backward: Program, cap: float | None) -> Program:
    """The chunk Program of an LM-head loss: ``train``'s steps with γ folded into the rows
    instead of the weight (``_fold_into_rows``; its LM head GEMM also storing the logits
    ``z``, ``LOGITS``), aux ``ce_grad_rows`` for ``dz`` and ``c`` in place of
    ``backward``'s logits-recomputing GEMM and its ``sum_partials``, then ``backward``'s norm-
    backward GEMM, ``dγ`` and weight-gradient GEMM. Inputs: the forward's and ``dloss``;
    outputs ``loss``, ``dx``, ``dgamma``, ``dw_lm``. ``cap``: the softcap ``train`` applies
    (None: none). ``ValueError`` naming what differs when the Programs are not of that form."""
    steps = [s.model_dump(mode="json") for s in train.steps]
    head = _only(steps, lambda s: s["kind"] == "gemm", "gemm step", train)
    first = head["epilogue"][0]
    if first["op"] != "scale_rows" or first["src"] != "acc":
        raise ValueError(
            f"{train.block}: the LM head's epilogue must start with scale_rows of acc (the "
            f"logits z = r ⊙ acc), not {first}"
        )
    head["epilogue"].append({"op": "store", "src": first["out"], "to": LOGITS, "dtype": "auto"})
    back = [s.model_dump(mode="json") for s in backward.steps]
    c_step = _only(back, lambda s: s.get("out") == "c", "step writing c", backward)
    grad = {
        "kind": "ce_grad_rows",
        "logits": LOGITS,
        "lse": "lse",
        "index": "target",
        "scale": "dloss",
        "cap": cap,
        "divide_by": c_step["divide_by"],
        "out": "dz",
        "zdz": "c",
        "dtype": "act",
    }
    rest = back[back.index(c_step) + 1 :]
    inputs = {**train.model_dump(mode="json")["inputs"]}
    inputs["dloss"] = backward.model_dump(mode="json")["inputs"]["dloss"]
    prep = _fold_into_rows(train.model_dump(mode="json")["prep"], steps, train)
    return Program.parse(
        {
            "block": f"{train.block.removesuffix('_train')}_grad",
            "inputs": inputs,
            "prep": prep,
            "steps": [*steps, grad, *rest],
            "outputs": {"loss": "loss", **{k: v for k, v in backward.outputs.items()}},
        }
    )


def _fold_into_rows(prep: list[dict], steps: list[dict], program: Program) -> list[dict]:
    """``program``'s prep — γ folded into the LM head weight, ``W · diag(γ)`` — moved onto the
    rows: ``(x ⊙ γ) Wᵀ = x (W · diag(γ))ᵀ``, so the steps that read the folded weight (the head
    GEMM, ``gather_dot``) read ``W`` itself with ``x ⊙ γ`` (``FOLDED_ROWS``, ``[rows, d]``) in
    place of ``x``, and no ``[V, d]`` copy of the weight is made. Edits ``steps`` in place;
    returns the new prep. ``ValueError`` naming what differs when the prep is not that one
    fold or a step reads the folded weight otherwise."""
    kinds = [p["kind"] for p in prep]
    if kinds != ["fold_norm_weight"]:
        raise ValueError(f"{program.block}: expected one prep step, fold_norm_weight, not {kinds}")
    fold = prep[0]
    weight, folded = fold["weight"], fold["out"]
    head = _only(steps, lambda s: _operand(s, "b") == folded, f"GEMM reading {folded}", program)
    rows = _operand(head, "a")
    for step in steps:
        if step["kind"] == "gemm" and _operand(step, "b") == folded:
            pair = (step["a"]["transpose"], step["b"]["transpose"])
            if pair != (False, True):
                raise ValueError(
                    f"{program.block}: GEMM {step.get('name')!r} must be {rows} @ {folded}.T "
                    f"to read the rows scaled instead, not transposes {pair}"
                )
            step["a"]["tensor"], step["b"]["tensor"] = FOLDED_ROWS, weight
        elif step["kind"] == "gather_dot" and step["w"] == folded and step["a"] == rows:
            step["a"], step["w"] = FOLDED_ROWS, weight
        elif folded in names_in(step):
            raise ValueError(
                f"{program.block}: step {step.get('name', step['kind'])!r} reads the folded "
                f"weight {folded!r} other than as the head GEMM's or gather_dot's weight beside "
                f"{rows!r}: γ cannot be moved onto the rows"
            )
    return [{**fold, "weight": rows, "out": FOLDED_ROWS}]


def _operand(step: dict, side: str) -> str | None:
    """The tensor a GEMM step reads as operand ``side`` (``"a"``/``"b"``); None for aux steps."""
    return step[side]["tensor"] if step["kind"] == "gemm" else None


def without_weight_gradient(program: Program) -> Program:
    """``program`` less its last step, the plain GEMM ``dzᵀ y → dw_lm``, returning ``dz`` and
    ``y`` instead: the caller runs that GEMM as an ``addmm`` into its gradient buffer, so the
    chunks' weight gradients accumulate without a ``[V, d]`` tensor per chunk."""
    last = program.steps[-1].model_dump(mode="json")
    a, b = last.get("a", {}), last.get("b", {})
    plain = [{"op": "store", "src": "acc", "to": "dw_lm", "dtype": "auto", "mode": "write"}]
    if (
        last.get("kind") != "gemm"
        or (a.get("tensor"), a.get("transpose"), b.get("tensor"), b.get("transpose"))
        != ("dz", True, "y", False)
        or last["epilogue"] != plain
    ):
        raise ValueError(f"{program.block}: the last step must be the plain GEMM dz.T @ y → dw_lm")
    data = program.model_dump(mode="json")
    data["steps"] = data["steps"][:-1]
    outputs = {n: v for n, v in data["outputs"].items() if n != "dw_lm"}
    data["outputs"] = {**outputs, "dz": "dz", "y": "y"}
    return Program.parse(data)


def _only(steps: list[dict], test: Any, what: str, program: Program) -> dict:
    found = [s for s in steps if test(s)]
    if len(found) != 1:
        raise ValueError(f"{program.block}: expected one {what}, found {len(found)}")
    return found[0]


def gradient_block(family: str, eps: float) -> Block:
    """The block a chunk Program is verified against: ``<forward>_grad`` of the family's
    forward at ``eps``."""
    return lm_head_gradient_block(FAMILIES[family].blocks(eps)["forward"])


@lru_cache(maxsize=8)
def chunk_runner(eps: float, verify: bool, family: str, cap: float | None) -> _Runner:
    """The runner of a family's chunk Program (compiled on first use), composed from its shipped
    verified Programs — with ``verify``, verified by the sandbox first (``NotVerified``)."""
    train, backward = dropin_programs(family, ("train", "backward_saved"), eps, verify=verify)
    program = gradient_program(train, backward, cap)
    if verify:
        _verify(program, gradient_block(family, eps))
    # Not keep_prepared: the prep reads the chunk's rows (γ folded into x), new every chunk; it
    # is a [rows, d] pass, and no prepared copy of the weight exists to share between chunks.
    return _Runner(without_weight_gradient(program))


def _verify(program: Program, block: Block) -> None:
    from coda.sandbox import SandboxOptions, evaluate

    report = evaluate(program, block, SandboxOptions(profile=False, seeds=[0]))
    if not report.verified:
        raise NotVerified(f"{block.name}: {report.render_compact()}")


class _ChunkedLoss(torch.autograd.Function):
    """``Σ_i weights_i · loss_i`` with every gradient computed in the forward, chunk by chunk;
    the backward scales them by the incoming gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        gamma: torch.Tensor,
        w: torch.Tensor,
        classes: torch.Tensor,
        weights: torch.Tensor,
        runner: _Runner,
        rows: int,
    ) -> torch.Tensor:
        wants_dw = ctx.needs_input_grad[2]
        if rows >= x.shape[0] > 0:  # one chunk: its outputs are the gradients as they are
            loss, dx, dgamma, dz, y = runner(x, gamma, w, classes, weights)
            dw = dz.T @ y if wants_dw else None
            total = torch.dot(loss.to(torch.float32), weights)
            dgamma = dgamma.to(gamma.dtype)  # (the Program's dγ has it: no copy)
        else:
            total, dx, dgamma, dw = _in_chunks(
                runner, x, gamma, w, classes, weights, rows=rows, wants_dw=wants_dw
            )
        # Held on ctx, not saved for backward: the backward scales them in place and hands them
        # over, so autograd takes each as the parameter's gradient without a copy (a tensor
        # the graph still held would be cloned) and the weight gradient exists once.
        ctx.grads = (dx, dgamma, dw)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "the fused LM-head loss's gradient was computed in its forward and handed over "
                "by its first backward: backward through it once per forward (retain_graph "
                "cannot run it again); compute the loss again for another backward"
            )
        (dx, dgamma, dw), ctx.grads = ctx.grads, None
        # Whether ``grad`` is 1 (a plain ``loss.backward()``) is known on the device only: its
        # kernel reads it there and leaves the gradients unread when it is, where ``mul_`` would
        # pass over each of them — the [V, d] weight gradient included — to multiply by one.
        # Any other value multiplies in fp32, rounded once to each gradient's dtype.
        scale_unless_one((dx, dgamma, dw), grad)
        return dx, dgamma, dw, None, None, None, None


def _in_chunks(
    runner: _Runner, x: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor,
    classes: torch.Tensor, weights: torch.Tensor, *, rows: int, wants_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The loss and the gradients ``dx``, ``dγ``, ``dW`` (None unless ``wants_dw``) of ``x``'s
    rows ``rows`` at a time: ``dx`` written chunk by chunk, ``dW`` accumulated."""
    dx = torch.empty_like(x)
    losses, dgammas, dw = [], [], None
    for start in range(0, x.shape[0], rows):
        part = slice(start, start + rows)
        loss, dx_part, dgamma_part, dz, y = runner(x[part], gamma, w, classes[part], weights[part])
        losses.append(loss)
        dgammas.append(dgamma_part)
        dx[part] = dx_part
        if wants_dw:  # the first chunk writes the buffer, later ones add
            dw = dz.T @ y if dw is None else dw.addmm_(dz.T, y)
        del dz, y, dx_part  # freed before the next chunk allocates its own
    if dw is None and wants_dw:  # no rows
        dw = torch.zeros_like(w)
    # The chunks' losses and γ partials summed once at the end (a few launches, not a few per
    # chunk): fp32 throughout, dγ rounded to γ's dtype once, at the end.
    if losses:
        total = torch.dot(torch.cat(losses).to(torch.float32), weights)
        dgamma = torch.stack(dgammas).to(torch.float32).sum(dim=0)
    else:
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        dgamma = torch.zeros(gamma.shape, dtype=torch.float32, device=x.device)
    return total, dx, dgamma.to(gamma.dtype), dw


def chunked_lm_head_loss(
    runner: _Runner,
    x: torch.Tensor,
    gamma: torch.Tensor,
    w: torch.Tensor,
    classes: torch.Tensor,
    weights: torch.Tensor,
    rows: int | None = None,
) -> torch.Tensor:
    """``Σ_i weights_i · CE(rmsnorm(x_i)·γ @ wᵀ, classes_i)`` (float32 scalar), differentiable
    in ``x``, ``gamma`` and ``w``, its gradient computed now, ``rows`` rows at a time (default
    ``chunk_rows``). ``weights``: float32 per-token weights (e.g. counted / number counted)."""
    rows = chunk_rows(x.shape[0], w.shape[0], w.shape[1]) if rows is None else rows
    if rows < 1:
        raise ValueError(f"chunk_rows must be a positive number of rows (or None), not {rows}")
    return _ChunkedLoss.apply(x, gamma, w, classes, weights, runner, rows)
