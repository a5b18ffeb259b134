"""The LM-head loss in training on a GPU (``coda.export.lm_head_chunks``): several row chunks and
one in bf16 and under autocast against the fp32 model, and its memory bounded by a chunk — never
a large batch's ``[tokens, vocabulary]`` logits or their gradient."""

from __future__ import annotations

import pytest
import torch

from .test_export_gpu import (
    DEVICE,
    TOY,
    _assert_loss_as_close_as_hugging_face,
    _causal_lm,
)

pytestmark = pytest.mark.cpu_capable
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("chunked", [True, False], ids=["several-chunks", "one-chunk"])
def test_the_fused_loss_in_bf16_and_under_autocast(chunked: bool) -> None:
    """causal_lm_loss in chunks of 128 rows (666 tokens: five full chunks and a last of 26;
    CPU toy: chunks of 4 of 18), or as ``chunk_rows`` has it (those tokens' logits are small:
    one chunk), on a random one-layer Llama with a 32000 vocabulary: loss and every gradient
    against the fp32 model by the sandbox's rule, next to Hugging Face's error."""
    from coda.export import causal_lm_loss
    from coda.export.lm_head import _loss_module

    hidden, vocab, seq, rows = (48, 96, 9, 4) if TOY else (1024, 32000, 333, 128)
    rows = rows if chunked else None
    hf = _causal_lm(hidden, 2 * hidden, 1, vocab)
    ids = torch.randint(0, vocab, (2, seq), device=DEVICE)
    labels = ids.clone()
    labels[0, : seq // 3] = -100
    labels[1, -5:] = -100  # ignored tokens in the last chunk

    def hf_loss(model) -> torch.Tensor:  # noqa: ANN001
        return model(input_ids=ids, labels=labels).loss

    def coda_loss(model) -> torch.Tensor:  # noqa: ANN001
        _loss_module(model, verify=False, tune="off").chunk_rows = rows
        return causal_lm_loss(model, ids, labels, verify=False, tune="off")

    _assert_loss_as_close_as_hugging_face(hf, hf_loss, coda_loss)


@pytest.mark.skipif(TOY, reason="measures GPU memory")
@pytest.mark.parametrize("tokens", [16384, 2048])
def test_training_memory_is_bounded_by_a_chunk_not_the_logits(tokens: int) -> None:
    """16384 tokens, vocabulary 32000, width 1024 in bf16: the loss's forward and backward
    allocate at their peak no more than a chunk's logits with their gradient written over them
    (1024 rows: 66 MB) and two of each gradient (the weight's, 66 MB, and ``dx``, 34 MB: the
    forward's and the backward's scaled by the incoming gradient), with 16 MiB for the row
    vectors and the allocator's rounding — no γ-folded copy of the weight (another 66 MB), no
    second chunk, where the unchunked backward held a full ``dz`` (1 GB). 2048 tokens are one
    chunk (``chunk_rows``) under the same bound: its logits, 131 MB, once."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from coda.export import CodaLlamaLMHeadLoss
    from coda.export.lm_head_chunks import chunk_rows

    vocab, width = 32000, 1024
    torch.manual_seed(0)
    norm = LlamaRMSNorm(width).to(DEVICE, torch.bfloat16)
    head = torch.nn.Linear(width, vocab, bias=False).to(DEVICE, torch.bfloat16)
    hidden = torch.randn(1, tokens, width, device=DEVICE, dtype=torch.bfloat16)
    hidden.requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), device=DEVICE)
    loss_fn = CodaLlamaLMHeadLoss(norm, head, tune="off")
    loss_fn(hidden, labels).backward()  # compiled, allocator warm
    for p in (hidden, norm.weight, head.weight):
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss = loss_fn(hidden, labels)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    rows = chunk_rows(tokens, vocab, width)
    bound = 2 * (rows * vocab + 2 * (vocab * width + tokens * width)) + 16 * 2**20
    assert torch.isfinite(loss) and head.weight.grad is not None
    assert peak <= bound, f"peak {peak / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"
