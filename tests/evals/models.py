"""Scripted models for eval tests, as ``python:tests.evals.models:<name>`` provider factories, so
the same scripts run in this process, in eval worker processes and in Ray tasks.

State that must survive a process (has the first attempt happened?) lives in marker files under
``$CODA_TEST_MARKERS`` (a test's tmp folder), one per factory and block.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from coda.agent.providers import BuiltinProvider, ProviderError
from coda.blocks.block import Block
from tests.agent.scripted import Script, broken_program, finish, good_program, submit

PRICED = "claude-haiku-4-5"  # $1 / $5 per million tokens: turns of (100, 20) tokens cost $0.0002


def _first_time(name: str, block: Block) -> bool:
    """True the first time ``name`` is built for ``block`` (across processes)."""
    marker = Path(os.environ["CODA_TEST_MARKERS"]) / f"{name}-{block.name}"
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(os.getpid()))
    return True


def broken_then_fixed(block: Block) -> Script:
    """A priced model that submits a broken program, reads the Report, fixes it, finishes."""
    return Script(
        [submit(broken_program(), "c1"), submit(good_program(), "c2"), finish("verified")],
        model=PRICED,
    )


def never_verifies(block: Block) -> Script:
    return Script([submit(broken_program(), "c1"), finish("giving up")], model=PRICED)


def interrupted_once(block: Block) -> Script:
    """First build: submits a good program, then Ctrl-C. Later builds: finish."""
    if _first_time("interrupted_once", block):
        return Script([submit(good_program(), "c1"), KeyboardInterrupt()], model=PRICED)
    return Script([finish("verified before the interruption")], model=PRICED)


def server_down_once(block: Block) -> Any:
    """First build: the provider fails for good (a harness-level error). Later: the planner."""
    if _first_time("server_down_once", block):
        return Script([ProviderError("the server is down", kind="server")], model=PRICED)
    return BuiltinProvider(block)


def crash_once(block: Block) -> BuiltinProvider:
    """First build: the process dies (as a lost worker would). Later: the built-in planner."""
    if _first_time("crash_once", block):
        os._exit(17)
    return BuiltinProvider(block)


def crash_always(block: Block) -> BuiltinProvider:
    """Every build: the process dies."""
    os._exit(17)
