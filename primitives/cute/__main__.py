"""``python -m coda.primitives.cute PROGRAM.json ... [--size M=1000 ...]``: which fused steps of
each Program the CuTe backend covers, and — with the CuTe DSL and QuACK installed — compile each
for Hopper (sm_90a) on this machine; no GPU needed. A file holds a Program, or an object with one
under ``"program"`` (as the drop-ins' shipped Programs in ``export/programs/`` do). Every size is
256 unless ``--size`` says otherwise. Exit status 1 when a covered step does not compile.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch


def _programs(paths: list[str]) -> list[tuple[str, object]]:
    from coda.primitives.ir import Program

    out = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        out.append((Path(path).name, Program.model_validate(data.get("program", data))))
    return out


def _sizes(program, given: dict[str, int]) -> dict[str, int]:
    names = {d for t in program.inputs.values() for d in t.shape if isinstance(d, str)}
    return {name: given.get(name, 256) for name in names}


def check(paths: list[str], compile_: bool, sizes: dict[str, int] | None = None) -> int:
    from coda.primitives import analyze
    from coda.primitives.cute.emit import CuteUnsupported
    from coda.primitives.cute.launch import CuteLaunch, CuteStep
    from coda.primitives.errors import ProgramError
    from coda.primitives.ir import GemmEpilogue
    from coda.primitives.types import torch_dtype

    failed = 0
    for label, program in _programs(paths):
        try:
            info = analyze(program, _sizes(program, sizes or {}))
        except ProgramError as e:  # the default sizes do not fit this Program
            print(f"{label}: not checked at these sizes ({e.message}); give them with --size")
            continue
        tensors = {
            n: torch.empty(t.shape, dtype=torch_dtype(t.dtype, torch.bfloat16))
            for n, t in info.tensors.items()
            if t.partials is None
        }
        for step, name in zip(program.steps, program.step_names(), strict=True):
            if not isinstance(step, GemmEpilogue) or info.gemms[name].vendor:
                continue
            gemm, runner = info.gemms[name], CuteStep(step)
            floats = {n: t.dtype for n, t in tensors.items() if t.is_floating_point()}
            try:
                source, config, writes = runner.plan(gemm, floats, torch.bfloat16)
                for out, shape, dtype in writes:
                    tensors[out] = torch.empty(shape, dtype=dtype)
                if compile_:
                    start = time.perf_counter()
                    launch = CuteLaunch(runner, source, gemm.M, gemm.N, config)
                    runner.compiled(source, launch.arguments(tensors), config)
                    print(f"{label} {name}: compiled in {time.perf_counter() - start:.1f} s")
                else:
                    print(f"{label} {name}: covered")
            except CuteUnsupported as e:
                compiled_failed = "did not compile" in str(e)
                failed += compiled_failed
                print(f"{label} {name}: {'FAILED' if compiled_failed else 'Triton'} — {e}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("programs", nargs="+", help="Program JSON files")
    p.add_argument(
        "--size", action="append", default=[], metavar="NAME=N", help="a size (default 256)"
    )
    p.add_argument("--no-compile", action="store_true", help="only say which steps are covered")
    args = p.parse_args(argv)
    have_dsl = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "quack"))
    if not args.no_compile and not have_dsl:
        print("the CuTe DSL or QuACK is not installed: saying what is covered, compiling nothing")
    if have_dsl:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
    try:
        sizes = {k: int(v) for k, v in (s.split("=", 1) for s in args.size)}
    except ValueError:
        p.error(f"--size takes NAME=N, got {args.size}")
    return check(args.programs, compile_=have_dsl and not args.no_compile, sizes=sizes)


if __name__ == "__main__":
    sys.exit(main())
