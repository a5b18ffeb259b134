"""One small indented-buffer helper: all generated source goes through it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class IndentedBuffer:
    """Lines of source at an indentation level; ``indent()`` is a context manager."""

    def __init__(self, level: int = 0, width: int = 4) -> None:
        self.lines: list[str] = []
        self.level = level
        self.width = width

    def line(self, text: str = "") -> None:
        for part in text.split("\n"):
            self.lines.append(" " * (self.level * self.width) + part if part else "")

    def extend(self, other: IndentedBuffer) -> None:
        self.lines.extend(other.lines)

    @contextmanager
    def indent(self, steps: int = 1) -> Iterator[None]:
        self.level += steps
        try:
            yield
        finally:
            self.level -= steps

    def getvalue(self) -> str:
        return "\n".join(self.lines) + "\n"
