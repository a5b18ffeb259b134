"""Run a generated CuTe epilogue module on a CPU, with the CuTe DSL and QuACK stood in for.

``emulate_step`` executes the module's ``epi_visit_subtile`` tile by tile over a whole output,
with fragments modelled as one output tile in row-major order (so adjacent elements are
adjacent columns, as the members of a pair are in the accumulator's fragment), and gathers what
the step writes: the output D, every tile store, and its partial sums summed over tiles. What it
checks is the generated code's arithmetic, pair handling, loop and masks against the reference
executor; QuACK's real layouts, copies and scheduling are the GPU tests' to check.

Past the output's edges the stand-ins do what the hardware does: TMA loads zeros into tiles and
the accumulator, vector loads leave what was there (here NaN, so an unmasked sum shows it), and
stores write nothing.
"""

from __future__ import annotations

import math
import sys
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import torch

from coda.primitives.cute.emit import CuteSource


class DType:
    """A CuTe numeric type: its torch dtype and width (callable, as the DSL's types are)."""

    def __init__(self, name: str, torch_dtype: torch.dtype, width: int) -> None:
        self.name, self.torch, self.width = name, torch_dtype, width

    def __call__(self, value: float) -> float:
        return value


BFLOAT16 = DType("BFloat16", torch.bfloat16, 16)
FLOAT16 = DType("Float16", torch.float16, 16)
FLOAT32 = DType("Float32", torch.float32, 32)
INT32 = DType("Int32", torch.int32, 32)


class Layout:
    """A fragment's layout: its number of elements (``shape`` is itself, as code reads both)."""

    def __init__(self, size: int) -> None:
        self.size = size

    @property
    def shape(self) -> Layout:
        return self


class Values:
    """What ``Frag.load()`` returns: the elements, and whether they are 32-bit words of pairs."""

    def __init__(self, data: torch.Tensor, words: bool = False) -> None:
        self.data, self.words = data, words

    def to(self, dtype: DType) -> Values:
        return Values(self.data.to(dtype.torch).to(torch.float64), self.words)


class Frag:
    """A register fragment: element ``i`` is ``storage[index[i]]`` (views and aliasing reduce
    buffers share a storage). ``words``: 32-bit words, each two 16-bit elements of ``storage``
    (``size`` counts the words)."""

    def __init__(self, storage: torch.Tensor, index: list[int] | None = None, words=False) -> None:
        self.storage = storage
        self.index = list(range(storage.numel())) if index is None else index
        self.words = words

    @property
    def size(self) -> int:
        return len(self.index) // 2 if self.words else len(self.index)

    @property
    def layout(self) -> Layout:
        return Layout(self.size)

    def __getitem__(self, i: int) -> float:
        assert not self.words, "a 32-bit word of pairs read as one value"
        return float(self.storage[self.index[i]])

    def __setitem__(self, i: int, value: float) -> None:
        assert not self.words, "a 32-bit word of pairs written as one value"
        self.storage[self.index[i]] = value

    def load(self) -> Values:
        return Values(self.storage[self.index].clone(), self.words)

    def store(self, values: Values) -> None:
        if values.words != self.words or values.data.numel() != len(self.index):
            # the output fragment takes the pairs' words (the GEMM's D, pair-wide)
            self.storage = torch.zeros(values.data.numel(), dtype=torch.float64)
            self.index = list(range(values.data.numel()))
            self.words = values.words
        self.storage[self.index] = values.data


def _make_rmem_tensor(layout: Layout | Frag, dtype: DType) -> Frag:
    return Frag(torch.zeros(layout.size, dtype=torch.float64))


def _recast_tensor(frag: Frag, dtype: DType) -> Frag:
    if dtype.width == 16:  # words as their 16-bit halves (or a 32-bit fragment's would-be halves)
        if frag.words:
            return Frag(frag.storage, frag.index)
        return Frag(torch.zeros(2 * frag.size, dtype=torch.float64))
    assert not frag.words and len(frag.index) % 2 == 0
    return Frag(frag.storage, frag.index, words=True)


class _Divided:
    def __init__(self, frag: Frag) -> None:
        self.frag = frag

    def __getitem__(self, key: tuple) -> Frag:
        member, rest = key
        assert rest is None and member in (0, 1)
        return Frag(self.frag.storage, self.frag.index[member::2])


def _recast_layout(new: int, old: int, layout: Layout) -> Layout:
    return Layout(layout.size * old // new)


def _fake_modules(coords_key: str) -> dict[str, ModuleType]:
    cute = ModuleType("cutlass.cute")
    cute.jit = lambda fn: fn
    cute.Tensor = Frag
    cute.make_rmem_tensor = _make_rmem_tensor
    cute.recast_tensor = _recast_tensor
    cute.recast_layout = _recast_layout
    cute.flat_divide = lambda frag, layout: _Divided(frag)
    cute.make_layout = lambda n: n
    cute.size = lambda frag: frag.size
    cutlass = ModuleType("cutlass")
    cutlass.cute = cute
    cutlass.range = lambda n, unroll_full=False: range(n)
    cutlass.BFloat16, cutlass.Float16, cutlass.Float32, cutlass.Int32 = (
        BFLOAT16, FLOAT16, FLOAT32, INT32,
    )  # fmt: skip
    utils = ModuleType("quack.cute_dsl_utils")
    utils.mlir_namedtuple = lambda cls: cls
    quack = ModuleType("quack")
    quack.cute_dsl_utils = utils
    epilogue = ModuleType("coda.primitives.cute.epilogue")
    epilogue.COORDS, epilogue.F, epilogue.HALF_WIDTH = coords_key, EmulatedF, "half-width"
    for name in ("ColVecLoad", "ColVecReduce", "RowVecLoad", "RowVecReduce", "TileLoad"):
        setattr(epilogue, name, lambda *args, **kwargs: (args, kwargs))
    epilogue.TypedTileStore = epilogue.Scalar = epilogue.TileLoad
    epilogue.CodaEpilogue = type("CodaEpilogue", (), {})
    epilogue.GemmSm90 = type("GemmSm90", (), {})
    return {
        "cutlass": cutlass,
        "cutlass.cute": cute,
        "quack": quack,
        "quack.cute_dsl_utils": utils,
        "coda.primitives.cute.epilogue": epilogue,
    }


class EmulatedF:
    """``cute.epilogue.F`` on Python floats."""

    exp, log, tanh, erf, sqrt, abs = math.exp, math.log, math.tanh, math.erf, math.sqrt, abs
    min, max = min, max

    @staticmethod
    def sigmoid(x: float) -> float:
        return 1.0 / (1.0 + math.exp(-x))

    @staticmethod
    def silu(x: float) -> float:
        return x / (1.0 + math.exp(-x))

    @staticmethod
    def rsqrt(x: float) -> float:
        return 1.0 / math.sqrt(x)

    @staticmethod
    def where(cond: bool, a: float, b: float) -> float:
        return a if cond else b

    @staticmethod
    def inside_m(coords: tuple, i: int, m_bound: int) -> bool:
        local, origin, _ = coords
        return origin[0] + local[i][0] < m_bound

    @staticmethod
    def inside_n(coords: tuple, i: int, n_bound: int) -> bool:
        local, origin, _ = coords
        return origin[1] + local[i][1] < n_bound

    @staticmethod
    def tile_inside_m(coords: tuple, m_bound: int) -> bool:
        _, origin, tile = coords
        return origin[0] + tile[0] <= m_bound

    @staticmethod
    def tile_inside_n(coords: tuple, n_bound: int) -> bool:
        _, origin, tile = coords
        return origin[1] + tile[1] <= n_bound


def load_module(source: CuteSource) -> Any:
    """The module's ``Epilogue`` class, defined over the stand-ins."""
    key = "__coords"
    namespace: dict[str, Any] = {"__name__": f"emulated_{source.key}"}
    with mock.patch.dict(sys.modules, _fake_modules(key)):
        exec(compile(source.text, f"<{source.step}>", "exec"), namespace)  # noqa: S102 - generated
    return namespace["Epilogue"], key


def _block(t: torch.Tensor, rows: range, cols: range) -> torch.Tensor:
    """``t[rows, cols]`` flattened row-major, zeros past its edges (as TMA loads them)."""
    out = torch.zeros((len(rows), len(cols)), dtype=torch.float64)
    have = t[rows.start : rows.stop, cols.start : cols.stop].double()
    out[: have.shape[0], : have.shape[1]] = have
    return out.reshape(-1)


def _vector(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """``t[start : start + length]``, NaN past its end (what a vector load leaves there)."""
    out = torch.full((length,), math.nan, dtype=torch.float64)
    have = t[start : start + length].double()
    out[: have.numel()] = have
    return out


def emulate_step(
    source: CuteSource,
    a: torch.Tensor,
    b: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    tile: tuple[int, int] = (4, 8),
) -> dict[str, torch.Tensor]:
    """What the step writes, from A ``[M, K]``, B ``[N, K]`` and the program's ``tensors``:
    ``source.output`` (D) and every store, in the dtypes of ``tensors``' entries of those names
    where present (else float32), and each partial-sum tensor summed over its tiles (float64:
    ``[M]`` for row partials, ``[N]`` for column partials)."""
    epilogue, coords_key = load_module(source)
    M, N = a.shape[0], b.shape[0]
    tm, tn = tile
    acc_full = a.float() @ b.float().T
    out: dict[str, torch.Tensor] = {}
    stores = [bd for bd in source.bindings if bd.kind == "store"]

    def target(name: str, shape: tuple) -> torch.Tensor:
        if name not in out:
            dtype = tensors[name].dtype if name in tensors else torch.float32
            out[name] = torch.full(shape, math.nan, dtype=dtype)
        return out[name]

    by_row = [r for r in range(tm) for _ in range(tn)]  # a row's value at each element
    by_col = [c for _ in range(tm) for c in range(tn)]
    for m0 in range(0, M, tm):
        for n0 in range(0, N, tn):
            rows, cols = range(m0, m0 + tm), range(n0, n0 + tn)
            E: dict[str, Any] = {"m_bound": M, "n_bound": N}
            local = [(r, c) for r in range(tm) for c in range(tn)]
            E[coords_key] = (local, (m0, n0), (tm, tn))
            partials: list[tuple[Any, Frag, str]] = []
            for bd in source.bindings:
                t = tensors.get(bd.tensor)
                if bd.kind == "tile" and bd.pairs:
                    data = _block(t, rows, range(2 * n0, 2 * n0 + 2 * tn))
                    E[bd.op] = Frag(data, words=True)
                elif bd.kind == "tile":
                    E[bd.op] = Frag(_block(t, rows, cols))
                elif bd.kind == "row":
                    E[bd.op] = Frag(_vector(t, m0, tm), by_row)
                elif bd.kind == "col":
                    E[bd.op] = Frag(_vector(t, n0, tn), by_col)
                elif bd.kind in ("row_partials", "col_partials"):
                    axis = bd.kind.split("_")[0]
                    length = tm if axis == "row" else tn
                    frag = Frag(
                        torch.zeros(length, dtype=torch.float64),
                        by_row if axis == "row" else by_col,
                    )
                    E[bd.op] = frag
                    partials.append((bd, frag, axis))
            acc = Frag(_block(acc_full, rows, cols))
            returned = epilogue.epi_visit_subtile(SimpleNamespace(), None, E, acc)
            if source.output is not None:
                width = 2 * N if acc.words else N
                d = target(source.output, (M, width))
                values = acc.storage[acc.index].reshape(tm, -1)
                _write(d, values, m0, n0 * values.shape[1] // tn)
            for bd, frag in zip(stores, returned, strict=True):
                width = N // 2 if bd.half else N
                s = target(bd.tensor, (M, width))
                values = frag.storage[frag.index].reshape(tm, -1)
                _write(s, values, m0, n0 * values.shape[1] // tn)
            for bd, frag, axis in partials:
                name = f"{bd.tensor}:sum"
                if axis == "row":
                    total = out.setdefault(name, torch.zeros(M, dtype=torch.float64))
                    n = min(tm, M - m0)
                    total[m0 : m0 + n] += frag.storage[:n]
                else:
                    total = out.setdefault(name, torch.zeros(N, dtype=torch.float64))
                    n = min(tn, N - n0)
                    total[n0 : n0 + n] += frag.storage[:n]
    return out


def _write(dst: torch.Tensor, values: torch.Tensor, row: int, col: int) -> None:
    """A TMA store: ``values`` at ``(row, col)``, rounded to ``dst``'s dtype, nothing past its
    edges."""
    r = min(values.shape[0], dst.shape[0] - row)
    c = min(values.shape[1], dst.shape[1] - col)
    if r > 0 and c > 0:
        dst[row : row + r, col : col + c] = values[:r, :c].to(dst.dtype)
