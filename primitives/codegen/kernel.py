"""Generate one readable Triton module per ``GemmEpilogue``: mainloop template + spliced epilogue.

Passes, each pure: ``plan`` (which tensors and spaces the epilogue touches, by emitting it into a
context) → ``signature`` (grouped kernel parameters) → ``render`` (the module text). The module
reads like Triton's persistent-matmul tutorial: ``_compute_pid`` with grouped ordering, the
persistent tile loop, the K loop into an fp32 ``accumulator``, then ``# --- epilogue ---`` and one
banner per primitive. It imports nothing but triton, so a person can run or edit it alone.

Set ``CODA_DEBUG_CODEGEN=1`` to print each generated module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton

from ..analysis import GemmInfo
from ..builder import gemm_to_python
from ..ir import GemmEpilogue
from .context import EmitContext, Param
from .emitter import IndentedBuffer

GENERATOR_VERSION = "2"

_HELPERS = """
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

_MAINLOOP = """\
start_pid = tl.program_id(axis=0)
num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
k_tiles = tl.cdiv(K, BLOCK_SIZE_K)
num_tiles = num_pid_m * num_pid_n
num_pid_in_group = GROUP_SIZE_M * num_pid_n
offs_k = tl.arange(0, BLOCK_SIZE_K)
# Persistent: each program walks output tiles start_pid, start_pid + NUM_SMS, ...
for tile_id in tl.range(start_pid, num_tiles, NUM_SMS):
    pid_m, pid_n = _compute_pid(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
    # --- mainloop: accumulator = A[rows of the tile, :] @ B[:, columns of the tile], fp32 ---
    # Rows/columns past M/N wrap around (% M, % N) instead of being masked: those lanes compute
    # duplicates that the epilogue never stores. Only the K edge needs a mask.
    offs_am = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)) % M
    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)) % N
    a_ptrs = a_ptr + offs_am.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn.to(tl.int64)[None, :] * stride_bn
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for ki in range(0, k_tiles):
        k_remaining = K - ki * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_remaining, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_remaining, other=0.0)
        accumulator = tl.dot(a, b, accumulator, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
"""

_META = (
    "BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,\n"
    "GROUP_SIZE_M: tl.constexpr, NUM_SMS: tl.constexpr, INPUT_PRECISION: tl.constexpr,"
)


@dataclass(frozen=True)
class KernelSource:
    """A generated module: its text, the kernel's name and how to fill its parameters."""

    step: str
    function: str
    source: str
    params: tuple[Param, ...]

    @property
    def digest(self) -> str:
        import hashlib

        key = f"{GENERATOR_VERSION}\0{triton.__version__}\0{self.source}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]


def _operand_params(step: GemmEpilogue) -> list[Param]:
    a_dims = (1, 0) if step.a.transpose else (0, 1)  # which tensor dim walks M, K
    b_dims = (1, 0) if step.b.transpose else (0, 1)  # which tensor dim walks K, N
    return [
        Param("a_ptr", "ptr", step.a.tensor),
        Param("b_ptr", "ptr", step.b.tensor),
        Param("M", "size"),
        Param("N", "size"),
        Param("K", "size"),
        Param("stride_am", "stride", step.a.tensor, a_dims[0]),
        Param("stride_ak", "stride", step.a.tensor, a_dims[1]),
        Param("stride_bk", "stride", step.b.tensor, b_dims[0]),
        Param("stride_bn", "stride", step.b.tensor, b_dims[1]),
    ]


def plan_epilogue(step: GemmEpilogue, gemm: GemmInfo, tensors: dict) -> EmitContext:
    """Emit every epilogue op into a fresh context (lines, parameters, index spaces)."""
    ctx = EmitContext(gemm.locals, tensors, [], IndentedBuffer(), IndentedBuffer())
    for op in step.epilogue:
        ctx.comment(f"--- {op.describe()} ---")
        op.emit(ctx)
    return ctx


def _signature(params: list[Param]) -> list[str]:
    groups = [
        ("# pointers", [p for p in params if p.kind == "ptr"]),
        ("# sizes", [p for p in params if p.kind in ("size", "shape")]),
        ("# strides", [p for p in params if p.kind == "stride"]),
    ]
    lines = []
    for title, group in groups:
        lines.append(title)
        names = [p.name for p in group]
        for i in range(0, len(names), 6):
            lines.append(", ".join(names[i : i + 6]) + ",")
    lines.append("# meta-parameters")
    lines.extend(_META.split("\n"))
    return lines


def order_params(params: list[Param]) -> tuple[Param, ...]:
    """Launch order = signature order: pointers, sizes, strides."""
    rank = {"ptr": 0, "size": 1, "shape": 1, "stride": 2}
    return tuple(sorted(params, key=lambda p: rank[p.kind]))


def generate_kernel(step: GemmEpilogue, gemm: GemmInfo, tensors: dict, block: str) -> KernelSource:
    """The Triton module implementing one fused gemm step."""
    ctx = plan_epilogue(step, gemm, tensors)
    params = order_params(_operand_params(step) + ctx.params)
    function = f"{gemm.name}_kernel"
    buf = IndentedBuffer()
    buf.line(f'"""Generated by coda-agent (codegen v{GENERATOR_VERSION}) — do not edit by hand.')
    buf.line("")
    buf.line(f"Step {gemm.name!r} of a program for block {block!r}, as builder calls:")
    buf.line("")
    with buf.indent():
        for line in gemm_to_python(step):
            buf.line(line)
    buf.line('"""')
    buf.line("import triton")
    buf.line("import triton.language as tl")
    buf.line("")
    buf.line(_HELPERS.rstrip())
    buf.line("")
    buf.line("")
    buf.line("@triton.jit")
    buf.line(f"def {function}(")
    with buf.indent():
        for line in _signature(list(params)):
            buf.line(line)
    buf.line("):")
    with buf.indent():
        buf.line(_MAINLOOP.rstrip())
        with buf.indent():
            buf.line("# --- epilogue ---")
            buf.extend(_reindent(ctx.preamble, buf.level, buf.width))
            buf.extend(_reindent(ctx.body, buf.level, buf.width))
    source = buf.getvalue()
    if os.environ.get("CODA_DEBUG_CODEGEN"):
        print(source)
    return KernelSource(gemm.name, function, source, params)


def _reindent(inner: IndentedBuffer, level: int, width: int) -> IndentedBuffer:
    out = IndentedBuffer(level, width)
    for line in inner.lines:
        out.line(line)
    return out
