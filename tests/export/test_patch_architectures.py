"""patch_llama and patch_model over every causal-LM architecture of the installed transformers
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) that builds from one set of tiny generic sizes: each patched
model computes the original's logits and loss (fp32, tight tolerance) or is refused with a
``ValueError`` naming the module and reason, the model untouched — never a silent difference,
never another exception; patch_model patches what it proves and reports every other module kind
kept with a reason, the model computing the original's logits and loss. Architectures that do not
build tiny (a config that rejects the sizes, a model still large at them, a forward that fails
unpatched) are skipped with the reason (``pytest -rs`` lists them). Kernels run in Triton's
interpreter: the probe input is 5 tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from coda.export import causal_lm_loss, patch_llama, patch_model
from coda.export.families import KINDS, LM_HEAD_LOSS

transformers = pytest.importorskip("transformers")

from transformers import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

TINY = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 96,
    "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
}  # fmt: skip
MLA = {  # latent attention (DeepSeek-style): its head widths, which head_dim does not set
    "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "kv_lora_rank": 16,
    "q_lora_rank": 16,
}  # fmt: skip
MAX_PARAMETERS = 5_000_000  # counted on the meta device before anything is allocated
IDS = torch.tensor([[1, 8, 15, 22, 29]])


def _tiny(model_type: str) -> torch.nn.Module:
    """The architecture's causal LM at ``TINY`` sizes (then without ``head_dim`` for configs
    that derive it, then with ``MLA``'s latent-attention widths), fp32, eval mode, norms away
    from their init so a norm applied twice or never shows; ``pytest.skip`` with the reason when
    it does not build tiny or run unpatched."""
    errors = []
    for sizes in (TINY, _without(TINY, "head_dim"), {**_without(TINY, "head_dim"), **MLA}):
        try:
            model = _build(model_type, sizes)
            with torch.no_grad():
                model(input_ids=IDS)
        except _NotTiny as e:
            pytest.skip(f"{model_type}: {e}")
        except Exception as e:  # noqa: BLE001 - any failure here: the architecture is not built
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        return model
    pytest.skip(f"{model_type}: does not build or run at tiny sizes ({errors[-1]})")


def _without(sizes: dict, key: str) -> dict:
    return {k: v for k, v in sizes.items() if k != key}


class _NotTiny(Exception):
    pass


def _build(model_type: str, sizes: dict) -> torch.nn.Module:
    config = CONFIG_MAPPING[model_type](**sizes)
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with torch.device("meta"):
        count = sum(p.numel() for p in cls(config).parameters())
    if count > MAX_PARAMETERS:
        raise _NotTiny(f"{count} parameters at tiny sizes (the config ignores some of them)")
    torch.manual_seed(0)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _module_names(model: torch.nn.Module) -> list[str]:
    return [type(model).__name__, "lm_head"] + [n for n, _ in model.named_modules() if "." in n]


def _refused_cleanly(error: ValueError, patched: torch.nn.Module, model: torch.nn.Module) -> None:
    """The refusal names a module of the model (or the model) and changed nothing."""
    message = str(error)
    assert any(name in message for name in _module_names(model)), message
    assert [type(m) for m in patched.modules()] == [type(m) for m in model.modules()], message
    theirs = model.state_dict()
    for key, value in patched.state_dict().items():
        assert torch.equal(value, theirs[key]), f"{key} changed by a refused patch"


def _assert_same_model(patched: torch.nn.Module, model: torch.nn.Module, what: str) -> None:
    with torch.no_grad():
        want = model(input_ids=IDS, labels=IDS)
        got = patched(input_ids=IDS).logits
        loss = causal_lm_loss(patched, IDS, IDS, verify=False, tune="off")
    scale = float(want.logits.abs().max().clamp(min=1))
    torch.testing.assert_close(got, want.logits, atol=2e-5 * scale, rtol=2e-5, msg=what)
    torch.testing.assert_close(loss, want.loss, atol=2e-5, rtol=2e-5, msg=what)


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_every_architecture_is_patched_exactly_or_refused(model_type: str) -> None:
    """``attention=True`` (the default) first; where that is refused, ``attention=False`` (the
    MLP half alone, how Mistral- or Qwen-style models patch); both with ``fused_loss``."""
    model = _tiny(model_type)
    for attention in (True, False):
        patched = copy.deepcopy(model)
        try:
            patch_llama(patched, verify=False, tune="off", attention=attention, fused_loss=True)
        except ValueError as e:
            _refused_cleanly(e, patched, model)
            continue
        _assert_same_model(patched, model, f"{model_type}, attention={attention}")
        return


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_patch_model_patches_exactly_or_keeps_with_a_reason(model_type: str) -> None:
    """Every kind ``patched (<recipe>)`` or ``kept: <reason>``; logits and loss (the fused one
    where the head is patched) the original's; a model without decoder layers refused cleanly."""
    model = _tiny(model_type)
    patched = copy.deepcopy(model)
    try:
        report = patch_model(patched, verify=False, tune="off", fused_loss=True)
    except ValueError as e:
        _refused_cleanly(e, patched, model)
        return
    for kind in KINDS:
        line = report.lines[kind]
        assert line.startswith("patched (") or len(line) > len("kept: ") + 10, (kind, line)
    with torch.no_grad():
        want = model(input_ids=IDS, labels=IDS)
        got = patched(input_ids=IDS, labels=IDS)
    scale = float(want.logits.abs().max().clamp(min=1))
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5 * scale, rtol=2e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=2e-5, rtol=2e-5)
    if report.patched(LM_HEAD_LOSS):
        with torch.no_grad():
            loss = causal_lm_loss(patched, IDS, IDS, verify=False, tune="off")
        torch.testing.assert_close(loss, want.loss, atol=2e-5, rtol=2e-5)
