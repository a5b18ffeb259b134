"""Where blocks are found: the built-in ones by name, and users' blocks from their own files."""

from __future__ import annotations

import difflib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from .block import Block

_BLOCKS: dict[str, Block] = {}
# Families of blocks made on demand from their name (e.g. ``llama_mlp_eps1e-06``): each resolver
# returns the (registered) block for a name it owns, or None — possibly a block of another name
# (``llama_mlp_eps1e-05`` is the built-in ``llama_mlp``). A sandbox worker resolves the same
# names the same way, so such blocks need no block file.
_RESOLVERS: list[Callable[[str], Block | None]] = []


def register_resolver(resolver: Callable[[str], Block | None]) -> None:
    """Let ``get_block`` build blocks of a family from their names."""
    _RESOLVERS.append(resolver)


class BlockNotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def register(block: Block) -> Block:
    """Make ``block`` available by name (a later registration of the same name replaces it)."""
    _BLOCKS[block.name] = block
    return block


def _load_builtin() -> None:
    from . import kernels, llama  # noqa: F401  (registers the built-in blocks)


def get_block(name: str) -> Block:
    _load_builtin()
    if name in _BLOCKS:
        return _BLOCKS[name]
    for resolver in _RESOLVERS:
        block = resolver(name)
        if block is not None:
            return block
    if name not in _BLOCKS:
        close = difflib.get_close_matches(name, list(_BLOCKS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise BlockNotFound(f"no block named {name!r}: {hint}known: {', '.join(sorted(_BLOCKS))}")
    return _BLOCKS[name]


def list_blocks() -> list[Block]:
    _load_builtin()
    return list(_BLOCKS.values())


def load_block_file(path: str | Path) -> list[Block]:
    """Import a Python file and register every ``Block`` defined at its top level."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"block file {str(path)!r} does not exist")
    name = f"coda_user_blocks_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    found = [v for v in vars(module).values() if isinstance(v, Block)]
    if not found:
        raise ValueError(f"{str(path)!r} defines no Block at its top level")
    return [register(b) for b in found]
