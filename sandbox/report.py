"""The typed Report the sandbox returns: which stage failed, on which output, by how much.

``render_text`` is for people (the CLI, ``report.json`` readers); ``render_compact`` is what an
agent reads as a tool result: the first failure in full, passing checks summarised, timings if
measured.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from .compare import OutputCheck

Stage = Literal["validate", "semantics", "compile", "verify", "profile"]
STAGES: tuple[Stage, ...] = ("validate", "semantics", "compile", "verify", "profile")

# Why a stage failed, as data (the message says it in words):
#   program        the program is malformed, ill-typed, or its algebra is wrong (a ProgramError)
#   block          the block (or its shape set) cannot judge programs: an input has no effect
#   plugin         a plugin module could not be loaded
#   mismatch       verify: outputs differ from the reference (NaN/Inf, constant, too large errors)
#   input_modified verify: the kernels wrote into a block input
#   screen         verify: an output does not follow one of the inputs as the reference does
#   exception      an unexpected Python exception (generated code, a primitive, a library)
#   oom            out of memory (the worker's memory cap, the device, or the system's OOM killer)
#   cuda_fault     a CUDA error (illegal address, device assert, ...): the GPU worker is discarded
#   timeout        the worker ran past the wall-clock limit; its process group was killed
#   crash          the worker died (a signal such as SIGSEGV, or an exit before it finished)
#   cancelled      the caller stopped the evaluation (an interrupted run); its worker was killed
Cause = Literal[
    "program",
    "block",
    "plugin",
    "mismatch",
    "input_modified",
    "screen",
    "exception",
    "oom",
    "cuda_fault",
    "timeout",
    "crash",
    "cancelled",
]


class StageResult(BaseModel):
    model_config = ConfigDict(frozen=True)
    stage: Stage
    status: Literal["passed", "failed", "skipped"]
    message: str = ""
    seconds: float = 0.0
    cause: Cause | None = None  # set when status == "failed"
    # The JSON path of the Program node (and field) at fault, e.g. "steps[2].epilogue[1].vector"
    # or "prep[1].gamma", when the stage could tell; None otherwise (and in older reports).
    loc: str | None = None

    def _summary_size(self) -> int:
        """How many of the message's lines ``summary`` takes: two when the first only introduces
        the detail below it (``invalid program:``), else one."""
        lines = self.message.splitlines()
        return 2 if len(lines) > 1 and lines[0].rstrip().endswith(":") else 1

    def summary(self) -> str:
        """The message in one line: its first line, with the first line of the detail joined on
        when the first line only introduces it."""
        taken = self.message.splitlines()[: self._summary_size()]
        return " ".join(line.strip() for line in taken)

    def detail(self) -> list[str]:
        """The message's lines that ``summary`` leaves out."""
        return self.message.splitlines()[self._summary_size() :]


class SemanticsCoverage(BaseModel):
    """Where the semantics stage checked the algebra beyond the block's shape sets: the seed of
    this run (``SandboxOptions.semantics_seed`` reproduces it), the shapes drawn from it and the
    input distributions (``coda.blocks.draws.SCENARIOS``) every shape ran under."""

    model_config = ConfigDict(frozen=True)
    seed: int
    drawn_shapes: list[dict[str, int]] = []
    inputs: list[str] = []


class ProfileRow(BaseModel):
    """Timings at one shape (GPU only; medians of ``triton.testing.do_bench``, L2 flushed)."""

    model_config = ConfigDict(frozen=True)
    sizes: dict[str, int]
    dtype: str
    program_ms: float
    gemms_ms: float  # the block's matrix products alone on cuBLAS: the speed of light
    eager_ms: float | None = None
    compile_ms: float | None = None
    tflops: float
    # step -> its MainloopConfig as a dict (maxnreg None: the compiler's register choice)
    configs: dict[str, dict[str, int | bool | None]] = {}
    mainloops: dict[str, str] = {}  # step -> "tma" | "tma_mainloop" | "pointer" (choose_mainloop)
    input_sets: int = 1  # input sets rotated while timing (more when they fit in L2)
    rel_err: float | None = None  # program vs fp32 reference, at this shape, in this run
    eager_rel_err: float | None = None  # eager PyTorch in the same dtype vs the same reference
    baselines_ms: dict[str, float] = {}  # further baselines timed in the same rounds (e.g. Liger)
    kernel_stats: dict[str, dict[str, int]] = {}  # step -> registers, spills, shared_bytes
    # configs tuning found fastest but rejected for wrong results: step -> "config: what differed"
    tuning_rejected: dict[str, list[str]] = {}
    # whether every fused GEMM ran the config tuning picked at this shape (SandboxOptions.tune),
    # rather than the one its Program names
    tuned: bool = False

    @property
    def ratio_to_gemms(self) -> float:
        return self.program_ms / self.gemms_ms

    def speedup(self, baseline_ms: float | None) -> float | None:
        return None if baseline_ms is None else baseline_ms / self.program_ms


class Report(BaseModel):
    """Everything one sandbox evaluation found. ``verified`` is the one bit that gates
    acceptance.
    """

    model_config = ConfigDict(frozen=True)
    verified: bool
    block: str
    program_hash: str
    device: str
    stages: list[StageResult]
    checks: list[OutputCheck] = []
    profile: list[ProfileRow] = []
    kernels: dict[str, str] = {}  # step -> generated module file name
    versions: dict[str, str] = {}
    semantics: SemanticsCoverage | None = None  # absent in reports written before it existed

    @property
    def failed_stage(self) -> StageResult | None:
        return next((s for s in self.stages if s.status == "failed"), None)

    def stage(self, name: Stage) -> StageResult | None:
        return next((s for s in self.stages if s.stage == name), None)

    def worst_check(self) -> OutputCheck | None:
        scored = [c for c in self.checks if c.max_abs_err is not None and c.allowed]
        if not scored:
            return None
        return max(scored, key=lambda c: c.max_abs_err / c.allowed)

    # -- rendering -------------------------------------------------------------------------------
    def headline(self, failure: bool = True) -> str:
        """The verdict in one line: with ``failure``, a failed stage's summary follows it."""
        failed = self.failed_stage
        if failed is not None:
            cause = f" [{failed.cause}]" if failed.cause else ""
            head = f"FAILED at {failed.stage}{cause}"
            return f"{head}: {failed.summary()}" if failure else head
        if not self.verified:
            return "NOT VERIFIED"
        worst = self.worst_check()
        tail = (
            f"; worst output {worst.output}: max|err| {worst.max_abs_err:.3g} "
            f"≤ allowed {worst.allowed:.3g}"
            if worst
            else ""
        )
        return f"VERIFIED ({len(self.checks)} checks passed{tail})"

    def render_text(self, stages_printed: bool = False) -> str:
        """The Report for people: the headline (with the failure's summary), the stages, the
        checks and the timings. The failed stage's message is not repeated: its summary is in the
        headline, and only the lines beyond it follow. ``stages_printed``: the caller printed each
        stage's line, summary included, as it ran, so the stage list and the summary are left
        out."""
        lines = [
            f"block {self.block}  program {self.program_hash}  on {self.device}",
            self.headline(failure=not stages_printed),
        ]
        failed = self.failed_stage
        if not stages_printed:
            lines.append("")
            for s in self.stages:
                mark = {"passed": "✓", "failed": "✗", "skipped": "–"}[s.status]
                message = "" if s is failed else f"  {s.message}"
                lines.append(f"  {mark} {s.stage:<9} {s.status:<7} {s.seconds:6.2f}s{message}")
                if s is failed:
                    lines += [f"    {line.strip()}" for line in s.detail()]
        elif failed is not None:
            lines += [f"  {line.strip()}" for line in failed.detail()]
        if self.checks:
            lines.append("")
            lines.append("checks:")
            lines += [f"  {c.summary()}" for c in self.checks]
            for c in self.checks:
                if not c.passed and c.first_bad:
                    first = "; ".join(
                        f"{m.index}: got {m.got:.5g}, want {m.want:.5g}" for m in c.first_bad
                    )
                    lines.append(f"  first mismatches of {c.output}: {first}")
                    break
        lines += self._profile_lines()
        return "\n".join(lines)

    def _profile_lines(self) -> list[str]:
        if not self.profile:
            prof = self.stage("profile")
            return [f"\ntimings: not measured ({prof.message})"] if prof else []
        lines = ["", "timings (ms, median):"]
        for r in self.profile:
            where = ", ".join(f"{k}={v}" for k, v in r.sizes.items())
            eager = f"{r.eager_ms:.3f}" if r.eager_ms else "n/a"
            comp = f"{r.compile_ms:.3f}" if r.compile_ms else "n/a"
            lines.append(
                f"  {where} {r.dtype}: program {r.program_ms:.3f} ({r.tflops:.0f} TFLOP/s), "
                f"GEMMs alone {r.gemms_ms:.3f} (×{r.ratio_to_gemms:.3f}), eager {eager}, "
                f"torch.compile {comp}"
            )
            for step, reasons in r.tuning_rejected.items():
                lines += [f"    tuning rejected for {step} (wrong results): {w}" for w in reasons]
        return lines

    def render_compact(self, max_checks: int = 6) -> str:
        """What an agent reads: the failure in full, the rest briefly."""
        lines = [self.headline()]
        failed = self.failed_stage
        if failed is not None:
            lines += failed.detail()
        if failed is not None and failed.loc:
            lines.append(f"  where: {failed.loc} (the JSON path of the program node to change)")
        bad = [c for c in self.checks if not c.passed]
        for c in bad[:max_checks]:
            lines.append("  " + c.summary())
            if c.first_bad:
                lines.append(
                    "    first: "
                    + "; ".join(
                        f"{m.index}: got {m.got:.5g}, want {m.want:.5g}" for m in c.first_bad[:3]
                    )
                )
        if len(bad) > max_checks:
            lines.append(f"  ... {len(bad) - max_checks} more failing checks")
        if self.verified:  # timings, or why there are none (an agent must not guess)
            lines += [line.strip() for line in self._profile_lines() if line.strip()]
        return "\n".join(lines)
