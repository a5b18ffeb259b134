"""Content-addressed store of generated kernel modules, and loading them as Triton kernels.

A module's file name carries the hash of its text, the generator version and the Triton version
(``KernelSource.digest``), so a changed primitive, template or Triton can never reuse a stale file.
Files live in ``kernels/`` under ``$CODA_CACHE_DIR`` (``settings.cache_dir``, default
``~/.cache/coda-agent``); the sandbox gives each worker its own directory and copies the files a
run used into the run's ``kernels/`` folder.

``load_kernel`` is the one place generated modules are imported (the sandbox's worker,
``compile_program`` in the caller's process, the export path): it checks the text against
``audit``'s allowlist first and executes exactly the text it checked, never a file someone may have
changed since.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from .. import backend
from ..settings import current
from .audit import check_generated_module
from .kernel import KernelSource

_LOADED: dict[str, ModuleType] = {}


def cache_dir() -> Path:
    path = current().cache_dir / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_source(kernel: KernelSource, directory: Path | None = None) -> Path:
    """Write the module (atomically) unless the file already holds exactly its text; its path."""
    directory = directory or cache_dir()
    path = directory / f"{kernel.step}_{kernel.digest}.py"
    if not path.exists() or path.read_text() != kernel.source:
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(kernel.source)
        os.replace(tmp, path)
    return path


def load_kernel(kernel: KernelSource, function: str):  # noqa: ANN201 - a triton JITFunction
    """Check the generated module against the allowlist (``audit.GeneratedCodeError`` if it holds
    anything codegen does not write), import it and return one of its kernel functions.

    The module runs from the checked text itself; the file (which Triton reads the source from)
    gets that same text, pinned in ``linecache`` so a later change on disk is never read back.
    Without a GPU its kernels become interpreted ones (``backend.interpreted``), this module's
    alone: the process's other Triton kernels are left as they are.
    """
    name = f"coda_generated_{kernel.step}_{kernel.digest}"
    module = _LOADED.get(name)
    if module is None:
        check_generated_module(kernel.source, name=f"{kernel.step}_{kernel.digest}.py")
        path = write_source(kernel)
        lines = kernel.source.splitlines(keepends=True)
        linecache.cache[str(path)] = (len(kernel.source), None, lines, str(path))
        spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        module.__file__ = str(path)
        sys.modules[name] = module
        exec(compile(kernel.source, str(path), "exec"), module.__dict__)  # noqa: S102 - checked
        backend.interpret_namespace(module.__dict__)  # interpreted kernels when there is no GPU
        _LOADED[name] = module
    return getattr(module, function)
