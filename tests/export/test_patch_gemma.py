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
    for hf_layer, layer in zip(model.model.layers, patched.model.layers, strict=True):
        for part in ("mlp", *fam._SANDWICH):  # the MLP half's modules, untouched
            hf_modules, modules = getattr(hf_layer, part).modules(), getattr(layer, part).modules()
            assert [type(m) for m in modules] == [type(m) for m in hf_modules], part


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


def _mlp_half_inputs(model: torch.nn.Module, batch: dict) -> list[tuple[torch.Tensor, ...]]:
    """Per decoder layer, what its MLP half receives in one fp16-autocast training step of
    ``model``: the residual stream entering ``post_attention_layernorm`` (fp32) and the gradient
    arriving at the MLP's output (fp16)."""
    seen: list[dict[str, torch.Tensor]] = [{} for _ in model.model.layers]
    handles = []
    for layer, record in zip(model.model.layers, seen, strict=True):

        def pre(_module, args, record=record) -> None:  # noqa: ANN001
            record["h"] = args[0].detach().clone()

        def post(_module, _args, out, record=record) -> None:  # noqa: ANN001
            out.register_hook(lambda g: record.__setitem__("dout", g.detach().clone()))

        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(pre))
        handles.append(layer.mlp.register_forward_hook(post))
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            model(**batch).loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return [(record["h"], record["dout"]) for record in seen]


def test_on_the_whole_models_activations_gemmas_mlp_half_keeps_hugging_face_precision() -> None:
    """The sandbox's rule where its premise holds — both implementations on the same inputs — at
    the inputs the whole fp16-autocast model gives each layer's MLP half (the model and batch of
    test_patch_model.py's autocast test): the drop-in and Hugging Face's modules under autocast,
    on the recorded residual stream and output gradient, against an fp32 run of the same.

    Why Gemma's MLP half stays out of that whole-model test: there, layer 1's down_proj weight
    gradient has one element (of 1536) 3.0e-6 off (3.2 fp16 ulps) where the rule allows 2.5e-6
    (twice Hugging Face's largest error in that gradient, 1.1e-6, plus the floor). Recomputed in
    float64 from what each run's MLP half received, that error is −1.8 ulps both runs share —
    from the gradient arriving at the MLP's output, computed through the autocast LM head
    upstream and rounded to fp16 — plus the MLP half's own rounding: −1.4 ulps in the patched
    run, +1.6 in Hugging Face's, whose sign there happened to cancel the shared part. The
    element is dout ᵀ · a (the down projection's weight gradient: no GeGLU backward in it), and
    over that whole gradient the drop-in's own rounding is below Hugging Face's (max 1.30e-6
    against 1.56e-6). The rule bounds one implementation's error by the other's; a part both
    share is not theirs to bound. Here, on the same inputs, nothing is shared, and it holds for
    every output. (The whole-model comparison is as fragile at other seeds of that model: with
    the MLP half patched, seed 1 has one element of layer 1's gate_proj gradient over the bound;
    with it kept, seed 0 has layer 0's k_proj gradient over the relative bound, 0.00325.)"""
    model = _model("gemma", seed=4)
    ids = _batch()["input_ids"]
    for i, (h, dout) in enumerate(_mlp_half_inputs(model, {"input_ids": ids, "labels": ids})):
        layer = model.model.layers[i]
        _check_autocast_mlp_half(f"layer {i}", layer.post_attention_layernorm, layer.mlp, h, dout)


def _check_autocast_mlp_half(
    where: str, norm: torch.nn.Module, mlp: torch.nn.Module, h: torch.Tensor, dout: torch.Tensor
) -> None:
    """``mlp(norm(h))`` and its gradients for ``dout`` (of h and every weight) by the drop-in
    and by the modules under fp16 autocast, each held to the sandbox's rule against the fp32
    run of the modules (llama_mlp's tolerance, as the module-level autocast test)."""
    from coda.blocks import get_block
    from coda.sandbox import check_output

    block = CodaLlamaMLPBlock(norm, mlp, residual=False, tune="off")
    params = [norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]

    def run(forward) -> list[torch.Tensor]:  # noqa: ANN001
        x = h.clone().requires_grad_()
        out = forward(x)
        return [out, *torch.autograd.grad(out, [x, *params], dout.to(out.dtype))]

    ref32 = run(lambda t: mlp(norm(t)))
    with torch.autocast("cpu", dtype=torch.float16):
        hf, coda = run(lambda t: mlp(norm(t))), run(block)
    tol = get_block("llama_mlp").tolerance
    names = ["out", "dx", "dgamma", "dw_gate", "dw_up", "dw_down"]
    for name, got, want, theirs in zip(names, coda, ref32, hf, strict=True):
        assert got.dtype == theirs.dtype, name
        c = check_output(
            f"{where} {name}", got, want, theirs, tol, sizes={}, seed=0, run_dtype=torch.float16
        )
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
