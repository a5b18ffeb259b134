"""Errors a Program can raise, written for the one who must fix it (often an LLM).

Every rejection names *where* (a location such as ``steps[1].epilogue[2] (swiglu)``), *what* is
wrong, and, where one exists, *what to change*. The sandbox turns these into Report entries
verbatim, so a failing unit test and the agent's feedback read the same.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ProgramError(ValueError):
    """A Program is malformed, ill-typed or cannot run at the requested shapes."""

    def __init__(self, message: str, *, loc: str = "", hint: str = "") -> None:
        self.loc = loc
        self.message = message
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        text = f"{self.loc}: {self.message}" if self.loc else self.message
        return f"{text} — {self.hint}" if self.hint else text

    def at(self, loc: str) -> ProgramError:
        """The same error, prefixed with an outer location."""
        if not self.loc:
            joined = loc
        elif self.loc.startswith("["):
            joined = loc + self.loc
        else:
            joined = f"{loc}.{self.loc}"
        return ProgramError(self.message, loc=joined, hint=self.hint)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A hint listing what exists, with the closest spelling first when there is one."""
    pool = sorted(set(candidates))
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.6)
    listing = ", ".join(repr(c) for c in pool) if pool else "(none)"
    if close:
        return f"did you mean {close[0]!r}? known: {listing}"
    return f"known: {listing}"
