"""Shapes of a block's values at its shape sets, as the rules need them: a size expression for one
dimension of a value (``divide_by``, ``head_dim``, ``rotary_cols``), and whether a value is a tile
of a GEMM's output.
"""

from __future__ import annotations

from typing import Any

from .state import PlanState

_TRACES: dict[int, tuple[Any, list]] = {}


def binding_shapes(st: PlanState) -> list[tuple[dict[str, int], dict[str, tuple[int, ...]]]]:
    """Every value's shape at each CPU and GPU shape set of the block (cached per block object)."""
    cached = _TRACES.get(id(st.block))
    if cached is None or cached[0] is not st.block:
        sets = st.block.shapes.cpu + st.block.shapes.gpu
        cached = (st.block, [(s, st.block.trace(s)) for s in sets])
        _TRACES[id(st.block)] = cached
    return cached[1]


def size_expr_of(st: PlanState, value: str, dim: int) -> str:
    """A size expression equal to ``value.shape[dim]`` at every shape set of the block."""
    traces = binding_shapes(st)
    names = sorted(
        {d for spec in st.block.inputs.values() for d in spec.shape if isinstance(d, str)}
    )
    for name in names:
        if all(shapes[value][dim] == sizes[name] for sizes, shapes in traces):
            return name
    widths = {shapes[value][dim] for _, shapes in traces}
    if len(widths) == 1:
        return str(widths.pop())
    raise ValueError(f"no size name of block {st.block.name!r} equals {value}.shape[{dim}]")


def tile_shaped(st: PlanState, value: str, gemm_out: str) -> bool:
    """``value`` has the GEMM output's rows and N/2, N or 2N columns at every shape set."""
    for _, shapes in binding_shapes(st):
        v, g = shapes.get(value), shapes[gemm_out]
        if v is None or len(v) != 2 or v[0] != g[0] or v[1] * 2 not in (g[1], 2 * g[1], 4 * g[1]):
            return False
    return True
