"""coda.export.patch_model over the families people fine-tune (random tiny configs, no downloads,
kernels in Triton's interpreter): the report says per module kind "patched" or "kept: <reason>",
and the patched model computes the original's logits, loss and every parameter's gradient (fp32),
keeps its state-dict keys both ways, generates the same greedy tokens, handles GQA, one KV head,
left padding and fp16 autocast. A family whose classes the installed transformers lacks is
skipped with the reason. The proofs bite: a recipe that reads the wrong rows of a fused weight is
kept, not run."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from coda.export import PatchReport, patch_model
from coda.export import families as fam

from .copies import clones_of_views_of

transformers = pytest.importorskip("transformers")

SMALL = {
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
P, K = "patched", "kept"
# the attention output's report lines: o_proj + residual, and through Gemma's or OLMo 2's post-norm
OUT = (P, "attn_out: x + o_proj(a)")
GEMMA2_OUT = (P, "gemma2_attn_out: x + post_attention_layernorm(o_proj(a)) (x̂ · (1 + w))")
OLMO2_OUT = (P, "olmo2_attn_out: x + post_attention_layernorm(o_proj(a)) (x̂ · w)")
# a sliding-window layer, then a global one (Gemma 2 and 3 alternate them), a window shorter
# than the test sequences
LOCAL_GLOBAL = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
# Gemma 2's scores capped at 1, with weights large enough that the cap changes them
GEMMA2 = {**LOCAL_GLOBAL, "attn_logit_softcapping": 1.0, "initializer_range": 0.5}
# family: (config class, causal-LM class, config extras, {kind: (status, reason substring)})
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {
        fam.ATTENTION_INPUT: (P, "LlamaAttention"), fam.MLP_HALF: (P, "gate_proj + up_proj"),
        fam.ATTENTION_OUTPUT: OUT,
        fam.LM_HEAD_LOSS: (P, "llama_lm_head_ce")}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}, {
        fam.ATTENTION_INPUT: (P, "MistralAttention"), fam.MLP_HALF: (P, "gate_proj + up_proj"),
        fam.ATTENTION_OUTPUT: OUT,
        fam.LM_HEAD_LOSS: (P, "llama_lm_head_ce")}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, {
        fam.ATTENTION_INPUT: (P, "qwen2_attn_in on Qwen2Attention"),
        fam.MLP_HALF: (P, "gate_proj + up_proj"), fam.ATTENTION_OUTPUT: OUT,
        fam.LM_HEAD_LOSS: (P, "llama_lm_head_ce")}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, {
        fam.ATTENTION_INPUT: (P, "qwen3_attn_in on Qwen3Attention"),
        fam.MLP_HALF: (P, "gate_proj + up_proj"), fam.ATTENTION_OUTPUT: OUT,
        fam.LM_HEAD_LOSS: (P, "llama_lm_head_ce")}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, {
        fam.ATTENTION_INPUT: (P, "Phi3Attention's qkv_proj"),
        fam.MLP_HALF: (P, "gate_up_proj = [gate; up]"), fam.ATTENTION_OUTPUT: OUT,
        fam.LM_HEAD_LOSS: (P, "llama_lm_head_ce")}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}, {
        fam.ATTENTION_INPUT: (P, "GemmaAttention"),
        fam.MLP_HALF: (P, "gemma_mlp on gate_proj + up_proj"),
        fam.ATTENTION_OUTPUT: OUT,
        fam.LM_HEAD_LOSS: (P, "llama_lm_head_ce")}),
    # Gemma 2: a sliding and a global layer, scores softcapped, scaled by query_pre_attn_scalar
    # (256) rather than head_dim
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", GEMMA2, {
        fam.ATTENTION_INPUT: (P, "llama_attn_in on Gemma2Attention"),
        fam.MLP_HALF: (P, "gemma2_mlp_branch on gate_proj + up_proj between"),
        fam.ATTENTION_OUTPUT: GEMMA2_OUT,
        fam.LM_HEAD_LOSS: (P, "lm_head_softcap_ce: final norm + LM head + logits capped at 30")}),
    # Gemma 3: a sliding layer (RoPE base 1e4) and a global one (1e6), each with its own tables
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", LOCAL_GLOBAL, {
        fam.ATTENTION_INPUT: (P, "gemma3_attn_in on Gemma3Attention"),
        fam.MLP_HALF: (P, "gemma2_mlp_branch on gate_proj + up_proj between"),
        fam.ATTENTION_OUTPUT: GEMMA2_OUT,
        fam.LM_HEAD_LOSS: (P, "llama_lm_head_ce")}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, {
        fam.ATTENTION_INPUT: (P, "olmo2_attn_in on Olmo2Attention"),
        fam.MLP_HALF: (P, "olmo2_mlp_branch on gate_proj + up_proj before post_feedforward"),
        fam.ATTENTION_OUTPUT: OLMO2_OUT,
        fam.LM_HEAD_LOSS: (P, "llama_lm_head_ce")}),
}  # fmt: skip
# the families whose attention input is patched, for the attention variants
ATTENDED = [f for f, spec in FAMILIES.items() if spec[3][fam.ATTENTION_INPUT][0] == P]
# and those only whose attention output is (the post-norm forms), for state dicts and generation
POST_NORMED = [f for f, spec in FAMILIES.items() if spec[3][fam.ATTENTION_OUTPUT] != OUT]


def _model(family: str, seed: int = 0, **config: object) -> torch.nn.Module:
    """The family's tiny causal LM (fp32, eval mode, dropout off), norms and biases away from
    their init (ones, zeros) so a norm applied twice or never, or a bias dropped, shows; skipped
    when transformers lacks its classes."""
    config_name, model_name, extras, _ = FAMILIES[family]
    config_cls, model_cls = (getattr(transformers, n, None) for n in (config_name, model_name))
    if config_cls is None or model_cls is None:
        pytest.skip(f"{family}: the installed transformers has no {config_name}/{model_name}")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SMALL, **extras, **config})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name and p.dim() == 1) or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def _patched(model: torch.nn.Module, **options: object) -> tuple[torch.nn.Module, PatchReport]:
    patched = copy.deepcopy(model)
    return patched, patch_model(patched, verify=False, tune="off", **options)


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    """Two sequences of 7 tokens, the second left-padded by 3."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_report_says_what_is_patched_and_why_the_rest_is_kept(family: str) -> None:
    """One line per module kind; kept kinds keep their modules; the patched model's logits are
    the original's."""
    model = _model(family)
    patched, report = _patched(model, fused_loss=True)
    lines = str(report).splitlines()
    assert len(lines) == 1 + len(fam.KINDS)
    assert lines[0] == f"{fam.family_name(model)}, 2 decoder layers:"
    expected = FAMILIES[family][3]
    for kind, (status, reason) in expected.items():
        line = report.lines[kind]
        assert line.startswith(status), f"{kind}: {line}"
        assert reason in line, f"{kind}: {line}"
        assert f"  {kind}: {line}" in lines
    for hf_layer, layer in zip(model.model.layers, patched.model.layers, strict=True):
        if not report.patched(fam.MLP_HALF):
            assert type(layer.mlp) is type(hf_layer.mlp)
        if not report.patched(fam.ATTENTION_INPUT):
            assert type(layer.self_attn) is type(hf_layer.self_attn)
        # the attention output: o_proj deferred (its weight under its key), the layer's class
        # a subclass of its own whose forward hands the drop-in the attention and the residual
        assert isinstance(layer, type(hf_layer)) and type(layer) is not type(hf_layer)
        assert type(layer.self_attn.o_proj).__name__ == "DeferredOProj"
    ids = _batch()["input_ids"]
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, patched(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _train_step(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("family", "kv_heads"),
    [(f, 2) for f in FAMILIES if any(s == P for s, _ in FAMILIES[f][3].values())]
    + [(f, kv) for f in ATTENDED for kv in (1, 4)],
)
def test_loss_and_every_gradient_match_with_left_padding(family: str, kv_heads: int) -> None:
    """Training mode with the fused loss (no logits made) and a left-padded batch: the loss and
    every parameter's gradient equal the original's (fp32); GQA, one KV head and MHA."""
    model = _model(family, seed=kv_heads, num_key_value_heads=kv_heads).train()
    patched, report = _patched(model, fused_loss=True)
    batch = _batch(seed=kv_heads)
    want_loss, want = _train_step(model, batch)
    got_loss, got = _train_step(patched, batch)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-6)
    assert got.keys() == want.keys()  # the same parameters, by the same names
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=2e-6, rtol=1e-5, msg=name)
    if FAMILIES[family][3][fam.LM_HEAD_LOSS][0] == P:
        assert report.patched(fam.LM_HEAD_LOSS)
        assert patched(**batch).logits is None  # the fused loss made no logits
    model.eval(), patched.eval()
    with torch.no_grad():
        want_logits, got_logits = model(**batch).logits, patched(**batch).logits
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ATTENDED + POST_NORMED)
def test_state_dicts_keep_hugging_face_keys_both_ways(family: str) -> None:
    model = _model(family)
    patched, _ = _patched(model)
    theirs, ours = model.state_dict(), patched.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    other = _model(family, seed=3)  # other weights, loaded both ways
    patched.load_state_dict(other.state_dict())
    fresh = _model(family, seed=5)
    fresh.load_state_dict(patched.state_dict())
    ids = _batch()["input_ids"]
    with torch.no_grad():
        want = other(input_ids=ids).logits
        torch.testing.assert_close(patched(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fresh(input_ids=ids).logits, want)


@pytest.mark.parametrize("family", ATTENDED + POST_NORMED)
def test_greedy_generation_is_unchanged(family: str) -> None:
    """Through the KV cache the patched attention fills (keys in the kernel's pair order), and
    through the patched attention outputs (one token per step after the prompt)."""
    model = _model(family, seed=7)
    patched, _ = _patched(model)
    ids = _batch()["input_ids"][:1, :5]
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(ids, **kwargs), model.generate(ids, **kwargs))


@pytest.mark.parametrize("family", ["phi3", "gemma", "qwen2", "qwen3", "olmo2"])
def test_under_fp16_autocast_the_patched_model_keeps_hugging_face_precision(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 weights under fp16 autocast: logits and every gradient held to the sandbox's rule
    against the fp32 model (within 2× Hugging Face's own autocast error plus a floor, relative
    error within the llama_mlp bound — or, where 2× Hugging Face's own relative error is above
    that bound, within that: a bias gradient sums a projection's gradient over every token and
    cancels, so its relative error sits near the bound in both runs; Qwen2's layer-1
    ``k_proj.bias`` is 0.0026 in Hugging Face's and 0.0027–0.0034 in the patched model's,
    depending on where its MLP rounds the normalised rows, while the median over all gradients
    of the patched error over Hugging Face's stayed 0.94×). Phi-3's
    kernels read row views of its fused weights; Gemma's read 1 + w for its norms. Gemma's MLP
    half stays Hugging Face's here: one element of its layer-1 down_proj gradient carries an
    error both runs share (the gradient from upstream) that Hugging Face's own rounding happens
    to cancel — tests/export/test_patch_gemma.py's
    test_on_the_whole_models_activations_gemmas_mlp_half_keeps_hugging_face_precision says by
    how much, and holds the drop-in to this rule on this model's own activations. OLMo 2: its
    attention input (no input norm, whole-projection q/k norms) and its MLP half
    (olmo2_mlp_branch). Gemma 3 is not here: on this batch Hugging Face's own fp16 autocast
    gradients are NaN (tests/gpu/test_family_attention_gpu.py checks it in fp16 through the
    interpreter on its own model and batch). Qwen3 is held to 3× rather than 2×: its q/k norms
    run on the projection's fp32 accumulator in the kernel, on the fp16-rounded projection in
    Hugging Face's, and its layer-1 input-norm gradient lands 2.28× Hugging Face's own error
    above the floor on an AVX-512 CPU with torch 2.13 (under 2× on the machine this rule was
    first run on; the other families at most 1.32× on the former)."""
    from coda.blocks import get_block
    from coda.sandbox import check_output

    if family == "gemma":
        recipes = tuple(r for r in fam.RECIPES if not r.name.startswith("gemma"))
        monkeypatch.setattr(fam, "RECIPES", recipes)
    model = _model(family, seed=4)
    patched, _ = _patched(model)
    batch = {"input_ids": _batch()["input_ids"], "labels": _batch()["input_ids"]}

    def step(m: torch.nn.Module) -> tuple[torch.Tensor, dict]:
        m.zero_grad(set_to_none=True)
        out = m(**batch)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad for n, p in m.named_parameters()}

    ref_logits, ref_grads = step(model)
    with torch.autocast("cpu", dtype=torch.float16):
        hf_logits, hf_grads = step(model)
        logits, grads = step(patched)
    tol = get_block("llama_mlp").tolerance
    pairs = [("logits", logits, ref_logits, hf_logits)]
    pairs += [(n, grads[n], ref_grads[n], hf_grads[n]) for n in ref_grads]
    for name, got, want, theirs in pairs:
        assert got.dtype == theirs.dtype, name
        ratio = 3.0 if family == "qwen3" else 2.0
        theirs_rel = ratio * _relative_error(theirs, want)
        rel = {**tol.rel, "float16": max(tol.rel["float16"], theirs_rel)}
        rule = tol.model_copy(update={"rel": rel, "ratio": ratio})
        c = check_output(name, got, want, theirs, rule, sizes={}, seed=0, run_dtype=torch.float16)
        assert c.passed, c.summary()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖``, as the sandbox's rule measures it."""
    diff = (got.double() - want.double()).norm()
    return float(diff / want.double().norm().clamp(min=1e-300))


def test_phi3_weights_stay_one_parameter_each() -> None:
    """The kernels read row views of ``gate_up_proj`` and ``qkv_proj``: no new Parameter, so an
    optimizer built before patching keeps training the model."""
    model = _model("phi3")
    before = dict(model.named_parameters())
    patch_model(model, verify=False, tune="off")
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is p for n, p in before.items())


def test_the_proofs_keep_a_recipe_that_reads_the_wrong_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Phi-3 MLP recipe that took [up; gate] for [gate; up], or an attention recipe that swapped
    the key and value rows, would compute another model: the probe forward shows it and the kind
    is kept with the reason — the correct recipes are patched (the previous tests)."""
    from coda.export import attention as attn_mod
    from coda.export import mlp as mlp_mod

    def swapped_gate_up(mlp: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = mlp_mod.CONCATENATED_GATE_UP.split(mlp)
        return up, gate

    def swapped_kv(attn: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        q, k, v = attn_mod.CONCATENATED_QKV.split(attn)
        return q, v, k

    gate_up = dataclasses.replace(mlp_mod.CONCATENATED_GATE_UP, split=swapped_gate_up)
    qkv = dataclasses.replace(attn_mod.CONCATENATED_QKV, split=swapped_kv)
    phi3 = dataclasses.replace(attn_mod.PHI3_ATTENTION, layout=qkv)
    monkeypatch.setattr(fam, "RECIPES", (fam._attention_recipe(phi3), fam._mlp_recipe(gate_up)))
    model = _model("phi3")
    patched, report = _patched(model)
    assert "returned something other than o_proj(attention(" in report.lines[fam.ATTENTION_INPUT]
    assert "returned something other than down_proj(silu(" in report.lines[fam.MLP_HALF]
    assert [type(m) for m in patched.modules()] == [type(m) for m in model.modules()]


def test_the_proofs_keep_qwen_recipes_that_miss_what_their_kernels_add(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Qwen2 proof without the biases computes another attention input, and a Qwen3 whose q/k
    norms use another epsilon than its input norm is not what qwen3_attn_in (one epsilon)
    computes: both kept with the reason, not run."""
    monkeypatch.setattr(fam, "_kernel_extras", lambda recipe, attn: {})
    _, report = _patched(_model("qwen2"))
    assert "returned something other than o_proj(attention(" in report.lines[fam.ATTENTION_INPUT]
    monkeypatch.undo()
    model = _model("qwen3")
    for layer in model.model.layers:
        layer.self_attn.q_norm.variance_epsilon = layer.self_attn.k_norm.variance_epsilon = 1e-3
    patched, report = _patched(model)
    assert (
        "q_norm/k_norm epsilon 0.001 is not input_layernorm's 1e-06"
        in report.lines[fam.ATTENTION_INPUT]
    )
    assert type(patched.model.layers[0].self_attn) is type(model.model.layers[0].self_attn)


class _PreNormed(torch.nn.Module):
    """An MLP (its projections and activation as its own) behind a LayerNorm of its input."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.norm, self.inner = torch.nn.LayerNorm(mlp.gate_proj.in_features), mlp
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.norm(x))


def test_the_proofs_keep_gemma_and_olmo2_recipes_that_miss_what_their_forwards_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Gemma 2 recipe that did not hand the attention function its logit softcap, a Gemma 3
    proof whose per-head norms lacked Gemma's ``1 + w``, an OLMo 2 proof without its q/k norms
    over the whole projection: each computes another attention, which the probe shows — kept
    with the reason, nothing replaced (the softcap also where the probe's scores are too small
    for it to change them: by the arguments Gemma 2's forward hands its attention function).
    And an OLMo 2 MLP behind a pre-norm of its own is not what the olmo2_mlp_branch kernels
    compute."""
    from coda.export import attention as attn_mod

    other = "returned something other than o_proj(attention("
    no_cap = dataclasses.replace(attn_mod.GEMMA2_ATTENTION, extras=attn_mod._layer_sliding_window)
    monkeypatch.setattr(fam, "RECIPES", (fam._attention_recipe(no_cap),))
    _, report = _patched(_model("gemma2"))
    assert other in report.lines[fam.ATTENTION_INPUT]
    # scores far below the cap (weights at their usual scale): the forward's arguments show it
    _, report = _patched(_model("gemma2", initializer_range=0.02))
    line = report.lines[fam.ATTENTION_INPUT]
    assert "hands its attention function {" in line and "'softcap': 1.0" in line, line
    monkeypatch.undo()
    monkeypatch.setattr(fam, "QK_NORM_OFFSETS", {})
    _, report = _patched(_model("gemma3"))
    assert other in report.lines[fam.ATTENTION_INPUT]
    monkeypatch.undo()
    monkeypatch.setattr(fam, "_kernel_extras", lambda recipe, attn: {})
    model = _model("olmo2")
    for layer in model.model.layers:  # a pre-norm the olmo2_mlp_branch kernels do not apply
        layer.mlp = _PreNormed(layer.mlp)
    patched, report = _patched(model, fuse_residual=False)  # the attention output kept too
    assert other in report.lines[fam.ATTENTION_INPUT]
    assert "returned something other than down_proj(silu(" in report.lines[fam.MLP_HALF]
    assert [type(m) for m in patched.modules()] == [type(m) for m in model.modules()]


def test_phi3_partial_rotary_keeps_the_attention_input() -> None:
    """Phi-3 with partial_rotary_factor (Phi-4-mini's): the rotary tables are narrower than the
    heads, which the llama_attn_in kernel rotates whole — kept; the MLP half still patches."""
    model = _model("phi3", rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5})
    _, report = _patched(model)
    assert report.lines[fam.ATTENTION_INPUT].startswith("kept: ")
    assert "no rotary tables (cos, sin) of the head width 8" in report.lines[fam.ATTENTION_INPUT]
    assert report.patched(fam.MLP_HALF)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_head_width_the_head_norm_kernel_cannot_hold_keeps_the_attention_input(
    family: str,
) -> None:
    """Per-head q/k norms run in the projection's epilogue, which holds whole heads of a power-of-
    two width: at head_dim 12 the drop-in refuses at patch time — kept, with the kernel's reason —
    and the model computes Hugging Face's loss, where it once reported patched and failed on its
    first forward. OLMo 2 (norms over the whole projection) patches at that width."""
    model = _model(family, head_dim=12)
    patched, report = _patched(model)
    line = report.lines[fam.ATTENTION_INPUT]
    assert line.startswith("kept: model.layers.0: the "), line
    assert "head_dim 12" in line and "must be a power of two" in line, line
    assert report.patched(fam.MLP_HALF)
    batch = _batch()
    torch.testing.assert_close(patched(**batch).loss, model(**batch).loss, rtol=1e-5, atol=1e-6)
    _, olmo = _patched(_model("olmo2", head_dim=12))
    assert olmo.patched(fam.ATTENTION_INPUT)


def test_attention_dropout_in_training_is_proven_on_the_deterministic_forward() -> None:
    """A Llama training with attention dropout: a probe in training mode records outputs with
    random units dropped, which no recomputation matches — the attention input was kept, as
    'differs from the one the drop-in mirrors', though the drop-in passes the dropout on as
    Hugging Face's forward does. The probe and proofs run in eval mode (each module's mode
    restored), everything patches, and a training step drops the same units as Hugging Face's
    under the same seed."""
    model = _model("llama", attention_dropout=0.3).train()
    patched, report = _patched(model)
    assert all(report.patched(kind) for kind in (fam.ATTENTION_INPUT, fam.MLP_HALF)), report
    assert all(m.training for m in patched.modules())
    batch = _batch()
    losses = []
    for m in (model, patched):
        torch.manual_seed(7)
        losses.append(m(**batch).loss)
    torch.manual_seed(8)
    assert not torch.allclose(model(**batch).loss, losses[0])  # the dropout draws units
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


def test_a_residual_dropout_keeps_what_it_reaches() -> None:
    """Phi-3's residual dropout (an ``nn.Dropout`` between the attention and the residual add,
    which the fused residual add would skip) keeps the probe in training mode: the attention
    output, which it reaches, is kept."""
    model = _model("phi3", resid_pdrop=0.3).train()
    _, report = _patched(model)
    assert report.lines[fam.ATTENTION_OUTPUT].startswith("kept: "), report


class _Adapted(torch.nn.Module):
    """What PEFT's ``lora.Linear`` is to the kernels: a module around a base ``nn.Linear`` whose
    ``weight`` is the base's, computing ``base(x) + x Aᵀ Bᵀ``."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_a = torch.nn.Parameter(torch.randn(2, base.in_features) * 0.5)
        self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, 2) * 0.5)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + x @ self.lora_a.T @ self.lora_b.T


def _adapt(model: torch.nn.Module, names: tuple[str, ...] = ("q_proj", "gate_proj")) -> None:
    """Wrap every layer's ``names`` projections in ``_Adapted``, as ``get_peft_model`` does."""
    torch.manual_seed(3)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in names:
                if isinstance(getattr(parent, name, None), torch.nn.Linear):
                    setattr(parent, name, _Adapted(getattr(parent, name)))


def test_projections_wrapped_by_an_adapter_are_kept() -> None:
    """LoRA before patching: a projection wrapped in an adapter module (whose ``weight`` is the
    base layer's, so every shape check passes, and whose adapter adds nothing at PEFT's zero
    initialisation, so a probe could not tell) is no ``nn.Linear``: the attention input and the
    MLP half are kept, naming it, and the model computes what it did."""
    model = _model("llama")
    _adapt(model)
    batch = _batch()
    want = model(**batch).loss
    patched, report = _patched(model)
    for kind, proj in ((fam.ATTENTION_INPUT, "self_attn.q_proj"), (fam.MLP_HALF, "mlp.gate_proj")):
        line = report.lines[kind]
        assert line.startswith(f"kept: model.layers.0: {proj} is a ") and "_Adapted" in line
        assert "not a torch.nn.Linear" in line, line
    torch.testing.assert_close(patched(**batch).loss, want, rtol=1e-5, atol=1e-6)


def test_an_adapter_put_in_after_patching_stops_the_forward() -> None:
    """LoRA after patching: the drop-ins hold the projections they read and refuse a call once
    one was replaced, naming it — rather than training a model without the adapters."""
    patched, _ = _patched(_model("llama"))
    _adapt(patched, ("gate_proj",))
    with pytest.raises(RuntimeError, match=r"CodaLlamaMLP.gate_proj was replaced by a .*_Adapted"):
        patched(**_batch())
    patched, _ = _patched(_model("llama"))
    _adapt(patched, ("q_proj",))
    with pytest.raises(RuntimeError, match=r"CodaLlamaAttention.q_proj was replaced"):
        patched(**_batch())


def test_peft_lora_either_side_of_patching_never_drops_the_adapters() -> None:
    """With PEFT itself: get_peft_model on a patched model stops at the first forward;
    patch_model on a PEFT model keeps the adapted kinds and computes PEFT's loss."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    base = _model("llama")
    torch.manual_seed(1)
    want = peft.get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(1)
    after = peft.get_peft_model(_patched(base)[0], config)
    with pytest.raises(RuntimeError, match="after patching"):
        after(**_batch())
    torch.manual_seed(1)
    before = peft.get_peft_model(copy.deepcopy(base), config)
    report = patch_model(before.base_model.model, verify=False, tune="off")
    assert not report.patched(fam.ATTENTION_INPUT) and not report.patched(fam.MLP_HALF)
    torch.testing.assert_close(before(**_batch()).loss, want(**_batch()).loss)


def test_patching_twice_changes_nothing_and_options_are_reported() -> None:
    model = _model("mistral")
    report = patch_model(model, verify=False, tune="off")
    assert report.model is model
    modules = list(model.modules())
    again = patch_model(model, verify=False, tune="off")
    assert list(model.modules()) == modules
    assert again.lines[fam.MLP_HALF] == "patched (already patched)"
    assert again.lines[fam.ATTENTION_INPUT] == "patched (already patched)"
    assert again.lines[fam.ATTENTION_OUTPUT] == "patched (already patched)"
    kept = patch_model(_model("llama"), verify=False, tune="off", attention=False)
    assert kept.lines[fam.ATTENTION_INPUT] == "kept: attention=False"
    assert kept.lines[fam.LM_HEAD_LOSS].startswith("kept: fused_loss=False")
    with pytest.raises(ValueError, match="has no decoder layer"):
        patch_model(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("family", ["mistral", "phi3", "qwen3", "olmo2"])
def test_a_patched_model_survives_deepcopy_and_torch_save(family: str) -> None:
    """The drop-in classes of other attention classes (``CodaMistralAttention``, …) are found by
    name when a pickled model loads; the recipes' layouts pickle with the blocks."""
    import io

    model = _model(family, seed=8)
    patched, _ = _patched(model)
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ids = _batch()["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for copied in (copy.deepcopy(patched), loaded):
            torch.testing.assert_close(copied(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    assert (
        type(loaded.model.layers[0].self_attn).__name__
        == f"Coda{FAMILIES[family][0][:-6]}Attention"
    )


def test_fuse_gate_up_interleaves_separate_projections_and_leaves_phi3_as_views() -> None:
    """``fuse_gate_up`` makes Llama's gate and up one interleaved Parameter; Phi-3's MLP keeps
    its one ``gate_up_proj`` (read as row views) — both compute the original's logits."""
    ids = _batch()["input_ids"]
    for family, fused in (("llama", True), ("phi3", False)):
        model = _model(family, seed=9)
        patched, report = _patched(model, fuse_gate_up=True)
        assert report.patched(fam.MLP_HALF)
        assert patched.model.layers[0].mlp.block.fused is fused
        with torch.no_grad():
            want, got = model(input_ids=ids).logits, patched(input_ids=ids).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_attention_output_proof_keeps_a_post_norm_of_the_wrong_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gemma 2's post_attention_layernorm taken for OLMo 2's ``x̂ · w`` (not its ``x̂ · (1 + w)``)
    would compute another model: the probe forward shows it and the attention output is kept,
    o_proj and the layer's class untouched."""
    monkeypatch.setattr(fam, "_post_norm_offset", lambda layer: 0.0)
    model = _model("gemma2")
    patched, report = _patched(model)
    line = report.lines[fam.ATTENTION_OUTPUT]
    assert line.startswith("kept: model.layers.0: what reaches the MLP half"), line
    assert "post_attention_layernorm(o_proj(a))" in line
    for hf_layer, layer in zip(model.model.layers, patched.model.layers, strict=True):
        assert type(layer) is type(hf_layer)
        assert type(layer.self_attn.o_proj) is torch.nn.Linear


def test_the_attention_output_is_kept_with_the_reason() -> None:
    """An o_proj with a bias, Phi-3's dropout before the residual add, ``fuse_residual=False``:
    kept, Hugging Face's o_proj and add run; what else is proven still patches."""
    _, report = _patched(_model("llama", attention_bias=True))
    assert "self_attn.o_proj has a bias" in report.lines[fam.ATTENTION_OUTPUT]
    assert report.patched(fam.MLP_HALF)
    model = _model("phi3", resid_pdrop=0.1)
    patched, report = _patched(model)
    assert "resid_attn_dropout has p = 0.1" in report.lines[fam.ATTENTION_OUTPUT]
    assert type(patched.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    _, report = _patched(_model("mistral"), fuse_residual=False)
    assert report.lines[fam.ATTENTION_OUTPUT].startswith("kept: fuse_residual=False")


def test_a_pickled_model_finds_its_layer_class_in_a_fresh_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CodaMistralDecoderLayer`` (the patched layer's class, built on first use) is built again
    by name when a pickled model loads where it does not exist yet."""
    import io

    from coda.export import attn_out

    model = _model("mistral", seed=8)
    patched, _ = _patched(model)
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    built = attn_out._LAYER_CLASSES
    monkeypatch.setattr(
        attn_out,
        "_LAYER_CLASSES",
        {k: v for k, v in built.items() if v.__module__ != attn_out.__name__},
    )
    monkeypatch.delattr(attn_out, "CodaMistralDecoderLayer")
    loaded = torch.load(buffer, weights_only=False)
    layer_class = type(loaded.model.layers[0])
    assert layer_class.__name__ == "CodaMistralDecoderLayer"
    assert layer_class is not type(patched.model.layers[0])  # built anew, by name
    ids = _batch()["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "olmo2"])
def test_gradient_checkpointing_reruns_the_patched_post_norm_layers(family: str) -> None:
    """The patched layer classes (subclasses of Hugging Face's) keep its gradient checkpointing:
    each layer reruns in the backward through the attention-output drop-in, same loss and
    gradients (non-reentrant)."""
    model = _model(family, seed=11).train()
    patched, report = _patched(model)
    assert report.patched(fam.ATTENTION_OUTPUT)
    patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _batch(seed=11)
    want_loss, want = _train_step(model, batch)
    got_loss, got = _train_step(patched, batch)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_the_attention_inputs_weight_gradients_are_not_copied_out_of_one_tensor(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Families whose attention-input backward computes one ``dW_qkv`` in Hugging Face's row
    order get dW_q, dW_k, dW_v from it as tensors of their own (aux ``split_rows``, one launch):
    nothing clones row views of the ``[Nq + 2·Nkv, d]`` gradient apart, and each gradient is
    the original model's."""
    model = _model(family).train()
    patched, report = _patched(model)
    assert report.patched(fam.ATTENTION_INPUT)
    fused_rows = 32 + 2 * 16  # Nq + 2·Nkv: 4 query heads and 2 KV heads of 8
    batch = _batch()
    _, want = _train_step(model, batch)
    copied = clones_of_views_of(fused_rows, monkeypatch)
    _, got = _train_step(patched, batch)
    assert copied == [], f"copies of rows of a fused QKV gradient: {copied}"
    names = [n for n in want if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]
    assert len(names) == 6  # two layers
    for name in names:
        torch.testing.assert_close(got[name], want[name], atol=2e-6, rtol=1e-5, msg=name)
