"""What a turn costs: a per-model table of list prices, in USD per million tokens.

Prices are the vendors' published list prices for standard (non-batch) requests; check them before
relying on ``--max-cost``. A model not in the table costs "unknown" (``None``) — never a guessed
number. Names match exactly; Anthropic's dated model ids are listed next to their aliases.

Input tokens are priced in three parts (``Usage``): tokens written to the prompt cache, tokens
read from it, and the rest at the full input rate, so ``--max-cost`` bounds the real bill of a run
whose requests are cached (``anthropic.py`` asks for caching; OpenAI caches on its own).

Sources (rates as checked on 2026-12-01; the vendors change them, so check before relying on
them):

* Anthropic — the pricing section of the prompt-caching guide
  (https://platform.claude.com/docs/en/build-with-claude/prompt-caching): a 5-minute cache write
  costs 1.25× the base input price, a cache read 0.1× (the loop asks for 5-minute entries).
* OpenAI — the "Cached input" column of https://platform.openai.com/docs/pricing as published in
  late 2025: GPT-5 models 0.1× the input price, GPT-4.1, o3 and o4-mini 0.25×, GPT-4o 0.5×;
  caching is automatic and writing to the cache costs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Usage

ANTHROPIC_CACHE_WRITE = 1.25  # × the base input price, 5-minute entries
ANTHROPIC_CACHE_READ = 0.1


@dataclass(frozen=True)
class Price:
    """USD per million tokens; cache rates default to the full input rate."""

    input_per_mtok: float
    output_per_mtok: float
    cache_write_per_mtok: float | None = None
    cache_read_per_mtok: float | None = None

    def cost(self, usage: Usage) -> float:
        write = (
            self.input_per_mtok if self.cache_write_per_mtok is None else self.cache_write_per_mtok
        )
        read = self.input_per_mtok if self.cache_read_per_mtok is None else self.cache_read_per_mtok
        return (
            usage.uncached_input_tokens * self.input_per_mtok
            + usage.cache_write_tokens * write
            + usage.cache_read_tokens * read
            + usage.output_tokens * self.output_per_mtok
        ) / 1e6


def anthropic(input_per_mtok: float, output_per_mtok: float) -> Price:
    """An Anthropic model's price: cache writes and reads at the Messages API's multipliers."""
    return Price(
        input_per_mtok,
        output_per_mtok,
        cache_write_per_mtok=input_per_mtok * ANTHROPIC_CACHE_WRITE,
        cache_read_per_mtok=input_per_mtok * ANTHROPIC_CACHE_READ,
    )


def openai(input_per_mtok: float, output_per_mtok: float, cached_per_mtok: float) -> Price:
    """An OpenAI model's price: cache reads at its "cached input" rate, writes at the input rate."""
    return Price(input_per_mtok, output_per_mtok, cache_read_per_mtok=cached_per_mtok)


FREE = Price(0.0, 0.0)

PRICES: dict[str, Price] = {
    # offline "models": no API calls
    "coda-planner": FREE,
    # Anthropic
    "claude-opus-4-5": anthropic(5.0, 25.0),
    "claude-opus-4-5-20251101": anthropic(5.0, 25.0),
    "claude-opus-4-1": anthropic(15.0, 75.0),
    "claude-opus-4-1-20250805": anthropic(15.0, 75.0),
    "claude-opus-4-0": anthropic(15.0, 75.0),
    "claude-opus-4-20250514": anthropic(15.0, 75.0),
    "claude-sonnet-4-5": anthropic(3.0, 15.0),
    "claude-sonnet-4-5-20250929": anthropic(3.0, 15.0),
    "claude-sonnet-4-0": anthropic(3.0, 15.0),
    "claude-sonnet-4-20250514": anthropic(3.0, 15.0),
    "claude-3-7-sonnet-20250219": anthropic(3.0, 15.0),
    "claude-haiku-4-5": anthropic(1.0, 5.0),
    "claude-haiku-4-5-20251001": anthropic(1.0, 5.0),
    "claude-3-5-haiku-20241022": anthropic(0.8, 4.0),
    # OpenAI
    "gpt-5": openai(1.25, 10.0, 0.125),
    "gpt-5-mini": openai(0.25, 2.0, 0.025),
    "gpt-5-nano": openai(0.05, 0.4, 0.005),
    "gpt-4.1": openai(2.0, 8.0, 0.5),
    "gpt-4.1-mini": openai(0.4, 1.6, 0.1),
    "gpt-4.1-nano": openai(0.1, 0.4, 0.025),
    "gpt-4o": openai(2.5, 10.0, 1.25),
    "gpt-4o-mini": openai(0.15, 0.6, 0.075),
    "o3": openai(2.0, 8.0, 0.5),
    "o4-mini": openai(1.1, 4.4, 0.275),
}


def price_for(model: str) -> Price | None:
    """The list price of ``model``, or ``None`` when it is not known."""
    return PRICES.get(model)


def cost_usd(model: str, usage: Usage) -> float | None:
    """USD for ``usage`` on ``model``; ``None`` ("unknown") when the model has no known price."""
    price = price_for(model)
    return None if price is None else price.cost(usage)


def format_cost(cost: float | None) -> str:
    return "unknown" if cost is None else f"${cost:.4f}"
