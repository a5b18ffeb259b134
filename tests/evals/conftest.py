"""Every eval test gets a private marker folder for the scripted models of ``models.py``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def markers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "markers"
    monkeypatch.setenv("CODA_TEST_MARKERS", str(folder))
    return folder
