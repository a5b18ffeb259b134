"""coda.export on the GPU in bfloat16: the Hugging Face LlamaMLP drop-in against the original
modules (both judged against a float32 reference by the sandbox's rule), and torch.compile with
the default inductor backend compiling around the custom ops."""

from __future__ import annotations

import os

import pytest
import torch

from coda.blocks import get_block
from coda.export import CodaLlamaMLPBlock
from coda.sandbox import check_output

pytestmark = pytest.mark.cpu_capable
transformers = pytest.importorskip("transformers")
DEVICE = os.environ.get("CODA_TEST_DEVICE", "cuda")
DTYPE = getattr(torch, os.environ.get("CODA_TEST_DTYPE", "bfloat16"))
BACKEND = os.environ.get("CODA_TEST_COMPILE_BACKEND", "inductor")
# CODA_TEST_DEVICE=cpu checks this file through the interpreter at toy sizes (no GPU needed).
TOY = DEVICE == "cpu"
AMP = torch.float16 if TOY else DTYPE  # autocast dtype; the CPU check: fp16 (bf16 dot is wrong)


def _hf_modules(hidden: int = 1024, inter: int = 2816, eps: float = 1e-5):  # noqa: ANN202
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_attention_heads=4, rms_norm_eps=eps
    )
    torch.manual_seed(0)
    norm, mlp = LlamaRMSNorm(hidden, eps=eps), LlamaMLP(cfg)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.weight.normal_(0, proj.in_features**-0.5)
    return norm.to(DEVICE), mlp.to(DEVICE)


def _run(forward, params: list, x: torch.Tensor, dout: torch.Tensor) -> list:  # noqa: ANN001
    x = x.detach().clone().requires_grad_()
    out = forward(x)
    return [out, *torch.autograd.grad(out, [x, *params], dout)]


@pytest.mark.parametrize("fuse", [False, True], ids=["hf-params", "fused-gate-up"])
def test_drop_in_matches_hugging_face_in_bf16(fuse: bool) -> None:
    hidden, tokens = (48, 11) if TOY else (1024, 333)
    norm, mlp = _hf_modules(hidden=hidden, inter=80 if TOY else 2816, eps=1e-6)
    x = torch.randn(3, tokens, hidden, device=DEVICE)  # 999 tokens on the GPU: ragged
    dout = torch.randn(3, tokens, hidden, device=DEVICE)
    params = [norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    ref32 = _run(lambda t: t + mlp(norm(t)), params, x, dout)
    norm, mlp = norm.to(DTYPE), mlp.to(DTYPE)
    params = [norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    hf = _run(lambda t: t + mlp(norm(t)), params, x.to(DTYPE), dout.to(DTYPE))
    # the Programs' verification is tests/gpu/test_blocks_gpu.py's job; the ops tune on first use
    block = CodaLlamaMLPBlock(norm, mlp, verify=False, tune="quick", fuse_gate_up=fuse)
    if fuse:  # one interleaved parameter: its gradient's even/odd rows are gate's and up's
        params = [norm.weight, block.gate_up_weight, mlp.down_proj.weight]
        out, dx, dgamma, dw_gate_up, dw_down = _run(block, params, x.to(DTYPE), dout.to(DTYPE))
        coda = [out, dx, dgamma, dw_gate_up[0::2], dw_gate_up[1::2], dw_down]
    else:
        coda = _run(block, params, x.to(DTYPE), dout.to(DTYPE))
    tol = get_block("llama_mlp").tolerance
    for name, got, want, theirs in zip(
        ["out", "dx", "dgamma", "dw_gate", "dw_up", "dw_down"], coda, ref32, hf, strict=True
    ):
        c = check_output(name, got, want, theirs, tol, sizes={}, seed=0, run_dtype=DTYPE)
        assert c.passed, c.summary()


def test_torch_compile_fullgraph_around_the_custom_ops() -> None:
    hidden, tokens = (48, 21) if TOY else (512, 1000)
    norm, mlp = _hf_modules(hidden=hidden, inter=80 if TOY else 1408)
    norm, mlp = norm.to(DTYPE), mlp.to(DTYPE)
    block = CodaLlamaMLPBlock(norm, mlp, verify=False, tune="off")
    params = [norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
    dout = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
    eager = _run(lambda t: torch.nn.functional.gelu(block(t)), params, x, dout)
    compiled_fn = torch.compile(
        lambda t: torch.nn.functional.gelu(block(t)), backend=BACKEND, fullgraph=True
    )
    compiled = _run(compiled_fn, params, x, dout)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_evaluation_and_empty_batches_on_the_gpu() -> None:
    """Without gradients the plain forward runs (nothing saved) and agrees with the training
    forward, also under torch.compile; an empty batch gives an empty output and zero gradients."""
    hidden, tokens = (48, 13) if TOY else (1024, 777)
    norm, mlp = _hf_modules(hidden=hidden, inter=80 if TOY else 2816)
    norm, mlp = norm.to(DTYPE), mlp.to(DTYPE)
    block = CodaLlamaMLPBlock(norm, mlp, verify=False, tune="off")
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
    trained = block(x.clone().requires_grad_()).detach()
    with torch.no_grad():
        evaluated = block(x)
        compiled = torch.compile(block, backend=BACKEND, fullgraph=True)(x)
    torch.testing.assert_close(evaluated, trained, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(compiled, evaluated, atol=0, rtol=0)
    params = [norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    empty = torch.randn(0, hidden, device=DEVICE, dtype=DTYPE)
    out, dx, *grads = _run(block, params, empty, torch.randn_like(empty))
    assert out.shape == (0, hidden) and dx.shape == (0, hidden)
    assert all(g.shape == p.shape and not g.any() for g, p in zip(grads, params, strict=True))


def _graph_inputs(tokens: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE, generator=g)
    return x, torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE, generator=g)


@pytest.mark.skipif(TOY, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fuse", [False, True], ids=["hf-params", "fused-gate-up"])
def test_a_training_step_captured_in_a_cuda_graph(fuse: bool) -> None:
    """Forward + backward of the drop-in captured once with torch.cuda.graph and replayed on new
    inputs (no host launch cost per step): outputs and gradients equal an eager step's."""
    hidden, tokens = 512, 1000
    norm, mlp = _hf_modules(hidden=hidden, inter=1408)
    norm, mlp = norm.to(DTYPE), mlp.to(DTYPE)
    block = CodaLlamaMLPBlock(norm, mlp, verify=False, tune="off", fuse_gate_up=fuse)
    params = [p for p in block.parameters() if p.requires_grad]
    static_x, static_dout = _graph_inputs(tokens, hidden, seed=0)
    static_x.requires_grad_()

    def step() -> torch.Tensor:
        for t in (static_x, *params):
            t.grad = None
        out = block(static_x)
        out.backward(static_dout)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles and launch plans outside capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in (static_x, *params):
        t.grad = None
    with torch.cuda.graph(graph):
        static_out = block(static_x)
        static_out.backward(static_dout)
    for seed in (1, 2):
        x, dout = _graph_inputs(tokens, hidden, seed)
        with torch.no_grad():
            static_x.copy_(x)
        static_dout.copy_(dout)
        graph.replay()
        want = _run(block, params, x, dout)
        got = [static_out, static_x.grad, *(p.grad for p in params)]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


@pytest.mark.skipif(TOY, reason="CUDA graphs need a GPU")
def test_torch_compile_reduce_overhead_graphs_the_training_step() -> None:
    """torch.compile(mode="reduce-overhead") records CUDA graphs of the forward and backward
    around the custom ops (no cudagraph skips) and agrees with eager."""
    from torch._dynamo.utils import counters

    hidden, tokens = 512, 1000
    norm, mlp = _hf_modules(hidden=hidden, inter=1408)
    norm, mlp = norm.to(DTYPE), mlp.to(DTYPE)
    block = CodaLlamaMLPBlock(norm, mlp, verify=False, tune="off")
    params = [norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    torch.compiler.reset()
    counters.clear()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for seed in range(3):
        x, dout = _graph_inputs(tokens, hidden, seed)
        got = [t.clone() for t in _run(compiled, params, x, dout)]
        want = _run(block, params, x, dout)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_hugging_face_mixed_precision_under_autocast() -> None:
    """fp32 master weights and residual stream under torch.autocast (bf16 on the GPU): the
    branch runs in the autocast dtype, the residual add and the gradients in fp32, held to the
    sandbox's rule against an fp32 run next to Hugging Face's own autocast error."""
    hidden, tokens = (48, 11) if TOY else (1024, 333)
    norm, mlp = _hf_modules(hidden=hidden, inter=80 if TOY else 2816, eps=1e-6)
    block = CodaLlamaMLPBlock(norm, mlp, verify=False, tune="off")
    x = torch.randn(3, tokens, hidden, device=DEVICE)
    dout = torch.randn(3, tokens, hidden, device=DEVICE)
    params = [norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    ref32 = _run(lambda t: t + mlp(norm(t)), params, x, dout)
    with torch.autocast(x.device.type, dtype=AMP):
        hf = _run(lambda t: t + mlp(norm(t)), params, x, dout)
        coda = _run(block, params, x, dout)
    tol = get_block("llama_mlp").tolerance
    for name, got, want, theirs in zip(
        ["out", "dx", "dgamma", "dw_gate", "dw_up", "dw_down"], coda, ref32, hf, strict=True
    ):
        assert got.dtype == theirs.dtype == torch.float32, name
        c = check_output(name, got, want, theirs, tol, sizes={}, seed=0, run_dtype=AMP)
        assert c.passed, c.summary()


def _causal_lm(hidden: int, inter: int, layers: int, vocab: int):  # noqa: ANN202
    """A random LlamaForCausalLM on DEVICE (fp32 weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(DEVICE)


def _low_precision_copies(model):  # noqa: ANN001, ANN202
    """(setting, copy of ``model``, autocast context): cast to AMP, and fp32 under autocast."""
    import copy

    yield "cast", copy.deepcopy(model).to(AMP), torch.autocast(DEVICE, enabled=False)
    yield "autocast", copy.deepcopy(model), torch.autocast(DEVICE, dtype=AMP)


def _loss_and_grads(model, loss_fn) -> list:  # noqa: ANN001
    """``[("loss", loss), (name, grad) …]`` of one backward of ``loss_fn(model)`` from zero
    gradients: what the LM-head loss tests compare with Hugging Face's."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return [("loss", loss.detach())] + [(n, p.grad) for n, p in model.named_parameters()]


def _assert_loss_as_close_as_hugging_face(hf, hf_loss, coda_loss) -> None:  # noqa: ANN001
    """``coda_loss``'s loss and gradients on bf16 and autocast copies of ``hf`` against the fp32
    model's, held to the LM-head block's rule next to Hugging Face's own (``hf_loss``) error."""
    ref32 = dict(_loss_and_grads(hf, hf_loss))
    tol = get_block("llama_lm_head_ce").tolerance
    for setting, model, amp in _low_precision_copies(hf):
        with amp:
            want, got = dict(_loss_and_grads(model, hf_loss)), _loss_and_grads(model, coda_loss)
        _assert_as_close_as_hugging_face(setting, got, ref32, want, tol)


def _assert_as_close_as_hugging_face(
    setting: str, got: list, ref32: dict, theirs: dict, tol
) -> None:  # noqa: ANN001
    """Each (name, tensor) of ``got`` within the sandbox's rule of the fp32 values, next to
    Hugging Face's own error in the same setting.

    The rule's fixed relative bound is a kernel's; a whole model's gradients (attention, several
    layers in bf16) carry more, Hugging Face's own included — so each output's relative bound is
    the larger of the rule's and ``ratio ×`` Hugging Face's own relative error (the max-error half
    of the rule already scales that way)."""
    dtype = str(AMP).removeprefix("torch.")
    for name, g in got:
        want, hf = ref32[name].double(), theirs[name].double()
        hf_rel = float((hf - want).norm() / want.norm().clamp_min(1e-300))
        bound = max(tol.rel.get(dtype, 1.0), tol.ratio * hf_rel)
        rule = tol.model_copy(update={"rel": {**tol.rel, dtype: bound}})
        c = check_output(
            name, g.float(), ref32[name], theirs[name].float(), rule, sizes={}, seed=0,
            run_dtype=AMP,
        )  # fmt: skip
        assert c.passed, f"{setting}: {c.summary()} (Hugging Face's own rel {hf_rel:.3g})"


def test_a_patched_llama_model_in_bf16_and_under_autocast() -> None:
    """patch_llama (norms, attention input, attention output, MLP) on a random two-layer
    LlamaForCausalLM: logits and every gradient against the fp32 model by the sandbox's rule —
    the model cast to bf16, and fp32 weights under bf16 autocast — next to Hugging Face's own
    error in the same setting."""
    import copy

    from coda.export import patch_llama

    hidden, inter, vocab, seq = (48, 80, 96, 9) if TOY else (1024, 2816, 2048, 333)
    hf = _causal_lm(hidden, inter, 2, vocab)
    ids = torch.randint(0, vocab, (2, seq), device=DEVICE)

    def step(model) -> list:  # noqa: ANN001
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return [("logits", out.logits.detach())] + [
            (n, p.grad) for n, p in model.named_parameters()
        ]

    ref32 = dict(step(hf))
    tol = get_block("llama_mlp").tolerance
    for setting, theirs, amp in _low_precision_copies(hf):
        coda = patch_llama(copy.deepcopy(theirs), verify=False, tune="off")
        with amp:
            want, got = dict(step(theirs)), step(coda)
        _assert_as_close_as_hugging_face(setting, got, ref32, want, tol)


@pytest.mark.skipif(TOY, reason="CUDA graphs need a GPU")
def test_torch_compile_reduce_overhead_graphs_a_patched_model() -> None:
    """The whole patched Llama — the attention input's RoPE-pair prep, attention output, MLP and
    fused loss — under ``torch.compile(mode="reduce-overhead", fullgraph=True)``: its forward and
    backward recorded as CUDA graphs (no cudagraph skips; nothing the drop-ins keep between calls
    lives in the graphs' memory pool, which cudagraph trees refuse) and replayed on new tokens,
    the loss and gradients those of the eager patched model."""
    import copy

    from torch._dynamo.utils import counters

    from coda.export import patch_llama

    hf = _causal_lm(512, 1408, 2, 1024).to(DTYPE)
    options = {"verify": False, "tune": "off", "fuse_gate_up": True, "fused_loss": True}
    eager = patch_llama(copy.deepcopy(hf), **options)
    patched = patch_llama(hf, **options)
    torch.compiler.reset()
    counters.clear()
    compiled = torch.compile(patched, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for _ in range(4):  # warm-up, recording, then replays
        ids = torch.randint(0, 1024, (2, 300), device=DEVICE, generator=gen)
        torch.compiler.cudagraph_mark_step_begin()
        for model in (patched, eager):
            model.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        want = eager(input_ids=ids, labels=ids).loss
        want.backward()
        torch.testing.assert_close(loss, want, atol=2e-2, rtol=2e-2)
        for (name, p), q in zip(patched.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=2e-2, rtol=2e-2, msg=name)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_a_patched_model_decodes_from_its_kv_cache() -> None:
    """The last token's logits from the KV cache (keys stored in the kernel's pair order) against
    a full forward, next to Hugging Face's own cached-vs-full difference — the cache path of the
    installed transformers (its Cache.update signature) included."""
    import copy

    from coda.export import patch_llama

    hidden, inter, vocab, seq = (48, 80, 96, 9) if TOY else (1024, 2816, 2048, 65)
    hf = _causal_lm(hidden, inter, 2, vocab).to(AMP).eval()
    coda = patch_llama(copy.deepcopy(hf), verify=False, tune="off")
    ids = torch.randint(0, vocab, (2, seq), device=DEVICE)

    def cached_and_full(model):  # noqa: ANN001, ANN202
        with torch.no_grad():
            full = model(input_ids=ids).logits[:, -1].float()
            prefix = model(input_ids=ids[:, :-1], use_cache=True)
            cache = prefix.past_key_values
            step = model(input_ids=ids[:, -1:], past_key_values=cache).logits[:, -1].float()
        return step, full

    (ours, ours_full), (theirs, theirs_full) = cached_and_full(coda), cached_and_full(hf)
    scale = float(theirs_full.abs().max())
    bound = 2 * float((theirs - theirs_full).abs().max()) + 1e-2 * scale
    assert float((ours - ours_full).abs().max()) <= bound
    assert float((ours_full - theirs_full).abs().max()) <= 0.05 * scale  # and near HF's logits


def test_the_fused_causal_lm_loss_in_bf16_and_under_autocast() -> None:
    """causal_lm_loss on a random one-layer LlamaForCausalLM (vocabulary 32000): loss and every
    gradient against the fp32 model by the sandbox's rule, next to Hugging Face's own error —
    the model cast to bf16, and fp32 weights under bf16 autocast."""
    from coda.export import causal_lm_loss

    hidden, vocab, seq = (48, 96, 9) if TOY else (1024, 32000, 333)
    hf = _causal_lm(hidden, 2 * hidden, 1, vocab)
    ids = torch.randint(0, vocab, (2, seq), device=DEVICE)
    labels = ids.clone()
    labels[0, : seq // 3] = -100

    def hf_loss(model) -> torch.Tensor:  # noqa: ANN001
        return model(input_ids=ids, labels=labels).loss

    def coda_loss(model) -> torch.Tensor:  # noqa: ANN001
        return causal_lm_loss(model, ids, labels, verify=False, tune="off")

    _assert_loss_as_close_as_hugging_face(hf, hf_loss, coda_loss)
