"""Watching what a patched step copies: every ``torch.Tensor.clone`` of a view whose base has a
given number of rows (e.g. rows of one fused QKV weight gradient that an exported call would have
to copy apart before returning them as separate gradients)."""

from __future__ import annotations

import pytest
import torch


def clones_of_views_of(rows: int, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """From now until the test ends (``monkeypatch`` undoes it), the shape of every clone of a
    view of a ``rows``-row tensor, in the returned list."""
    copied: list[tuple[int, ...]] = []
    clone = torch.Tensor.clone

    def recording_clone(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if self._base is not None and self._base.shape[0] == rows:
            copied.append(tuple(self.shape))
        return clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", recording_clone)
    return copied
