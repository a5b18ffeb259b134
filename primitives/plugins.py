"""Plugins: extra primitives (epilogue ops, aux steps, prep steps) from modules outside coda.

A plugin is a Python module — a dotted module name (``my_pkg.my_ops``) or a path to a ``.py`` file —
that defines ``EpilogueOp`` / ``AuxStep`` / ``PrepStep`` subclasses exactly as the built-in families
do. ``load_plugins`` imports it; its classes register themselves (``base``), and every registration
rebuilds the ``Program`` models, so a plugin's ops parse, appear in ``Program.model_json_schema()``
and reach codegen like built-in ones. A plugin may add new ``op``/``kind`` names, never replace one.

The sandbox passes ``SandboxOptions.plugins`` to its worker subprocess, which loads the same plugins
before it parses the program; ``CODA_PLUGINS`` (entries separated by ``os.pathsep``) is the default
for that option. Plugins are trusted code (like a ``--block-file``): they run in the caller and in
the worker.

``plugin_scope`` restores the registries on exit — for tests that register rogue primitives without
leaking them into other tests in the same process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from .base import register_node, restore_registries, snapshot_registries
from .settings import current


class PluginError(ImportError):
    """A plugin could not be imported or registered; the message names it and says why."""


def plugins_from_env() -> list[str]:
    """The plugin list of ``$CODA_PLUGINS`` (``os.pathsep``-separated; ``settings.plugins``)."""
    return list(current().plugins)


def is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def normalize(spec: str) -> str:
    """File plugins as absolute paths (a worker runs in another directory); modules unchanged."""
    return str(Path(spec).expanduser().resolve()) if is_file_spec(spec) else spec


def _module_name(path: Path) -> str:
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return f"coda_plugin_{path.stem}_{digest}"


def _import_file(path: Path) -> ModuleType:
    name = _module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise PluginError(f"plugin file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _register_module(module: ModuleType) -> list[type]:
    """(Re-)register the node classes defined in ``module`` (not the ones it imports)."""
    found = []
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__ and register_node(value):
            found.append(value)
    return found


def load_plugin(spec: str) -> ModuleType:
    """Import one plugin and register its nodes; raise ``PluginError`` saying what went wrong."""
    try:
        if is_file_spec(spec):
            module = _import_file(Path(normalize(spec)))
        else:
            module = importlib.import_module(spec)
        nodes = _register_module(module)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of user code is reported by name
        raise PluginError(f"plugin {spec!r} could not be loaded: {type(e).__name__}: {e}") from e
    if not nodes:
        raise PluginError(
            f"plugin {spec!r} defines no EpilogueOp, AuxStep or PrepStep subclass with an op/kind "
            "literal at its top level"
        )
    return module


def load_plugins(specs: Iterable[str]) -> list[ModuleType]:
    """Load every plugin in ``specs`` (idempotent: loading one twice registers it once)."""
    return [load_plugin(spec) for spec in specs]


@contextmanager
def plugin_scope() -> Iterator[None]:
    """Registries as they are now are restored on exit (and the models rebuilt)."""
    snapshot = snapshot_registries()
    try:
        yield
    finally:
        restore_registries(snapshot)
