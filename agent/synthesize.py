"""Synthesize a kernel for a block — the programmatic entry point (the CLI and evals call these).

``synthesize`` starts a run (the built-in planner unless another provider is given) and
``resume`` continues one from its transcript; both drive ``AgentLoop`` and return its
``AgentResult``. ``check_budgets`` refuses budgets that cannot be enforced (a dollar limit for a
model without a known price) before anything starts.
"""

from __future__ import annotations

from pathlib import Path

from coda.blocks.block import Block
from coda.sandbox.stages import SandboxOptions

from .loop import AgentLoop, AgentResult, Budgets, OnEvent
from .providers.base import Provider
from .providers.builtin import BuiltinProvider
from .providers.pricing import PRICES, price_for
from .providers.retry import RetryPolicy
from .runs import RunDir


class BudgetError(ValueError):
    """A budget that cannot be enforced; the message says what to use instead."""


def check_budgets(provider: Provider, budgets: Budgets) -> None:
    if budgets.max_cost is not None and price_for(provider.model) is None:
        known = ", ".join(sorted(m for m in PRICES if m != "coda-planner"))
        raise BudgetError(
            f"no price is known for model {provider.model!r}, so --max-cost cannot be enforced: "
            f"use --max-tokens instead, or a model with a known price ({known})"
        )


def synthesize(
    block: Block,
    runs_dir: str | Path = "runs",
    *,
    provider: Provider | None = None,
    budgets: Budgets | None = None,
    sandbox: SandboxOptions | None = None,
    block_file: str | None = None,
    base_url: str | None = None,
    transcript: str | None = None,
    retry: RetryPolicy | None = None,
    on_event: OnEvent | None = None,
) -> AgentResult:
    """Run the agent loop on ``block`` in a new folder under ``runs_dir``."""
    provider = provider or BuiltinProvider(block)
    budgets = budgets or Budgets()
    check_budgets(provider, budgets)
    loop = AgentLoop.start(
        block,
        provider,
        runs_dir,
        budgets=budgets,
        sandbox=sandbox,
        block_file=block_file,
        base_url=base_url,
        transcript=transcript,
        retry=retry,
        on_event=on_event,
    )
    return loop.run()


def resume(
    run: RunDir,
    block: Block,
    provider: Provider,
    *,
    budgets: Budgets | None = None,
    sandbox: SandboxOptions | None = None,
    retry: RetryPolicy | None = None,
    on_event: OnEvent | None = None,
    block_file: str | None = None,
) -> AgentResult:
    """Continue ``run`` from its transcript with ``provider`` (budgets: the recorded ones unless
    given). ``block_file``: the file ``block`` came from, which the worker imports — the caller's
    choice, never the transcript's."""
    budgets = budgets or Budgets(**run.state().start.budgets)
    check_budgets(provider, budgets)
    loop = AgentLoop.resume(
        block,
        provider,
        run,
        budgets=budgets,
        sandbox=sandbox,
        retry=retry,
        on_event=on_event,
        block_file=block_file,
    )
    return loop.run()
