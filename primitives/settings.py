"""The process's settings: every environment variable coda reads, read once, in one frozen object.

``current()`` reads the environment the first time it is called and returns the same ``Settings``
afterwards; nothing else in coda reads ``os.environ`` for its own configuration (the sandbox's
worker gets its settings from the environment its runner gives it). Nothing here writes to the
environment.

Tests (and programs) change settings with ``override(**fields)``, a context manager that puts a
copy with those fields changed in place for its duration::

    with override(cache_dir=tmp_path, plugins=("my_ops.py",)):
        ...

Module flags that code or benchmarks toggle at run time (``runtime.REPLAY``, ``launch.DIRECT``,
``export.autograd.EAGER_CALLS``) take their start value from here when their module is imported.

Variables, their fields and effects (the README's configuration table says the same):

* ``CODA_CACHE_DIR`` → ``cache_dir`` (default ``~/.cache/coda-agent``): generated kernel modules
  (``kernels/``) and the tuning cache (``tuning.json``).
* ``CODA_PLUGINS`` → ``plugins`` (none): extra primitive modules or files, ``os.pathsep``-separated;
  the sandbox's default plugin list.
* ``CODA_DECIDE_EVERY_RUN=1`` → ``decide_every_run``: compiled programs decide their launches on
  every call (no run-plan replay).
* ``CODA_TRITON_LAUNCH=1`` → ``triton_launch``: every kernel launch takes Triton's own path.
* ``CODA_DISPATCH_OPS=1`` → ``dispatch_ops``: exported ops go through the ``torch.library``
  dispatcher on every call.
* ``CODA_DEBUG_CODEGEN`` (non-empty) → ``debug_codegen``: print every generated module.
* ``CODA_SANDBOX_WORKER=1`` → ``sandbox_worker``: this process is a sandbox worker (the sandbox's
  runner sets it for its workers).
* ``CODA_COMPILE_THREADS`` → ``compile_threads`` (default: one per CPU, at most 16): threads
  that compile a run's kernels ahead of its launches (``compile_ahead``); ``1`` compiles each
  kernel at its first launch.
* ``CODA_EPILOGUE_BACKEND`` → ``epilogue_backend`` (default ``triton``): which kernels run fused
  GEMM steps — ``triton``, ``cute`` (QuACK's Hopper GEMM on the CuTe DSL for every step it
  covers; the rest on Triton) or ``auto`` (where the DSL, QuACK and a Hopper GPU are there, each
  step the CuTe backend covers on whichever backend tuning found cheaper at the call's shapes —
  the larger of its GPU and host times —, on CuTe where it was not tuned). Tuning also picks the
  CuTe tile per shape. See ``coda.primitives.cute``.
* ``TRITON_INTERPRET=1`` → ``force_interpreter``: run coda's kernels in Triton's interpreter even
  on a GPU (Triton's own variable; without a GPU coda interprets its kernels regardless).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    """coda's configuration; see the module docstring for each field's variable and effect."""

    cache_dir: Path
    plugins: tuple[str, ...] = ()
    decide_every_run: bool = False
    triton_launch: bool = False
    dispatch_ops: bool = False
    debug_codegen: bool = False
    sandbox_worker: bool = False
    force_interpreter: bool = False
    compile_threads: int | None = None
    epilogue_backend: str = "triton"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """The settings that ``environ`` describes (unset variables take their defaults)."""
        cache = environ.get("CODA_CACHE_DIR") or Path.home() / ".cache" / "coda-agent"
        raw_plugins = environ.get("CODA_PLUGINS", "")
        return cls(
            cache_dir=Path(cache),
            plugins=tuple(p for p in raw_plugins.split(os.pathsep) if p.strip()),
            decide_every_run=environ.get("CODA_DECIDE_EVERY_RUN") == "1",
            triton_launch=environ.get("CODA_TRITON_LAUNCH") == "1",
            dispatch_ops=environ.get("CODA_DISPATCH_OPS") == "1",
            debug_codegen=bool(environ.get("CODA_DEBUG_CODEGEN")),
            sandbox_worker=environ.get("CODA_SANDBOX_WORKER") == "1",
            force_interpreter=environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
            compile_threads=_positive_int(environ, "CODA_COMPILE_THREADS"),
            epilogue_backend=_choice(environ, "CODA_EPILOGUE_BACKEND", EPILOGUE_BACKENDS),
        )


EPILOGUE_BACKENDS = ("triton", "cute", "auto")  # the first is the default


def _choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """Variable ``name`` as one of ``choices`` (the first when unset or empty)."""
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return choices[0]
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


def _positive_int(environ: Mapping[str, str], name: str) -> int | None:
    """Variable ``name`` as a positive integer; None when unset or empty."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive integer (unset: the default)")
    return int(raw)


_current: Settings | None = None


def current() -> Settings:
    """The process's settings, read from the environment on the first call."""
    global _current
    if _current is None:
        _current = Settings.from_environ(os.environ)
    return _current


@contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """Use ``current()`` with ``changes`` applied until the block ends (then the previous
    settings again). A field name that ``Settings`` does not have is a ``TypeError``."""
    global _current
    previous = current()
    _current = dataclasses.replace(previous, **changes)  # type: ignore[arg-type]
    try:
        yield _current
    finally:
        _current = previous
