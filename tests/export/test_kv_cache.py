"""``coda.export.kv_cache``: the fused causal-LM loss runs its base model with a cache that keeps
nothing — no key or value is copied into a cache the loss never returns — and computes what
Hugging Face's model does; a caller's own cache decision is left alone."""

from __future__ import annotations

import pytest
import torch

from coda.export import causal_lm_loss
from coda.export.kv_cache import (
    PLAIN_CACHE_MODELS,
    _plain_cache_model,
    cache_keyword,
    discarding_cache,
)
from coda.export.lm_head import check_fused_loss_fits

from .test_lm_head import _labels, _loss_and_grads
from .test_patch import _model

transformers = pytest.importorskip("transformers")


@pytest.fixture
def stored(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The key shapes every cache layer of any cache stored in the test."""
    from transformers import cache_utils

    calls: list[tuple[int, ...]] = []
    real = cache_utils.DynamicLayer.update

    def counted(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(tuple(key_states.shape))
        return real(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicLayer, "update", counted)
    return calls


def test_the_loss_stores_no_keys_and_equals_hugging_face_s(stored: list) -> None:
    """Hugging Face's forward with labels fills a cache (one update per layer); the fused loss's
    forward stores nothing, with the same loss and gradients."""
    model = _model(seed=31)
    ids = torch.randint(0, 96, (2, 9))
    labels = _labels(ids)
    want, want_grads = _loss_and_grads(model, lambda: model(input_ids=ids, labels=labels).loss)
    assert len(stored) == model.config.num_hidden_layers  # the test sees a cache being filled
    check_fused_loss_fits(model)  # (its probe runs Hugging Face's forward, with a cache)
    stored.clear()
    got, grads = _loss_and_grads(model, lambda: causal_lm_loss(model, ids, labels, tune="off"))
    assert stored == []
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, atol=2e-6, rtol=1e-5, msg=name)


def test_a_caller_s_cache_decision_or_a_config_without_cache_is_left_alone(stored: list) -> None:
    from transformers.cache_utils import DynamicCache

    model = _model(seed=32)
    base = model.model
    kept = discarding_cache(base, {})
    keyword = cache_keyword(type(base).forward)
    assert list(kept) == [keyword]
    cache = next(iter(kept.values()))
    k = torch.randn(1, 2, 5, 12)
    assert cache.update(k, k, 0) == (k, k) and cache.get_seq_length() == 0
    for given in ({"use_cache": False}, {"use_cache": True}, {"past_key_values": None}):
        assert discarding_cache(base, given) == {}
    ids = torch.randint(0, 96, (1, 7))
    check_fused_loss_fits(model)
    stored.clear()
    own = DynamicCache(config=model.config)
    causal_lm_loss(model, ids, ids, tune="off", **{keyword: own})
    assert own.get_seq_length() == 7 and len(stored) == model.config.num_hidden_layers
    model.config.use_cache = False
    assert discarding_cache(base, {}) == {}


@pytest.mark.parametrize("family,name", sorted(PLAIN_CACHE_MODELS))
def test_each_listed_base_model_makes_a_plain_dynamic_cache_itself(family: str, name: str) -> None:
    """What the allowlist stands for, read from the installed transformers: the class's forward
    takes a cache and makes ``DynamicCache(config=self.config)`` under that keyword when none is
    given — and the discarding cache goes in through the same keyword."""
    import importlib
    import inspect

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(module, name)
    keyword = _plain_cache_model(cls)
    assert keyword in ("cache", "past_key_values")
    source = inspect.getsource(cls.forward)
    assert f"if use_cache and {keyword} is None:" in source
    assert f"{keyword} = DynamicCache(config=self.config)" in source
    assert keyword in inspect.signature(cls.forward).parameters


class _Config:
    use_cache = True


def _forward_cache(self, input_ids=None, cache=None, use_cache=None):  # noqa: ANN001, ANN202
    if use_cache and cache is None:
        cache = DynamicCache(config=self.config)  # noqa: F821
    return cache


def _forward_past_key_values(self, input_ids=None, past_key_values=None, use_cache=None):  # noqa: ANN001, ANN202
    if use_cache and past_key_values is None:
        past_key_values = DynamicCache(config=self.config)  # noqa: F821
    return past_key_values


def _forward_legacy(self, input_ids=None, past_key_values=None, use_cache=None):  # noqa: ANN001, ANN202
    if use_cache and not isinstance(past_key_values, Cache):  # noqa: F821
        past_key_values = DynamicCache.from_legacy_cache(past_key_values)  # noqa: F821
    return past_key_values


def _forward_elsewhere(self, input_ids=None, use_cache=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
    if use_cache and cache is None:  # noqa: F821
        cache = DynamicCache(config=self.config)  # noqa: F841, F821
    return kwargs


def test_the_cache_keyword_is_the_one_the_installed_forward_makes_its_cache_under() -> None:
    """transformers 5 releases took the cache as ``past_key_values`` before ``cache``; the
    discarding cache must go in through the keyword the installed forward reads (under another
    it lands in ``**kwargs`` and the model makes and fills its own), and a forward that makes no
    plain cache of either (transformers 4's legacy caches) gets none."""
    assert cache_keyword(_forward_cache) == "cache"
    assert cache_keyword(_forward_past_key_values) == "past_key_values"
    assert cache_keyword(_forward_legacy) is None
    assert cache_keyword(_forward_elsewhere) is None  # makes one, but takes no such keyword
    assert cache_keyword(len) is None  # no Python source


def test_a_model_with_a_cache_of_its_own_or_a_subclass_gets_none() -> None:
    """MiniMax makes its own cache type and refuses any other; a user's subclass of a listed
    model may do anything: neither is handed a discarding cache."""
    from transformers import LlamaConfig, LlamaModel, MiniMaxConfig, MiniMaxModel

    minimax = MiniMaxModel(
        MiniMaxConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, num_local_experts=2, head_dim=8,
        )
    )  # fmt: skip
    assert discarding_cache(minimax, {}) == {}

    class MyLlama(LlamaModel):
        pass

    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip
    assert discarding_cache(MyLlama(cfg), {}) == {}
    assert list(discarding_cache(LlamaModel(cfg), {})) == [cache_keyword(LlamaModel.forward)]
