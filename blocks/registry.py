"""Where blocks are found: the built-in ones by name, and users' blocks from their own files.

A block file is user code run at import. ``load_block_file`` turns anything it raises (an
exception, a ``SyntaxError``, ``exit()``) into a ``BlockFileError`` naming the file; with
``probe=True`` it first imports the file in a short-lived subprocess (``probe_block_file``), so a
file that ends the process outright (``os._exit``, a crash in an extension) is reported as such
instead of ending the caller — with ``os._exit(0)``, with a success status.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    from . import kernels, llama, qwen  # noqa: F401  (registers the built-in blocks)


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
    """Every block registered in this process: the built-in ones, those of block files loaded so
    far and those a family resolver made on demand."""
    _load_builtin()
    return list(_BLOCKS.values())


def builtin_blocks() -> list[Block]:
    """The blocks this package defines (``coda.blocks.kernels``, ``coda.blocks.llama`` and
    ``coda.blocks.qwen``), in definition order, whatever else has been registered in the
    process."""
    from . import kernels, llama, qwen

    return [v for m in (kernels, llama, qwen) for v in vars(m).values() if isinstance(v, Block)]


class BlockFileError(ValueError):
    """A block file that cannot be imported; the message names the file and what to change."""


PROBE_TIMEOUT_S = 300.0


def load_block_file(
    path: str | Path, *, probe: bool = False, probe_timeout_s: float | None = None
) -> list[Block]:
    """Import a Python file and register every ``Block`` defined at its top level.

    ``probe``: import it in a subprocess first (``probe_block_file``, stopped after
    ``probe_timeout_s``, at most ``PROBE_TIMEOUT_S``), so that a file that ends the process is a
    ``BlockFileError`` here rather than the end of this process."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"block file {str(path)!r} does not exist")
    if probe:
        limit = PROBE_TIMEOUT_S if probe_timeout_s is None else probe_timeout_s
        probe_block_file(path, min(limit, PROBE_TIMEOUT_S))
    name = f"coda_user_blocks_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    builtin = {b.name for b in builtin_blocks()}  # (registered before the file may register)
    registered = dict(_BLOCKS)
    try:
        with _folder_on_path(path.parent):
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - user code: every failure is reported
        del sys.modules[name]
        _restore(registered)
        raise BlockFileError(_import_failure(path, e)) from None
    found = [v for v in vars(module).values() if isinstance(v, Block)]
    if not found:
        raise ValueError(f"{str(path)!r} defines no Block at its top level")
    taken = sorted({b.name for b in found} & builtin)
    if taken:
        _restore(registered)
        raise BlockFileError(
            f"{path} defines block {taken[0]!r}, the name of a built-in block: a block file's "
            f"blocks need names of their own (e.g. 'my_{taken[0]}'), or the built-in block and "
            "this one would be taken for each other"
        )
    return [register(b) for b in found]


def _restore(registered: dict[str, Block]) -> None:
    """The registry as it was before a block file was imported (the file may have registered
    blocks itself before it failed)."""
    _BLOCKS.clear()
    _BLOCKS.update(registered)


@contextmanager
def _folder_on_path(folder: Path) -> Iterator[None]:
    """The block file's folder first on ``sys.path`` while it is imported, as ``python file.py``
    puts it, so the file can import the modules beside it (``from my_layers import ...``);
    ``sys.path`` is as before afterwards (the modules it imported stay imported)."""
    entry = str(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        if entry in sys.path:
            sys.path.remove(entry)


def _import_failure(path: Path, error: BaseException) -> str:
    """What went wrong importing block file ``path``, and where, in one paragraph."""
    if isinstance(error, SyntaxError) and error.filename == str(path):
        return f"{path}:{error.lineno}: the block file is not valid Python: {error.msg}"
    if isinstance(error, SystemExit):
        return (
            f"importing {path} called exit({error.code!r}): a block file must only define blocks "
            'when imported; put script code under `if __name__ == "__main__":`'
        )
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if f.filename == str(path)] or frames
    where = f" at {mine[-1].filename}:{mine[-1].lineno}" if mine else ""
    return (
        f"importing {path} raised {type(error).__name__}{where}: {error} — fix the block file "
        "(it is imported to find its blocks)"
    )


def probe_block_file(path: Path, timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """Import block file ``path`` in a fresh Python process; the names of the blocks it defines.

    ``BlockFileError`` if the import fails, or if the process ends before reporting — whatever its
    exit status (``os._exit(0)`` included), since a file that ends the process when imported
    cannot be used as a block file."""
    with tempfile.TemporaryDirectory(prefix="coda-block-probe-") as tmp:
        result = Path(tmp) / "result.json"
        code = "from coda.blocks.registry import _probe_main; _probe_main()"
        cmd = [sys.executable, "-c", code, str(path), str(result)]
        try:
            proc = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise BlockFileError(
                f"importing {path} did not finish within {timeout_s:g} s: a block file must "
                "define its blocks when imported, not run a long computation"
            ) from None
        if not result.is_file():
            raise BlockFileError(_probe_death(path, proc))
        found = json.loads(result.read_text())
    if "error" in found:
        raise BlockFileError(found["error"])
    return found["blocks"]


def _probe_death(path: Path, proc: subprocess.CompletedProcess) -> str:
    """The message for a probe process that ended without reporting a result."""
    status = proc.returncode
    how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
    tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-5:]
    detail = "\nits last lines of stderr:\n" + "\n".join(tail) if tail else ""
    return (
        f"importing {path} ended the Python process before it finished (the process {how}): a "
        "block file must only define blocks when imported — remove the call that exits or "
        f"crashes (os._exit, sys.exit in a thread, a crashing extension){detail}"
    )


def _probe_main() -> None:
    """In the probe process: import ``argv[1]``, write its block names (or the error) to
    ``argv[2]``."""
    path, out = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        found: dict = {"blocks": [b.name for b in load_block_file(path)]}
    except (BlockFileError, FileNotFoundError, ImportError, ValueError) as e:
        found = {"error": str(e)}
    out.write_text(json.dumps(found))
