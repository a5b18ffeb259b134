"""The Gemma MLP drop-ins on the GPU in bfloat16: ``gemma_mlp`` (GeGLU under Gemma's ``(1 + w)``
norm) and ``gemma2_mlp_branch`` (Gemma 2/3's sandwich norms) against Hugging Face's modules, the
model cast to bf16 and fp32 weights under bf16 autocast, and ``patch_model`` on Gemma and Gemma 2
models — every value judged against a float32 run by the sandbox's rule, next to Hugging Face's
own error in the same setting. ``CODA_TEST_DEVICE=cpu CODA_TEST_DTYPE=float32`` checks this file
through the interpreter at toy sizes (fp16 for the low-precision runs)."""

from __future__ import annotations

import copy

import pytest
import torch

from coda.blocks import get_block
from coda.export import CodaLlamaMLPBlock, patch_model
from coda.sandbox import check_output
from tests.gpu.test_export_gpu import (
    AMP,
    DEVICE,
    TOY,
    _assert_as_close_as_hugging_face,
    _low_precision_copies,
    _run,
)

pytestmark = pytest.mark.cpu_capable
transformers = pytest.importorskip("transformers")


def _modules(sandwich: bool, hidden: int, inter: int) -> tuple[torch.nn.Module, ...]:
    """(pre-norm, MLP, post-norm or None): Gemma's, or Gemma 2's with its sandwich norms, on
    DEVICE (fp32), norm weights away from zero."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP, Gemma2RMSNorm

    config = transformers.Gemma2Config(hidden_size=hidden, intermediate_size=inter)
    torch.manual_seed(0)
    mlp = Gemma2MLP(config)
    norms = [Gemma2RMSNorm(hidden, eps=1e-6) for _ in range(2 if sandwich else 1)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.normal_(0, 0.3)
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.weight.normal_(0, proj.in_features**-0.5)
    post = norms[1].to(DEVICE) if sandwich else None
    return norms[0].to(DEVICE), mlp.to(DEVICE), post


def _plus_residual(branch):  # noqa: ANN001, ANN202
    return lambda t: t + branch(t)


@pytest.mark.parametrize("sandwich", [False, True], ids=["gemma_mlp", "gemma2_mlp_branch"])
def test_the_gemma_mlp_drop_ins_in_bf16_and_under_autocast(sandwich: bool) -> None:
    """The drop-in's branch plus the residual: output and the gradients of x and every weight."""
    hidden, inter, tokens = (48, 80, 11) if TOY else (1024, 2816, 333)
    pre, mlp, post = _modules(sandwich, hidden, inter)

    def hf_branch(t: torch.Tensor) -> torch.Tensor:
        out = mlp(pre(t))
        return out if post is None else post(out)

    x = torch.randn(3, tokens, hidden, device=DEVICE)
    dout = torch.randn(3, tokens, hidden, device=DEVICE)
    modules = [pre, mlp] + ([] if post is None else [post])
    params = [p for m in modules for p in m.parameters()]
    ref32 = _run(_plus_residual(hf_branch), params, x, dout)
    tol = get_block("gemma2_mlp_branch" if sandwich else "gemma_mlp").tolerance
    for setting, amp, dtype in (
        ("cast", torch.autocast(DEVICE, enabled=False), AMP),
        ("autocast", torch.autocast(DEVICE, dtype=AMP), torch.float32),
    ):
        for m in modules:
            m.to(dtype)
        block = CodaLlamaMLPBlock(pre, mlp, post_norm=post, residual=False, tune="off")
        xs, douts = x.to(dtype), dout.to(dtype)
        with amp:
            theirs = _run(_plus_residual(hf_branch), params, xs, douts)
            got = _run(_plus_residual(block), params, xs, douts)
        for i, (g, want, hf) in enumerate(zip(got, ref32, theirs, strict=True)):
            c = check_output(
                f"{setting}[{i}]", g.float(), want, hf.float(), tol, sizes={}, seed=0,
                run_dtype=AMP,
            )  # fmt: skip
            assert c.passed, c.summary()
        for m in modules:
            m.float()


@pytest.mark.parametrize(
    ("family", "fused_loss"),
    [("gemma", False), ("gemma2", False), ("gemma2", True), ("olmo2", False)],
)
def test_patch_model_on_gemma_models_in_bf16_and_under_autocast(
    family: str, fused_loss: bool
) -> None:
    """A random two-layer Gemma / Gemma 2 model with its MLP halves and attention outputs
    patched (``attn_out``; Gemma 2's through its ``(1 + w)`` post-norm, ``gemma2_attn_out``),
    and with ``fused_loss`` Gemma 2's softcapped LM-head loss (``lm_head_softcap_ce``) — and an
    OLMo 2 model's attention outputs through its post-norm (``olmo2_attn_out``): the loss, the
    logits (when made) and every gradient against the fp32 model, cast to bf16 and under bf16
    autocast."""
    hidden, inter, vocab, seq = (48, 80, 96, 9) if TOY else (1024, 2816, 2048, 333)
    names = {
        "gemma": ("GemmaConfig", "GemmaForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    }[family]
    config = getattr(transformers, names[0])(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8, vocab_size=vocab,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = getattr(transformers, names[1])(config).to(DEVICE)
    ids = torch.randint(0, vocab, (2, seq), device=DEVICE)

    def step(model: torch.nn.Module) -> list:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        logits = [] if out.logits is None else [("logits", out.logits.detach())]
        return [("loss", out.loss.detach().reshape(1)), *logits] + [
            (n, p.grad) for n, p in model.named_parameters()
        ]

    ref32 = dict(step(hf))
    tol = get_block("gemma_mlp").tolerance
    for setting, theirs, amp in _low_precision_copies(hf):
        coda = copy.deepcopy(theirs)
        report = patch_model(coda, verify=False, tune="off", fused_loss=fused_loss)
        assert report.lines["MLP half"].startswith("patched") or family == "olmo2", report
        assert report.lines["attention output"].startswith("patched"), report
        assert report.lines["final norm + LM head loss"].startswith("patched") == fused_loss
        with amp:
            want, got = dict(step(theirs)), step(coda)
        _assert_as_close_as_hugging_face(setting, got, ref32, want, tol)
