"""Append-only JSON-lines files that a crash cannot make unreadable (transcripts, eval results).

``append_line`` writes one line and syncs it; if the write fails (a full disk) the file is cut
back to where it ended, so it never keeps half a line. ``repair_tail`` is for a file some earlier
process was writing when it died: its last line may be torn (no newline, not JSON), and anything
appended after it would be glued onto it. It cuts such a tail off — saving the bytes to a side
file, so nothing is lost — or gives a whole record that only lost its newline the newline back.
Both raise ``OSError``; callers say which file it was and what to do.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import BinaryIO


def append_line(path: Path, line: bytes) -> None:
    """Append ``line`` (ending in a newline) to ``path`` and push it to disk before returning."""
    with open(path, "ab") as f:
        end = f.seek(0, os.SEEK_END)
        try:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            with contextlib.suppress(OSError):
                f.truncate(end)
            raise


def repair_tail(path: Path, torn: Path) -> str | None:
    """Make ``path`` end with a whole line; a note saying what was done, or ``None`` if it did.

    A torn last line (no newline and not JSON, or not JSON at all) is cut off and its bytes are
    appended to ``torn``; a JSON last line without its newline gets the newline."""
    if not path.is_file():
        return None
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        start = _last_line_start(f, size)
        f.seek(start)
        tail = f.read()
        whole = tail.endswith(b"\n")
        if tail.strip() == b"" or (whole and _is_json(tail)):
            return None
        if not whole and _is_json(tail):
            f.write(b"\n")
            _sync(f)
            return f"{path}: the last record had lost its newline; it was added back"
        with open(torn, "ab") as t:
            t.write(tail if whole else tail + b"\n")
            _sync(t)
        f.truncate(start)
        _sync(f)
    return (
        f"{path}: cut off a torn last line ({len(tail)} bytes at byte {start}, left by a process "
        f"that stopped mid-write); the bytes are kept in {torn}"
    )


def _sync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def _last_line_start(f: BinaryIO, size: int) -> int:
    """The offset where the file's last line starts (a final newline belongs to that line)."""
    pos, block = size, 1 << 16
    end = size - 1 if size else 0
    while pos > 0:
        step = min(block, pos)
        pos -= step
        f.seek(pos)
        chunk = f.read(step)
        found = chunk.rfind(b"\n", 0, max(0, end - pos))
        if found >= 0:
            return pos + found + 1
    return 0


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return True
