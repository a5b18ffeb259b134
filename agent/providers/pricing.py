"""What a turn costs: a per-model table of list prices, in USD per million tokens.

Prices are the vendors' published list prices for standard (non-batch) requests as known when this
table was written (late 2025); check them before relying on ``--max-cost``. A model not in the table
costs "unknown" (``None``) — never a guessed number. Names match exactly; Anthropic's dated model
ids are listed next to their aliases. Cached input tokens are counted at the full input price, an
upper bound (the loop does not request prompt caching).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Usage


@dataclass(frozen=True)
class Price:
    input_per_mtok: float
    output_per_mtok: float

    def cost(self, usage: Usage) -> float:
        return (
            usage.input_tokens * self.input_per_mtok + usage.output_tokens * self.output_per_mtok
        ) / 1e6


FREE = Price(0.0, 0.0)

PRICES: dict[str, Price] = {
    # offline "models": no API calls
    "coda-planner": FREE,
    # Anthropic
    "claude-opus-4-5": Price(5.0, 25.0),
    "claude-opus-4-5-20251101": Price(5.0, 25.0),
    "claude-opus-4-1": Price(15.0, 75.0),
    "claude-opus-4-1-20250805": Price(15.0, 75.0),
    "claude-opus-4-0": Price(15.0, 75.0),
    "claude-opus-4-20250514": Price(15.0, 75.0),
    "claude-sonnet-4-5": Price(3.0, 15.0),
    "claude-sonnet-4-5-20250929": Price(3.0, 15.0),
    "claude-sonnet-4-0": Price(3.0, 15.0),
    "claude-sonnet-4-20250514": Price(3.0, 15.0),
    "claude-3-7-sonnet-20250219": Price(3.0, 15.0),
    "claude-haiku-4-5": Price(1.0, 5.0),
    "claude-haiku-4-5-20251001": Price(1.0, 5.0),
    "claude-3-5-haiku-20241022": Price(0.8, 4.0),
    # OpenAI
    "gpt-5": Price(1.25, 10.0),
    "gpt-5-mini": Price(0.25, 2.0),
    "gpt-5-nano": Price(0.05, 0.4),
    "gpt-4.1": Price(2.0, 8.0),
    "gpt-4.1-mini": Price(0.4, 1.6),
    "gpt-4.1-nano": Price(0.1, 0.4),
    "gpt-4o": Price(2.5, 10.0),
    "gpt-4o-mini": Price(0.15, 0.6),
    "o3": Price(2.0, 8.0),
    "o4-mini": Price(1.1, 4.4),
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
