"""What keeps a worker away from the caller's secrets: its environment, and the caller's ``/proc``.

* ``worker_environment`` builds the worker's environment from an **allowlist** — what Python,
  Triton, CUDA, the dynamic linker and the locale need, and the ``CODA_*`` settings — instead of
  removing secret-looking names from a copy (``DATABASE_URL`` or ``GITHUB_PAT`` look like nothing).
  Names with a secret marker (``KEY``, ``TOKEN``, …) are dropped even when allowed.
* A process may read another one's ``/proc/<pid>/environ`` (and ``mem``) when both run under the
  same uid and the target is *dumpable*, or when it holds a capability that overrides that. So,
  while a worker runs, the caller marks itself non-dumpable (``caller_undumpable``; a counter
  restores the old flag after the last concurrent worker): that is what stops a worker of a
  non-root caller (observed: a uid-65534 child reads a dumpable uid-65534 parent's environ, and is
  refused once the parent is non-dumpable). A root worker would read it anyway, so the worker,
  before it touches anything of the candidate, removes ``CAP_SYS_PTRACE``, ``CAP_SYS_ADMIN`` and
  ``CAP_PERFMON`` from its effective, permitted and inheritable sets, its bounding set (no later
  ``exec`` regains them) and its ambient set (``drop_ptrace``). Observed on Linux 6.18 as root:
  each of the three alone let a child read a non-dumpable parent's environ; without all three
  the read is refused, even while the caller is dumpable.

Both degrade instead of failing where the OS refuses (another platform, no ``prctl``, no
``CAP_SETPCAP``): each returns or logs a sentence saying what was not done.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping

log = logging.getLogger(__name__)

# An environment variable whose name contains one of these never reaches a worker.
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "COOKIE")
ALLOWED_NAMES = frozenset(
    {
        # the process and its user
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TEMP", "TMP", "TZ", "TERM",
        # locale
        "LANG", "LANGUAGE",
        # Python and its environment
        "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
        "PYTHONWARNINGS", "VIRTUAL_ENV", "CONDA_PREFIX",
        # the dynamic linker, and the C compiler Triton builds its launchers with
        "LD_LIBRARY_PATH", "CC", "CXX",
        # thread pools of torch's CPU kernels
        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
        # AMD GPUs
        "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
    }
)  # fmt: skip
ALLOWED_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "TRITON_", "TORCH_", "TORCHINDUCTOR_", "CODA_")


def allowed(name: str) -> bool:
    """Whether a variable of this name may reach a worker."""
    upper = name.upper()
    if any(marker in upper for marker in SECRET_MARKERS):
        return False
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def worker_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """The allowed part of ``parent`` (``allowed``); the runner adds the worker's own settings."""
    return {k: v for k, v in parent.items() if allowed(k)}


# -- /proc -----------------------------------------------------------------------------------------
PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# Each of these alone let a root process read a non-dumpable root process's /proc/<pid>/environ
# (observed on Linux 6.18).
SNOOPING_CAPABILITIES = {"CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21, "CAP_PERFMON": 38}
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _prctl(libc: ctypes.CDLL, *args: int) -> int:
    result = libc.prctl(*(ctypes.c_ulong(a) for a in args), *[ctypes.c_ulong(0)] * (5 - len(args)))
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def drop_ptrace() -> str:
    """Remove the capabilities that read another process's ``/proc`` files past its dumpable flag
    (``SNOOPING_CAPABILITIES``) from this process for good — every capability set, the bounding
    set (no later ``exec`` regains them), the ambient set; say what was done, or why it could not
    be."""
    libc = _libc()
    if libc is None:
        return f"CAP_SYS_PTRACE not dropped: no prctl on {sys.platform}"
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    names = "/".join(SNOOPING_CAPABILITIES)
    try:
        _check(libc.capget(ctypes.byref(header), data))
        with contextlib.suppress(OSError):  # kernels before 4.3 have no ambient set
            _prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        bounding = "dropped from the bounding set"
        for number in SNOOPING_CAPABILITIES.values():
            try:
                _prctl(libc, PR_CAPBSET_DROP, number)
            except OSError as e:  # needs CAP_SETPCAP (and an old kernel may not know the number)
                bounding = f"bounding set unchanged ({e.strerror})"
        for number in SNOOPING_CAPABILITIES.values():
            word, bit = data[number // 32], 1 << (number % 32)
            for field in ("effective", "permitted", "inheritable"):
                setattr(word, field, getattr(word, field) & ~bit)
        _check(libc.capset(ctypes.byref(header), data))
        return f"{names} dropped; {bounding}"
    except OSError as e:
        return f"{names} not dropped: {e.strerror}"


def _check(result: int) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


_dumpable_lock = threading.Lock()
_dumpable_users = 0
_dumpable_saved: int | None = None


@contextlib.contextmanager
def caller_undumpable() -> Iterator[str]:
    """While the block runs, this process is non-dumpable: a same-uid process without
    ``CAP_SYS_PTRACE`` (a worker) can neither read its ``/proc`` files nor attach to it. Yields
    what was done; the flag is restored when the last of concurrent users leaves."""
    global _dumpable_users, _dumpable_saved
    libc = _libc()
    note = "caller non-dumpable while the worker runs"
    with _dumpable_lock:
        if libc is None:
            note = f"caller left dumpable: no prctl on {sys.platform}"
        elif _dumpable_users == 0:
            try:
                _dumpable_saved = _prctl(libc, PR_GET_DUMPABLE)
                _prctl(libc, PR_SET_DUMPABLE, 0)
            except OSError as e:
                _dumpable_saved = None
                note = f"caller left dumpable: prctl failed ({e.strerror})"
        if _dumpable_saved is None and libc is not None and _dumpable_users > 0:
            note = "caller left dumpable: prctl failed earlier"
        _dumpable_users += 1
    if not note.startswith("caller non-dumpable"):
        log.warning("worker isolation: %s; the worker may read this process's /proc files", note)
    try:
        yield note
    finally:
        with _dumpable_lock:
            _dumpable_users -= 1
            if _dumpable_users == 0 and _dumpable_saved is not None and libc is not None:
                with contextlib.suppress(OSError):
                    _prctl(libc, PR_SET_DUMPABLE, _dumpable_saved)
                _dumpable_saved = None
