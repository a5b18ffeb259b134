"""Where kernels run: on a CUDA GPU when there is one, otherwise in Triton's CPU interpreter.

``INTERPRET`` and ``DEVICE`` are facts about this machine (no CUDA device, or ``TRITON_INTERPRET=1``
forcing the interpreter: see ``settings``); importing this module sets nothing.

The choice is made per kernel, not for the process. Triton decides whether a ``@triton.jit``
function is interpreted when the decorator runs, from ``TRITON_INTERPRET``; coda never sets that
variable (it would switch every other Triton library in the process to the interpreter, and would
have to happen before Triton is imported). Instead ``interpreted`` turns coda's own kernels —
the hand-written ones (decorated with ``jit`` below) and every generated module
(``codegen.cache.load_kernel``) — into ``InterpretedFunction``s when ``INTERPRET`` holds. Triton's
standard library (``tl.sum``, ``tl.max``, ``tl.cdiv``, ...) was built for compilation when the
interpreter was not chosen for the process, so while one of coda's interpreted kernels runs, its
``@triton.jit`` functions are swapped for interpreted twins and put back afterwards — the same
temporary patching of ``triton.language`` that Triton's interpreter does for its builtins on
every launch (and, like it, not meant for two threads launching interpreted kernels at once).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager, suppress
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .settings import current

INTERPRET: bool = current().force_interpreter or not torch.cuda.is_available()
DEVICE: str = "cpu" if INTERPRET else "cuda"


def describe() -> str:
    """One line for reports: which device and backend kernels run on."""
    if INTERPRET:
        return "cpu (Triton interpreter)"
    return f"cuda ({torch.cuda.get_device_name()})"


class CodaInterpretedFunction(InterpretedFunction):
    """One of coda's kernels run by Triton's interpreter, with Triton's standard library
    interpreted for the duration of each launch (``interpreted_language``). Calls of one kernel
    function from another happen inside a launch, where the library is interpreted already."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with interpreted_language():
            return super().run(*args, **kwargs)


# Interpreted twins of Triton's library functions, by the Python function they wrap.
_TWINS: dict[Callable, InterpretedFunction] = {}


def _twin(function: JITFunction) -> InterpretedFunction:
    twin = _TWINS.get(function.fn)
    if twin is None:
        twin = _TWINS[function.fn] = InterpretedFunction(function.fn)
    return twin


def _language_namespaces() -> list[Any]:
    """``triton.language`` and its submodules, and the tensor class (whose methods such as
    ``x.sum()`` are library functions too)."""
    import triton.language as tl

    modules = [m for n, m in list(sys.modules.items()) if n.startswith("triton.language")]
    return [m for m in modules if m is not None] + [tl.tensor]


def _import_lazy_triton_modules() -> None:
    """Triton imports its Gluon dialect lazily during a launch (3.9), and Gluon insists that the
    library it re-exports is compiled: import it before anything is swapped."""
    with suppress(ImportError):  # an older Triton without Gluon
        import triton.experimental.gluon  # noqa: F401


@contextmanager
def interpreted_language() -> Iterator[None]:
    """Swap every ``@triton.jit`` function of ``triton.language`` for its interpreted twin until
    the block ends. Nested uses are harmless: an already swapped function is not a JITFunction."""
    _import_lazy_triton_modules()
    swapped: list[tuple[Any, str, JITFunction]] = []
    for namespace in _language_namespaces():
        for name, value in list(vars(namespace).items()):
            if isinstance(value, JITFunction):
                swapped.append((namespace, name, value))
                setattr(namespace, name, _twin(value))
    try:
        yield
    finally:
        for namespace, name, value in reversed(swapped):
            setattr(namespace, name, value)


def interpreted(kernel: Any) -> Any:
    """``kernel`` as it runs on this machine: a ``@triton.jit`` function becomes a
    ``CodaInterpretedFunction`` when ``INTERPRET`` holds; anything else is returned unchanged
    (also a kernel Triton itself already interprets under ``TRITON_INTERPRET=1``)."""
    if INTERPRET and isinstance(kernel, JITFunction):
        return CodaInterpretedFunction(kernel.fn)
    return kernel


def interpret_namespace(namespace: MutableMapping[str, Any]) -> None:
    """Make every ``@triton.jit`` function in a module's namespace ``interpreted``, so kernels
    that call each other by name reach the interpreted versions."""
    for name, value in list(namespace.items()):
        if isinstance(value, JITFunction):
            namespace[name] = interpreted(value)


def jit(fn: Callable) -> Any:
    """``@triton.jit`` for coda's hand-written kernels: compiled on a GPU, interpreted otherwise."""
    return interpreted(triton.jit(fn))
