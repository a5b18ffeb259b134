"""Content-addressed store of generated kernel modules, and loading them as Triton kernels.

A module's file name carries the hash of its text, the generator version and the Triton version
(``KernelSource.digest``), so a changed primitive, template or Triton can never reuse a stale file.
Files live in ``$CODA_CACHE_DIR`` (default ``~/.cache/coda-agent/kernels``); the sandbox gives each
worker its own directory and copies the files a run used into the run's ``kernels/`` folder.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from .kernel import KernelSource

_LOADED: dict[str, ModuleType] = {}


def cache_dir() -> Path:
    root = os.environ.get("CODA_CACHE_DIR") or Path.home() / ".cache" / "coda-agent"
    path = Path(root) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_source(kernel: KernelSource, directory: Path | None = None) -> Path:
    """Write the module once (atomically) and return its path."""
    directory = directory or cache_dir()
    path = directory / f"{kernel.step}_{kernel.digest}.py"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(kernel.source)
        os.replace(tmp, path)
    return path


def load_kernel(kernel: KernelSource, function: str):  # noqa: ANN201 - a triton JITFunction
    """Import the generated module (from its file, so Triton can read the source) and return one
    of its kernel functions."""
    path = write_source(kernel)
    name = f"coda_generated_{kernel.step}_{kernel.digest}"
    module = _LOADED.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _LOADED[name] = module
    return getattr(module, function)
