"""Errors a Program can raise, written for the one who must fix it (often an LLM).

Every rejection names *where* (a location such as ``steps[1].epilogue[2] (swiglu)``), *what* is
wrong, and, where one exists, *what to change*. The sandbox turns these into Report entries
verbatim, so a failing unit test and the agent's feedback read the same.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

_LABEL = re.compile(r"\s*\([^()]*\)")


class ProgramError(ValueError):
    """A Program is malformed, ill-typed or cannot run at the requested shapes."""

    def __init__(
        self,
        message: str,
        *,
        loc: str = "",
        hint: str = "",
        subject: str = "",
        path: str | None = None,
    ) -> None:
        self.loc = loc
        self.message = message
        self.hint = hint
        # The name the error is about (a tensor no step writes, ...), for callers that look for
        # where it should have come from; and a JSON path that overrides the one ``loc`` gives.
        self.subject = subject
        self._path = path
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
        return ProgramError(self.message, loc=joined, hint=self.hint, subject=self.subject)

    @property
    def path(self) -> str | None:
        """The location as a JSON path into the Program (``steps[2].epilogue[0].tensor``), the
        labels that make ``loc`` readable dropped; None when the error has no location."""
        return self._path if self._path is not None else json_path(self.loc)


def json_path(loc: str) -> str | None:
    """A ``loc`` as a JSON path: ``steps[2] (gemm 'down').epilogue[0] (add_tile).tensor`` →
    ``steps[2].epilogue[0].tensor``."""
    path = _LABEL.sub("", loc).strip()
    return path or None


def first_validation_error(error: Any, root: str = "") -> str:
    """A pydantic ``ValidationError``'s first error in one line, ``"<field path>: <message>"``
    (``root`` in place of an empty path; the message alone when both are empty)."""
    first = error.errors()[0]
    where = ".".join(map(str, first["loc"])) or root
    return f"{where}: {first['msg']}" if where else first["msg"]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A hint listing what exists, with the closest spelling first when there is one."""
    pool = sorted(set(candidates))
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.6)
    listing = ", ".join(repr(c) for c in pool) if pool else "(none)"
    if close:
        return f"did you mean {close[0]!r}? known: {listing}"
    return f"known: {listing}"
