"""The sandbox stages: validate → semantics → compile → verify → profile.

Each stage returns a ``StageResult`` (and its payload); the first failure stops the run. Stages
catch what a candidate can throw and name its cause (``report.Cause``): a ``ProgramError`` is the
program's fault and becomes its message; a ``StageFailure`` carries its own cause (a mismatch, a
modified input, an input the outputs do not follow, a degenerate block); any other exception is
classified (out of memory, CUDA fault, or an unexpected exception, with its last frames) — never an
exception in the caller.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from coda.blocks.block import Block
from coda.blocks.draws import SCENARIOS, draw_shapes, scenario_inputs
from coda.primitives import backend
from coda.primitives.analysis import ProgramInfo, analyze_all, upstream_fix
from coda.primitives.compile_ahead import compile_ahead_of
from coda.primitives.errors import ProgramError
from coda.primitives.footprint import check_footprint
from coda.primitives.ir import Program
from coda.primitives.plugins import normalize, plugins_from_env
from coda.primitives.reference import execute_reference, outputs_of
from coda.primitives.runtime import CompiledProgram, compile_program
from coda.primitives.types import TORCH_DTYPES

from .compare import OutputCheck, check_output
from .errors import StageFailure
from .faults import classify_exception, describe_exception
from .localize import localize, make_run
from .report import ProfileRow, SemanticsCoverage, Stage, StageResult
from .screen import reference64, screen_block, screen_program

# What runs after validate, in the worker subprocess (or in-process with isolate=False).
WORKER_STAGES: tuple[Stage, ...] = ("semantics", "compile", "verify", "profile")

SEMANTICS_REL_TOL = 1e-9  # float64 algebra: reassociation costs ~1e-15; a wrong program is O(1)
DRAWN_SHAPES = 2  # fresh shapes per run for the semantics stage (blocks/draws.py)
F64 = torch.float64

# The worker's memory cap under the interpreter (RLIMIT_DATA: heap and private writable mappings).
# A worker verifying llama_mlp at its CPU shapes uses ~250 MiB of data (torch + Triton + numpy);
# 4 GiB leaves room for a user's larger CPU shapes and stops a runaway allocation long before it
# takes the machine. On a CUDA GPU "auto" sets no host cap: see ``worker.apply_memory_cap``.
DEFAULT_INTERPRETER_MEMORY_MB = 4096

# Caps on what validate lets a program allocate (``primitives/footprint.py``; float32 bytes per
# activation element), per tensor and in all, at every shape set it is checked at. The largest
# built-in block tensor at any CPU, GPU or bench shape set is llama_lm_head_ce_bwd's [16384,
# 128256] logit gradient (7.8 GiB), the largest total its 14.5 GiB there: the caps leave 4× and 9×
# of room for larger user shapes (a 256k vocabulary, wider models), and refuse a program that
# would build terabytes before anything runs.
DEFAULT_MAX_TENSOR_GIB = 32.0
DEFAULT_MAX_TOTAL_GIB = 128.0


class SandboxOptions(BaseModel):
    """How thoroughly to check. ``None`` means the default for the device kernels run on."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    shapes: list[dict[str, int]] | None = None  # default: block.shapes.cpu / .gpu
    dtypes: list[str] | None = None  # default: float32 + float16 (CPU), bfloat16 + float16 (GPU)
    seeds: list[int] = [0, 1]
    profile: bool = True
    bench_shapes: list[dict[str, int]] | None = None  # default: block.shapes.bench
    tune: bool = True  # tune mainloop configs before timing (GPU only)
    # What tuning times for a kernel new to the tuning cache: "quick" (``QUICK_SPACE``, 8 configs:
    # each costs a compile of seconds on a GPU) or "full" (the whole Hopper space, 19).
    tune_space: Literal["quick", "full"] = "quick"
    timeout_s: float = 600.0
    # semantics/compile/verify/profile in a worker subprocess (False: trusted, no fences)
    isolate: bool = True
    # Workers compile into one Triton cache and keep tuned configs in one coda cache, the
    # sandbox's own under <coda cache>/sandbox (both keyed by content), so what one candidate
    # compiled or tuned serves the next; False:
    # each worker starts with empty private caches (``runner.worker_env``).
    shared_caches: bool = True
    # Host memory cap of the worker in MiB: "auto" (DEFAULT_INTERPRETER_MEMORY_MB under the
    # interpreter, none on a CUDA GPU), an explicit number (applied on any Linux machine), or None.
    memory_limit_mb: Literal["auto"] | int | None = "auto"
    # validate refuses a program whose largest tensor, or all of whose tensors, would take more
    # than this many GiB at some shape set (None: no cap).
    max_tensor_gib: float | None = DEFAULT_MAX_TENSOR_GIB
    max_total_gib: float | None = DEFAULT_MAX_TOTAL_GIB
    # Modules or .py files defining extra primitives, loaded by the caller and by the worker.
    plugins: list[str] = Field(default_factory=plugins_from_env)
    # The semantics stage's drawn shapes and inputs: None draws a seed per run (os.urandom); the
    # Report records it, and setting it here reproduces that run.
    semantics_seed: int | None = None
    drawn_shapes: int = DRAWN_SHAPES

    @field_validator("memory_limit_mb")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 64:
            raise ValueError("memory_limit_mb must be at least 64 (MiB), 'auto' or None")
        return value

    @field_validator("max_tensor_gib", "max_total_gib")
    @classmethod
    def _positive_cap(cls, value: float | None) -> float | None:
        if value is not None and not value > 0:
            raise ValueError("max_tensor_gib and max_total_gib must be positive (GiB) or None")
        return value

    @field_validator("plugins")
    @classmethod
    def _absolute(cls, value: list[str]) -> list[str]:
        return [normalize(spec) for spec in value]

    def memory_cap_mb(self) -> int | None:
        """The cap the worker applies on this machine (None: no cap)."""
        if self.memory_limit_mb == "auto":
            return DEFAULT_INTERPRETER_MEMORY_MB if backend.INTERPRET else None
        return self.memory_limit_mb

    def byte_caps(self) -> tuple[int | None, int | None]:
        """(per tensor, total) caps in bytes for validate."""
        return _gib(self.max_tensor_gib), _gib(self.max_total_gib)

    def verify_shapes(self, block: Block) -> list[dict[str, int]]:
        if self.shapes is not None:
            return self.shapes
        return block.shapes.cpu if backend.INTERPRET else (block.shapes.gpu or block.shapes.cpu)

    def verify_dtypes(self) -> list[str]:
        if self.dtypes is not None:
            return self.dtypes
        # bfloat16 tl.dot is wrong in the Triton 3.9 interpreter: bf16 is verified on GPUs only.
        return ["float32", "float16"] if backend.INTERPRET else ["bfloat16", "float16"]

    def float32_shape(self, block: Block) -> dict[str, int] | None:
        """Where verify adds one float32 run: with the default dtypes, when they lack float32 (on
        a GPU), at the block's smallest CPU shape set; else None. Only float32's tolerance sees
        an intermediate rounded through a lower precision than the block's (a
        ``store(dtype="float16")`` that a later step reads): under bf16's and fp16's it passes.
        A small shape: at a GPU shape set's million elements per output, an honest backward
        program's worst float32 element can exceed twice PyTorch's worst by a few percent."""
        if self.dtypes is not None or "float32" in self.verify_dtypes():
            return None
        return min(block.shapes.cpu, key=lambda s: math.prod(s.values()))

    def profile_shapes(self, block: Block) -> list[dict[str, int]]:
        return self.bench_shapes if self.bench_shapes is not None else block.shapes.bench


def _gib(value: float | None) -> int | None:
    return None if value is None else int(value * (1 << 30))


@contextmanager
def timed(stage: Stage, sink: list[StageResult]) -> Iterator[dict[str, Any]]:
    """Run a stage body; record passed / failed (with the error) and its wall time."""
    box: dict[str, Any] = {"status": "passed", "message": "", "cause": None, "loc": None}
    start = time.perf_counter()
    try:
        yield box
    except StageFailure as e:
        box.update(status="failed", message=e.render(), cause=e.cause, loc=e.path)
    except ProgramError as e:
        box.update(status="failed", message=e.render(), cause="program", loc=e.path)
    except Exception as e:  # noqa: BLE001 - a candidate may throw anything; it becomes a report
        cause = classify_exception(e)
        box.update(status="failed", message=describe_exception(stage, e, cause), cause=cause)
    sink.append(
        StageResult(
            stage=stage,
            status=box["status"],
            message=box["message"],
            seconds=round(time.perf_counter() - start, 3),
            cause=box["cause"],
            loc=box["loc"],
        )
    )


# -- validate --------------------------------------------------------------------------------------
def check_against_block(program: Program, block: Block) -> None:
    """The program must be for this block: same name, inputs and outputs."""
    if program.block != block.name:
        raise ProgramError(
            f"the program is for block {program.block!r}, not {block.name!r}", loc="block"
        )
    want = block.program_inputs()
    have = {n: d.model_dump(mode="json") for n, d in program.inputs.items()}
    for name in want:
        if name not in have:
            raise ProgramError(
                f"missing input {name!r} {want[name]}",
                loc="inputs",
                hint=f"copy the block's inputs exactly: {want}",
            )
        if have[name] != want[name]:
            raise ProgramError(
                f"input {name!r} is declared {have[name]} but the block has {want[name]}",
                loc=f"inputs.{name}",
            )
    extra = sorted(set(have) - set(want))
    if extra:
        raise ProgramError(
            f"{extra} are not inputs of block {block.name!r}",
            loc="inputs",
            hint=f"the block's inputs are {sorted(want)}",
        )
    missing = [o for o in block.outputs if o not in program.outputs]
    unknown = [o for o in program.outputs if o not in block.outputs]
    if missing or unknown:
        raise ProgramError(
            f"outputs must be exactly {block.outputs}; missing {missing}, unknown {unknown}",
            loc="outputs",
        )


def check_output_shapes(block: Block, program: Program, infos: list[ProgramInfo]) -> None:
    """Every output must have the shape the block's reference gives it, at every shape set (from
    the block's graph on meta tensors: nothing is computed)."""
    for info in infos:
        want = block.trace(info.sizes)
        for name, value in program.outputs.items():
            tensor = info.tensors[program.output_tensor(name)]
            shape = tuple(tensor.shape)
            if not isinstance(value, str):
                meta = torch.empty(shape, device="meta")
                shape = tuple(value.apply(meta, info.sizes).shape)
            if name in want and shape != tuple(want[name]):
                raise ProgramError(
                    f"output {name!r} would have shape {list(shape)} but the block's reference "
                    f"gives {list(want[name])} (at {_where(info.sizes)})",
                    loc=f"outputs.{name}",
                    hint="check the steps that produce it: their sizes, axes and transposes",
                )


def validate(
    data: Program | dict | str,
    block: Block,
    size_sets: list[dict[str, int]],
    results: list[StageResult],
    options: SandboxOptions | None = None,
) -> tuple[Program | None, list[ProgramInfo]]:
    """Parse, match the block, type-check at every shape set, and size every tensor there.

    ``options`` gives the size caps (``max_tensor_gib``, ``max_total_gib``; without it, the
    defaults).
    """
    program, infos = None, []
    max_tensor, max_total = (options or SandboxOptions()).byte_caps()
    with timed("validate", results) as box:
        program = data if isinstance(data, Program) else Program.parse(data)
        check_against_block(program, block)
        try:
            infos = analyze_all(program, size_sets)
            check_output_shapes(block, program, infos)
        except ProgramError as e:
            # reported where one edit removes it, which may be upstream of where it surfaces
            also = lambda p, i: check_output_shapes(block, p, i)  # noqa: E731
            raise upstream_fix(program, size_sets, e, also=also) from None
        for info in infos:
            check_footprint(
                program,
                info.tensors,
                info.sizes,
                max_tensor_bytes=max_tensor,
                max_total_bytes=max_total,
            )
        box["message"] = f"{len(program.steps)} steps; checked at {len(size_sets)} shape sets"
    return (program if results[-1].status == "passed" else None), infos


# -- semantics -------------------------------------------------------------------------------------
def semantics_seed(options: SandboxOptions) -> int:
    """The seed of this run's drawn shapes and inputs: ``options.semantics_seed``, else fresh."""
    if options.semantics_seed is not None:
        return options.semantics_seed
    return int.from_bytes(os.urandom(4), "little")


def semantics(
    program: Program,
    block: Block,
    shapes: list[dict[str, int]],
    results: list[StageResult],
    *,
    seed: int = 0,
    drawn: int = DRAWN_SHAPES,
) -> SemanticsCoverage | None:
    """The reference executor (float64, CPU) against the block's reference: is the algebra right?

    First, once per block, the block screen: every input must move the reference (``screen``).
    Then the runs of ``_semantic_runs``: the shape sets with the block's own inputs, the other
    input distributions of ``draws.SCENARIOS`` (a ``where`` or clamp that only N(0, 1) values keep
    inert) and ``drawn`` fresh shapes from ``seed`` (a size expression right only at the shape
    sets). Returns what was covered (None if the stage failed).
    """
    coverage = None
    with timed("semantics", results) as box:
        screen_block(block, shapes)
        fresh = _drawn_shapes(block, drawn, seed)
        _analyze_drawn(program, shapes, fresh, seed)
        worst, skipped = 0.0, 0
        bases: dict[tuple, dict[str, torch.Tensor]] = {}  # the block's inputs, once per shape
        for sizes, scenario, drawn_seed in _semantic_runs(shapes, fresh, seed):
            input_seed = 0 if drawn_seed is None else drawn_seed  # the shape sets: seed 0
            key = tuple(sizes.items())
            if key not in bases:
                bases[key] = block.make_inputs(sizes, F64, seed=input_seed)
            inputs = scenario_inputs(block, sizes, scenario, input_seed, F64, base=bases[key])
            want = _reference(block, inputs, sizes, drawn_seed)
            if not all(bool(torch.isfinite(t).all()) for t in want.values()):
                skipped += 1  # outside the block's own domain (its reference overflows)
                continue
            got = outputs_of(program, execute_reference(program, inputs, exact=True))
            where = _describe_run(sizes, scenario, drawn_seed)
            try:
                for name in block.outputs:
                    worst = max(
                        worst, _semantic_error(name, got[name], want[name], where, scenario)
                    )
            except ProgramError as e:
                raise _localized(
                    e, program, block, make_run(block, sizes, inputs), shapes
                ) from None
        coverage = SemanticsCoverage(seed=seed, drawn_shapes=fresh, inputs=list(SCENARIOS))
        box["message"] = _semantics_message(worst, shapes, fresh, seed, skipped)
    return coverage if results[-1].status == "passed" else None


def _localized(
    error: ProgramError, program: Program, block: Block, failing: Any, shapes: list[dict[str, int]]
) -> ProgramError:
    """The mismatch, located at the node whose single repair makes every output match (on two
    runs: ``localize``); as it is when no single repair does. Repairs are searched at the
    smallest shape set where the program fails too (cheapest), and confirmed on the failing run.
    """
    smallest = min((s for s in shapes if s != failing.sizes), key=_elements, default=None)
    if smallest is None:
        return error
    try:
        small = make_run(block, smallest, block.make_inputs(smallest, F64, seed=0))
        cheaper = _elements(smallest) < _elements(failing.sizes)
        if cheaper and small.error(program.model_dump(mode="json")) > SEMANTICS_REL_TOL:
            runs = [small, failing]
        else:
            runs = [failing, small]
        found = localize(program, runs)
    except Exception:  # noqa: BLE001 - a diagnosis that fails must not hide the mismatch itself
        found = None
    if found is None:
        return error
    return ProgramError(
        f"{error.message}. At fault: {found.path} — every output matches after this one "
        f"change: {found.what}",
        loc=found.path,
        hint=error.hint,
    )


def _elements(sizes: dict[str, int]) -> int:
    return math.prod(sizes.values())


def _semantic_runs(
    shapes: list[dict[str, int]], fresh: list[dict[str, int]], seed: int
) -> list[tuple[dict[str, int], str, int | None]]:
    """``(sizes, input distribution, seed of a drawn shape or None)`` for every run: each shape
    set with the block's inputs; the first shape set and the first drawn shape (beyond the shape
    sets) under every distribution; the other drawn shapes with the block's inputs. About 16
    float64 runs at modest sizes: a fraction of a second for a Llama block."""
    others = [name for name in SCENARIOS if name != "standard"]
    runs = [(sizes, "standard", None) for sizes in shapes]
    runs += [(shapes[0], name, None) for name in others]
    for i, sizes in enumerate(fresh):
        runs += [
            (sizes, name, seed) for name in (["standard", *others] if i == 0 else ["standard"])
        ]
    return runs


def _reference(
    block: Block, inputs: dict[str, torch.Tensor], sizes: dict[str, int], drawn_seed: int | None
) -> dict[str, torch.Tensor]:
    """The block's reference; where it cannot run at a drawn shape, the block is at fault."""
    try:
        return block.reference(inputs)
    except (RuntimeError, ValueError, IndexError) as e:
        if drawn_seed is None:
            raise
        raise StageFailure(
            f"block {block.name!r}: its reference fails at the drawn shape {_where(sizes)} (seed "
            f"{drawn_seed}): {type(e).__name__}: {e}. Shapes are drawn under the relations that "
            "hold at all of the block's shape sets; this one needs another. This is a fault of "
            "the block, not of the program: add shape sets that show the relation",
            cause="block",
        ) from None


def _drawn_shapes(block: Block, count: int, seed: int) -> list[dict[str, int]]:
    if count <= 0:
        return []
    try:
        return draw_shapes(block, count, random.Random(seed))
    except ValueError as e:
        raise StageFailure(
            f"{e}. This is a fault of the block, not of the program: give it shape sets whose "
            "sizes show the relations they need, with tensors of modest size",
            cause="block",
        ) from None


def _analyze_drawn(
    program: Program, shapes: list[dict[str, int]], fresh: list[dict[str, int]], seed: int
) -> None:
    """The program must be valid at the drawn shapes, with the same types as at the shape sets."""
    for sizes in fresh:
        try:
            analyze_all(program, [*shapes, sizes])
        except ProgramError as e:
            raise ProgramError(
                f"{e.message} — at the drawn shape {_where(sizes)} (seed {seed}), while the "
                "program is valid at the block's shape sets",
                loc=e.loc,
                hint="a size expression (rotary_cols, divide_by, head_dim, a view's start/stop) "
                "must be right at every binding of the sizes, not only at the shape sets: write "
                "it as the sizes it stands for (e.g. 'Nq + Nkv', 'd')",
            ) from None


def _where(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def _describe_run(sizes: dict[str, int], scenario: str, drawn_seed: int | None) -> str:
    shape = (
        f"the drawn shape {_where(sizes)} (seed {drawn_seed})"
        if drawn_seed is not None
        else _where(sizes)
    )
    return f"{shape}, inputs: {scenario}"


def _semantics_message(
    worst: float, shapes: list[dict], fresh: list[dict], seed: int, skipped: int
) -> str:
    drawn = "; ".join(_where(s) for s in fresh)
    skip = f"; {skipped} runs skipped where the block's reference is not finite" if skipped else ""
    return (
        f"algebra matches the block in float64 (worst relative error {worst:.1e}) at its "
        f"{len(shapes)} shape sets and {len(fresh)} drawn shapes (seed {seed}: {drawn}); "
        f"{len(SCENARIOS)} input distributions at {_where(shapes[0])}"
        + (f" and {_where(fresh[0])}" if fresh else "")
        + skip
    )


def _semantic_error(
    name: str, got: torch.Tensor, want: torch.Tensor, where: str, scenario: str = "standard"
) -> float:
    if tuple(got.shape) != tuple(want.shape):
        raise ProgramError(
            f"output {name!r} has shape {list(got.shape)} but the block's reference "
            f"gives {list(want.shape)} (at {where})"
        )
    bad = int((~torch.isfinite(got)).sum())
    if bad and bool(torch.isfinite(want).all()):
        raise ProgramError(
            f"output {name!r} has {bad} NaN/Inf values in float64 at {where} (the block's "
            "reference has none)",
            hint="the program's algebra divides by zero, takes log/sqrt of a non-positive value "
            "or overflows: check its map expressions and scales",
        )
    diff = got.double() - want.double()
    rel = float(diff.norm() / max(float(want.double().norm()), 1e-300))
    if not rel <= SEMANTICS_REL_TOL:
        idx = int(diff.abs().flatten().argmax())
        pos = list(torch.unravel_index(torch.tensor(idx), got.shape))
        raise ProgramError(
            f"output {name!r} does not match the block's reference in float64 at {where}: "
            f"relative error {rel:.3g}, largest at {[int(p) for p in pos]} (got "
            f"{float(got.flatten()[idx]):.6g}, want {float(want.flatten()[idx]):.6g})",
            hint=_mismatch_hint(where, scenario),
        )
    return rel


def _mismatch_hint(where: str, scenario: str) -> str:
    if "drawn shape" in where:
        return (
            "the program matches at the block's shape sets but not at this fresh shape: a size "
            "expression (or a step) is right only at some sizes — write each size expression as "
            "the sizes it stands for, so that it is right at every binding of the sizes"
        )
    if scenario != "standard":
        return (
            f"the program matches with the block's own inputs but not with {scenario}: its "
            "result depends on the values' magnitude where the block's does not — a where/min/"
            "max threshold, a clamp, or an eps that differs from the block's"
        )
    return (
        "the algebra is wrong before any kernel runs: check each step against the "
        "reference source (scales, pair order, residual, eps)"
    )


# -- compile ---------------------------------------------------------------------------------------
def compile_stage(
    program: Program,
    info: ProgramInfo,
    block: Block,
    sizes: dict[str, int],
    results: list[StageResult],
    on_kernels: Callable[[dict[str, str]], None] | None = None,
) -> CompiledProgram | None:
    """Generate and import every kernel; on a GPU also build them (one launch at ``sizes``).

    ``on_kernels`` receives the generated sources as soon as they exist, before anything imports
    or builds them, so a kernel that fails to compile can still be read.
    """
    compiled = None
    with timed("compile", results) as box:
        compiled = compile_program(program, info)
        if on_kernels is not None:
            on_kernels({name: k.source for name, k in compiled.kernels.items()})
        compiled.load_all()
        if not backend.INTERPRET:
            dtype = TORCH_DTYPES["bfloat16"]
            inputs = block.make_inputs(sizes, dtype, seed=0, device=backend.DEVICE)
            compile_ahead_of(lambda: compiled.collect_launches(inputs))
            compiled(inputs)
            torch.cuda.synchronize()
            cute_sources = compiled.cute_sources()  # steps on CODA_EPILOGUE_BACKEND=cute
            if on_kernels is not None and cute_sources:
                on_kernels({f"{n}.cute": text for n, text in cute_sources.items()})
        on_cute = sorted(n for n, m in compiled.mainloops_used.items() if m == "cute")
        kinds = f"{len(compiled.kernels) - len(on_cute)} Triton" + (
            f", {len(on_cute)} CuTe ({', '.join(on_cute)})" if on_cute else ""
        )
        box["message"] = f"{kinds} kernels ({backend.describe()})"
    return compiled if results[-1].status == "passed" else None


# -- verify ----------------------------------------------------------------------------------------
def verify(
    compiled: CompiledProgram,
    block: Block,
    shapes: list[dict[str, int]],
    dtypes: list[str],
    seeds: list[int],
    results: list[StageResult],
    *,
    float32_at: dict[str, int] | None = None,
) -> list[OutputCheck]:
    """Every output at every shape × dtype × seed against the float64 reference (and, given
    ``float32_at``, once in float32 there: ``SandboxOptions.float32_shape``), then the input
    screen (every output must follow each input) at the smallest shape.

    Runs alternate between the kernels the process runs (the configured epilogue backend, the
    mainloop the runtime picks: TMA where operands allow it) and Triton's pointer mainloop, which
    users' tensors may equally get (``_on_path``): a kernel is verified under both (with the
    defaults, every shape under both). Under ``CODA_EPILOGUE_BACKEND=auto`` or ``cute`` the first
    runs the steps the CuTe backend covers on QuACK's GEMM and the second on Triton, which tuning
    under ``auto`` pins for a step where it costs less.
    """
    checks: list[OutputCheck] = []
    smallest = min(shapes, key=lambda s: math.prod(s.values()))
    runs = [(s, d, seed) for s in shapes for d in dtypes for seed in seeds]
    extra = ""
    if float32_at is not None and "float32" not in dtypes:
        runs.append((float32_at, "float32", seeds[0]))
        extra = f" + float32 at {', '.join(f'{k}={v}' for k, v in float32_at.items())}"
    with timed("verify", results) as box:
        mainloops = ["auto" if i % 2 == 0 else "pointer" for i in range(len(runs))]
        planned = [(s, d, m) for (s, d, _), m in zip(runs, mainloops, strict=True)]
        _compile_runs_ahead(compiled, block, [*planned, (smallest, "float32", "auto")])
        for (sizes, dtype, seed), mainloop in zip(runs, mainloops, strict=True):
            with _on_path(compiled, mainloop):
                checks += verify_one(compiled, block, sizes, TORCH_DTYPES[dtype], seed)
        failed = [c for c in checks if not c.passed]
        if failed:
            raise StageFailure(
                f"{len(failed)} of {len(checks)} output checks failed; first: "
                f"{failed[0].summary()}",
                cause="mismatch",
            )
        screened = screen_program(
            lambda inputs: compiled(inputs, poison=True), block, smallest, backend.DEVICE
        )
        box["message"] = (
            f"{len(checks)} checks passed ({len(shapes)} shapes × {' and '.join(dtypes)} × "
            f"{len(seeds)} seeds{extra}); {screened}"
        )
    return checks


def _compile_runs_ahead(
    compiled: CompiledProgram, block: Block, runs: list[tuple[dict[str, int], str, str]]
) -> None:
    """Compile every kernel ``verify``'s runs — ``(sizes, dtype, mainloop)``, the input
    screen's last — will launch, at once (``compile_ahead_of``): each distinct run once,
    collected without launching on inputs drawn as the run draws them (seeds change values,
    not launches)."""

    def collect() -> list:
        calls = []
        for sizes, dtype, mainloop in dict.fromkeys(
            (tuple(sizes.items()), dtype, mainloop) for sizes, dtype, mainloop in runs
        ):
            with _on_path(compiled, mainloop):
                inputs = block.make_inputs(dict(sizes), TORCH_DTYPES[dtype], 0, backend.DEVICE)
                calls += compiled.collect_launches(inputs, poison=True)
        return calls

    compile_ahead_of(collect)


@contextmanager
def _on_path(compiled: CompiledProgram, mainloop: str) -> Iterator[None]:
    """Run ``compiled`` with ``mainloop`` until the block ends: ``"auto"`` on its configured
    epilogue backend; ``"pointer"`` all on Triton: the fused steps on its pointer mainloop (a
    forced mainloop runs on Triton whatever the backend, the CuTe backend having none) and the
    plain products on cuBLAS, where tuning under ``auto`` may have pinned QuACK's GEMM."""
    saved = compiled.mainloop, compiled.epilogue_backend
    compiled.mainloop = mainloop
    if mainloop == "pointer":
        compiled.epilogue_backend = "triton"
    try:
        yield
    finally:
        compiled.mainloop, compiled.epilogue_backend = saved


def verify_one(
    compiled: CompiledProgram, block: Block, sizes: dict[str, int], dtype: torch.dtype, seed: int
) -> list[OutputCheck]:
    inputs = block.make_inputs(sizes, dtype, seed, device=backend.DEVICE)
    snapshot = {n: t.clone() for n, t in inputs.items()}
    ref64 = reference64(block, inputs, device=backend.DEVICE)
    torch_out = block.reference(inputs)
    out = compiled(inputs, poison=True)
    for name, before in snapshot.items():
        if not torch.equal(before, inputs[name]):
            changed = int((before != inputs[name]).sum())
            where = ", ".join(f"{k}={v}" for k, v in sizes.items())
            raise StageFailure(
                f"the program modified its input {name!r} ({changed} elements changed at {where}, "
                f"{str(dtype).removeprefix('torch.')}, seed {seed})",
                cause="input_modified",
                hint="inputs are read-only: a kernel stores into a block input's memory; store "
                "results to new tensors",
            )
    mainloops = ",".join(sorted(set(compiled.mainloops_used.values()))) or "vendor"
    return [
        check_output(
            name,
            out[name],
            ref64[name],
            torch_out[name],
            block.tolerance,
            sizes=sizes,
            seed=seed,
            run_dtype=dtype,
        ).model_copy(update={"mainloop": mainloops})
        for name in block.outputs
    ]


# -- profile ---------------------------------------------------------------------------------------
def profile(
    compiled: CompiledProgram,
    block: Block,
    shapes: list[dict[str, int]],
    results: list[StageResult],
    *,
    tune: bool = True,
    tune_space: Literal["quick", "full"] = "quick",
) -> list[ProfileRow]:
    rows: list[ProfileRow] = []
    if backend.INTERPRET:
        results.append(
            StageResult(
                stage="profile", status="skipped", message="no CUDA GPU here: timings not measured"
            )
        )
        return rows
    if not shapes:
        results.append(
            StageResult(
                stage="profile", status="skipped", message="the block declares no benchmark shapes"
            )
        )
        return rows
    with timed("profile", results) as box:
        from .profiling import profile_shape

        for sizes in shapes:
            row = profile_shape(
                compiled, block, sizes, TORCH_DTYPES["bfloat16"], tune=tune, space=tune_space
            )
            rows.append(row)
            _check_profiled_error(row, block)
        box["message"] = "; ".join(f"×{r.ratio_to_gemms:.3f} of GEMMs alone" for r in rows)
    return rows


def _check_profiled_error(row: ProfileRow, block: Block) -> None:
    """The benchmark shape is checked too: a kernel wrong at scale is not fast, it is wrong."""
    bound = max(block.tolerance.rel.get(row.dtype, 0.0), 2 * (row.eager_rel_err or 0.0))
    if row.rel_err is None or not row.rel_err <= bound:
        where = ", ".join(f"{k}={v}" for k, v in row.sizes.items())
        raise ProgramError(
            f"at the benchmark shape {where} ({row.dtype}) the relative error against an fp32 "
            f"reference is {row.rel_err:.3g}, above {bound:.3g} (eager PyTorch: "
            f"{row.eager_rel_err:.3g})"
        )


def run_worker_stages(
    program: Program,
    info: ProgramInfo,
    block: Block,
    options: SandboxOptions,
    emit: Callable[[str, Any], None],
) -> None:
    """semantics → compile → verify → profile (``WORKER_STAGES``) for a validated program,
    reporting the start and the result of each through ``emit``; the first failure stops."""
    results: list[StageResult] = []
    shapes = options.verify_shapes(block)
    emit("started", "semantics")
    seed = semantics_seed(options)
    coverage = semantics(
        program, block, block.shapes.cpu, results, seed=seed, drawn=options.drawn_shapes
    )
    if coverage is not None:
        emit("semantics", coverage)
    emit("stage", results[-1])
    if results[-1].status != "passed":
        return
    emit("started", "compile")
    compiled = compile_stage(
        program, info, block, shapes[0], results, on_kernels=lambda k: emit("kernels", k)
    )
    emit("stage", results[-1])
    if compiled is None:
        return
    emit("started", "verify")
    dtypes = options.verify_dtypes()
    checks = verify(
        compiled, block, shapes, dtypes, options.seeds, results,
        float32_at=options.float32_shape(block),
    )  # fmt: skip
    emit("checks", checks)
    emit("stage", results[-1])
    if results[-1].status != "passed" or not options.profile:
        return
    emit("started", "profile")
    rows = profile(
        compiled,
        block,
        options.profile_shapes(block),
        results,
        tune=options.tune,
        tune_space=options.tune_space,
    )
    emit("profile", rows)
    emit("stage", results[-1])
