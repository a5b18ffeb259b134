"""What a primitive's ``emit`` writes through: the epilogue function of one generated kernel.

The epilogue is its own ``@triton.jit`` function, called on each sub-tile of the accumulator: it
sees ``accumulator`` (``BLOCK_SIZE_M × EPI_N`` fp32), the tile's row block ``pid_m`` and the first
column ``start_n`` of the sub-tile. The context owns the naming scheme (epilogue value ``z`` is
the Triton variable ``v_z``), the parameters (a tensor ``r`` becomes ``r_ptr`` plus
``stride_r...``), and the row / column index vectors of each column space, which it defines once,
on first use, at the top of the epilogue. Primitives therefore emit only their own math and never
spell pointer arithmetic.

With ``tma`` (the epilogue of the Hopper kernel) whole tiles of ``[M, W]`` tensors are loaded and
written through TMA tensor descriptors (``x_desc``, one sub-tile per block; the copy engine
zero-fills and clips the edges): one bulk copy per tile instead of per-thread addresses, masks and
a register-hungry scatter. Rows, columns, gathers and accumulating stores stay pointer accesses.

The scheme is injective: two program names never share a Triton identifier (``stem``), and a
parameter or load whose name is taken by something else is an error, never a silent reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

from ..types import LocalType, TensorInfo
from .emitter import IndentedBuffer

ACC_VAR = "accumulator"

# Identifiers of the kernel template a tensor's derived names could otherwise spell: a_ptr, a_ptrs,
# b_ptr, b_ptrs (the operands) and stride_am, _ak, _bk, _bn (as a vector's stride_<name>).
_TEMPLATE_STEMS = frozenset({"a", "b", "am", "ak", "bk", "bn"})


def _plain(tensor: str) -> bool:
    """A tensor name usable as is in derived names (``x`` → ``x_ptr``, ``stride_x_m``, ``x_tile``).

    Not plain: template stems; ``a_tensor``/``b_tensor`` (what ``a``/``b`` become); ``v_``
    (epilogue values), ``p_`` (partials and pair temporaries) and ``esc_`` (escaped stems)
    prefixes, and the bare stems ``v``, ``p`` and ``esc`` whose derived names (``v_tile``,
    ``p_ptr``) would enter those prefixes' spaces; ``_m``/``_n`` suffixes (``stride_<x>_m`` is a
    tile's stride, ``stride_<x_m>`` a vector's).
    """
    return (
        tensor not in _TEMPLATE_STEMS
        and tensor not in ("a_tensor", "b_tensor", "v", "p", "esc")
        and not tensor.startswith(("v_", "p_", "esc_"))
        and not tensor.endswith(("_m", "_n"))
    )


# How each column space is written in the epilogue: (suffix of its index vars, first column of the
# sub-tile, sub-tile width, extent). A value in space N/2 (after a 2→1 pair contraction) covers
# half the columns of the accumulator's sub-tile, starting at half its first column.
_SPACES: dict[Fraction, tuple[str, str, str, str]] = {
    Fraction(1): ("", "start_n", "EPI_N", "N"),
    Fraction(1, 2): ("_half", "(start_n // 2)", "(EPI_N // 2)", "(N // 2)"),
    Fraction(2): ("_x2", "(start_n * 2)", "(EPI_N * 2)", "(N * 2)"),
}


# The block width of one sub-tile in each column space, as a descriptor's block names it (the
# runtime maps these names to numbers when it builds the descriptor).
DESCRIPTOR_BLOCKS: dict[Fraction, str] = {
    Fraction(1): "EPI_N",
    Fraction(1, 2): "EPI_N//2",
    Fraction(2): "EPI_N*2",
}


@dataclass(frozen=True)
class Param:
    """One kernel parameter and where its launch value comes from.

    ``size``: ``M``/``N``/``K`` of the GEMM, or ``expr`` (a size expression over the program's
    sizes, e.g. ``"Nq + Nkv"``) evaluated at launch; ``shape``: ``tensor.shape[dim]``.
    """

    name: str
    kind: Literal["ptr", "stride", "size", "shape", "desc"]
    tensor: str | None = None
    dim: int | None = None
    expr: str | None = None  # a "size" parameter computed from the size binding (e.g. "Nq + Nkv")
    block: tuple[str, str] | None = None  # a TMA descriptor's block shape (meta-parameter names)


@dataclass(frozen=True)
class Space:
    """Index vector, in-bounds mask and block width of one axis of the output tile."""

    offs: str
    mask: str
    block: str


@dataclass
class EmitContext:
    """The epilogue of one generated kernel while its primitives are being emitted."""

    locals: dict[str, LocalType]
    tensors: dict[str, TensorInfo]
    params: list[Param]
    body: IndentedBuffer
    preamble: IndentedBuffer
    tma: bool = False  # whole tiles through TMA descriptors (the Hopper kernel's epilogue)
    _vars: dict[str, str] = field(default_factory=lambda: {"acc": ACC_VAR})
    _spaces: dict[object, Space] = field(default_factory=dict)
    _loads: dict[tuple, str] = field(default_factory=dict)

    # -- values ----------------------------------------------------------------------------------
    def var(self, name: str) -> str:
        """The Triton variable that holds epilogue value ``name``."""
        return self._vars[name]

    def define(self, name: str) -> str:
        """Name the Triton variable for a newly produced epilogue value."""
        self._vars[name] = f"v_{name}"
        return self._vars[name]

    def type_of(self, name: str) -> LocalType:
        return self.locals[name]

    def line(self, code: str) -> None:
        self.body.line(code)

    def comment(self, text: str) -> None:
        self.body.line(f"# {text}")

    # -- index spaces ----------------------------------------------------------------------------
    def rows(self) -> Space:
        if "rows" not in self._spaces:
            p = self.preamble
            p.line("offs_cm = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)")
            p.line("mask_cm = offs_cm < M")
            p.line("offs_cm64 = offs_cm.to(tl.int64)  # row offsets × stride can pass 2**31")
            self._spaces["rows"] = Space("offs_cm", "mask_cm", "BLOCK_SIZE_M")
        return self._spaces["rows"]

    def cols(self, scale: Fraction) -> Space:
        if scale not in self._spaces:
            suffix, start, block, extent = _SPACES[scale]
            offs, mask = f"offs_cn{suffix}", f"mask_cn{suffix}"
            self.preamble.line(f"{offs} = {start} + tl.arange(0, {block})")
            self.preamble.line(f"{mask} = {offs} < {extent}")
            self._spaces[scale] = Space(offs, mask, block)
        return self._spaces[scale]

    def block(self, scale: Fraction) -> str:
        """The constexpr width of this sub-tile in a column space."""
        return _SPACES[scale][2]

    def split_pairs(self, value: str, scale: Fraction, first: str, second: str) -> None:
        """Split a tile into its even and odd columns (adjacent pairs): two tiles half as wide."""
        shape = f"(BLOCK_SIZE_M, {self.block(scale)} // 2, 2)"
        self.line(f"{first}, {second} = tl.split(tl.reshape({value}, {shape}))")

    def join_pairs(self, first: str, second: str, scale: Fraction) -> str:
        """Interleave two tiles column by column into one of space ``scale`` (twice as wide)."""
        return f"tl.reshape(tl.join({first}, {second}), (BLOCK_SIZE_M, {self.block(scale)}))"

    def col_start(self, scale: Fraction) -> str:
        """The first column of this sub-tile in a column space, as kernel code."""
        return _SPACES[scale][1]

    def extent(self, scale: Fraction) -> str:
        """The number of columns of a column space, as kernel code (``N``, ``(N // 2)``, ...)."""
        return _SPACES[scale][3]

    def tile_mask(self, scale: Fraction) -> str:
        return f"{self.rows().mask}[:, None] & {self.cols(scale).mask}[None, :]"

    # -- kernel parameters -----------------------------------------------------------------------
    def _add(self, param: Param) -> str:
        same = next((p for p in self.params if p.name == param.name), None)
        if same is None:
            self.params.append(param)
        elif same != param:
            raise RuntimeError(f"codegen name collision: {same} and {param} are both {param.name}")
        return param.name

    @staticmethod
    def base(tensor: str) -> str:
        """Stem of the kernel names derived from a tensor: the name itself when that is safe,
        ``a_tensor``/``b_tensor`` for ``a``/``b`` (the operands own ``a_ptr``), else
        ``esc_<name>_`` (its prefix and trailing ``_`` keep it apart from every plain stem)."""
        if tensor in ("a", "b"):
            return f"{tensor}_tensor"
        return tensor if _plain(tensor) else f"esc_{tensor}_"

    def pointer(self, tensor: str) -> str:
        return self._add(Param(f"{self.base(tensor)}_ptr", "ptr", tensor))

    def stride(self, tensor: str, dim: int, axis: str) -> str:
        suffix = f"_{axis}" if axis else ""
        return self._add(Param(f"stride_{self.base(tensor)}{suffix}", "stride", tensor, dim))

    def shape(self, tensor: str, dim: int) -> str:
        """A kernel size parameter holding ``tensor.shape[dim]`` at launch."""
        return self._add(Param(f"{self.base(tensor)}_shape{dim}", "shape", tensor, dim))

    def descriptor(self, tensor: str, scale: Fraction) -> str:
        """A TMA descriptor of ``tensor`` whose block is one sub-tile in column space ``scale``."""
        block = ("BLOCK_SIZE_M", DESCRIPTOR_BLOCKS[scale])
        return self._add(Param(f"{self.base(tensor)}_desc", "desc", tensor, block=block))

    def tile_origin(self, scale: Fraction) -> str:
        """``[first row, first column]`` of this sub-tile in column space ``scale``."""
        return f"[pid_m * BLOCK_SIZE_M, {_SPACES[scale][1]}]"

    def size(self, expr: str, stem: str) -> str:
        """A kernel size parameter holding a size expression's value at launch."""
        return self._add(Param(f"{stem}_size", "size", expr=expr))

    # -- loads and stores ------------------------------------------------------------------------
    def tile_ptrs(self, tensor: str, scale: Fraction) -> str:
        _rows, cols = self.rows(), self.cols(scale)
        return (
            f"{self.pointer(tensor)} + offs_cm64[:, None] * {self.stride(tensor, 0, 'm')}"
            f" + {cols.offs}[None, :] * {self.stride(tensor, 1, 'n')}"
        )

    def _named_load(self, key: tuple, name: str, code: str) -> str:
        """Emit ``name = code`` once per epilogue (a tensor read twice is loaded once)."""
        if key not in self._loads:
            if name in self._loads.values():
                raise RuntimeError(f"codegen name collision: two loads named {name}")
            self.line(f"{name} = {code}")
            self._loads[key] = name
        return self._loads[key]

    def load_tile(self, tensor: str, scale: Fraction) -> str:
        """An fp32 tile of a program tensor at this output tile (zeros outside the edges)."""
        if self.tma:
            desc = self.descriptor(tensor, scale)
            code = f"{desc}.load({self.tile_origin(scale)}).to(tl.float32)"
            return self._named_load(("tile", tensor, scale), f"{self.base(tensor)}_tile", code)
        code = (
            f"tl.load({self.tile_ptrs(tensor, scale)}, mask={self.tile_mask(scale)}, other=0.0)"
            ".to(tl.float32)"
        )
        return self._named_load(("tile", tensor, scale), f"{self.base(tensor)}_tile", code)

    def load_row(self, tensor: str) -> str:
        """A length-M vector as an fp32 ``[BLOCK_SIZE_M, 1]`` column of this tile's rows."""
        rows = self.rows()
        ptrs = f"{self.pointer(tensor)} + {rows.offs} * {self.stride(tensor, 0, '')}"
        code = f"tl.load({ptrs}, mask={rows.mask}, other=0.0).to(tl.float32)[:, None]"
        return self._named_load(("row", tensor), f"{self.base(tensor)}_row", code)

    def load_col(self, tensor: str, scale: Fraction) -> str:
        """A length-N·scale vector as an fp32 ``[1, block]`` row of this tile's columns."""
        cols = self.cols(scale)
        ptrs = f"{self.pointer(tensor)} + {cols.offs} * {self.stride(tensor, 0, '')}"
        code = f"tl.load({ptrs}, mask={cols.mask}, other=0.0).to(tl.float32)[None, :]"
        return self._named_load(("col", tensor, scale), f"{self.base(tensor)}_col", code)

    def load_gather(
        self, tensor: str, cols: str, cols_mask: str, other: float, tag: str = ""
    ) -> str:
        """An fp32 ``[BLOCK_SIZE_M, len(cols)]`` tile of ``tensor[rows of this tile, cols]``.

        ``cols`` is a kernel expression of column indices (e.g. a per-pair frequency index into a
        cos table); lanes outside the rows or ``cols_mask`` read ``other``. ``tag`` tells apart
        the variables of two gathers of one tensor at different columns.
        """
        rows = self.rows()
        ptrs = (
            f"{self.pointer(tensor)} + offs_cm64[:, None] * {self.stride(tensor, 0, 'm')}"
            f" + ({cols})[None, :] * {self.stride(tensor, 1, 'n')}"
        )
        mask = f"{rows.mask}[:, None] & ({cols_mask})[None, :]"
        code = f"tl.load({ptrs}, mask={mask}, other={other!r}).to(tl.float32)"
        name = f"{self.base(tensor)}_gather{tag}"
        return self._named_load(("gather", tensor, cols), name, code)

    def store_tile(self, tensor: str, value: str, scale: Fraction, *, accumulate: bool) -> None:
        """Store a tile, cast to the destination's dtype; ``accumulate`` adds to what is there."""
        if self.tma and not accumulate:
            desc = self.descriptor(tensor, scale)
            self.line(f"{desc}.store({self.tile_origin(scale)}, ({value}).to({desc}.dtype))")
            return
        self.rows()
        ptrs, mask = f"{self.base(tensor)}_ptrs", self.tile_mask(scale)
        self.line(f"{ptrs} = {self.tile_ptrs(tensor, scale)}")
        if accumulate:
            value = f"tl.load({ptrs}, mask={mask}, other=0.0).to(tl.float32) + {value}"
        self.line(
            f"tl.store({ptrs}, ({value}).to({self.pointer(tensor)}.dtype.element_ty), mask={mask})"
        )

    def store_partials(self, tensor: str, values: str, axis: str, scale: Fraction) -> None:
        """Store a tile's partial reduction into its slot of a partials buffer.

        ``axis="row"``: one value per row, into column ``start_n // EPI_N`` (this sub-tile's) of
        ``[M, ⌈N/EPI_N⌉]``; ``axis="col"``: one value per column, into column ``pid_m`` of
        ``[W, ⌈M/BLOCK_SIZE_M⌉]``. A sub-tile wholly past the last column (the second half of a
        ragged last tile) has no slot and stores nothing — by its mask, not an ``if``: Triton 3.6
        cannot flatten a persistent loop around a conditional store (``TritonGPUFuseNestedLoops``
        fails; seen on the H200), and the condition is broadcast to the row tensor because a
        scalar bool in a mask breaks the interpreter.
        """
        rows = self.rows()
        if axis == "row":
            inside = f"({rows.offs} * 0 + start_n < N)"
            index, slot, mask = "offs_cm64", "(start_n // EPI_N)", f"{rows.mask} & {inside}"
        else:
            cols = self.cols(scale)
            index, slot, mask = f"{cols.offs}.to(tl.int64)", "pid_m", cols.mask
        ptrs = (
            f"{self.pointer(tensor)} + {index} * {self.stride(tensor, 0, 'm')}"
            f" + {slot} * {self.stride(tensor, 1, 'n')}"
        )
        self.line(f"tl.store({ptrs}, {values}, mask={mask})")
