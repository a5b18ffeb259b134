"""What a compiled kernel costs on the device: registers, spills and shared memory, read from
what a Triton launch returns."""

from __future__ import annotations

from typing import Any


def compiled_kernel_stats(launched: Any) -> dict[str, int]:
    """Registers per thread, spilled registers and shared memory of a compiled kernel, from what
    a Triton launch returns (empty under the interpreter, which compiles nothing)."""
    stats = {}
    for key, attr in (("registers", "n_regs"), ("spills", "n_spills")):
        value = getattr(launched, attr, None)
        if isinstance(value, int):
            stats[key] = value
    shared = getattr(getattr(launched, "metadata", None), "shared", None)
    if isinstance(shared, int):
        stats["shared_bytes"] = shared
    return stats
