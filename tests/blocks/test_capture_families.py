"""The families suite (``evals/suites/families``): each block file's function is the
transformers model's own computation (checked against its modules on a random tiny config), the
captured graph of each block (op types, wiring, constants), each forward block's backward block
(autograd of its function, its shown source runs), and the blocks the planner lowers verify in
the sandbox from their captured graphs (float32 and float16, ragged shapes, the block file
re-imported by the worker)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coda.blocks import Block, load_block_file
from coda.blocks.autodiff import VJP
from coda.blocks.capture import CapturedBlock
from coda.evals.suites import load_suite, select
from coda.planner import lower
from coda.sandbox import SandboxOptions, evaluate

transformers = pytest.importorskip("transformers")

FAMILIES = Path(__file__).resolve().parents[2] / "evals" / "suites" / "families"
D, F_, M = 48, 80, 7  # hidden, intermediate, tokens
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


@pytest.fixture(scope="module")
def suite_blocks() -> dict[str, Block]:
    """Every block of the suite's files: the captured forward blocks and their backward blocks."""
    return {b.name: b for path in sorted(FAMILIES.glob("*.py")) for b in load_block_file(path)}


@pytest.fixture(scope="module")
def blocks(suite_blocks) -> dict[str, CapturedBlock]:  # noqa: ANN001
    """The forward blocks, captured from the files' functions."""
    return {n: b for n, b in suite_blocks.items() if isinstance(b, CapturedBlock)}


@pytest.fixture(scope="module")
def backward(suite_blocks) -> dict[str, Block]:  # noqa: ANN001
    """The backward blocks (``backward_block`` of a forward block: autograd of its function)."""
    return {n: b for n, b in suite_blocks.items() if not isinstance(b, CapturedBlock)}


def _randomize(*modules: torch.nn.Module) -> None:
    """Random weights (norm weights too, which start at 0 or 1)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                scale = p.shape[-1] ** -0.5 if p.dim() == 2 else 0.25
                p.copy_(torch.randn(p.shape, generator=gen) * scale + (p.dim() == 1))


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor, **kw: object) -> None:
    """Equal: to float32's rounding, and bit for bit in bfloat16 (the same ops in the same
    order, so the casts are the model's: a Llama-order norm in a Gemma block would differ)."""
    exact = {"rtol": 0, "atol": 0} if got.dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got, want, **exact, **kw)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def _rope_tables(module_cls: type, config: object) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = module_cls(config)
    cos, sin = rotary(_x(1, M, D), torch.arange(M)[None])
    return cos[0], sin[0]


def _hf_attn_in(attn, norm, x, cos, sin, apply_rotary_pos_emb, head_norms=None):  # noqa: ANN001
    """Hugging Face's attention input path as the modules run it: [1, M, d] hidden states, q/k
    as [1, heads, M, head_dim], back to [M, heads·head_dim]."""
    h = norm(x[None])
    shape = (1, M, -1, HEAD_DIM)
    q, k = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape)
    if head_norms is not None:
        q, k = head_norms[0](q), head_norms[1](k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])
    flat = lambda t: t.transpose(1, 2).reshape(M, -1)  # noqa: E731
    return {"q": flat(q), "k": flat(k), "v": attn.v_proj(h)[0]}


# -- the functions are the models' computations ----------------------------------------------------
@DTYPES
def test_gemma_and_gemma2_mlps_are_transformers_modules(blocks, dtype) -> None:  # noqa: ANN001
    from transformers.models.gemma import modeling_gemma as g
    from transformers.models.gemma2 import modeling_gemma2 as g2

    config = transformers.GemmaConfig(
        hidden_size=D, intermediate_size=F_, hidden_act="gelu_pytorch_tanh"
    )
    mlp, norm = g.GemmaMLP(config), g.GemmaRMSNorm(D, eps=1e-6)
    _randomize(mlp, norm)
    mlp, norm, x = mlp.to(dtype), norm.to(dtype), _x(M, D, dtype=dtype)
    got = blocks["hf_gemma_mlp"].function(
        x, norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    )
    _same(got, x + mlp(norm(x)))

    config2 = transformers.Gemma2Config(
        hidden_size=D, intermediate_size=F_, hidden_activation="gelu_pytorch_tanh"
    )
    mlp2, pre, post = g2.Gemma2MLP(config2), g2.Gemma2RMSNorm(D), g2.Gemma2RMSNorm(D)
    _randomize(mlp2, pre, post)
    mlp2, pre, post = mlp2.to(dtype), pre.to(dtype), post.to(dtype)
    weights = [mlp2.gate_proj.weight, mlp2.up_proj.weight, mlp2.down_proj.weight]
    got = blocks["hf_gemma2_mlp"].function(x, pre.weight, post.weight, *weights)
    _same(got, x + post(mlp2(pre(x))))


@DTYPES
def test_gemma2_lm_head_ce_is_the_causal_lm_with_its_softcap(blocks, dtype) -> None:  # noqa: ANN001
    config = transformers.Gemma2Config(
        vocab_size=97,
        hidden_size=D,
        intermediate_size=F_,
        num_hidden_layers=0,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        final_logit_softcapping=30.0,
    )
    model = transformers.Gemma2ForCausalLM(config).eval()
    _randomize(model.model.norm, model.lm_head)
    model = model.to(dtype)
    x = _x(M, D, dtype=dtype) * 3
    target = torch.randint(0, 97, (M,), generator=torch.Generator().manual_seed(2))
    hf = model(inputs_embeds=x[None], labels=target[None], shift_labels=target[None])
    got = blocks["hf_gemma2_lm_head_ce"].function(
        x, model.model.norm.weight, model.lm_head.weight, target
    )
    want = torch.nn.functional.cross_entropy(hf.logits[0].float(), target, reduction="none")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got.mean(), hf.loss)
    assert hf.logits.abs().max() < 30.0  # the softcap is in the model's logits


@DTYPES
def test_gpt2_mlp_is_the_gpt2_block(blocks, dtype) -> None:  # noqa: ANN001
    config = transformers.GPT2Config(n_embd=D, n_head=HEADS, n_inner=F_)
    assert config.activation_function == "gelu_new"  # GPT-2's own, written out by hand
    layer = transformers.models.gpt2.modeling_gpt2.GPT2Block(config).eval()
    _randomize(layer.ln_2, layer.mlp)
    layer, x = layer.to(dtype), _x(M, D, dtype=dtype)
    fc, proj = layer.mlp.c_fc, layer.mlp.c_proj
    got = blocks["hf_gpt2_mlp"].function(
        x, layer.ln_2.weight, layer.ln_2.bias, fc.weight.T, fc.bias, proj.weight.T, proj.bias
    )
    _same(got, x + layer.mlp(layer.ln_2(x)))


@DTYPES
def test_phi3_mlp_and_olmo2_attn_out_are_transformers_modules(blocks, dtype) -> None:  # noqa: ANN001
    from transformers.models.olmo2 import modeling_olmo2 as olmo2
    from transformers.models.phi3 import modeling_phi3 as phi3

    config = transformers.Phi3Config(hidden_size=D, intermediate_size=F_)
    mlp, norm = phi3.Phi3MLP(config), phi3.Phi3RMSNorm(D, eps=1e-5)
    _randomize(mlp, norm)
    mlp, norm, x = mlp.to(dtype), norm.to(dtype), _x(M, D, dtype=dtype)
    got = blocks["hf_phi3_mlp"].function(
        x, norm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight
    )
    _same(got, x + mlp(norm(x)))

    config = transformers.Olmo2Config(
        hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS
    )
    attn, post = olmo2.Olmo2Attention(config, 0), olmo2.Olmo2RMSNorm(D, eps=1e-6)
    _randomize(attn, post)
    attn, post, a = attn.to(dtype), post.to(dtype), _x(M, D, dtype=dtype) * 2
    got = blocks["hf_olmo2_attn_out"].function(a, attn.o_proj.weight, post.weight, x)
    _same(got, x + post(attn.o_proj(a)))


@DTYPES
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_attention_inputs_are_transformers_attention_projections(blocks, family, dtype) -> None:  # noqa: ANN001
    modeling = getattr(getattr(transformers.models, family), f"modeling_{family}")
    prefix = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    config = getattr(transformers, f"{prefix}Config")(
        hidden_size=D,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5 if family == "mistral" else 1e-6,
    )
    attn = getattr(modeling, f"{prefix}Attention")(config, 0)
    norm = getattr(modeling, f"{prefix}RMSNorm")(D, eps=config.rms_norm_eps)
    _randomize(attn, norm)
    attn, norm, x = attn.to(dtype), norm.to(dtype), _x(M, D, dtype=dtype)
    cos, sin = (
        t.to(dtype) for t in _rope_tables(getattr(modeling, f"{prefix}RotaryEmbedding"), config)
    )
    heads = (attn.q_norm, attn.k_norm) if family == "qwen3" else None
    want = _hf_attn_in(attn, norm, x, cos, sin, modeling.apply_rotary_pos_emb, heads)
    args = [x, norm.weight, attn.q_proj.weight]
    if family == "qwen2":
        args += [attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias]
        args += [attn.v_proj.weight, attn.v_proj.bias]
    else:
        args += [attn.k_proj.weight, attn.v_proj.weight]
    if family == "qwen3":
        args += [attn.q_norm.weight, attn.k_norm.weight]
    got = blocks[f"hf_{family}_attn_in"].function(*args, cos, sin)
    for name in ("q", "k", "v"):
        _same(got[name], want[name], msg=name)
    if family == "mistral":
        a = _x(M, HEADS * HEAD_DIM, dtype=dtype)
        got = blocks["hf_mistral_attn_out"].function(a, attn.o_proj.weight, x)
        _same(got, x + attn.o_proj(a))


def _tables(dtype: torch.dtype, head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's default rotary tables [M, head_dim] (rotate-half layout)."""
    freq = 10000.0 ** (-torch.arange(0, head_dim, 2) / head_dim)
    emb = (torch.arange(M)[:, None] * freq).repeat(1, 2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@DTYPES
def test_gemma3_attn_in_is_the_transformers_attention_input(blocks, dtype) -> None:  # noqa: ANN001
    from transformers.models.gemma3 import modeling_gemma3 as gemma3

    config = transformers.Gemma3TextConfig(
        hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM
    )
    attn, norm = gemma3.Gemma3Attention(config, 0), gemma3.Gemma3RMSNorm(D, eps=1e-6)
    _randomize(attn, norm)
    attn, norm, x = attn.to(dtype), norm.to(dtype), _x(M, D, dtype=dtype)
    cos, sin = _tables(dtype)
    heads = (attn.q_norm, attn.k_norm)
    want = _hf_attn_in(attn, norm, x, cos, sin, gemma3.apply_rotary_pos_emb, heads)
    weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    got = blocks["hf_gemma3_attn_in"].function(
        x, norm.weight, *weights, attn.q_norm.weight, attn.k_norm.weight, cos, sin
    )
    for name in ("q", "k", "v"):
        _same(got[name], want[name], msg=name)


@DTYPES
def test_olmo2_attn_in_is_the_transformers_attention_input(blocks, dtype) -> None:  # noqa: ANN001
    """No input norm; q_norm/k_norm over the whole projection before the heads are split."""
    from transformers.models.olmo2 import modeling_olmo2 as olmo2

    config = transformers.Olmo2Config(
        hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6
    )  # OLMo 2's checkpoints set 1e-6 (the config's default is 1e-5)
    attn = olmo2.Olmo2Attention(config, 0)
    _randomize(attn)
    attn, x = attn.to(dtype), _x(M, D, dtype=dtype)
    cos, sin = _tables(dtype, attn.head_dim)
    shape = (1, M, -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(x[None])).view(shape).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x[None])).view(shape).transpose(1, 2)
    q, k = olmo2.apply_rotary_pos_emb(q, k, cos[None], sin[None])
    flat = lambda t: t.transpose(1, 2).reshape(M, -1)  # noqa: E731
    weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    norms = [attn.q_norm.weight, attn.k_norm.weight]
    got = blocks["hf_olmo2_attn_in"].function(x, *weights, *norms, cos, sin)
    _same(got["q"], flat(q), msg="q")
    _same(got["k"], flat(k), msg="k")
    _same(got["v"], attn.v_proj(x), msg="v")


@DTYPES
def test_qwen2_mlp_is_the_transformers_mlp_sub_layer(blocks, dtype) -> None:  # noqa: ANN001
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    config = transformers.Qwen2Config(hidden_size=D, intermediate_size=F_)
    mlp, norm = qwen2.Qwen2MLP(config), qwen2.Qwen2RMSNorm(D, eps=1e-6)
    _randomize(mlp, norm)
    for tokens in (M, 1):
        mlp, norm, x = mlp.to(dtype), norm.to(dtype), _x(tokens, D, dtype=dtype)
        weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        got = blocks["hf_qwen2_mlp"].function(x, norm.weight, *weights)
        _same(got, x + mlp(norm(x)))


# -- the captured graphs ---------------------------------------------------------------------------
GEMMA_NORM = "rms_norm({x}, {w}, eps=1e-06, offset=1.0, cast='after_weight')"
LLAMA_NORM = "norm_1 = rms_norm(x, gamma, eps={eps})"
GRAPHS = {
    "hf_gemma_mlp": [
        "norm_1 = " + GEMMA_NORM.format(x="x", w="gamma"),
        "linear_1 = linear(norm_1, w_gate)",
        "linear_2 = linear(norm_1, w_up)",
        "glu_1 = glu(linear_1, linear_2, act='gelu_tanh')",
        "linear_3 = linear(glu_1, w_down)",
        "out = add(x, linear_3)",
    ],
    "hf_gemma2_mlp": [
        "norm_1 = " + GEMMA_NORM.format(x="x", w="pre_gamma"),
        "linear_1 = linear(norm_1, w_gate)",
        "linear_2 = linear(norm_1, w_up)",
        "glu_1 = glu(linear_1, linear_2, act='gelu_tanh')",
        "linear_3 = linear(glu_1, w_down)",
        "norm_2 = " + GEMMA_NORM.format(x="linear_3", w="post_gamma"),
        "out = add(x, norm_2)",
    ],
    "hf_gemma2_lm_head_ce": [
        "norm_1 = " + GEMMA_NORM.format(x="x", w="gamma"),
        "linear_1 = linear(norm_1, w_lm)",
        "softcap_1 = activation(linear_1, kind='softcap', cap=30.0)",
        "loss = cross_entropy(softcap_1, target)",
    ],
    "hf_gemma3_attn_in": [
        "norm_1 = " + GEMMA_NORM.format(x="x", w="gamma"),
        "linear_1 = linear(norm_1, w_q)",
        "head_norm_1 = head_" + GEMMA_NORM.format(x="linear_1", w="q_gamma"),
        "q = rope(head_norm_1, cos, sin)",
        "linear_2 = linear(norm_1, w_k)",
        "head_norm_2 = head_" + GEMMA_NORM.format(x="linear_2", w="k_gamma"),
        "k = rope(head_norm_2, cos, sin)",
        "v = linear(norm_1, w_v)",
    ],
    "hf_gpt2_mlp": [
        "norm_1 = layer_norm(x, ln_weight, ln_bias, eps=1e-05)",
        "linear_1 = linear(norm_1, w_fc, b_fc)",
        "gelu_tanh_1 = activation(linear_1, kind='gelu_tanh')",
        "linear_2 = linear(gelu_tanh_1, w_proj, b_proj)",
        "out = add(x, linear_2)",
    ],
    "hf_mistral_attn_in": [
        LLAMA_NORM.format(eps="1e-05"),
        "linear_1 = linear(norm_1, w_q)",
        "q = rope(linear_1, cos, sin)",
        "linear_2 = linear(norm_1, w_k)",
        "k = rope(linear_2, cos, sin)",
        "v = linear(norm_1, w_v)",
    ],
    "hf_mistral_attn_out": ["linear_1 = linear(attn, w_o)", "x_out = add(x, linear_1)"],
    "hf_olmo2_attn_in": [
        "linear_1 = linear(x, w_q)",
        "norm_1 = rms_norm(linear_1, q_gamma, eps=1e-06, cast='after_weight')",
        "q = rope(norm_1, cos, sin)",
        "linear_2 = linear(x, w_k)",
        "norm_2 = rms_norm(linear_2, k_gamma, eps=1e-06, cast='after_weight')",
        "k = rope(norm_2, cos, sin)",
        "v = linear(x, w_v)",
    ],
    "hf_olmo2_attn_out": [
        "linear_1 = linear(attn, w_o)",
        "norm_1 = rms_norm(linear_1, gamma, eps=1e-06, cast='after_weight')",
        "x_out = add(x, norm_1)",
    ],
    "hf_phi3_mlp": [
        LLAMA_NORM.format(eps="1e-05"),
        "linear_1 = linear(norm_1, w_gate_up)",
        "chunk_1 = chunk(linear_1, chunks=2, index=0)",
        "chunk_2 = chunk(linear_1, chunks=2, index=1)",
        "swiglu_1 = swiglu(chunk_1, chunk_2)",
        "linear_2 = linear(swiglu_1, w_down)",
        "out = add(x, linear_2)",
    ],
    "hf_qwen2_attn_in": [
        LLAMA_NORM.format(eps="1e-06"),
        "linear_1 = linear(norm_1, w_q, b_q)",
        "q = rope(linear_1, cos, sin)",
        "linear_2 = linear(norm_1, w_k, b_k)",
        "k = rope(linear_2, cos, sin)",
        "v = linear(norm_1, w_v, b_v)",
    ],
    "hf_qwen2_mlp": [
        LLAMA_NORM.format(eps="1e-06"),
        "linear_1 = linear(norm_1, w_gate)",
        "linear_2 = linear(norm_1, w_up)",
        "swiglu_1 = swiglu(linear_1, linear_2)",
        "linear_3 = linear(swiglu_1, w_down)",
        "out = add(x, linear_3)",
    ],
    "hf_qwen3_attn_in": [
        LLAMA_NORM.format(eps="1e-06"),
        "linear_1 = linear(norm_1, w_q)",
        "head_norm_1 = head_rms_norm(linear_1, q_gamma, eps=1e-06)",
        "q = rope(head_norm_1, cos, sin)",
        "linear_2 = linear(norm_1, w_k)",
        "head_norm_2 = head_rms_norm(linear_2, k_gamma, eps=1e-06)",
        "k = rope(head_norm_2, cos, sin)",
        "v = linear(norm_1, w_v)",
    ],
}


def test_every_suite_block_captures_into_its_op_graph(blocks, backward) -> None:  # noqa: ANN001
    suite = load_suite("families")
    assert sorted(suite.blocks) == sorted([*GRAPHS, *backward]) == sorted([*blocks, *backward])
    assert len(blocks) >= 12
    assert select(suite).blocks == suite.blocks
    for name, want in GRAPHS.items():
        assert [op.source() for op in blocks[name].graph] == want, name
        assert not [op for op in blocks[name].graph if op.op == "opaque"], name


def test_each_reference_source_runs_as_the_reference(blocks) -> None:  # noqa: ANN001
    """What an LLM reads is what runs: the shown source alone (callees, constants, defaults)
    computes the block's reference."""
    for name, block in blocks.items():
        scope: dict = {}
        exec(compile(block.reference_source(), f"<{name}>", "exec"), scope)
        sizes = block.shapes.cpu[-1]
        inputs = block.make_inputs(sizes, torch.float32, seed=0)
        got = scope[block.function.__name__](**inputs)
        got = got if isinstance(got, dict) else {block.outputs[0]: got}
        for out, want in block.reference(inputs).items():
            torch.testing.assert_close(got[out], want, rtol=0, atol=0, msg=f"{name}.{out}")


def test_every_forward_block_has_a_backward_block_whose_source_runs(blocks, backward) -> None:  # noqa: ANN001
    """Each ``<name>_bwd`` is autograd of ``<name>``'s function over every weight and activation
    (not the rotary tables), and its shown source computes its reference."""
    assert sorted(backward) == sorted(f"{name}_bwd" for name in blocks)
    for name, block in backward.items():
        (vjp,) = [op for op in block.graph if isinstance(op, VJP)]
        forward = blocks[vjp.forward]
        assert sorted(vjp.wrt) == sorted(set(forward.inputs) - {"cos", "sin", "target"}), name
        assert sorted(vjp.cotangents) == sorted(forward.outputs), name
        scope: dict = {}
        exec(compile(block.reference_source(), f"<{name}>", "exec"), scope)
        inputs = block.make_inputs(block.shapes.cpu[-1], torch.float32, seed=0)
        got = scope[name](**inputs)
        for out, want in block.reference(inputs).items():
            torch.testing.assert_close(got[out], want, rtol=0, atol=0, msg=f"{name}.{out}")


def test_the_odd_sizes_are_there(blocks) -> None:  # noqa: ANN001
    sets = [s for b in blocks.values() for s in b.shapes.cpu]
    assert any(s["M"] == 1 for s in sets)
    assert any(s["d"] % 16 for s in sets)


# -- the blocks the planner lowers today verify from their captured graphs -------------------------
OPTIONS = SandboxOptions(profile=False, isolate=False, seeds=[0])


@pytest.mark.parametrize(
    "name",
    [
        "hf_gpt2_mlp",
        "hf_gemma_mlp",
        "hf_gemma2_lm_head_ce",
        "hf_phi3_mlp",
        "hf_gemma3_attn_in",
        "hf_olmo2_attn_in",
        "hf_qwen2_mlp",
        "hf_phi3_mlp_bwd",
        "hf_qwen2_mlp_bwd",
        "hf_gpt2_mlp_bwd",
    ],
)
def test_captured_blocks_verify_in_the_sandbox(suite_blocks, name: str) -> None:  # noqa: ANN001
    block = suite_blocks[name]
    report = evaluate(lower(block), block, OPTIONS)
    assert report.verified, report.render_text()
    assert {c.dtype for c in report.checks} == {"float32", "float16"}


def test_the_sandbox_worker_reimports_the_block_file(blocks) -> None:  # noqa: ANN001
    block = blocks["hf_mistral_attn_out"]
    options = SandboxOptions(profile=False, seeds=[0])
    report = evaluate(lower(block), block, options, block_file=str(FAMILIES / "mistral.py"))
    assert report.verified, report.render_text()
    assert {tuple(sorted(c.sizes.items())) for c in report.checks} >= {
        (("M", 1), ("Nq", 48), ("d", 24))
    }
