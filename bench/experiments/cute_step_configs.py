"""Experiment: the CuTe-covered steps of the shipped Programs at a training step's shapes, at
several tile configs, with B as stored and as a copy laid out the other way, beside cuBLAS.

``choose_config`` picks the CuTe tile by a rule measured at 8192³ (bench/RESULTS.md, runs
2026-12-02h-j). A Llama training step at 8192 tokens has other shapes — K = 2048 for the down
projection's backward, N = 2048 for the attention output — and its weights are stored as PyTorch
keeps them, so some B operands are N-major. This script times, per step:

- ``cublas``: ``torch.mm`` of the step's A and B as stored;
- ``cute <config> B <K|N>-major``: the product's generated kernel at that config, B as stored;
- ``... (copy)``: the same with B copied to the other layout (the weight transposed in memory;
  not with ``--stored-only``);
- ``... without <ops>``: with ``--without``, the kernel of the step with those epilogue ops left
  out, B as stored — what each part of an epilogue costs. Each spec removes the ops it names
  together (``+`` between them): ``partial_reduce`` (every one), ``store:a`` (the store to
  ``a``), ``map:a`` (the map writing ``a``), ``load_tile:u_tile``; a step none of whose ops match
  is not timed again. Its output is not checked (it computes less);
- ``tuned <config>`` and ``triton (tuned)``: with ``--tuned``, the kernel quick tuning pins for the
  step under ``CODA_EPILOGUE_BACKEND`` (a CuTe config, ``triton``, or for a plain step under
  ``auto`` ``cublas``), and where a fused step's is CuTe its Triton kernel at its tuned config —
  what the product runs, beside the configs above.

A config is ``128x192`` (ping-pong, clusters of two CTAs along M), ``256x128c`` (cooperative),
``128x128/1x2`` (clusters along N), and after any of them ``+e4`` (four epilogue stages),
``+l4`` (four tile-load stages, the tile stores two), ``+w64`` (epilogue sub-tiles 64 columns
wide), ``+ov0`` / ``+ov1`` (``CuteConfig.epi_overlap`` 0 or 1, QuACK's epilogue loop or the
overlapped reads alone; the default is 2) and ``+dyn`` (the dynamic tile scheduler: clusters
take the next free tile from a counter). With ``--vendor`` the plain steps (cuBLAS in the
product) are timed on the CuTe kernel too.

``--programs`` takes shipped Programs (``export/programs``) and blocks by name — a paper kernel's
block is lowered by the planner, as ``bench/paper_kernels.py`` does (``--size M=4096 --size
N=4096 --size K=4096``; the SwiGLU backward also ``--size N2=8192``).

Every other CuTe variant's written tensors are checked against the Triton backend's for the same
step first. Timed in interleaved rounds of the profiler's 100 ms windows
(``timing.SUSTAINED``). Not product code.

    python3 bench/experiments/cute_step_configs.py [--programs llama_mlp_bwd_saved,...]
        [--configs 128x128,128x192,256x128c,128x128+e4] [--size M=8192 ...] [--rounds 3]
        [--without partial_reduce,store:a+map:a,...] [--stored-only] [--tuned] [--vendor]
        [--steps down_bwd,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROGRAMS = "llama_mlp_train,llama_mlp_bwd_saved,attn_out,llama_attn_in_bwd_saved"
SIZES = {"M": 8192, "d": 2048, "f": 8192, "Nq": 2048, "Nkv": 512, "Nqkv": 3072, "D": 64}
ROOT = Path(__file__).resolve().parents[2]
LOOPS = ("ov0", "ov1", "ov2")  # the modifiers of CuteConfig.epi_overlap's levels


def parse_config(text: str):
    """``128x192`` (ping-pong, cluster 2×1), ``256x128c`` (cooperative), ``128x128/1x2``, and
    after any of them ``+e4`` (four stages of epilogue tile loads and stores), ``+l4`` (four
    stages of tile loads, QuACK's two of tile stores), ``+w64`` (epilogue sub-tiles 64 columns
    wide), ``+ovN`` (``CuteConfig.epi_overlap``: 0 QuACK's epilogue loop, 1 the next sub-tile's
    tile loads read during this one's arithmetic, 2 — the default — also each sub-tile stored
    after the next one's arithmetic) and ``+dyn`` (the dynamic tile scheduler)."""
    from coda.primitives.cute.launch import CuteConfig

    text, *modifiers = text.split("+")
    body, _, cluster = text.partition("/")
    coop = body.endswith("c")
    tm, tn = (int(v) for v in body.rstrip("c").split("x"))
    cm, cn = (int(v) for v in cluster.split("x")) if cluster else (2, 1)
    stages = [int(m[1:]) for m in modifiers if m.startswith("e")]
    loads = [int(m[1:]) for m in modifiers if m.startswith("l")]
    widths = [int(m[1:]) for m in modifiers if m.startswith("w")]
    loops = [int(m[2:]) for m in modifiers if m in LOOPS]
    unknown = [m for m in modifiers if m != "dyn" and not _numbered(m)]
    if unknown:
        known = "+eN, +lN, +wN, +ov0, +ov1, +ov2, +dyn"
        raise ValueError(f"{text}: unknown modifier(s) {unknown} (known: {known})")
    return CuteConfig(
        tm, tn, cm, cn, not coop, stages[-1] if stages else 0, "dyn" in modifiers,
        loads[-1] if loads else 0, widths[-1] if widths else 0, loops[-1] if loops else 2,
    )  # fmt: skip


def _numbered(modifier: str) -> bool:
    """Whether ``modifier`` is ``eN``, ``lN``, ``wN`` or ``ov0``–``ov2``."""
    if modifier in LOOPS:
        return True
    return modifier[:1] in ("e", "l", "w") and modifier[1:].isdigit()


def config_label(config) -> str:
    """``config`` as ``parse_config`` reads it, cluster always spelled out."""
    text = f"{config.tile_m}x{config.tile_n}{'' if config.pingpong else 'c'}"
    text += f"/{config.cluster_m}x{config.cluster_n}"
    text += f"+e{config.epi_stages}" if config.epi_stages else ""
    text += f"+l{config.epi_loads}" if config.epi_loads else ""
    text += f"+w{config.epi_n}" if config.epi_n else ""
    text += f"+ov{config.epi_overlap}" if config.epi_overlap != 2 else ""
    return text + ("+dyn" if config.dynamic else "")


def _matches(op, token: str) -> bool:
    """Whether epilogue op ``op`` is what ``token`` names: ``kind`` or ``kind:name`` (the name
    it writes: ``out`` or ``to``)."""
    kind, _, name = token.partition(":")
    if op.op != kind:
        return False
    return not name or name in (getattr(op, "out", None), getattr(op, "to", None))


def ablated(step, spec: str):
    """``step`` without the epilogue ops ``spec`` names (``+``-joined tokens), or None when it
    has none of them."""
    tokens = spec.split("+")
    kept = [op for op in step.epilogue if not any(_matches(op, t) for t in tokens)]
    if len(kept) == len(step.epilogue):
        return None
    return step.model_copy(update={"epilogue": kept})


def tuned_launches(program, block, sizes: dict) -> tuple[dict, dict]:
    """Program ``program`` tuned as the benchmarks tune it (quick space; the backend of
    ``CODA_EPILOGUE_BACKEND``), on inputs of its own: per step tuning chose for, ``{label:
    launch}`` for the kernel it pinned (``tuned <config, triton or cublas>``) and, where a fused
    step's is a CuTe kernel, the step's tuned Triton kernel (``triton (tuned)``); and what
    tuning timed, per step."""
    import torch

    from coda.primitives import analyze, compile_program
    from coda.primitives.codegen.tuning import QUICK_SPACE, tune_program

    inputs = block.make_inputs(sizes, torch.bfloat16, seed=1, device="cuda")
    compiled = compile_program(program, analyze(program, sizes))
    prepared = compiled.prepare(inputs)
    tuning = tune_program(compiled, prepared, space=QUICK_SPACE)
    tensors = compiled.run(prepared)
    launches, timed = {}, {}
    for step in tuning:  # the fused steps, and under auto the plain ones
        pinned = compiled.cute_configs.get(step)
        fused = step in compiled.kernels
        label = f"tuned {config_label(pinned) if pinned else 'triton' if fused else 'cublas'}"
        fns = {label: compiled.step_launch(step, tensors)}
        if pinned is not None and fused:
            compiled.cute_configs[step] = None
            fns["triton (tuned)"] = compiled.step_launch(step, tensors)
            compiled.cute_configs[step] = pinned
        launches[step] = fns
        timed[step] = tuning[step].as_dict()
    return launches, timed


def step_rows(
    name: str,
    sizes: dict,
    configs: list,
    rounds: int,
    without: list[str] = (),
    copies: bool = True,
    tuned: bool = False,
    vendor: bool = False,
    only: frozenset[str] = frozenset(),
) -> list[dict]:
    import torch

    from coda.primitives import analyze, compile_program
    from coda.primitives.cute import launch
    from coda.primitives.cute.emit import CuteUnsupported
    from coda.primitives.ir import GemmEpilogue
    from coda.primitives.reference import activation_dtype
    from coda.primitives.timing import SUSTAINED, interleaved_ms

    program, block = _program(name)
    dims = {d for t in program.inputs.values() for d in t.shape if isinstance(d, str)}
    sizes = {k: v for k, v in sizes.items() if k in dims}
    launches, timed = tuned_launches(program, block, sizes) if tuned else ({}, {})
    inputs = block.make_inputs(sizes, torch.bfloat16, seed=0, device="cuda")
    compiled = compile_program(program, analyze(program, sizes))
    compiled.epilogue_backend = "triton"
    prepared = compiled.prepare(inputs)
    tensors = compiled.run(prepared)
    info = compiled.info_for({n: prepared[n] for n in program.inputs})
    act = activation_dtype(program, tensors)
    rows = []
    for step, sname in zip(program.steps, program.step_names(), strict=True):
        if not isinstance(step, GemmEpilogue) or (info.gemms[sname].vendor and not vendor):
            continue
        if only and sname not in only:
            continue
        gemm = info.gemms[sname]
        compiled.run_gemm_step(sname, tensors)  # Triton: the reference for the checks
        want = {n: tensors[n].clone() for n in gemm.writes if gemm.writes[n].partials is None}
        runner = launch.CuteStep(step)
        a, b = runner._operands(tensors)
        fns = {"cublas": lambda a=a, b=b: torch.mm(a, b.t()), **launches.get(sname, {})}
        errors = {}
        b_name = step.b.tensor
        stored = tensors[b_name]
        flipped = stored.t().contiguous().t()  # the same values, the other dimension contiguous
        for config in configs:
            for b_tensor in (stored, flipped) if copies else (stored,):
                local = dict(tensors)
                local[b_name] = b_tensor
                label = f"cute {config_label(config)} B {_major(runner, local)}"
                label += " (copy)" if b_tensor is flipped else ""
                try:
                    actions = runner.actions(gemm, local, act, stored.device, False, config)
                except CuteUnsupported as e:
                    errors[label] = f"refused: {e}"[:200]
                    continue
                except Exception as e:  # a config that does not fit shared memory
                    errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    continue
                run = actions[-1]
                run(local, None)  # twice: a dynamic scheduler's tile counter must be back at 0
                run(local, None)
                torch.cuda.synchronize()
                err = max(
                    float((local[n].float() - w.float()).abs().max() / w.float().abs().max())
                    for n, w in want.items()
                )
                if err > 0.02:
                    errors[label] = f"WRONG: {err:.3g}"
                    continue
                fns[label] = lambda run=run, local=local: run(local, None)
            for spec in without:
                smaller = ablated(step, spec)
                if smaller is None:
                    continue
                label = f"cute {config_label(config)} without {spec}"
                local = dict(tensors)
                try:
                    actions = launch.CuteStep(smaller).actions(
                        gemm, local, act, stored.device, False, config
                    )
                except Exception as e:  # noqa: BLE001 (an experiment: report and go on)
                    errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    continue
                fns[label] = lambda run=actions[-1], local=local: run(local, None)
        times = interleaved_ms(fns, rounds=rounds, warmup=SUSTAINED["warmup"], rep=SUSTAINED["rep"])
        row = {
            "program": name, "step": sname, "M": gemm.M, "N": gemm.N, "K": gemm.K,
            "b_stored": _major(runner, tensors),
            "ms": times, "over_cublas": {k: v / times["cublas"] for k, v in times.items()},
            "errors": errors, "tuning": timed.get(sname),
        }  # fmt: skip
        rows.append(row)
        best = min((k for k in times if k != "cublas"), key=times.get, default=None)
        print(
            f"{name} {sname} {gemm.M}x{gemm.N}x{gemm.K} (B {row['b_stored']}): cublas "
            f"{times['cublas']:.3f} ms; "
            + "; ".join(f"{k} {v:.3f}" for k, v in times.items() if k != "cublas")
            + f"; best {best}; {errors or ''}",
            flush=True,
        )
    return rows


def _program(name: str):
    """The shipped Program ``name`` (``export/programs``) and its block, or else the block
    ``name`` (a paper kernel, say) and the Program the planner lowers it to."""
    from coda.blocks import get_block
    from coda.primitives.ir import Program

    shipped = ROOT / "export" / "programs" / f"{name}.json"
    if shipped.exists():
        program = Program.model_validate(json.loads(shipped.read_text())["program"])
        return program, get_block(program.block)
    from coda.planner import lower

    block = get_block(name)
    return lower(block), block


def _major(runner, tensors) -> str:
    """How the step's B operand, as QuACK takes it (``[N, K]``), lies in memory."""
    return "K-major" if runner._operands(tensors)[1].stride(1) == 1 else "N-major"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", default=PROGRAMS)
    p.add_argument("--configs", default="128x128,128x192,256x128c")
    p.add_argument("--size", action="append", default=[], metavar="NAME=N")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--stored-only", action="store_true",
        help="B as stored only: no variant on a copy laid out the other way (half the compiles)",
    )  # fmt: skip
    p.add_argument(
        "--without", default="", metavar="SPECS",
        help="comma-separated epilogue ablations, each ops joined by + (see the docstring)",
    )  # fmt: skip
    p.add_argument("--steps", default="", help="comma-separated step names (default: every one)")
    p.add_argument(
        "--tuned", action="store_true",
        help="also time each step's kernel as quick tuning pins it, and its tuned Triton kernel",
    )  # fmt: skip
    p.add_argument(
        "--vendor", action="store_true",
        help="also the plain steps (cuBLAS in the product) on the CuTe kernel at each config",
    )  # fmt: skip
    args = p.parse_args(argv)
    without = [w for w in args.without.split(",") if w]
    sizes = dict(SIZES)
    sizes.update({k: int(v) for k, v in (s.split("=", 1) for s in args.size)})
    configs = [parse_config(c) for c in args.configs.split(",")]
    rows: list[dict] = []
    for name in args.programs.split(","):
        rows += step_rows(
            name, sizes, configs, args.rounds, without, not args.stored_only, args.tuned,
            args.vendor, frozenset(filter(None, args.steps.split(","))),
        )  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
