"""Small programs for testing one primitive at a time: ``acc = a @ b`` then the ops under test.

The operand tensors are named ``a`` and ``b`` on purpose: those names collide with the GEMM
operands' kernel parameters, which codegen must rename.
"""

from __future__ import annotations

from typing import Any

import torch

from coda.primitives import Program, analyze, bind_sizes, compile_program, execute_reference

# (atol, rtol) of kernel vs reference executor at kernel precision: a store may round differently
# by one unit in the last place of its dtype; bfloat16 (GPU only) has 8 mantissa bits (~4e-3
# relative) and accumulation order may flip a rounding, hence about two ulps.
DTYPE_TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def gemm_program(
    epilogue: list[dict[str, Any]],
    extra: dict[str, Any] | None = None,
    *,
    a_t: bool = False,
    b_t: bool = True,
    outputs: dict[str, str] | None = None,
    config: Any = "auto",
    prep: list | None = None,
    steps_before: list | None = None,
) -> Program:
    """One gemm step over ``a`` [M, K] (or [K, M] if a_t) and ``b`` [N, K] used as b.T (or [K,
    N]).
    """
    inputs = {"a": ["K", "M"] if a_t else ["M", "K"], "b": ["N", "K"] if b_t else ["K", "N"]}
    inputs.update(extra or {})
    gemm = {
        "kind": "gemm",
        "name": "k",
        "a": "a.T" if a_t else "a",
        "b": "b.T" if b_t else "b",
        "epilogue": epilogue,
        "config": config,
    }
    stored = [op["to"] for op in epilogue if op["op"] == "store"]
    return Program.parse(
        {
            "block": "test",
            "inputs": inputs,
            "prep": prep or [],
            "steps": [*(steps_before or []), gemm],
            "outputs": outputs or {t: t for t in stored},
        }
    )


def make_inputs(
    program: Program, sizes: dict[str, int], dtype: torch.dtype, seed: int = 0, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Random inputs; int64 inputs are column indices in [0, N) plus a few out of range."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, decl in program.inputs.items():
        shape = [sizes[d] if isinstance(d, str) else d for d in decl.shape]
        if decl.dtype == "int64":
            index = torch.randint(0, sizes["N"], shape, generator=gen)
            index[::7] = -100  # an ignore_index: no column holds it
            index[3::11] = sizes["N"] + 3
            out[name] = index
            continue
        x = torch.randn(shape, generator=gen) / (sizes.get("K", 1) ** 0.25)
        out[name] = x.to(dtype if decl.dtype == "act" else torch.float32).to(device)
    return out


def rope_tables(
    rows: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[rows, head_dim]`` like Hugging Face's: random angles, the two halves equal."""
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 6.3
    emb = torch.cat([angles, angles], dim=1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def run_both(
    program: Program,
    inputs: dict[str, torch.Tensor],
    mainloop: str = "auto",
    variants_used: dict[str, str] | None = None,
):
    """(kernel tensors, kernel-precision reference tensors, exact float64 reference tensors);
    ``variants_used`` receives the kernel variant each fused step launched."""
    info = analyze(program, bind_sizes(program, {n: t.shape for n, t in inputs.items()}))
    compiled = compile_program(program, info)
    compiled.mainloop = mainloop
    got = compiled.run(compiled.prepare(inputs), poison=True)
    if variants_used is not None:
        variants_used.update(compiled.mainloops_used)
    ref = execute_reference(program, inputs)
    exact = execute_reference(program, inputs, exact=True)
    return got, ref, exact


def captured_residual_file(name: str, cpu: list[dict[str, int]]) -> str:
    """A block file's source that captures ``x + F.linear(x, w)`` with ``Block.from_torch`` as
    block ``name`` at CPU shape sets ``cpu`` and registers it when imported."""
    return f"""
import torch.nn.functional as F

from coda.blocks import Block, ShapeSets, TensorSpec, register


def proj_residual(x, w):
    return x + F.linear(x, w)


captured = register(
    Block.from_torch(
        proj_residual,
        name="{name}",
        inputs={{"x": TensorSpec(shape=["M", "d"]), "w": TensorSpec(shape=["d", "d"])}},
        shapes=ShapeSets(cpu={cpu!r}),
    )
)
"""


def residual_program(block: Any) -> dict[str, Any]:
    """``out = x + x @ w.T`` in one fused gemm, for a test block with inputs ``x`` and ``w``."""
    return {
        "block": block.name,
        "inputs": block.program_inputs(),
        "steps": [
            {
                "kind": "gemm",
                "a": "x",
                "b": "w.T",
                "epilogue": [
                    {"op": "add_tile", "src": "acc", "tensor": "x", "out": "o"},
                    {"op": "store", "src": "o", "to": "out"},
                ],
            }
        ],
        "outputs": {"out": "out"},
    }


_COMPILE_FOR_HOPPER = """
import json, sys, importlib
import triton
from coda.primitives.offline_target import StandInDriver
spec = json.loads(sys.stdin.read())
module, name = spec["kernel"].split(":")
kernel = getattr(importlib.import_module(module), name)
fn = triton.jit(getattr(kernel, "fn", kernel))  # (on a CPU, coda's kernels are interpreted)
names = list(fn.arg_names)
signature = {n: spec["signature"].get(n, "constexpr") for n in names}
constants = {(names.index(k),): v for k, v in spec["constexprs"].items()}
source = triton.compiler.ASTSource(fn, signature, constants)
compiled = triton.compile(source, target=StandInDriver(90).target, options={"num_warps": 4})
assert compiled.asm["cubin"], "no cubin"
sys.stdout.write(compiled.asm["ptx"])
"""


def compile_for_hopper(kernel: str, signature: dict[str, str], constexprs: dict[str, Any]) -> str:
    """The PTX of coda's Triton kernel ``kernel`` (``"module:function"``) compiled for sm_90 —
    to the cubin, through Triton's bundled ptxas — as a GPU would compile it, for kernels whose
    GPU path a CPU cannot run. ``signature``: every runtime argument's type (``"*bf16"``,
    ``"i32"``, ``"fp32"``), ``constexprs`` the meta-parameters' values. In a fresh process: once
    a kernel has run in Triton's interpreter, the process's ``triton.language`` builtins stay the
    interpreter's, and compiling there fails."""
    import json
    import subprocess
    import sys

    spec = json.dumps({"kernel": kernel, "signature": signature, "constexprs": constexprs})
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER],
        input=spec, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"{kernel} did not compile for sm_90:\n{done.stderr[-3000:]}")
    return done.stdout


_WARM_FOR_HOPPER = """
import importlib, importlib.util, json, pickle, sys
import torch
torch.cuda.is_available = lambda: True  # coda's kernels import as Triton's, not interpreted
from coda.primitives.offline_target import for_target


def kernel(module, path, function):
    if module.startswith("coda_generated_"):  # a generated module: run its file, as codegen does
        if module not in sys.modules:
            spec = importlib.util.spec_from_file_location(module, path)
            sys.modules[module] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[module])
    return getattr(importlib.import_module(module), function)


with for_target(90):
    for module, path, function, grid, args, meta in pickle.load(sys.stdin.buffer):
        row = {"kernel": function, "meta": {k: v for k, v in meta.items() if k.isupper()}}
        try:
            compiled = kernel(module, path, function).warmup(*args, grid=grid, **meta)
            row.update(shared=compiled.metadata.shared, cubin=len(compiled.asm["cubin"]))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[-3000:]
        print(json.dumps(row, default=str), flush=True)
"""


def warm_for_hopper(launches: list[tuple[Any, Any, tuple, dict]]) -> list[dict[str, Any]]:
    """Compile each collected launch's kernel for sm_90 as that launch would on an H200 —
    ``JITFunction.warmup`` on its arguments (dtypes, alignments, integers, descriptors) and
    meta-parameters, through Triton's whole pipeline to a cubin — in a fresh process, through
    ``offline_target.for_target(90)`` (see ``compile_for_hopper`` for why not this one).
    ``launches``: ``(kernel, grid, args, meta)`` as ``launch.collected_launches`` collects them
    (interpreted kernels, CPU tensors). One row per launch: ``kernel``, its upper-case
    ``meta``, and ``shared`` bytes and ``cubin`` size, or ``error``."""
    import json
    import pickle
    import subprocess
    import sys

    specs = []
    for kernel, grid, args, meta in launches:
        fn = getattr(kernel, "fn", kernel)
        specs.append((fn.__module__, fn.__code__.co_filename, fn.__name__, grid, args, meta))
    done = subprocess.run(
        [sys.executable, "-c", _WARM_FOR_HOPPER],
        input=pickle.dumps(specs), capture_output=True, timeout=1800, check=False,
    )  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.decode().splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(rows) != len(specs):
        raise AssertionError(f"compiling for sm_90 stopped:\n{done.stderr.decode()[-3000:]}")
    return rows
