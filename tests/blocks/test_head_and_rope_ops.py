"""The graph ops for attention inputs of other families (``RoPE`` in Hugging Face's order,
``HeadRMSNorm``) and the shape ops (``Chunk``, ``Scale``), against Hugging Face's own modules."""

import pytest
import torch

from coda.blocks import Chunk, HeadRMSNorm, RoPE, Scale
from coda.blocks import functional as fn

transformers = pytest.importorskip("transformers")


def _tables(rows: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(rows, head // 2, dtype=torch.float64)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize(("rows", "heads", "head"), [(5, 3, 8), (1, 1, 4), (7, 2, 16)])
def test_rope_is_hugging_face_apply_rotary_pos_emb(rows: int, heads: int, head: int) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = torch.randn(rows, heads * head, dtype=torch.float64)
    cos, sin = _tables(rows, head)
    # Hugging Face: [batch, heads, seq, D] with cos/sin [batch, seq, D]
    hf = x.reshape(1, rows, heads, head).transpose(1, 2)
    want, _ = apply_rotary_pos_emb(hf, hf, cos[None], sin[None])
    want = want.transpose(1, 2).reshape(rows, heads * head)
    op = RoPE(x="x", cos="cos", sin="sin", out="y")
    torch.testing.assert_close(op.call({"x": x, "cos": cos, "sin": sin}), want)
    assert "def rotate_half" in "".join(op.helper_sources())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_rms_norm_is_qwen3_q_norm_per_head(dtype: torch.dtype) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    rows, heads, head = 6, 3, 8
    norm = Qwen3RMSNorm(head, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(head))
    x = torch.randn(rows, heads * head).to(dtype)
    want = norm.to(dtype)(x.view(rows, heads, head)).reshape(rows, -1)
    op = HeadRMSNorm(x="x", weight="w", eps=1e-6, out="y")
    got = op.call({"x": x, "w": norm.weight.detach()})
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a whole-row RMSNorm differs: the statistic is per head
    assert not torch.equal(got, fn.rms_norm(x, norm.weight.detach().repeat(heads), 1e-6))


def test_gemma_head_rms_norm_uses_offset_and_late_cast() -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    rows, heads, head = 4, 2, 8
    norm = Gemma3RMSNorm(head, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.1 * torch.randn(head))
    x = torch.randn(rows, heads * head).to(torch.bfloat16)
    want = norm.to(torch.bfloat16)(x.view(rows, heads, head)).reshape(rows, -1)
    op = HeadRMSNorm(x="x", weight="w", eps=1e-6, offset=1.0, cast="after_weight", out="y")
    got = op.call({"x": x, "w": norm.weight.detach().to(torch.bfloat16)})
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_chunk_and_scale() -> None:
    z = torch.randn(3, 12)
    gate, up = z.chunk(2, dim=-1)
    assert torch.equal(Chunk(x="z", chunks=2, index=0, out="g").call({"z": z}), gate)
    assert torch.equal(Chunk(x="z", chunks=2, index=1, out="u").call({"z": z}), up)
    assert torch.equal(Scale(x="z", factor=2.5, out="s").call({"z": z}), z * 2.5)
    with pytest.raises(ValueError, match="chunk index 2 is not below chunks=2"):
        Chunk(x="z", chunks=2, index=2, out="bad")
    with pytest.raises(ValueError):
        Scale(x="z", factor=float("nan"), out="bad")


def test_sources_print_the_calls() -> None:
    assert RoPE(x="q", cos="c", sin="s", out="r").source() == "r = rope(q, c, s)"
    assert Chunk(x="z", chunks=2, index=1, out="u").source() == "u = chunk(z, chunks=2, index=1)"
    assert (
        HeadRMSNorm(x="q", weight="w", eps=1e-6, out="n").source()
        == "n = head_rms_norm(q, w, eps=1e-06)"
    )
