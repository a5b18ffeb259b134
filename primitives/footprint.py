"""What a program's tensors would occupy at one binding of its sizes — known before anything runs.

``analyze`` gives every program tensor's shape at a binding; ``footprints`` turns that into bytes
(inputs, prep results, what steps store, partial buffers, aux results and the block outputs that
are views), and ``check_footprint`` refuses a program whose largest tensor or whose total is past
a cap, naming the tensor, its shape at that binding and what to change. The sandbox runs this in
validate, so a program that would allocate terabytes (a chain of ``concat_rows`` doubles a
weight's rows each step) is refused in milliseconds instead of being run.

Sizes are counted as kernels store them: an activation-dtype (``act``) tensor at 4 bytes per
element (float32, the widest dtype kernels run in), a partials buffer at one float32 per tile of
the narrowest sub-tile a config allows (``MIN_PARTIALS_BLOCK`` columns: an upper bound on every
config's buffer). Temporaries of the executors (a GEMM's product in the reference executor, the
float64 copies of the semantics check) are not counted here: the sandbox worker's memory cap
bounds those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ProgramError
from .ir import GemmEpilogue, OutputView, Program
from .types import TensorInfo, partials_shape

ELEMENT_BYTES = {"act": 4, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}
MIN_PARTIALS_BLOCK = 8  # a 16-column sub-tile after a 2→1 pair contraction reduces 8 columns
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


@dataclass(frozen=True)
class Footprint:
    """One tensor's size at one binding; ``view``: a block output that is a view (no storage)."""

    name: str
    loc: str  # where the program makes it: "inputs.x", "prep[2] (concat_rows)", "steps[0] ..."
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    view: bool = False

    def describe(self) -> str:
        dtype = "float32 (act)" if self.dtype == "act" else self.dtype  # as it is counted
        return f"[{', '.join(map(str, self.shape))}] {dtype} = {format_bytes(self.nbytes)}"


def format_bytes(n: int | float) -> str:
    """``n`` bytes in binary units to four significant digits, e.g. ``32 GiB``, ``256.3 MiB``."""
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.4g} {_UNITS[unit]}"


def _storage(info: TensorInfo) -> tuple[tuple[int, ...], str]:
    """The shape and dtype the tensor is allocated with (a partials buffer at its widest)."""
    p = info.partials
    if p is None:
        return info.shape, info.dtype
    return partials_shape(info.shape[0], p.length, MIN_PARTIALS_BLOCK), "float32"


def _locations(program: Program) -> dict[str, str]:
    """producer (as ``analyze`` records it) → the location an error names."""
    locs = {f"prep[{i}]": f"prep[{i}] ({step.kind})" for i, step in enumerate(program.prep)}
    for i, (step, name) in enumerate(zip(program.steps, program.step_names(), strict=True)):
        kind = "gemm" if isinstance(step, GemmEpilogue) else step.kind
        locs[name] = f"steps[{i}] ({kind} {name!r})"
    return locs


def footprints(
    program: Program, tensors: dict[str, TensorInfo], sizes: dict[str, int]
) -> list[Footprint]:
    """Every program tensor (``tensors``: ``ProgramInfo.tensors``) and every output view, sized."""
    locs = _locations(program)
    out: list[Footprint] = []
    for name, info in tensors.items():
        shape, dtype = _storage(info)
        loc = f"inputs.{name}" if info.producer == "input" else locs.get(info.producer, "")
        nbytes = math.prod(shape) * ELEMENT_BYTES.get(dtype, 8)
        out.append(Footprint(name, loc, shape, dtype, nbytes))
    for key, value in program.outputs.items():
        source = tensors.get(program.output_tensor(key))
        if isinstance(value, OutputView) and source is not None and len(source.shape) == 2:
            start, stop = value.bounds(sizes, source.shape[value.dim])
            shape = list(source.shape)
            shape[value.dim] = -(-(stop - start) // value.step)
            nbytes = math.prod(shape) * ELEMENT_BYTES.get(source.dtype, 8)
            out.append(Footprint(key, f"outputs.{key}", tuple(shape), source.dtype, nbytes, True))
    return out


def check_footprint(
    program: Program,
    tensors: dict[str, TensorInfo],
    sizes: dict[str, int],
    *,
    max_tensor_bytes: int | None,
    max_total_bytes: int | None,
) -> int:
    """Raise ``ProgramError`` when a tensor or the total is past its cap; return the total bytes.

    The caps are named by the ``SandboxOptions`` fields that set them, so the message says what
    a user with genuinely larger shapes changes.
    """
    sized = footprints(program, tensors, sizes)
    where = ", ".join(f"{k}={v}" for k, v in sizes.items())
    for f in sized:
        if max_tensor_bytes is not None and f.nbytes > max_tensor_bytes:
            what = "block output view" if f.view else "tensor"
            raise ProgramError(
                f"{what} {f.name!r} would be {f.describe()} at {where}, above the sandbox's "
                f"per-tensor cap of {format_bytes(max_tensor_bytes)}",
                loc=f.loc,
                hint=_hint([f], "max_tensor_gib"),
            )
    total = sum(f.nbytes for f in sized if not f.view)
    if max_total_bytes is not None and total > max_total_bytes:
        largest = sorted((f for f in sized if not f.view), key=lambda f: -f.nbytes)[:3]
        listing = ", ".join(f"{f.name!r} {f.describe()}" for f in largest)
        own = [f for f in sized if _the_block_s(f)]
        raise ProgramError(
            f"the program's tensors would take {format_bytes(total)} at {where} (largest: "
            f"{listing}), above the sandbox's total cap of {format_bytes(max_total_bytes)}",
            hint=_hint(
                own if sum(f.nbytes for f in own) > max_total_bytes else [], "max_total_gib"
            ),
        )
    return total


def _the_block_s(f: Footprint) -> bool:
    """Whether ``f`` is sized by the block itself: one of its inputs."""
    return f.loc.startswith("inputs.")


def _hint(over: list[Footprint], cap: str) -> str:
    """What to change when the tensors ``over`` are past the cap that ``SandboxOptions.<cap>``
    sets: the block's shapes when they are the block's own tensors, else the program's steps."""
    if over and all(_the_block_s(f) for f in over):
        names = ", ".join(repr(f.name) for f in over)
        return (
            f"{names}: the block's own tensors at this shape set — no program can make them "
            f"smaller. This is a fault of the block's shape sets, not of the program: give the "
            f"block smaller shapes, or raise the cap (SandboxOptions.{cap})"
        )
    return f"{_HINT}; SandboxOptions.{cap} raises the cap"


_HINT = (
    "the block's own tensors are far smaller: check the steps that build the largest tensors "
    "(each concat_rows or interleave_rows of a tensor with itself doubles its rows) and build "
    "only what the block's outputs need"
)
