"""The Qwen2/Qwen3 attention-input blocks: backward blocks without the bias inputs no gradient
depends on (their shown source runs and is autograd of the forward with the biases), epsilon
variants resolved by name."""

from __future__ import annotations

import pytest
import torch

from coda.blocks import get_block
from coda.blocks.autodiff import backward_block
from coda.blocks.qwen import COTANGENTS, qwen2_attn_in, qwen3_attn_in_family

SIZES = {"M": 5, "d": 12, "Nq": 16, "Nkv": 8, "D": 4}


def test_qwen2_backward_leaves_out_the_biases_and_is_autograd_with_them() -> None:
    block = get_block("qwen2_attn_in_bwd")
    assert not {"b_q", "b_k", "b_v"} & set(block.inputs)
    assert {"db_q", "db_k", "db_v"} <= set(block.outputs)
    inputs = block.make_inputs(SIZES, torch.float64, seed=0)
    got = block.reference(inputs)
    # autograd through the forward with random (not zero) biases gives the same gradients
    forward = {n: inputs[n] for n in qwen2_attn_in.inputs if n in inputs}
    gen = torch.Generator().manual_seed(1)
    for name in ("b_q", "b_k", "b_v"):
        width = SIZES["Nq" if name == "b_q" else "Nkv"]
        forward[name] = torch.randn(width, dtype=torch.float64, generator=gen)
    leaves = {n: t.clone().requires_grad_(n not in ("cos", "sin")) for n, t in forward.items()}
    outs = qwen2_attn_in.reference(leaves)
    cot = {o: inputs[f"d{o}"] for o in COTANGENTS}
    names = [n for n in leaves if n not in ("cos", "sin")]
    grads = torch.autograd.grad(
        [outs[o] for o in cot], [leaves[n] for n in names], [cot[o] for o in cot]
    )
    for name, grad in zip(names, grads, strict=True):
        torch.testing.assert_close(got[f"d{name}"], grad)
    namespace: dict = {}
    exec(block.reference_source(), namespace)  # noqa: S102
    shown = namespace["qwen2_attn_in_bwd"](**inputs)
    assert all(torch.equal(shown[o], got[o]) for o in block.outputs)


def test_zeros_and_saved_values_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="saved forward values depend on the inputs"):
        backward_block(
            qwen2_attn_in,
            name="qwen2_both",
            cotangents=COTANGENTS,
            wrt=["x"],
            saved=COTANGENTS,
            zeros=["b_q"],
        )


def test_epsilon_variants_resolve_by_name() -> None:
    family = qwen3_attn_in_family(1e-6)
    assert family["forward"].name == "qwen3_attn_in_eps1e-06"
    assert get_block("qwen3_attn_in_eps1e-06_bwd") is family["backward"]
    norms = [op for op in family["forward"].graph if hasattr(op, "eps")]
    assert {op.eps for op in norms} == {1e-6} and len(norms) == 3
