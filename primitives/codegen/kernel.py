"""Generate one readable Triton module per ``GemmEpilogue``: mainloops + one spliced epilogue.

Passes, each pure: ``plan_epilogue`` (emit every primitive into a context: lines, parameters, index
spaces) → ``_render_*`` (module text). The module reads like Triton's persistent-matmul tutorial and
holds, in order:

* ``_compute_pid`` — grouped tile ordering;
* ``_<step>_epilogue`` — the primitives, one ``# --- <primitive>(...) ---`` banner each, on one
  ``BLOCK_SIZE_M × EPI_N`` sub-tile of the fp32 accumulator;
* ``_<step>_epilogue_tile`` — splits the accumulator into ``EPILOGUE_SUBTILES`` column sub-tiles
  (fewer live registers per step of the epilogue) and runs the epilogue on each;
* ``<step>_kernel`` — the Hopper mainloop: persistent over output tiles, operands through TMA tensor
  descriptors (out-of-bounds tiles zero-filled by the copy engine, so ragged sizes need no masks),
  and the epilogue's whole tiles too (``_<step>_epilogue_tma``: loads and stores of ``[M, W]``
  tensors as bulk copies, not per-thread addresses);
* ``<step>_kernel_tma_mainloop`` — the same with the pointer epilogue, for epilogue tensors TMA
  cannot describe (only generated when the epilogue moves tiles);
* ``<step>_kernel_ptr`` — the same loop with pointer loads, for operands TMA cannot describe (last
  stride not 1, strides not 16-byte aligned), GPUs before Hopper, and Triton without descriptors.

Epilogues that reduce across the tile (partial reductions, column selects) run on the same
``tl.split`` sub-tiles as the rest: each sub-tile writes its own slot of row partials. (From
2026-11-29 to 2026-11-30 they ran on *split accumulators* — one per column slice, B loaded slice by
slice — after reductions of ``tl.split`` sub-tiles computed wrong values on an H200 under Triton
3.6; the ``split_reductions`` experiment of bench/RESULTS.md, run 2026-11-30e, found them right
under every config tried and never slower — up to 1.9× faster — flattened and warp-specialized
loops included. Tuning still checks every winning config's outputs against the reference
executor.)

It imports nothing but triton, so a person can run or edit it alone. Set ``CODA_DEBUG_CODEGEN=1`` to
print each generated module.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass

import triton

from ..analysis import GemmInfo
from ..builder import gemm_to_python
from ..ir import GemmEpilogue
from ..settings import current
from .context import EmitContext, Param
from .emitter import IndentedBuffer

GENERATOR_VERSION = "8"

# The Hopper kernels' operand descriptors; every other descriptor is a tile of the epilogue.
OPERAND_DESCRIPTORS = ("a_desc", "b_desc")

_COMPUTE_PID = """\
@triton.jit
def _compute_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M: tl.constexpr):
    # Grouped ordering: GROUP_SIZE_M row-tiles advance together along N, so the B tiles they
    # share stay in L2.
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n
"""

# Every kernel starts alike: the tile grid, then (after {setup}) the persistent walk over tiles.
_GRID = """\
start_pid = tl.program_id(axis=0)
num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
num_tiles = num_pid_m * num_pid_n
num_pid_in_group = GROUP_SIZE_M * num_pid_n
"""
_WALK = """\
{setup}
# Persistent: each program walks output tiles start_pid, start_pid + NUM_PROGRAMS, ...
# (one or two programs per SM: MainloopConfig.programs_per_sm)
for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN,
                       warp_specialize=WARP_SPECIALIZE):
    pid_m, pid_n = _compute_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
"""

# The persistent tile loop shared by both mainloops; {loads} fills the K loop's body.
_TILE_LOOP = (
    _GRID
    + _WALK
    + """\
    # --- mainloop: accumulator = A[rows of the tile, :] @ B[:, columns of the tile], fp32 ---
{tile_setup}
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for ki in range(0, k_tiles):
{loads}
        accumulator = tl.dot(a, b, accumulator, input_precision=INPUT_PRECISION)
{advance}
    # --- epilogue ---
    {epilogue_tile}(accumulator, pid_m, pid_n, {epilogue_args}, {tile_meta})
"""
)

_META = [
    "BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,",
    "GROUP_SIZE_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, INPUT_PRECISION: tl.constexpr,",
    "EPILOGUE_SUBTILES: tl.constexpr, EPI_N: tl.constexpr,  # EPI_N = BLOCK_SIZE_N // SUBTILES",
    "FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,",
]

# The numbers of column sub-tiles an epilogue can run on (``MainloopConfig.epilogue_subtiles``).
SUBTILE_COUNTS = (1, 2, 4, 8)


def _subtiles_body(epi: str, args: str) -> str:
    """The body of ``_<step>_epilogue_tile``: one branch per sub-tile count (a constexpr, so one
    survives compilation). Each level of splitting halves every piece of the level before —
    ``tl.reshape`` to ``(rows, 2, width / 2)``, ``tl.permute`` the 2 last, ``tl.split`` — as
    Triton's persistent-matmul tutorial does; piece ``acc_01`` is the second quarter. The epilogue
    then runs on the pieces left to right, each with its own first column."""
    out = [
        "# Split the BLOCK_SIZE_M × BLOCK_SIZE_N accumulator into column sub-tiles, epilogue on "
        "each.",
        "start_n = pid_n * BLOCK_SIZE_N",
    ]
    for count in SUBTILE_COUNTS:
        if count == SUBTILE_COUNTS[0]:
            out.append(f"if EPILOGUE_SUBTILES == {count}:")
        elif count != SUBTILE_COUNTS[-1]:
            out.append(f"elif EPILOGUE_SUBTILES == {count}:")
        else:
            allowed = ", ".join(map(str, SUBTILE_COUNTS[:-1])) + f" or {count}"
            out.append("else:")
            out.append(
                f"    tl.static_assert(EPILOGUE_SUBTILES == {count}, "
                f'"EPILOGUE_SUBTILES must be {allowed}")'
            )
        pieces = ["accumulator"]
        width = 1
        while len(pieces) < count:
            width *= 2
            halves = []
            for piece in pieces:
                stem = "acc_" if piece == "accumulator" else piece
                out.append(
                    f"    pair = tl.permute(tl.reshape({piece}, (BLOCK_SIZE_M, 2, "
                    f"BLOCK_SIZE_N // {width})), (0, 2, 1))"
                )
                out.append(f"    {stem}0, {stem}1 = tl.split(pair)")
                halves += [f"{stem}0", f"{stem}1"]
            pieces = halves
        epi_n = "BLOCK_SIZE_N" if count == 1 else f"BLOCK_SIZE_N // {count}"
        for k, piece in enumerate(pieces):
            first = ["start_n", f"start_n + {epi_n}"][k] if k < 2 else f"start_n + {k} * ({epi_n})"
            out.append(f"    {epi}({piece}, pid_m, {first}, {args}, BLOCK_SIZE_M, {epi_n})")
    return "\n".join(out)


@dataclass(frozen=True)
class KernelVariant:
    """One launchable kernel of a module and how to fill its parameters, in order."""

    function: str
    params: tuple[Param, ...]


@dataclass(frozen=True)
class KernelSource:
    """A generated module: its text and its kernels (``tma`` and ``pointer`` mainloops)."""

    step: str
    source: str
    variants: dict[str, KernelVariant]

    @property
    def digest(self) -> str:
        key = f"{GENERATOR_VERSION}\0{triton.__version__}\0{self.source}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]


def plan_epilogue(
    step: GemmEpilogue, gemm: GemmInfo, tensors: dict, *, tma: bool = False
) -> EmitContext:
    """Emit every epilogue op into a fresh context (lines, parameters, index spaces); ``tma``:
    tiles through TMA descriptors (the Hopper kernel's epilogue)."""
    ctx = EmitContext(gemm.locals, tensors, [], IndentedBuffer(), IndentedBuffer(), tma=tma)
    if not tma:
        ctx.rows()  # pointer epilogues mask by row; the TMA one defines rows where they are used
    for op in step.epilogue:
        ctx.comment(f"--- {op.describe()} ---")
        op.emit(ctx)
    return ctx


def order_params(params: list[Param]) -> tuple[Param, ...]:
    """Signature order: descriptors, pointers, sizes (GEMM sizes, tensor shapes, size
    expressions), strides."""
    rank = {"desc": 0, "ptr": 1, "size": 2, "shape": 2, "stride": 3}
    return tuple(sorted(params, key=lambda p: rank[p.kind]))


def _epilogue_params(ctx: EmitContext) -> tuple[Param, ...]:
    return order_params([*ctx.params, Param("M", "size"), Param("N", "size")])


def _signature(buf: IndentedBuffer, params: tuple[Param, ...], meta: list[str]) -> None:
    """Parameters in launch order (``order_params``), grouped under one comment per kind."""
    titles = {
        "desc": "# TMA descriptors",
        "ptr": "# pointers",
        "size": "# sizes",
        "shape": "# sizes",
        "stride": "# strides",
    }
    with buf.indent():
        for title in dict.fromkeys(titles.values()):
            names = [p.name for p in params if titles[p.kind] == title]
            if names:
                buf.line(title)
                for i in range(0, len(names), 6):
                    buf.line(", ".join(names[i : i + 6]) + ",")
        buf.line("# meta-parameters")
        for line in meta:
            buf.line(line)
    buf.line("):")


def _names(params: tuple[Param, ...]) -> str:
    return ", ".join(p.name for p in params)


def _wrap_calls(text: str, width: int = 96) -> str:
    """Break long lines of generated code after the commas of their outermost call's arguments
    (not inside brackets), with a hanging indent; a line with no such comma stays as it is."""
    out = []
    for line in text.split("\n"):
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        parens = brackets = 0
        cuts = []
        for i, ch in enumerate(line):
            parens += (ch == "(") - (ch == ")")
            brackets += (ch == "[") - (ch == "]")
            if ch == "," and parens == 1 and not brackets and line[i + 1 : i + 2] == " ":
                cuts.append(i)
        start = 0  # where the current output line begins in `line`
        prefix = ""
        while len(prefix) + len(line) - start > width:
            fits = [c for c in cuts if c > start and len(prefix) + c + 1 - start <= width]
            if not fits:
                break
            out.append(prefix + line[start : fits[-1] + 1])
            start, prefix = fits[-1] + 2, indent
        out.append(prefix + line[start:])
    return "\n".join(out)


def _render_epilogue(
    buf: IndentedBuffer,
    function: str,
    ctx: EmitContext,
    params: tuple[Param, ...],
) -> None:
    """The epilogue on one sub-tile, and the function that splits a whole accumulator into
    sub-tiles for it."""
    buf.line("@triton.jit")
    buf.line(f"def {function}(")
    with buf.indent():
        buf.line("accumulator, pid_m, start_n,")
    _signature(buf, params, ["BLOCK_SIZE_M: tl.constexpr, EPI_N: tl.constexpr,"])
    with buf.indent():
        buf.line("# This sub-tile: rows of block pid_m; columns [start_n, start_n + EPI_N) of N.")
        buf.extend(_reindent(ctx.preamble, buf.level, buf.width))
        buf.extend(_reindent(ctx.body, buf.level, buf.width))
    buf.line("")
    buf.line("")
    buf.line("@triton.jit")
    buf.line(f"def {function}_tile(")
    with buf.indent():
        buf.line("accumulator, pid_m, pid_n,")
    _signature(
        buf,
        params,
        [
            "BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,",
            "EPILOGUE_SUBTILES: tl.constexpr,",
        ],
    )
    with buf.indent():
        buf.line(_wrap_calls(_subtiles_body(function, _names(params))))


def _operand_dims(step: GemmEpilogue) -> tuple[tuple[int, int], tuple[int, int]]:
    """Which stored dim walks (M, K) of A and (K, N) of B."""
    a_dims = (1, 0) if step.a.transpose else (0, 1)
    b_dims = (1, 0) if step.b.transpose else (0, 1)
    return a_dims, b_dims


def _tma_variant(step: GemmEpilogue, epi: tuple[Param, ...]) -> tuple[tuple[Param, ...], dict]:
    # A descriptor describes the operand as stored (its last dim contiguous); a transposed operand
    # is loaded in its stored orientation and transposed in registers/shared memory with `.T`.
    a_block = (
        ("BLOCK_SIZE_K", "BLOCK_SIZE_M") if step.a.transpose else ("BLOCK_SIZE_M", "BLOCK_SIZE_K")
    )
    b_block = (
        ("BLOCK_SIZE_N", "BLOCK_SIZE_K") if step.b.transpose else ("BLOCK_SIZE_K", "BLOCK_SIZE_N")
    )
    a_load = (
        "a_desc.load([offs_k, offs_am]).T" if step.a.transpose else "a_desc.load([offs_am, offs_k])"
    )
    b_load = (
        "b_desc.load([offs_bn, offs_k]).T" if step.b.transpose else "b_desc.load([offs_k, offs_bn])"
    )

    params = order_params(
        [
            Param(OPERAND_DESCRIPTORS[0], "desc", step.a.tensor, block=a_block),
            Param(OPERAND_DESCRIPTORS[1], "desc", step.b.tensor, block=b_block),
            *epi,
            Param("K", "size"),
        ]
    )
    parts = {
        "setup": "",
        "tile_setup": "    offs_am = pid_m * BLOCK_SIZE_M\n    offs_bn = pid_n * BLOCK_SIZE_N",
        "advance": "",
    }
    parts["loads"] = (
        f"        offs_k = ki * BLOCK_SIZE_K\n        a = {a_load}\n"
        f"        b = {b_load}  # [BLOCK_SIZE_K, BLOCK_SIZE_N]"
    )
    return params, parts


def _pointer_variant(step: GemmEpilogue, epi: tuple[Param, ...]) -> tuple[tuple[Param, ...], dict]:
    a_dims, b_dims = _operand_dims(step)
    params = order_params(
        [
            Param("a_ptr", "ptr", step.a.tensor),
            Param("b_ptr", "ptr", step.b.tensor),
            Param("stride_am", "stride", step.a.tensor, a_dims[0]),
            Param("stride_ak", "stride", step.a.tensor, a_dims[1]),
            Param("stride_bk", "stride", step.b.tensor, b_dims[0]),
            Param("stride_bn", "stride", step.b.tensor, b_dims[1]),
            *epi,
            Param("K", "size"),
        ]
    )
    a_setup = (
        "    # Rows/columns past M/N wrap around (% M, % N) instead of being masked: those\n"
        "    # lanes compute duplicates the epilogue never stores. Only K needs a mask.\n"
        "    offs_am = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)) % M\n"
        "    a_ptrs = a_ptr + offs_am.to(tl.int64)[:, None] * stride_am"
        " + offs_k[None, :] * stride_ak\n"
    )
    a_load = (
        "        k_remaining = K - ki * BLOCK_SIZE_K\n"
        "        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_remaining, other=0.0)\n"
    )
    parts = {
        "setup": "offs_k = tl.arange(0, BLOCK_SIZE_K)",
        "tile_setup": (
            a_setup + "    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)) % N\n"
            "    b_ptrs = b_ptr + offs_k[:, None] * stride_bk"
            " + offs_bn.to(tl.int64)[None, :] * stride_bn"
        ),
        "loads": (
            a_load + "        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_remaining, other=0.0)"
        ),
        "advance": (
            "        a_ptrs += BLOCK_SIZE_K * stride_ak\n        b_ptrs += BLOCK_SIZE_K * stride_bk"
        ),
    }
    return params, parts


def _render_kernel(
    buf: IndentedBuffer,
    function: str,
    params: tuple[Param, ...],
    parts: dict,
    epilogue: str,
    epi: tuple[Param, ...],
    doc: str,
) -> None:
    buf.line("@triton.jit")
    buf.line(f"def {function}(")
    _signature(buf, params, _META)
    with buf.indent():
        buf.line(f'"""{doc}"""')
        text = _TILE_LOOP.format(
            epilogue_tile=f"{epilogue}_tile",
            epilogue_args=_names(epi),
            tile_meta="BLOCK_SIZE_M, BLOCK_SIZE_N, EPILOGUE_SUBTILES",
            **parts,
        )
        body = _wrap_calls(text)
        for line in body.rstrip().split("\n"):
            if line.strip():
                buf.line(line)


def generate_kernel(step: GemmEpilogue, gemm: GemmInfo, tensors: dict, block: str) -> KernelSource:
    """The Triton module implementing one fused gemm step."""
    name = gemm.name
    ctx = plan_epilogue(step, gemm, tensors)
    epi = _epilogue_params(ctx)
    ctx_tma = plan_epilogue(step, gemm, tensors, tma=True)
    epi_tma = _epilogue_params(ctx_tma)
    buf = IndentedBuffer()
    buf.line(f'"""Generated by coda-agent (codegen v{GENERATOR_VERSION}) — do not edit by hand.')
    buf.line("")
    buf.line(f"Step {name!r} of a program for block {block!r}, as builder calls:")
    buf.line("")
    with buf.indent():
        for line in gemm_to_python(step):
            buf.line(_in_docstring(line))
    buf.line('"""')
    buf.line("import triton")
    buf.line("import triton.language as tl")
    buf.line("")
    buf.line("")
    buf.line(_COMPUTE_PID.rstrip())
    buf.line("")
    buf.line("")
    epilogue = f"_{name}_epilogue"
    _render_epilogue(buf, epilogue, ctx, epi)
    # The Hopper kernel's epilogue moves whole tiles by TMA; with no tile to move it is the same.
    epilogue_tma = f"{epilogue}_tma" if epi_tma != epi else epilogue
    if epilogue_tma != epilogue:
        buf.line("")
        buf.line("")
        _render_epilogue(buf, epilogue_tma, ctx_tma, epi_tma)
    kernels = [
        (
            "tma",
            f"{name}_kernel",
            _tma_variant,
            epilogue_tma,
            epi_tma,
            "Hopper mainloop: operands (and the epilogue's tiles) via TMA descriptors.",
        ),
        (
            "pointer",
            f"{name}_kernel_ptr",
            _pointer_variant,
            epilogue,
            epi,
            "Portable mainloop: pointer loads (any strides, any GPU, the CPU interpreter).",
        ),
    ]
    if epilogue_tma != epilogue:  # for epilogue tensors TMA cannot describe (ragged rows)
        kernels.insert(
            1,
            (
                "tma_mainloop",
                f"{name}_kernel_tma_mainloop",
                _tma_variant,
                epilogue,
                epi,
                "Hopper mainloop, operands via TMA descriptors; the epilogue's tiles by pointer.",
            ),
        )
    variants = {}
    for kind, function, builder, epilogue_fn, epilogue_params, doc in kernels:
        params, parts = builder(step, epilogue_params)
        names = [p.name for p in params]
        if len(set(names)) != len(names):  # the naming scheme is injective: this is a codegen bug
            raise RuntimeError(f"codegen name collision in the signature of {function}: {names}")
        buf.line("")
        buf.line("")
        _render_kernel(buf, function, params, parts, epilogue_fn, epilogue_params, doc)
        variants[kind] = KernelVariant(function, params)
    source = buf.getvalue()
    _check_no_parameter_reassigned(source)
    if current().debug_codegen:
        print(source)
    return KernelSource(name, source, variants)


def _in_docstring(text: str) -> str:
    """``text`` as it may stand inside the module's ``\"\"\"`` docstring: built-in fields are
    canonical and cannot end it, but a plugin's free-text field printed by ``repr`` could (a
    backslash or three quotes); escaped, it stays text."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def _check_no_parameter_reassigned(source: str) -> None:
    """A local that shares a parameter's name (``p_ptr`` the partials of tensor ``ptr``, and the
    pointer of tensor ``p``) would silently replace it: the naming scheme is injective, so this is
    a codegen bug, reported as one."""
    for function in ast.parse(source).body:
        if not isinstance(function, ast.FunctionDef):
            continue
        params = {a.arg for a in function.args.args}
        stored = {
            n.id
            for n in ast.walk(function)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id in params
        }
        if stored:
            raise RuntimeError(
                f"codegen name collision in {function.name}: local {sorted(stored)} reassigns a "
                "parameter of the same name"
            )


def _reindent(inner: IndentedBuffer, level: int, width: int) -> IndentedBuffer:
    out = IndentedBuffer(level, width)
    for line in inner.lines:
        out.line(line)
    return out
