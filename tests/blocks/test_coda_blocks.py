"""The paper's ten kernels and the Llama layer blocks: their references against independent
formulas — autograd, PyTorch's cross-entropy, and Hugging Face's own Llama modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coda.blocks import functional as fn
from coda.blocks import get_block
from coda.blocks.kernels import KERNELS

LAYER_BLOCKS = [
    "llama_attn_in",
    "llama_attn_out",
    "llama_lm_head_ce",
    "llama_mlp_bwd",
    "llama_attn_in_bwd",
    "llama_lm_head_ce_bwd",
    "llama_mlp_train",
    "llama_mlp_bwd_saved",
    "llama_mlp_branch_train",
    "llama_mlp_branch_bwd_saved",
    "llama_lm_head_ce_train",
    "llama_lm_head_ce_bwd_saved",
    "llama_attn_in_bwd_saved",
]
PAPER_TABLE = [
    "gemm_residual_partial_rmsnorm",
    "gemm_rmsnorm",
    "gemm_swiglu",
    "gemm_rmsnorm_swiglu",
    "gemm_rope",
    "gemm_rmsnorm_rope",
    "gemm_partial_cross_entropy",
    "gemm_rmsnorm_partial_cross_entropy",
    "gemm_residual_partial_rmsnorm_bwd",
    "gemm_partial_swiglu_bwd",
]


def test_the_ten_kernels_are_blocks() -> None:
    assert [k.name for k in KERNELS] == PAPER_TABLE
    for block in KERNELS:
        assert get_block(block.name) is block
        assert any(s["M"] % 32 for s in block.shapes.cpu), "a ragged M"
        assert block.shapes.bench, block.name


def test_reference_sources_run_as_shown() -> None:
    for name in [*PAPER_TABLE, *LAYER_BLOCKS]:
        block = get_block(name)
        namespace: dict = {}
        exec(block.reference_source(), namespace)  # noqa: S102
        inputs = block.make_inputs(block.shapes.cpu[2], torch.float64, seed=1)
        got = namespace[name](**inputs)
        want = block.reference(inputs)
        assert all(torch.equal(got[o], want[o]) for o in block.outputs), name


# -- kernel-level helpers against autograd ---------------------------------------------------------
def _rmsnorm64(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma


def test_rms_norm_backward_identity_matches_autograd() -> None:
    # docs/algebra.md §4: dx = r (γ ⊙ g − x̂ c), c = (1/d) Σ y g, and Σ y g = Σ z dz when z = y W
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    gamma = (1 + 0.1 * torch.randn(12, generator=gen, dtype=torch.float64)).requires_grad_()
    w = torch.randn(20, 12, generator=gen, dtype=torch.float64)
    dz = torch.randn(7, 20, generator=gen, dtype=torch.float64)
    y = _rmsnorm64(x, gamma)
    z = y @ w.T
    dx, dgamma = torch.autograd.grad(z, [x, gamma], dz)
    g = dz @ w
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + 1e-5)
    c = fn.row_dot(z.detach(), dz) / 12
    assert torch.allclose(c, fn.row_dot(y.detach(), g) / 12)
    assert torch.allclose(fn.rms_norm_backward(g, x.detach(), rstd, gamma.detach(), c), dx)
    assert torch.allclose(fn.rms_norm_weight_grad(g, x.detach(), rstd), dgamma)
    assert torch.allclose(fn.apply_rstd(x.detach(), rstd, gamma.detach()), y)


def test_swiglu_pairs_backward_matches_autograd() -> None:
    z = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    da = torch.randn(5, 8, dtype=torch.float64)
    (want,) = torch.autograd.grad(fn.swiglu_pairs(z), z, da)
    assert torch.allclose(fn.swiglu_pairs_backward(da, z.detach()), want)


def test_rope_adjacent_is_hugging_face_rope_in_pair_order() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from tests.helpers import rope_tables

    cos, sin = rope_tables(9, 8, torch.float64)
    q = torch.randn(9, 24, dtype=torch.float64)  # 3 heads of 8
    q4 = q.reshape(1, 9, 3, 8).transpose(1, 2)
    hf, _ = apply_rotary_pos_emb(q4, q4, cos[None], sin[None])
    hf = hf.transpose(1, 2).reshape(9, 24)
    got = fn.rope_adjacent(fn.to_adjacent_pairs(q, cos), cos, sin)
    assert torch.allclose(got, fn.to_adjacent_pairs(hf, cos))


def test_cross_entropy_pieces() -> None:
    logits = torch.randn(6, 11, dtype=torch.float64)
    target = torch.randint(0, 11, (6,))
    loss = fn.logsumexp(logits) - fn.select_target(logits, target)
    assert torch.allclose(loss, F.cross_entropy(logits, target, reduction="none"))
    assert torch.allclose(fn.cross_entropy(logits, target), loss)


# -- layer blocks against Hugging Face's modules ---------------------------------------------------
# LlamaRMSNorm upcasts to float32, not float64, so its outputs carry fp32 rounding even in float64.
HF = {"atol": 1e-5, "rtol": 1e-5}


def _config(**kw):  # noqa: ANN003, ANN202
    from transformers import LlamaConfig

    base = dict(
        hidden_size=48,
        intermediate_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        vocab_size=200,
    )
    return LlamaConfig(**{**base, **kw})


def _init(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen) * (0.1 if p.dim() > 1 else 1.0) + (p.dim() == 1)
            )
    return module.double()


def test_llama_attn_in_matches_hugging_face() -> None:
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = _config()
    norm = _init(LlamaRMSNorm(48, eps=1e-5), 0)
    attn = _init(LlamaAttention(config, layer_idx=0), 1)
    rotary = LlamaRotaryEmbedding(config)
    x = torch.randn(1, 9, 48, dtype=torch.float64)
    cos, sin = rotary(x, torch.arange(9)[None])
    h = norm(x)
    q = attn.q_proj(h).view(1, 9, 4, 16).transpose(1, 2)
    k = attn.k_proj(h).view(1, 9, 2, 16).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    q, k = (t.transpose(1, 2).reshape(9, -1) for t in (q, k))
    v = attn.v_proj(h)[0]
    got = get_block("llama_attn_in").reference(
        {
            "x": x[0],
            "gamma": norm.weight,
            "w_q": attn.q_proj.weight,
            "w_k": attn.k_proj.weight,
            "w_v": attn.v_proj.weight,
            "cos": cos[0],
            "sin": sin[0],
        }
    )["qkv"]
    pairs = lambda t: fn.to_adjacent_pairs(t, cos[0])  # noqa: E731
    assert torch.allclose(got, torch.cat([pairs(q), pairs(k), v], dim=1), **HF)
    # the pair order changes nothing attention sees: per-head scores q·k are the same
    scores = lambda t_q, t_k: t_q[:, :16] @ t_k[:, :16].T  # noqa: E731
    assert torch.allclose(scores(got[:, :64], got[:, 64:96]), scores(q, k), **HF)


def test_llama_lm_head_ce_matches_hugging_face_loss() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = _init(LlamaRMSNorm(48, eps=1e-5), 0)
    lm_head = _init(torch.nn.Linear(48, 200, bias=False), 1)
    x = torch.randn(1, 9, 48, dtype=torch.float64)
    labels = torch.randint(0, 200, (1, 9))
    logits = lm_head(norm(x))
    hf_mean = ForCausalLMLoss(logits, labels, vocab_size=200)
    # HF shifts labels by one and averages; the block takes shifted targets per token
    target = torch.cat([labels[0, 1:], torch.tensor([0])])
    loss = get_block("llama_lm_head_ce").reference(
        {"x": x[0], "gamma": norm.weight, "w_lm": lm_head.weight, "target": target}
    )["loss"]
    assert torch.allclose(loss[:-1].mean(), hf_mean.double(), **HF)  # HF upcasts to fp32


def test_llama_mlp_bwd_matches_hugging_face_autograd() -> None:
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    config = _config()
    norm = _init(LlamaRMSNorm(48, eps=1e-5), 0)
    mlp = _init(LlamaMLP(config), 1)
    x = torch.randn(9, 48, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(9, 48, dtype=torch.float64)
    out = x + mlp(norm(x))
    params = [x, norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    want = torch.autograd.grad(out, params, dout)
    got = get_block("llama_mlp_bwd").reference(
        {
            "x": x.detach(),
            "gamma": norm.weight.detach(),
            "w_gate": mlp.gate_proj.weight.detach(),
            "w_up": mlp.up_proj.weight.detach(),
            "w_down": mlp.down_proj.weight.detach(),
            "dout": dout,
        }
    )
    names = ["dx", "dgamma", "dw_gate", "dw_up", "dw_down"]
    for name, w in zip(names, want, strict=True):
        assert torch.allclose(got[name], w, **HF), name


@pytest.mark.parametrize("name", LAYER_BLOCKS)
def test_layer_blocks_trace_and_count_flops(name: str) -> None:
    block = get_block(name)
    sizes = block.shapes.cpu[0]
    assert block.flops(sizes) > 0
    shapes = block.trace(sizes)
    for out in block.outputs:
        assert out in shapes


def test_llama_mlp_epsilon_variants_resolve_by_name() -> None:
    from coda.blocks import BlockNotFound
    from coda.blocks.llama import llama_mlp_family

    family = llama_mlp_family(1e-6)
    for key, suffix in [("forward", ""), ("backward", "_bwd"), ("train", "_train")]:
        assert get_block(f"llama_mlp_eps1e-06{suffix}") is family[key]
    assert get_block("llama_mlp_eps1e-06_bwd_saved") is family["backward_saved"]
    assert family["backward"].graph[0].forward == "llama_mlp_eps1e-06"
    branch = llama_mlp_family(1e-6, residual=False)
    assert get_block("llama_mlp_branch_eps1e-06_bwd") is branch["backward"]
    assert branch["forward"].name == "llama_mlp_branch_eps1e-06"
    assert not any(op.op == "add" for op in branch["forward"].graph)  # no residual
    assert family["train"].graph[0].eps == 1e-6
    assert family["train"].graph[-1].eps == 1e-6  # the saved statistic's, as the norm's
    builtin = llama_mlp_family(1e-5)
    assert builtin["forward"] is get_block("llama_mlp")
    assert builtin["backward_saved"] is get_block("llama_mlp_bwd_saved")
    # Llama 3's own epsilon written out names the built-in blocks
    assert get_block("llama_mlp_eps1e-05") is builtin["forward"]
    assert get_block("llama_mlp_eps1e-05_bwd_saved") is builtin["backward_saved"]
    assert get_block("llama_attn_in_eps1e-05_bwd") is get_block("llama_attn_in_bwd")
    with pytest.raises(BlockNotFound):
        get_block("llama_mlp_epsilon")


def test_lm_head_epsilon_variants_have_a_training_pair() -> None:
    from coda.blocks.llama import llama_lm_head_ce_family

    family = llama_lm_head_ce_family(1e-6)
    assert get_block("llama_lm_head_ce_eps1e-06_train") is family["train"]
    assert get_block("llama_lm_head_ce_eps1e-06_bwd_saved") is family["backward_saved"]
    assert family["train"].graph[0].eps == 1e-6
    assert family["backward_saved"].graph[0].forward == "llama_lm_head_ce_eps1e-06_train"
    assert llama_lm_head_ce_family(1e-5)["train"] is get_block("llama_lm_head_ce_train")


def test_saved_inputs_are_the_forward_values() -> None:
    # llama_mlp_bwd_saved receives g and u (not a = silu(g)·u, which its first epilogue
    # recomputes): drawn consistently with x and the weights
    block = get_block("llama_mlp_bwd_saved")
    inputs = block.make_inputs(block.shapes.cpu[1], torch.float64, seed=3)
    values = get_block("llama_mlp").values({n: inputs[n] for n in get_block("llama_mlp").inputs})
    assert all(torch.equal(inputs[n], values[n]) for n in ("g", "u")) and "a" not in inputs
    assert "g, u, rstd_h: saved by the forward pass" in block.reference_source()
    # ... and the pre-norm's statistic, as the training forward returns it (one value a row)
    assert get_block("llama_mlp_train").outputs == ["out", "g", "u", "rstd_h"]
    # a post-norm after the down projection (OLMo 2, Gemma 2's sandwich) needs a saved too
    assert get_block("olmo2_mlp_branch_train").outputs == ["out", "g", "u", "a"]
    assert "a" in get_block("gemma2_mlp_branch_bwd_saved").inputs
    assert torch.equal(inputs["rstd_h"], fn.row_rstd(inputs["x"], 1e-5))
    # llama_lm_head_ce_bwd_saved receives each row's log-sum-exp of the logits
    block = get_block("llama_lm_head_ce_bwd_saved")
    inputs = block.make_inputs(block.shapes.cpu[0], torch.float64, seed=3)
    logits = fn.rms_norm(inputs["x"], inputs["gamma"], 1e-5) @ inputs["w_lm"].T
    assert torch.allclose(inputs["lse"], torch.logsumexp(logits, dim=-1))


def test_the_residual_of_an_attention_output_passes_its_gradient_through() -> None:
    # x only enters x_out = x + attn @ w_oᵀ: its gradient is dx_out, so the backward block has
    # no dx (the exported function hands dx_out on) and does not take x
    for name in ("attn_out_bwd", "gemma2_attn_out_bwd", "olmo2_attn_out_bwd"):
        block = get_block(name)
        vjp = block.graph[0]
        assert vjp.passthrough == {"x": "x_out"}, name
        assert "dx" not in block.outputs and "x" not in block.inputs, name
        assert "dx is dx_out itself" in block.reference_source(), name


def test_only_a_residual_passes_its_gradient_through() -> None:
    from coda.blocks.autodiff import backward_block, residual_passthrough
    from coda.blocks.block import TensorSpec

    dout = {"out": TensorSpec(shape=["M", "d"])}
    # llama_mlp's x also feeds the pre-norm: its gradient is more than dout
    with pytest.raises(ValueError, match="exactly one graph op reads"):
        residual_passthrough(get_block("llama_mlp"), "x", dout)
    with pytest.raises(ValueError, match="not an Add"):
        residual_passthrough(get_block("llama_mlp"), "w_down", dout)
    # llama_attn_out's x_out feeds the next norm's statistic: with a cotangent for it too, x's
    # gradient gets that path's share
    both = {"x_out": TensorSpec(shape=["M", "d"]), "rstd": TensorSpec(shape=["M"])}
    with pytest.raises(ValueError, match=r"\['rstd'\] are computed from 'x_out'"):
        residual_passthrough(get_block("llama_attn_out"), "x", both)
    assert residual_passthrough(get_block("llama_attn_out"), "x", {"x_out": both["x_out"]})
    with pytest.raises(ValueError, match="leave them out of wrt"):
        backward_block(
            get_block("attn_out"),
            name="attn_out_bwd_twice",
            cotangents={"x_out": both["x_out"]},
            wrt=["attn", "x"],
            passthrough=["x"],
        )
