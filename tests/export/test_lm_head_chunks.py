"""The LM-head loss in training (``coda.export.lm_head_chunks``): loss and every gradient computed
in the forward, row chunk by row chunk, equal to Hugging Face's / PyTorch's — several chunks, a
last partial chunk, ignored labels, softcapped logits; the chunk Program verified by the sandbox."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coda.export import CodaLlamaLMHeadLoss, causal_lm_loss, lm_head
from coda.export.lm_head_chunks import (
    LOGITS,
    MIN_CHUNK_ROWS,
    ONE_CHUNK_LOGITS,
    chunk_rows,
    gradient_block,
    gradient_program,
    without_weight_gradient,
)
from coda.export.resolve import dropin_programs
from coda.primitives.ir import Program
from coda.primitives.run_plans import Allocate

from .test_lm_head import _labels, _loss_and_grads, check_fp16_autocast_precision
from .test_patch import _model

transformers = pytest.importorskip("transformers")


@pytest.fixture
def chunks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(tokens, rows per chunk) of each chunked loss call."""
    calls: list[tuple[int, int]] = []
    real = lm_head.chunked_lm_head_loss

    def counted(runner, x, *args, rows=None):  # noqa: ANN001, ANN002, ANN202
        calls.append((x.shape[0], rows))
        return real(runner, x, *args, rows=rows)

    monkeypatch.setattr(lm_head, "chunked_lm_head_loss", counted)
    return calls


def _chunked(model: torch.nn.Module, rows: int | None) -> None:
    """Build ``model``'s fused loss (first call) and make it run ``rows`` rows per chunk."""
    lm_head._loss_module(model, verify=False, tune="off").chunk_rows = rows


def test_several_chunks_equal_hugging_face(
    chunks: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """21 tokens (3 × 7) in chunks of 4: five full chunks and a last one of 1 row; ignored labels
    in the first and in the last chunk. Each chunk folds γ into its own rows (``[rows, d]``):
    no prepared copy of the ``[V, d]`` weight is made."""
    from coda.primitives.runtime import CompiledProgram

    lm_head.chunk_runner.cache_clear()  # its run plans below: this test's calls only
    model = _model(seed=21)
    ids = torch.randint(0, 96, (3, 7))
    labels = _labels(ids)
    labels[2, 5] = -100
    want, want_grads = _loss_and_grads(model, lambda: model(input_ids=ids, labels=labels).loss)
    _chunked(model, 4)
    preps: list[tuple[str, dict[str, tuple[int, ...]]]] = []
    real_prep = CompiledProgram._run_prep

    def counted_prep(self, inputs, info):  # noqa: ANN001, ANN202
        tensors = real_prep(self, inputs, info)
        made = {n: tuple(t.shape) for n, t in tensors.items() if n not in inputs}
        preps.append((self.program.block, made))
        return tensors

    monkeypatch.setattr(CompiledProgram, "_run_prep", counted_prep)
    got, grads = _loss_and_grads(model, lambda: causal_lm_loss(model, ids, labels, tune="off"))
    assert chunks == [(21, 4)]
    rows = [4, 4, 4, 4, 4, 1]
    assert preps == [("llama_lm_head_ce_eps1e-06_grad", {"x_folded": (r, 48)}) for r in rows]
    # each chunk's dz is written over its logits (one [rows, V] buffer), at both chunk shapes
    runner = lm_head.chunk_runner(*lm_head._loss_module(model, verify=False, tune="off")._chunks)
    plans = runner.compiled._run_plans.values()
    shared = [a.shared for p in plans for a in p.actions if isinstance(a, Allocate) and a.shared]
    assert shared == [(("dz", LOGITS),)] * 2
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-6, rtol=1e-5, msg=name)


def test_the_backward_scales_by_the_incoming_gradient_and_no_grad_skips_it(
    chunks: list[tuple[int, int]],
) -> None:
    model = _model(seed=22)
    ids = torch.randint(0, 96, (2, 9))
    labels = _labels(ids)
    want, want_grads = _loss_and_grads(
        model, lambda: -2.5 * model(input_ids=ids, labels=labels, num_items_in_batch=13).loss
    )
    _chunked(model, 5)
    got, grads = _loss_and_grads(
        model, lambda: -2.5 * causal_lm_loss(model, ids, labels, num_items_in_batch=13)
    )
    torch.testing.assert_close(got, want, atol=4e-6, rtol=2e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=4e-6, rtol=1e-5, msg=name)
    loss = causal_lm_loss(model, ids, labels, tune="off")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through it once per forward"):
        loss.backward()
    chunks.clear()
    with torch.no_grad():  # the loss alone: no gradient work, no chunks
        loss = causal_lm_loss(model, ids, labels, num_items_in_batch=13, tune="off")
    assert chunks == []
    torch.testing.assert_close(-2.5 * loss, want, atol=4e-6, rtol=2e-6)


@pytest.mark.parametrize("rows", [3, None], ids=["chunks-of-3", "one-chunk"])
def test_the_softcapped_loss_in_chunks_equals_pytorch(
    rows: int | None, chunks: list[tuple[int, int]]
) -> None:
    """Gemma 2's head (logits capped at 30) from hidden states, against PyTorch's formula:
    ``30 · tanh(lm_head(norm(h)) / 30)``, mean cross-entropy over the counted tokens."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(23)
    norm, head = LlamaRMSNorm(40, eps=1e-6), torch.nn.Linear(40, 333, bias=False)
    with torch.no_grad():
        norm.weight.add_(0.2 * torch.randn(40))
        head.weight.mul_(60)  # logits of tens: the cap bends them
    hidden = torch.randn(2, 8, 40, requires_grad=True)
    labels = torch.randint(0, 333, (2, 8))
    labels[1, :3] = -100
    params = [hidden, norm.weight, head.weight]

    def reference() -> torch.Tensor:
        logits = 30.0 * torch.tanh(head(norm(hidden)) / 30.0)
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.reshape(-1, 333), shifted.reshape(-1), ignore_index=-100)

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad(loss, params))

    want = reference()
    loss_fn = CodaLlamaLMHeadLoss(norm, head, tune="off", softcap=30.0)
    loss_fn.chunk_rows = rows
    got = loss_fn(hidden, labels)
    assert chunks == [(16, rows)]
    assert reference().abs().max() > 0 and head(norm(hidden)).abs().max() > 30  # capped
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    for name, g, w in zip(["hidden", "gamma", "w_lm"], grads(got), grads(want), strict=True):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("rows", [4, None], ids=["chunks-of-4", "one-chunk"])
def test_fp16_chunks_keep_hugging_face_precision(rows: int | None) -> None:
    """fp16 under autocast, in chunks: loss and gradients held to the sandbox's rule against
    the fp32 run, next to Hugging Face's own fp16 autocast error."""
    model = _model(seed=24)
    ids = torch.randint(0, 96, (3, 7))
    check_fp16_autocast_precision(
        model, ids, lambda labels: causal_lm_loss(model, ids, labels), lambda: _chunked(model, rows)
    )


def test_chunk_rows_follows_the_vocabulary_with_a_floor() -> None:
    # Liger's rule: logits of a chunk about as large as the hidden states ...
    assert chunk_rows(65536, 32000, 2048) == 4096  # 65536 / ⌈32000 / 2048⌉ = 4096
    assert chunk_rows(65536, 256000, 2304) == MIN_CHUNK_ROWS  # 65536 / 112 → 1024
    # ... but never fewer rows than the weight gradient's reduction needs
    assert chunk_rows(8192, 32000, 2048) == MIN_CHUNK_ROWS
    assert chunk_rows(2048, 128256, 2048) == MIN_CHUNK_ROWS  # Llama 3's head: 263M logits
    # a batch whose logits are small is one chunk, up to ONE_CHUNK_LOGITS of them
    assert chunk_rows(2048, 32000, 2048) == 2048
    assert chunk_rows(2048, 32768, 4096) == 2048 and ONE_CHUNK_LOGITS == 2048 * 32768
    assert chunk_rows(2049, 32768, 4096) == MIN_CHUNK_ROWS
    assert chunk_rows(3, 96, 48) == 3
    assert chunk_rows(0, 96, 48) == 1  # (no rows: a positive row count all the same)


def test_the_chunk_program_drops_only_the_weight_gradient_gemm() -> None:
    train, backward = dropin_programs(
        "llama_lm_head_ce", ("train", "backward_saved"), 1e-5, verify=False
    )
    program = gradient_program(train, backward, None)
    assert [s.kind for s in program.steps].count("gemm") == 3  # head, dz W, dzᵀ y
    kinds = [getattr(s, "name", s.kind) for s in program.steps]
    assert "lm_head_bwd" not in kinds and "ce_grad_rows" in kinds  # no recomputed logits
    assert list(program.outputs) == ["loss", "dx", "dgamma", "dw_lm"]
    # γ folded into the chunk's rows, not into a [V, d] copy of the weight
    (fold,) = program.prep
    assert (fold.kind, fold.weight, fold.gamma, fold.out) == (
        "fold_norm_weight",
        "x",
        "gamma",
        "x_folded",
    )
    head, gather = program.steps[1], program.steps[2]
    assert (head.a.tensor, head.b.tensor) == ("x_folded", "w_lm")
    assert (gather.kind, gather.a, gather.w) == ("gather_dot", "x_folded", "w_lm")
    assert "w_lm_folded" not in program.model_dump_json()
    chunk = without_weight_gradient(program)
    assert chunk.steps == program.steps[:-1]
    assert list(chunk.outputs) == ["loss", "dx", "dgamma", "dz", "y"]
    with pytest.raises(ValueError, match="the last step must be the plain GEMM dz.T @ y"):
        without_weight_gradient(chunk)


def test_gamma_moves_onto_the_rows_only_where_every_read_of_the_folded_weight_allows_it() -> None:
    """A step that reads the folded weight other than as the head GEMM's or ``gather_dot``'s
    weight beside ``x`` (here: ``gather_dot`` of other rows) cannot read ``W`` with ``x ⊙ γ``."""
    train, backward = dropin_programs(
        "llama_lm_head_ce", ("train", "backward_saved"), 1e-5, verify=False
    )
    data = train.model_dump(mode="json")
    data["steps"][2]["a"] = "rstd_h"  # (only the composition is checked here, not the types)
    odd = Program.model_validate(data)
    with pytest.raises(ValueError, match="step 'gather_dot' reads the folded weight 'w_lm_folded'"):
        gradient_program(odd, backward, None)
    data = train.model_dump(mode="json")
    data["prep"].append({**data["prep"][0], "out": "w_lm_twice"})
    with pytest.raises(ValueError, match="expected one prep step, fold_norm_weight"):
        gradient_program(Program.model_validate(data), backward, None)


@pytest.mark.parametrize(
    "family, cap", [("llama_lm_head_ce", None), ("lm_head_softcap_ce", 30.0)], ids=["plain", "cap"]
)
def test_the_chunk_program_is_verified_by_the_sandbox(family: str, cap: float | None) -> None:
    """The Program each chunk runs (before its weight-gradient GEMM becomes an addmm) against
    the block ``<family>_grad`` — loss and autograd of it — float32 and float16."""
    from coda.sandbox import SandboxOptions, evaluate

    train, backward = dropin_programs(family, ("train", "backward_saved"), 1e-5, verify=False)
    block = gradient_block(family, 1e-5)
    report = evaluate(
        gradient_program(train, backward, cap), block, SandboxOptions(profile=False, seeds=[0])
    )
    assert report.verified, report.render_compact()


def test_gradient_blocks_resolve_by_name_for_lm_head_losses_only() -> None:
    """A sandbox worker finds ``<loss block>_grad`` by name — any epsilon, softcapped or not —
    and no ``_grad`` of a block that is not an LM-head loss."""
    from coda.blocks import get_block
    from coda.blocks.registry import BlockNotFound

    block = get_block("lm_head_softcap_ce_eps1e-06_grad")
    assert list(block.inputs) == ["x", "gamma", "w_lm", "target", "dloss"]
    assert block.outputs == ["loss", "dx", "dgamma", "dw_lm"]
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "x": torch.randn(5, 8, generator=gen),
        "gamma": torch.rand(8, generator=gen) + 0.5,
        "w_lm": torch.randn(11, 8, generator=gen),
        "target": torch.randint(0, 11, (5,), generator=gen),
        "dloss": torch.rand(5, generator=gen),
    }
    out = block.reference(inputs)
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ("x", "gamma", "w_lm")}
    h = torch.nn.functional.rms_norm(leaves["x"], (8,), leaves["gamma"], eps=1e-6)
    logits = 30 * torch.tanh(h @ leaves["w_lm"].T / 30)
    loss = F.cross_entropy(logits, inputs["target"], reduction="none")
    (loss * inputs["dloss"]).sum().backward()
    torch.testing.assert_close(out["loss"], loss.detach())
    for name, leaf in leaves.items():
        torch.testing.assert_close(out[f"d{name}"], leaf.grad, msg=name)
    with pytest.raises(BlockNotFound):
        get_block("llama_mlp_grad")
