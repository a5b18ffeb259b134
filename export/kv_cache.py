"""A key/value cache that keeps nothing, for a forward whose cache nobody reads.

A Hugging Face decoder with ``use_cache`` on (its configs' default, in training too) makes a
``DynamicCache`` per forward, and every attention layer's ``cache.update(k, v)`` copies its keys
and values into it — ``torch.cat`` onto an empty tensor, two copies per layer (on an H200, 0.23 ms
of a 4-layer Llama training step at 8192 tokens). ``causal_lm_loss`` returns a loss, never the
cache, so those copies are lost work; turning ``use_cache`` off instead is no better: with no
attention mask, Hugging Face then checks the position ids for packed sequences with a ``.all()``
that makes the host wait for the GPU.

``discarding_cache(base, given)`` gives the cache argument for ``base``'s forward instead
(``cache``, or ``past_key_values`` in earlier transformers 5 releases: read from the installed
forward): a ``DynamicCache`` whose ``update`` hands the keys and values back as they came and
stores nothing.
Everything else of the cache answers as an empty one does — no cached length, masks for the
query alone — which is what a fresh cache answers when the masks are made, before any layer
updates it: the attention sees the same keys, values and mask. Only for the base models known to
make such a plain ``DynamicCache`` themselves (``PLAIN_CACHE_MODELS``): a model with a cache of
its own kind keeps it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

# the forward keywords through which a caller already decides about the cache
CACHE_KEYWORDS = frozenset({"cache", "past_key_values", "use_cache"})


@functools.cache
def _discarding_class() -> type:
    from transformers.cache_utils import DynamicCache

    class DiscardingCache(DynamicCache):
        """A ``DynamicCache`` that stores nothing: ``update`` returns its keys and values."""

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
            return key_states, value_states

    return DiscardingCache


# The Hugging Face base models (transformers 5) known to make exactly ``DynamicCache(config=...)``
# whenever ``use_cache`` is on and no cache is given, in training too: the decoders the drop-ins
# are built for. Another model may make a cache of its own type (MiniMax refuses any other), share
# keys and values between layers through it, or take none; it gets no discarding cache.
# tests/export/test_kv_cache.py checks each against its installed source.
PLAIN_CACHE_MODELS = frozenset(
    {
        ("llama", "LlamaModel"),
        ("mistral", "MistralModel"),
        ("qwen2", "Qwen2Model"),
        ("qwen3", "Qwen3Model"),
        ("gemma", "GemmaModel"),
        ("gemma2", "Gemma2Model"),
        ("gemma3", "Gemma3TextModel"),
        ("phi3", "Phi3Model"),
        ("olmo", "OlmoModel"),
        ("olmo2", "Olmo2Model"),
    }
)


def _plain_cache_model(cls: type) -> str | None:
    """The keyword through which ``cls`` takes its cache, when ``cls`` is one of
    ``PLAIN_CACHE_MODELS`` itself (a subclass may do otherwise) and its installed forward makes
    the plain cache (``cache_keyword``); else None."""
    module = cls.__module__
    prefix = "transformers.models."
    if not module.startswith(prefix):
        return None
    family = module[len(prefix) :].split(".")[0]
    if (family, cls.__name__) not in PLAIN_CACHE_MODELS:
        return None
    return cache_keyword(cls.forward)


@functools.cache
def cache_keyword(forward: Any) -> str | None:
    """The keyword through which a base model's ``forward`` takes a cache — ``cache`` (recent
    transformers 5 releases) or ``past_key_values`` (earlier ones) — when its installed source
    makes exactly ``DynamicCache(config=self.config)`` under that keyword whenever ``use_cache``
    is on and no cache is given; None when it does neither (transformers 4 made no cache in
    training for some families, or only a legacy one)."""
    try:
        parameters = inspect.signature(forward).parameters
        source = inspect.getsource(forward)
    except (TypeError, ValueError, OSError):
        return None
    for keyword in ("cache", "past_key_values"):
        makes = f"if use_cache and {keyword} is None:" in source
        plain = f"{keyword} = DynamicCache(config=self.config)" in source
        if keyword in parameters and makes and plain:
            return keyword
    return None


def discarding_cache(base: nn.Module, given: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments that make ``base`` (a Hugging Face base model) run with a cache that
    keeps nothing — none when the caller's ``given`` keywords already decide about the cache
    (``cache``, ``past_key_values`` or ``use_cache``), ``use_cache`` is off in the model's
    config, ``base`` is not one of ``PLAIN_CACHE_MODELS`` (whose own cache is a plain
    ``DynamicCache``), or ``torch.compile`` is tracing the call (Dynamo cannot trace the class's
    first definition; the compiled graph keeps Hugging Face's own cache)."""
    if CACHE_KEYWORDS.intersection(given) or not getattr(base.config, "use_cache", False):
        return {}
    if torch.compiler.is_compiling():
        return {}
    keyword = _plain_cache_model(type(base))
    if keyword is None:
        return {}
    return {keyword: _discarding_class()(config=base.config)}
