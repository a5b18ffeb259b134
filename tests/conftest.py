"""Test configuration: a private kernel cache per pytest run (set before coda reads its
settings), and GPU tests skipped cleanly without a GPU."""

import os
import tempfile

os.environ.setdefault("CODA_CACHE_DIR", tempfile.mkdtemp(prefix="coda-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

import coda.primitives  # noqa: E402,F401

HAS_GPU = torch.cuda.is_available() and not coda.primitives.backend.INTERPRET


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu runs on the GPU machine)")
    # A GPU file that honours CODA_TEST_DEVICE (marked cpu_capable) runs through the interpreter
    # at toy sizes with CODA_TEST_DEVICE=cpu.
    on_cpu = os.environ.get("CODA_TEST_DEVICE") == "cpu"
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
            if not HAS_GPU and not (on_cpu and item.get_closest_marker("cpu_capable")):
                item.add_marker(skip_gpu)
    # Long tests first: xdist hands tests out in collection order, so a long one collected late
    # would start when the rest are nearly done (the GPU eval cell, ~250 s, did: the whole
    # tests/gpu run then ran past 480 s).
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
