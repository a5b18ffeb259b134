"""Generated code as text: structure, and golden snapshots of the llama_mlp kernels.

Regenerate the snapshots after an intended codegen change with ``CODA_UPDATE_GOLDEN=1 pytest
tests/primitives/test_codegen.py`` and review the diff like any other code change.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import analyze, compile_program
from coda.primitives.ir import GemmEpilogue
from tests.helpers import gemm_program

GOLDEN = Path(__file__).parent.parent / "golden"


@pytest.fixture(scope="module")
def llama():
    block = get_block("llama_mlp")
    program = lower(block)
    return program, compile_program(program, analyze(program, block.shapes.cpu[0]))


def _kernel_body(source: str, function: str) -> str:
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return ast.get_source_segment(source, fn) or ""


def test_one_module_per_gemm_with_one_dot_per_mainloop(llama) -> None:
    program, compiled = llama
    fused = [s for s in program.steps if isinstance(s, GemmEpilogue) and not s.is_plain_store]
    assert len(compiled.kernels) == len(fused)
    for kernel in compiled.kernels.values():
        # _compute_pid; the epilogue and its sub-tiling wrapper with pointer accesses and with
        # TMA tiles (every llama_mlp step moves tiles); the TMA mainloop with either epilogue and
        # the pointer mainloop
        assert kernel.source.count("@triton.jit") == 8
        assert set(kernel.variants) == {"tma", "tma_mainloop", "pointer"}
        epilogue = f"_{kernel.step}_epilogue"
        tma_body = _kernel_body(kernel.source, kernel.variants["tma"].function)
        ptr_body = _kernel_body(kernel.source, kernel.variants["pointer"].function)
        mixed_body = _kernel_body(kernel.source, kernel.variants["tma_mainloop"].function)
        assert f"{epilogue}_tma_tile(" in tma_body and f"{epilogue}_tile(" in ptr_body
        assert "a_desc.load(" in mixed_body and f"{epilogue}_tile(" in mixed_body
        assert "_desc." in _kernel_body(kernel.source, f"{epilogue}_tma")
        assert "_desc" not in _kernel_body(kernel.source, epilogue)
        for variant in kernel.variants.values():
            assert _kernel_body(kernel.source, variant.function).count("tl.dot(") == 1
        assert kernel.source.count("tl.dot(") == len(kernel.variants)
        assert "torch" not in kernel.source
        compile(kernel.source, kernel.step, "exec")


def test_every_written_tensor_is_stored(llama) -> None:
    program, compiled = llama
    for step in program.steps:
        if not isinstance(step, GemmEpilogue) or step.name not in compiled.kernels:
            continue
        source = compiled.kernels[step.name].source
        for op in step.epilogue:
            target = getattr(op, "to", None)
            if target is not None:
                assert re.search(rf"tl\.store\({target}(_tensor)?_ptrs?\b", source), target


def test_banners_name_each_primitive(llama) -> None:
    program, compiled = llama
    gate_up = compiled.kernels["gate_up"].source
    assert gate_up.count("# --- epilogue ---") == 3  # one call per mainloop
    for op in program.steps[1].epilogue:
        assert f"# --- {op.describe()} ---" in gate_up


def test_plain_store_gemm_runs_on_the_vendor_gemm() -> None:
    program = gemm_program([{"op": "store", "src": "acc", "to": "c"}])
    compiled = compile_program(program, analyze(program, {"M": 8, "N": 16, "K": 16}))
    assert compiled.kernels == {}


def test_operand_names_a_and_b_do_not_collide() -> None:
    program = gemm_program(
        [
            {"op": "add_tile", "src": "acc", "tensor": "a", "out": "y"},
            {"op": "store", "src": "y", "to": "b2"},
        ]
    )
    # a is [M, K] and is added as an [M, N] tile when K == N
    compiled = compile_program(program, analyze(program, {"M": 8, "N": 16, "K": 16}))
    source = compiled.kernels["k"].source
    assert "a_tensor_ptr" in source and "a_ptr" in source


@pytest.mark.parametrize("step", ["gate_up", "down"])
def test_golden_llama_mlp_kernels(llama, step: str) -> None:
    _, compiled = llama
    source = compiled.kernels[step].source
    path = GOLDEN / f"llama_mlp.{step}.py"
    if os.environ.get("CODA_UPDATE_GOLDEN"):
        path.write_text(source)
    assert path.exists(), f"no snapshot {path}; run with CODA_UPDATE_GOLDEN=1 to create it"
    assert source == path.read_text(), (
        f"generated {step} kernel differs from {path}; if intended, regenerate with "
        "CODA_UPDATE_GOLDEN=1 and review the diff"
    )


def test_mainloop_choice_follows_operand_layout() -> None:
    import torch

    from coda.primitives.runtime import choose_mainloop

    program = gemm_program(
        [
            {"op": "store", "src": "acc", "to": "c", "dtype": "float32"},
            {"op": "map", "expr": "acc", "out": "y"},
            {"op": "store", "src": "y", "to": "d"},
        ]
    )
    step = program.steps[0]
    cpu = torch.device("cpu")
    aligned = {"a": torch.zeros(8, 32), "b": torch.zeros(16, 32)}
    ragged = {"a": torch.zeros(8, 45), "b": torch.zeros(16, 45)}  # rows of 180 bytes
    assert choose_mainloop("auto", step, aligned, cpu) == "tma"
    assert choose_mainloop("auto", step, ragged, cpu) == "pointer"
    assert choose_mainloop("pointer", step, aligned, cpu) == "pointer"
    with pytest.raises(RuntimeError, match="TMA mainloop was requested but cannot describe"):
        choose_mainloop("tma", step, ragged, cpu)


def test_gpu_tuning_space_is_well_formed() -> None:
    # The GPU path of tune_program cannot run here; its candidate space can be checked.
    from coda.primitives.codegen.tuning import _HOPPER_SPACE, candidate_configs

    configs = candidate_configs(16384, 16384, 2048, itemsize=2, interpret=False)
    assert 0 < len(configs) <= len(_HOPPER_SPACE)
    assert any(c.warp_specialize for c in configs) and any(c.flatten for c in configs)
    small = candidate_configs(8, 64, 64, itemsize=2, interpret=False)
    assert all(c.block_m <= 128 for c in small)


def test_a_tma_epilogue_too_big_for_shared_memory_falls_back_to_pointer_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the H200, TMA-staged epilogue tiles next to a deep mainloop pipeline can need more shared
    # memory than the SM has (the launch fails before running): the step reruns with pointer tiles
    # and remembers that for its config.
    import torch
    from triton.runtime.errors import OutOfResources

    from coda.primitives.runtime import CompiledProgram

    block = get_block("llama_mlp")
    program = lower(block)
    inputs = block.make_inputs(block.shapes.cpu[0], torch.float32, seed=0)
    compiled = compile_program(program, analyze(program, block.shapes.cpu[0]))
    want = compiled(inputs)  # with the TMA epilogue
    assert set(compiled.mainloops_used.values()) == {"tma"}
    compiled = compile_program(program, analyze(program, block.shapes.cpu[0]))
    launched: list[str] = []
    launch = CompiledProgram._launch

    def small_smem(self, *args):  # noqa: ANN001, ANN202
        variant = args[-1]
        launched.append(variant)
        if variant == "tma":
            raise OutOfResources(262160, 232448, "shared memory")
        return launch(self, *args)

    monkeypatch.setattr(CompiledProgram, "_launch", small_smem)
    got = compiled(inputs)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    assert set(compiled.mainloops_used.values()) == {"tma_mainloop"}
    assert launched.count("tma") == len(compiled.kernels)  # tried once per step and config
    launched.clear()
    got = compiled(inputs)  # the same run signature: its plan replays, deciding nothing
    assert launched == []
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    got = compiled(inputs, poison=True)  # a new run signature decides anew, remembering
    assert launched == ["tma_mainloop"] * len(compiled.kernels)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    compiled.mainloop = "pointer"  # a forced variant that fails is not replaced
    monkeypatch.setattr(CompiledProgram, "_launch", lambda self, *a: (_ for _ in ()).throw(
        OutOfResources(1, 0, "shared memory")))  # fmt: skip
    with pytest.raises(OutOfResources):
        compiled(inputs)


def test_one_compiled_program_reused_across_sizes_configs_and_variants() -> None:
    # Launch plans (arguments' sources, grid, meta-parameters) are cached per size binding,
    # config and variant: a program called alternately at two sizes, under two pinned configs and
    # both kernel variants must match a fresh program every time.
    import torch

    from coda.primitives.ir import MainloopConfig

    block = get_block("llama_mlp")
    program = lower(block)
    small = MainloopConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
    split = small.model_copy(update={"block_n": 64, "epilogue_subtiles": 2})
    shared = compile_program(program, analyze(program, block.shapes.cpu[0]))
    calls = [
        (block.shapes.cpu[1], None, "auto"),
        (block.shapes.cpu[0], small, "auto"),
        (block.shapes.cpu[1], split, "auto"),
        (block.shapes.cpu[1], split, "pointer"),
        (block.shapes.cpu[0], split, "auto"),
        (block.shapes.cpu[1], None, "auto"),
    ]
    for i, (sizes, config, mainloop) in enumerate(calls):
        inputs = block.make_inputs(sizes, torch.float32, seed=i)
        fresh = compile_program(program, analyze(program, sizes))
        for compiled in (shared, fresh):
            compiled.configs = {} if config is None else dict.fromkeys(compiled.kernels, config)
            compiled.mainloop = mainloop
        got, want = shared(inputs), fresh(inputs)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=f"call {i}: {name}")
        assert shared.mainloops_used == fresh.mainloops_used
    assert len(shared._plans) > len(shared.kernels)  # several plans per step, each reused
