"""Fixtures of the GPU tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coda.primitives.settings import override


@pytest.fixture
def triton_backend() -> Iterator[None]:
    """Fused steps on the Triton backend whatever ``CODA_EPILOGUE_BACKEND`` says, for tests whose
    subject is the Triton kernels or their launches (under ``auto`` or ``cute`` those steps
    would run on QuACK's GEMM; ``test_cute_gpu.py`` covers that backend)."""
    with override(epilogue_backend="triton"):
        yield
