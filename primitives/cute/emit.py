"""Generate a fused GEMM step's epilogue as a CuTe DSL module on QuACK's Hopper GEMM.

``generate(step, gemm, dtypes)`` walks the step's epilogue and asks each op for its CuTe lines
(``EpilogueOp.emit_cute``, beside the op's Triton ``emit``); an op, a value or a dtype this
backend does not cover raises ``CuteUnsupported`` with the reason, and the step stays on Triton.
The result is the text of a module defining ``Epilogue`` (``cute/epilogue.py`` says what it
stands on) plus what the launcher needs to bind tensors to it. Generation is plain text work: it
needs neither the CuTe DSL nor a GPU, so its tests run anywhere.

How values live in registers. The accumulator fragment ``tRS_rD`` holds some elements of the
current output sub-tile; the generated ``epi_visit_subtile`` runs one straight-line loop over
them, each epilogue value a float32 scalar per element. A value as wide as the accumulator
(scale 1) is one scalar ``v_<name>``; a value twice as wide (scale 2: ``[g, u]`` pairs
interleaved) is two, ``p0_<name>`` and ``p1_<name>``, the pair's members — the pair of output
columns ``(2k, 2k+1)`` sits over accumulator column ``k``. Such a tensor moves through TMA as
32-bit words, each one pair of 16-bit values (QuACK's gated GEMMs do the same). Row vectors
(one value per row, ``[M]``) and column vectors (``[N]``) come in as fragments laid out like the
accumulator, so element ``i`` of each lines up.

A step that contracts the accumulator's own column pairs (``swiglu``, ``split_pairs`` or a 2→1
``pairwise`` of ``acc``: a fused gate/up GEMM) loops over pairs instead
(``CuteEmitContext.halves``): element ``i`` is accumulator columns ``(2i, 2i+1)``, an
accumulator-wide value is two scalars and a half-wide one (``[M, N/2]``) one. A half-wide tensor
is stored through its own TMA store with an epilogue tile half as wide, as QuACK's gated GEMM
stores its activation.

Partial sums mask the elements past the output's edge only where the tile crosses it: the loop is
generated twice, and a tile that lies wholly inside the output takes the copy without masks.

Everything generated from a Program is structural: value names are validated identifiers and
get a prefix, expressions are re-printed from their parsed trees (``expr.Expr.to_cute``), dtypes
and sizes come from a fixed table — no text of the Program reaches the module as written.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, NoReturn

import torch

from .. import expr as expr_lang

if TYPE_CHECKING:
    from ..analysis import GemmInfo
    from ..ir import GemmEpilogue

# The element types the generated code names, by torch dtype.
CUTE_DTYPES = {
    torch.bfloat16: "BFloat16",
    torch.float16: "Float16",
    torch.float32: "Float32",
}
_PAIR_DTYPES = (torch.bfloat16, torch.float16)  # a pair of these is one 32-bit word
_REDUCE_KINDS = {"sum": "{v}", "sumsq": "{v} * {v}"}


class CuteUnsupported(Exception):
    """This step cannot run on the CuTe backend; ``str(e)`` says why (it runs on Triton)."""


@dataclass(frozen=True)
class Binding:
    """One QuACK epilogue op of the generated class and the program tensor it binds.

    ``kind``: ``tile`` (TMA tile load), ``store`` (TMA tile store; the first store of the step is
    the GEMM's own output D), ``row`` / ``col`` (per-row ``[M]`` / per-column ``[N]`` vector
    load), ``row_partials`` / ``col_partials`` (per-tile partial sums ``[M, ⌈N/tile_n⌉]`` /
    ``[N, ⌈M/tile_m⌉]``). ``pairs``: the tensor is twice the accumulator's width and moves as
    32-bit words; ``half``: a store half the accumulator's width.
    """

    kind: str
    op: str  # the op's name in the class (``EpilogueArguments`` field)
    tensor: str
    pairs: bool = False
    half: bool = False  # a tile store half the accumulator's width (``[M, N/2]``)


@dataclass(frozen=True)
class CuteSource:
    """A generated module and how to bind a step's tensors to it."""

    step: str
    text: str
    bindings: tuple[Binding, ...]
    output: str | None  # the tensor written as D (None: the step stores nothing tile-wide)
    output_pairs: bool
    uses_coords: bool

    @functools.cached_property
    def key(self) -> str:
        """The module's name suffix: a digest of its text (looked up on every launch)."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class MaskedSum:
    """A body line adding ``terms`` to partial-sum fragment ``target``: masked by the edge
    ``edge`` (``m`` or ``n``) in the loop for tiles crossing it, plain in the other."""

    target: str
    terms: str
    edge: str

    def line(self, masked: bool) -> str:
        terms = f"F.where(inside_{self.edge}, {self.terms}, 0.0)" if masked else self.terms
        return f"{self.target} = {self.target} + {terms}"


@dataclass
class CuteEmitContext:
    """What an op's ``emit_cute`` writes through: values, bindings, and the loop's lines."""

    gemm: GemmInfo
    dtypes: dict[str, torch.dtype]  # program tensor -> its dtype at this call
    halves: bool = False  # the loop runs over accumulator column pairs (module docstring)
    body: list[str | MaskedSum] = field(default_factory=list)  # inside the per-element loop
    setup: list[str] = field(default_factory=list)  # before the loop
    finish: list[str] = field(default_factory=list)  # after the loop
    bindings: list[Binding] = field(default_factory=list)
    values: dict[str, list[str]] = field(default_factory=lambda: {"acc": ["acc"]})
    stores: list[str] = field(default_factory=list)  # aux outputs' fragments, in binding order
    output: tuple[str, bool] | None = None
    edges: set[str] = field(default_factory=set)  # the output edges a reduction masks: m, n
    pair_layout: bool = False

    # -- values ------------------------------------------------------------------------------
    def scale(self, name: str) -> Fraction:
        return self.gemm.locals[name].scale if name != "acc" else Fraction(1)

    @property
    def uses_coords(self) -> bool:
        """Whether the loop reads its elements' coordinates (to mask an edge)."""
        return bool(self.edges)

    @property
    def index(self) -> str:
        """The index, in a fragment laid out like the accumulator, of the loop's element (of
        its pair's first member when looping over pairs)."""
        return "2 * i" if self.halves else "i"

    @property
    def unit(self) -> Fraction:
        """The width of a value that is one scalar at the loop's element."""
        return Fraction(1, 2) if self.halves else Fraction(1)

    def kind(self, name: str) -> str:
        return self.gemm.locals[name].kind if name != "acc" else "tile"

    def parts(self, name: str) -> list[str]:
        """The scalar(s) of value ``name`` at the loop's element: one, or a pair's two."""
        return self.values[name]

    def part(self, name: str, member: int) -> str:
        """Member ``member`` of ``name`` where a pair-wide value is being computed: a pair-wide
        value's own member, a narrower (row-vector) value itself."""
        parts = self.values[name]
        return parts[member] if len(parts) == 2 else parts[0]

    def define(self, name: str, parts: list[str]) -> None:
        """Value ``name`` is ``parts`` (one scalar's code, or a pair's two). Generated names are
        a prefix per kind and member plus the Program's name, so no two can meet."""
        names = [f"v_{name}"] if len(parts) == 1 else [f"p{k}_{name}" for k in range(len(parts))]
        for var, code in zip(names, parts, strict=True):
            self.body.append(f"{var} = {code}")
        self.values[name] = names

    def width(self, name: str) -> int:
        """How many scalars value ``name`` has at the loop's element: 1, or 2 for a value twice
        the loop's unit (a pair-wide tile; the accumulator itself when looping over pairs)."""
        if self.kind(name) == "row":
            return 1
        relative = self.scale(name) / self.unit
        if relative in (1, 2):
            return int(relative)
        raise CuteUnsupported(
            f"value {name!r} is {self.gemm.locals[name].describe()}; the CuTe backend handles "
            "values as wide as the accumulator or twice as wide, or half as wide next to a "
            "contraction of the accumulator's own pairs"
        )

    def refuse(self, why: str) -> NoReturn:
        """Keep this step on Triton, saying why (``CuteUnsupported``)."""
        raise CuteUnsupported(why)

    def expression(self, source: str, var) -> str:
        return expr_lang.parse(source).to_cute(var)

    # -- bindings ------------------------------------------------------------------------------
    def _bind(
        self, kind: str, prefix: str, tensor: str, pairs: bool = False, half: bool = False
    ) -> str:
        for b in self.bindings:
            if b.kind == kind and b.tensor == tensor:
                return b.op
        op = f"{prefix}_{tensor}"
        self.bindings.append(Binding(kind, op, tensor, pairs, half))
        return op

    def _dtype(self, tensor: str) -> torch.dtype:
        dtype = self.dtypes[tensor]
        if dtype not in CUTE_DTYPES:
            raise CuteUnsupported(
                f"tensor {tensor!r} is {dtype}; the CuTe backend moves 16/32-bit floats"
            )
        return dtype

    def tile(self, tensor: str, scale: Fraction) -> list[str]:
        """Load ``tensor``'s block of this sub-tile (TMA); its scalar(s) at the loop's element."""
        dtype = self._dtype(tensor)
        if scale not in (1, 2) or (self.halves and scale != 1):
            raise CuteUnsupported(
                f"tile {tensor!r} is {scale}× the accumulator's width; the CuTe backend loads "
                "tiles as wide as the accumulator, or twice as wide where no pair of the "
                "accumulator is contracted"
            )
        pairs = scale == 2
        if pairs and dtype not in _PAIR_DTYPES:
            raise CuteUnsupported(f"pair-wide tile {tensor!r} is {dtype}; pairs move as 16-bit")
        first = not any(b.kind == "tile" and b.tensor == tensor for b in self.bindings)
        op = self._bind("tile", "t", tensor, pairs)
        if first:
            loaded = f"E[{op!r}]"
            if pairs:  # 32-bit words, each a pair of 16-bit values
                self.pair_layout = True
                self.setup.append(
                    f"l16_{tensor} = cute.recast_tensor({loaded}, {CUTE_DTYPES[dtype]})"
                )
                loaded = f"l16_{tensor}"
            self.setup += [
                f"l_{tensor} = cute.make_rmem_tensor({loaded}.layout, Float32)",
                f"l_{tensor}.store({loaded}.load().to(Float32))",
            ]
            if pairs:
                self.setup += _members(
                    f"l_{tensor}", f"lp_{tensor}", f"l0_{tensor}", f"l1_{tensor}"
                )
        if pairs:
            return [f"l0_{tensor}[i]", f"l1_{tensor}[i]"]
        if self.halves:
            return [f"l_{tensor}[2 * i]", f"l_{tensor}[2 * i + 1]"]
        return [f"l_{tensor}[i]"]

    def vector(self, vector: str, axis: str) -> str:
        """A row (``[M]``) or column (``[N]``) vector's value at the loop's element."""
        self._dtype(vector)
        if self.halves and axis == "col":
            raise CuteUnsupported(
                f"column vector {vector!r} next to a contraction of the accumulator's pairs"
            )
        first = not any(b.kind == axis and b.tensor == vector for b in self.bindings)
        op = self._bind(axis, "wr" if axis == "row" else "wc", vector)
        if first:
            self.setup.append(f"{op} = E[{op!r}]")
        return f"{op}[{self.index}]"  # looping over pairs: a row's value at the first member

    def reduce(self, to: str, axis: str, kind: str, parts: list[str]) -> None:
        """Add this element's contribution to ``to``'s per-tile partial sum. Elements past the
        reduced axis's edge add nothing; past the other edge they need no mask, as QuACK writes
        no partial there (a row partial of a row past M, a column partial of a column past N)."""
        if kind not in _REDUCE_KINDS:
            raise CuteUnsupported(
                f"partial_reduce kind {kind!r} (the CuTe backend sums: sum, sumsq)"
            )
        if axis == "col" and len(parts) != 1:
            raise CuteUnsupported("a column reduction of a pair-wide value")
        if axis == "col" and self.halves:
            raise CuteUnsupported("a column reduction next to a contraction of the accumulator")
        op = self._bind(f"{axis}_partials", "r", to)
        edge = "n" if axis == "row" else "m"  # a row's partial sums columns: mask past N
        self.edges.add(edge)
        terms = " + ".join(_REDUCE_KINDS[kind].format(v=p) for p in parts)
        self.setup.append(f"{op} = E[{op!r}]")
        self.body.append(MaskedSum(f"{op}[{self.index}]", terms, edge))

    def store(self, to: str, parts: list[str]) -> None:
        """Write value ``parts`` to program tensor ``to`` (rounded once to its dtype)."""
        if self.halves:
            self._store_by_pairs(to, parts)
            return
        dtype = self._dtype(to)
        pairs = len(parts) == 2
        if pairs and dtype not in _PAIR_DTYPES:
            raise CuteUnsupported(f"pair-wide store {to!r} is {dtype}; pairs move as 16-bit")
        cute_dtype = CUTE_DTYPES[dtype]
        if self.output is None:
            self.output = (to, pairs)
            if not pairs:
                self.body.append(f"tRS_rD[i] = {parts[0]}")
                return
            self._pair_fragment(to, parts, cute_dtype)
            self.finish.append(f"tRS_rD.store(cute.recast_tensor(o16_{to}, Float32).load())")
            return
        self._bind("store", "s", to, pairs)
        if pairs:
            self._pair_fragment(to, parts, cute_dtype)
            self.finish += [
                f"oo_{to} = cute.make_rmem_tensor(tRS_rD.layout.shape, Float32)",
                f"oo_{to}.store(cute.recast_tensor(o16_{to}, Float32).load())",
            ]
            self.stores.append(f"oo_{to}")
            return
        self.setup.append(f"o_{to} = cute.make_rmem_tensor(tRS_rD.layout.shape, Float32)")
        self.body.append(f"o_{to}[i] = {parts[0]}")
        self.stores.append(f"o_{to}")

    def _store_by_pairs(self, to: str, parts: list[str]) -> None:
        """``store`` where the loop runs over accumulator pairs: an accumulator-wide value is
        written member by member (the first such store is the GEMM's output D, over the
        accumulator's own fragment), a half-wide one (16-bit) through a half-width store."""
        dtype = self._dtype(to)
        if len(parts) == 2:
            fragment = "tRS_rD"  # the first accumulator-wide store is the GEMM's output D
            if self.output is None:
                self.output = (to, False)
            else:
                fragment = f"o_{to}"
                self._bind("store", "s", to)
                self.setup.append(
                    f"{fragment} = cute.make_rmem_tensor(tRS_rD.layout.shape, Float32)"
                )
                self.stores.append(fragment)
            self.body += [f"{fragment}[2 * i] = {parts[0]}", f"{fragment}[2 * i + 1] = {parts[1]}"]
            return
        if dtype not in _PAIR_DTYPES:
            raise CuteUnsupported(f"half-wide store {to!r} is {dtype}; it must be 16-bit")
        self._bind("store", "s", to, half=True)
        self.setup.append(
            f"o_{to} = cute.make_rmem_tensor(cute.recast_layout(2, 1, tRS_rD.layout).shape, "
            "Float32)"
        )
        self.body.append(f"o_{to}[i] = {parts[0]}")
        self.stores.append(f"o_{to}")

    def _pair_fragment(self, to: str, parts: list[str], cute_dtype: str) -> None:
        """Pair members written element by element into ``o_<to>``, then rounded to 16 bits
        as ``o16_<to>`` (two to a 32-bit word) after the loop."""
        self.pair_layout = True
        self.setup.append(f"o_{to} = cute.make_rmem_tensor(pair_layout, Float32)")
        self.setup += _members(f"o_{to}", f"op_{to}", f"o0_{to}", f"o1_{to}")
        self.body += [f"o0_{to}[i] = {parts[0]}", f"o1_{to}[i] = {parts[1]}"]
        self.finish += [
            f"o16_{to} = cute.make_rmem_tensor(o_{to}.layout, {cute_dtype})",
            f"o16_{to}.store(o_{to}.load().to({cute_dtype}))",
        ]


def generate(step: GemmEpilogue, gemm: GemmInfo, dtypes: dict[str, torch.dtype]) -> CuteSource:
    """The CuTe module of fused step ``step`` (analysed as ``gemm``) for tensors of ``dtypes``;
    raises ``CuteUnsupported`` naming what keeps it on Triton."""
    if gemm.accumulates:
        raise CuteUnsupported("a store that accumulates into an earlier step's tensor")
    halves = any(v.scale == Fraction(1, 2) for v in gemm.locals.values())
    ctx = CuteEmitContext(gemm, dtypes, halves=halves)
    if halves:
        ctx.values["acc"] = ["p0_acc", "p1_acc"]
    for op in step.epilogue:
        op.emit_cute(ctx)
    return CuteSource(
        step=gemm.name,
        text=_module(step, gemm, ctx),
        bindings=tuple(ctx.bindings),
        output=ctx.output[0] if ctx.output else None,
        output_pairs=bool(ctx.output and ctx.output[1]),
        uses_coords=ctx.uses_coords,
    )


def _members(fragment: str, view: str, first: str, second: str) -> list[str]:
    """Lines naming the two members of each pair of ``fragment``'s elements (adjacent columns:
    the accumulator fragment's innermost mode)."""
    return [
        f"{view} = cute.flat_divide({fragment}, cute.make_layout(2))",
        f"{first}, {second} = {view}[0, None], {view}[1, None]",
    ]


_OP_CLASSES = {
    "tile": "TileLoad",
    "store": "TypedTileStore",
    "row": "ColVecLoad",  # QuACK's "column vector" runs along M: one value per row
    "col": "RowVecLoad",
    "row_partials": "ColVecReduce",
    "col_partials": "RowVecReduce",
}


def _module(step: GemmEpilogue, gemm: GemmInfo, ctx: CuteEmitContext) -> str:
    ops = [f"        {_op_class(b)}," for b in ctx.bindings]
    fields = [f"        {b.op}: cute.Tensor" for b in ctx.bindings]
    if ctx.uses_coords:
        ops += [
            '        Scalar("m_bound", dtype=Int32),',
            '        Scalar("n_bound", dtype=Int32),',
        ]
        fields += ["        m_bound: Int32", "        n_bound: Int32"]
    setup = ["E = epi_loop_tensors"]
    if ctx.pair_layout:
        setup.append("pair_layout = cute.recast_tensor(tRS_rD, BFloat16).layout")
    if ctx.uses_coords:
        setup += ["coords = E[COORDS]", 'm_bound = E["m_bound"]', 'n_bound = E["n_bound"]']
    setup += ctx.setup
    returned = "".join(f"{frag}, " for frag in ctx.stores)
    if ctx.edges:
        inside = " & ".join(f"F.tile_inside_{e}(coords, {e}_bound)" for e in sorted(ctx.edges))
        loops = [
            f"if {inside}:  # the whole tile lies inside the output: nothing to mask",
            *_loop(ctx, masked=False, indent="    "),
            "else:",
            *_loop(ctx, masked=True, indent="    "),
        ]
    else:
        loops = _loop(ctx, masked=False)
    lines = [
        f'"""Step {gemm.name!r}: its epilogue on QuACK\'s Hopper GEMM (CuTe DSL), generated by',
        'coda from the Program; do not edit."""',
        "",
        "from typing import NamedTuple",
        "",
        "import cutlass",
        "import cutlass.cute as cute",
        "from cutlass import BFloat16, Float16, Float32, Int32",
        "from quack.cute_dsl_utils import mlir_namedtuple",
        "",
        "from coda.primitives.cute.epilogue import (",
        "    COORDS, F, HALF_WIDTH, CodaEpilogue, ColVecLoad, ColVecReduce, GemmSm90, RowVecLoad,",
        "    RowVecReduce, Scalar, TileLoad, TypedTileStore,",
        ")",
        "",
        "",
        "class Epilogue(CodaEpilogue, GemmSm90):",
        f"    uses_coords = {ctx.uses_coords}",
        "    _epi_ops = (",
        *ops,
        "    )",
        "",
        "    @mlir_namedtuple",
        "    class EpilogueArguments(NamedTuple):",
        *(fields or ["        pass"]),
        "",
        "    @cute.jit",
        "    def epi_visit_subtile(self, params, epi_loop_tensors, tRS_rD, tRS_rC=None):",
        *(f"        {line}" for line in setup),
        *(f"        {line}" for line in loops),
        *(f"        {line}" for line in ctx.finish),
        f"        return ({returned})",
        "",
    ]
    return "\n".join(lines)


def _op_class(b: Binding) -> str:
    if b.half:
        return f'{_OP_CLASSES[b.kind]}("{b.op}", epi_tile_fn=HALF_WIDTH)'
    return f'{_OP_CLASSES[b.kind]}("{b.op}")'


def _loop(ctx: CuteEmitContext, masked: bool, indent: str = "") -> list[str]:
    """The per-element loop: over fragment elements, or over their pairs (``ctx.halves``); with
    ``masked``, partial sums leave out the elements past the output's edges."""
    count = "cute.size(tRS_rD) // 2" if ctx.halves else "cute.size(tRS_rD)"
    acc = "p0_acc, p1_acc = tRS_rD[2 * i], tRS_rD[2 * i + 1]"
    body = [acc if ctx.halves else "acc = tRS_rD[i]"]
    if masked:
        body += [
            f"inside_{e} = F.inside_{e}(coords, {ctx.index}, {e}_bound)" for e in sorted(ctx.edges)
        ]
    body += [line.line(masked) if isinstance(line, MaskedSum) else line for line in ctx.body]
    return [
        f"{indent}for i in cutlass.range({count}, unroll_full=True):",
        *(f"{indent}    {line}" for line in body),
    ]
