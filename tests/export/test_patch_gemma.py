"""patch_model's Gemma MLP halves (random tiny configs, kernels in Triton's interpreter): Gemma's
GeGLU under its ``(1 + w)`` norm (``gemma_mlp``) and Gemma 2/3's between sandwich norms
(``gemma2_mlp_branch``). Logits, loss and every gradient against the unpatched model are
``tests/export/test_patch_model.py``'s (its family table); here: state dicts and generation with
the sandwich patched, the drop-in with its residual, the kernels chosen by activation and norm,
and proofs that keep what the kernels do not compute."""

from __future__ import annotations

import pytest
import torch

from coda.export import CodaLlamaMLPBlock
from coda.export import families as fam
from tests.export.test_patch_model import _batch, _model, _patched

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_sandwich_mlp_halves_keep_state_dicts_and_generation(family: str) -> None:
    """Both norms deferred into the MLP's kernels, gate and up packed (``fuse_gate_up``): the
    state dict has Hugging Face's keys and values both ways, and greedy generation is the
    original's."""
    model = _model(family, seed=7)
    patched, report = _patched(model, fuse_gate_up=True)
    assert report.patched(fam.MLP_HALF)
    layer = patched.model.layers[0]
    assert type(layer.pre_feedforward_layernorm).__name__ == "DeferredRMSNorm"
    assert layer.mlp.block.fused and layer.mlp.block.kernel.name == "gemma2_mlp_branch"
    theirs, ours = model.state_dict(), patched.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    other = _model(family, seed=3)
    patched.load_state_dict(other.state_dict())
    ids = _batch()["input_ids"]
    with torch.no_grad():
        want = other(input_ids=ids).logits
        torch.testing.assert_close(patched(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(
        patched.generate(ids[:1, :5], **kwargs), other.generate(ids[:1, :5], **kwargs)
    )


def _gemma_modules(activation: str = "gelu_pytorch_tanh") -> tuple[torch.nn.Module, ...]:
    from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm

    config = transformers.GemmaConfig(
        hidden_size=24, intermediate_size=40, hidden_activation=activation
    )
    torch.manual_seed(0)
    norm, mlp = GemmaRMSNorm(24, eps=1e-6), GemmaMLP(config)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    return norm, mlp


def test_the_drop_in_with_its_residual_computes_gemmas_mlp_half_and_gradients() -> None:
    """``CodaLlamaMLPBlock(norm, mlp)`` on Gemma's modules runs ``gemma_mlp`` (the residual
    added in the down projection's epilogue): ``x + mlp(norm(x))`` and the gradients of x and
    every weight, in fp32; the norm's own weight takes its gradient (``1 + w`` is in the
    kernels)."""
    norm, mlp = _gemma_modules()
    block = CodaLlamaMLPBlock(norm, mlp, tune="off")
    assert block.kernel.name == "gemma_mlp" and block.residual
    x = torch.randn(2, 7, 24)
    dout = torch.randn(2, 7, 24)
    params = [norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]

    def run(forward) -> list[torch.Tensor]:  # noqa: ANN001
        xx = x.clone().requires_grad_()
        out = forward(xx)
        return [out, *torch.autograd.grad(out, [xx, *params], dout)]

    want = run(lambda t: t + mlp(norm(t)))
    got = run(block)
    for name, g, w in zip(["out", "x", "gamma", "gate", "up", "down"], got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5, msg=name)


def test_a_geglu_mlp_under_a_llama_norm_is_refused_naming_the_shipped_kernels() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    _, mlp = _gemma_modules()
    with pytest.raises(ValueError, match=r"no shipped kernel computes a tanh-GELU GLU MLP under "
                       r"an RMSNorm x̂ · w;.*\(gemma_mlp\)"):  # fmt: skip
        CodaLlamaMLPBlock(LlamaRMSNorm(24), mlp)


def test_gemma_with_exact_gelu_keeps_its_mlp_half_saying_why() -> None:
    """An exact-GELU gate (``nn.GELU()``): no kernel computes it — kept, named."""
    model = _model("gemma")
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    _, report = _patched(model)
    line = report.lines[fam.MLP_HALF]
    assert line.startswith("kept: ") and "a GeGLU MLP with exact GELU" in line, line


def test_the_sandwich_proof_keeps_a_recipe_that_swaps_the_norms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sandwich recipe that took the post-norm for the pre-norm would compute another model:
    the probe forward shows the MLP does not receive its output, and the kind is kept (the
    attention input kept too, so no module changes)."""
    monkeypatch.setattr(fam, "_SANDWICH", tuple(reversed(fam._SANDWICH)))
    model = _model("gemma2")
    patched, report = _patched(model, attention=False)
    line = report.lines[fam.MLP_HALF]
    assert "mlp does not receive post_feedforward_layernorm's output" in line, line
    assert [type(m) for m in patched.modules()] == [type(m) for m in model.modules()]


def _gemma2_modules() -> tuple[torch.nn.Module, ...]:
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP, Gemma2RMSNorm

    config = transformers.Gemma2Config(hidden_size=48, intermediate_size=80)
    torch.manual_seed(1)
    pre, post, mlp = Gemma2RMSNorm(48, eps=1e-6), Gemma2RMSNorm(48, eps=1e-6), Gemma2MLP(config)
    with torch.no_grad():
        pre.weight.normal_(0, 0.3), post.weight.normal_(0, 0.3)
    return pre, mlp, post


@pytest.mark.parametrize("sandwich", [False, True], ids=["gemma_mlp", "gemma2_mlp_branch"])
def test_under_fp16_autocast_the_drop_ins_keep_hugging_face_precision(sandwich: bool) -> None:
    """fp32 weights and residual stream under fp16 autocast (the interpreter's bf16 dot is wrong;
    bf16 in tests/gpu): the branch in fp16, ``x +`` in fp32, every gradient in fp32 — held to the
    sandbox's rule against an fp32 run, next to Hugging Face's own autocast error."""
    from coda.blocks import get_block
    from coda.sandbox import check_output

    if sandwich:
        pre, mlp, post = _gemma2_modules()
        block = CodaLlamaMLPBlock(pre, mlp, post_norm=post, residual=False, tune="off")
        params = [pre.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        params.append(post.weight)
        names = ["dgamma_pre", "dw_gate", "dw_up", "dw_down", "dgamma_post"]
        branch = lambda t: post(mlp(pre(t)))  # noqa: E731
    else:
        pre, mlp = _gemma_modules()
        block = CodaLlamaMLPBlock(pre, mlp, residual=False, tune="off")
        params = [pre.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        names = ["dgamma", "dw_gate", "dw_up", "dw_down"]
        branch = lambda t: mlp(pre(t))  # noqa: E731
    width = pre.weight.shape[0]
    x, dout = torch.randn(3, 11, width), torch.randn(3, 11, width)

    def run(forward) -> list[torch.Tensor]:  # noqa: ANN001
        xx = x.clone().requires_grad_()
        out = xx + forward(xx)
        return [out, *torch.autograd.grad(out, [xx, *params], dout)]

    ref32 = run(branch)
    with torch.autocast("cpu", dtype=torch.float16):
        hf, coda = run(branch), run(block)
    tol = get_block("llama_mlp").tolerance
    for name, got, want, theirs in zip(["out", "dx", *names], coda, ref32, hf, strict=True):
        assert got.dtype == theirs.dtype == torch.float32, name
        c = check_output(name, got, want, theirs, tol, sizes={}, seed=0, run_dtype=torch.float16)
        assert c.passed, c.summary()


def test_a_logit_cap_no_kernel_applies_keeps_the_lm_head_loss() -> None:
    """Gemma 2 with ``final_logit_softcapping=50``: the shipped kernels cap at 30 — kept, named;
    the MLP half still patches."""
    model = _model("gemma2", final_logit_softcapping=50.0)
    _, report = _patched(model, fused_loss=True)
    line = report.lines[fam.LM_HEAD_LOSS]
    assert line.startswith("kept: final_logit_softcapping 50: the shipped softcapped"), line
    assert "cap the logits at 30" in line
    assert report.patched(fam.MLP_HALF)


def test_the_head_proof_keeps_a_cap_the_forward_does_not_apply() -> None:
    """A config that names a cap its model's forward never applies (Gemma's forward reads no
    ``final_logit_softcapping``): the probe shows uncapped logits, and the loss is kept."""
    model = _model("gemma")
    model.config.final_logit_softcapping = 30.0
    _, report = _patched(model, fused_loss=True)
    line = report.lines[fam.LM_HEAD_LOSS]
    assert line.startswith("kept: the model's logits are not 30 · tanh(lm_head(norm(x)) / 30)")
