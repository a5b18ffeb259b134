"""``StageFailure``: a stage's verdict on a candidate, with the cause named as data."""

from __future__ import annotations

from coda.primitives.errors import ProgramError

from .report import Cause


class StageFailure(ProgramError):
    """A candidate failed a stage for a reason other than a malformed program (``cause``)."""

    def __init__(self, message: str, *, cause: Cause, loc: str = "", hint: str = "") -> None:
        super().__init__(message, loc=loc, hint=hint)
        self.cause: Cause = cause
