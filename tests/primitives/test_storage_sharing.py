"""An aux output takes over an intermediate's storage (``primitives/storage_sharing.py``): the
chunked LM-head loss's ``dz`` is written over its logits, the decision recorded in the run plan
and replayed, with the values of a run that allocates ``dz`` bit for bit — and never where the
logits are read later, are a Program output or a Program input, or in a poisoned run."""

from __future__ import annotations

import pytest
import torch

from coda.export.lm_head_chunks import LOGITS, gradient_block, gradient_program
from coda.export.resolve import dropin_programs
from coda.primitives import analyze, compile_program
from coda.primitives.analysis import bind_sizes
from coda.primitives.ir import Program
from coda.primitives.run_plans import Allocate
from coda.primitives.runtime import CompiledProgram
from coda.primitives.storage_sharing import _owns_storage

SIZES = {"M": 5, "d": 24, "V": 37}  # odd rows and vocabulary: partial tiles and column blocks


@pytest.fixture(scope="module")
def chunk() -> Program:
    """The chunked LM-head loss's Program (as verified against ``llama_lm_head_ce_grad``)."""
    train, backward = dropin_programs(
        "llama_lm_head_ce", ("train", "backward_saved"), 1e-5, verify=False
    )
    return gradient_program(train, backward, None)


def _compiled(program: Program) -> CompiledProgram:
    return compile_program(program, analyze(program, SIZES))


def _inputs(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    return gradient_block("llama_lm_head_ce", 1e-5).make_inputs(SIZES, dtype, seed)


def _shared_pairs(compiled: CompiledProgram) -> set[tuple[str, str]]:
    """Every (output, input) pair the recorded run plans share storage between."""
    return {
        pair
        for plan in compiled._run_plans.values()
        for action in plan.actions
        if isinstance(action, Allocate)
        for pair in action.shared
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dz_takes_over_the_logits_and_equals_an_allocated_dz_bit_for_bit(
    chunk: Program, dtype: torch.dtype
) -> None:
    compiled = _compiled(chunk)
    inputs = _inputs(dtype)
    shared = compiled.run(compiled.prepare(inputs))
    assert shared["dz"].data_ptr() == shared[LOGITS].data_ptr()
    assert _shared_pairs(compiled) == {("dz", LOGITS)}  # recorded in the run plan ...
    replayed = compiled.run(compiled.prepare(inputs))  # ... and replayed
    assert replayed["dz"].data_ptr() == replayed[LOGITS].data_ptr()
    assert replayed["dz"].data_ptr() != shared["dz"].data_ptr()  # (the first run's still held)
    # a poisoned run never shares (an unwritten dz element would hold a finite logit, not NaN)
    allocated = compiled.run(compiled.prepare(inputs), poison=True)
    assert allocated["dz"].data_ptr() != allocated[LOGITS].data_ptr()
    assert not torch.isnan(allocated["dz"]).any()
    for name in ("loss", "dz", "c", "dx", "dgamma_partials", "y", "dw_lm"):
        for run in (shared, replayed):
            assert torch.equal(run[name], allocated[name]), name


def test_logits_read_later_or_returned_keep_their_storage(chunk: Program) -> None:
    """A second ``ce_grad_rows`` of the same logits right after the first: the first may not
    write over them (the second reads them), the second may. With the logits a Program output,
    neither may."""
    data = chunk.model_dump(mode="json")
    first = next(i for i, s in enumerate(data["steps"]) if s["kind"] == "ce_grad_rows")
    again = {**data["steps"][first], "out": "dz_again", "zdz": "c_again"}
    data["steps"].insert(first + 1, again)
    read_twice = Program.model_validate(data)
    compiled = _compiled(read_twice)
    inputs = _inputs(torch.float32)
    tensors = compiled.run(compiled.prepare(inputs))
    assert _shared_pairs(compiled) == {("dz_again", LOGITS)}
    assert tensors["dz"].data_ptr() != tensors[LOGITS].data_ptr()
    assert torch.equal(tensors["dz"], tensors["dz_again"])  # the logits were intact for both
    returned = Program.model_validate(
        {**chunk.model_dump(mode="json"), "outputs": {**chunk.outputs, "z": LOGITS}}
    )
    compiled = _compiled(returned)
    out = compiled(inputs)
    assert _shared_pairs(compiled) == set()
    tensors = compiled.run(compiled.prepare(inputs))
    assert tensors["dz"].data_ptr() != tensors[LOGITS].data_ptr()
    assert torch.equal(out["z"], tensors[LOGITS])  # the logits, not dz
    want = _compiled(chunk)(inputs)
    for name, t in want.items():
        assert torch.equal(out[name], t), name


def test_logits_that_are_a_program_input_are_never_written() -> None:
    """``ce_grad_rows`` straight on an input's logits: ``dz`` is allocated, the input unchanged."""
    program = Program.model_validate(
        {
            "block": "ce_grad_of_given_logits",
            "inputs": {
                "z": ["M", "V"],
                "lse": {"shape": ["M"], "dtype": "float32"},
                "target": {"shape": ["M"], "dtype": "int64"},
                "dloss": {"shape": ["M"], "dtype": "float32"},
            },
            "steps": [
                {"kind": "ce_grad_rows", "logits": "z", "lse": "lse", "index": "target"}
                | {"scale": "dloss", "out": "dz", "zdz": "c"}
            ],
            "outputs": {"dz": "dz", "c": "c"},
        }
    )
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(3, 11, generator=gen, dtype=torch.float32)
    inputs = {
        "z": z,
        "lse": torch.logsumexp(z, dim=1),
        "target": torch.tensor([0, 10, 4]),
        "dloss": torch.rand(3, generator=gen),
    }
    before = z.clone()
    sizes = bind_sizes(program, {n: tuple(t.shape) for n, t in inputs.items()})
    compiled = compile_program(program, analyze(program, sizes))
    out = compiled(inputs)
    assert _shared_pairs(compiled) == set()
    assert out["dz"].data_ptr() != z.data_ptr() and torch.equal(z, before)
    want = torch.softmax(z, dim=1) - torch.nn.functional.one_hot(inputs["target"], 11)
    torch.testing.assert_close(out["dz"], want * inputs["dloss"][:, None])


def test_only_a_whole_unshared_contiguous_tensor_of_the_output_type_is_taken_over() -> None:
    t = torch.zeros(4, 6)
    shape, dtype = (4, 6), torch.float32
    assert _owns_storage({"z": t, "other": torch.zeros(4, 6)}, "z", shape, dtype)
    assert not _owns_storage({"z": t, "view": t[1:]}, "z", shape, dtype)  # another name's too
    assert not _owns_storage({"z": t}, "z", (6, 4), dtype)
    assert not _owns_storage({"z": t}, "z", shape, torch.float16)
    assert not _owns_storage({"z": torch.zeros(6, 4).T}, "z", shape, dtype)  # not contiguous
    assert not _owns_storage({"z": torch.zeros(5, 6)[1:]}, "z", shape, dtype)  # part of one
