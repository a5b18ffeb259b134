"""The autograd glue of ``export_autograd`` works out once, per function, where each value sits
(the runner's argument binding, the saved tensors, the cotangents, the gradients) instead of
building dicts by name on every call: these tests pin what those positions must give."""

from __future__ import annotations

import pytest
import torch

from coda.blocks import get_block
from coda.export.attention import hf_attn_in_function


@pytest.mark.parametrize("used", ["k_rot", "v"])
def test_outputs_a_loss_does_not_use_get_zero_cotangents_of_their_own_shape(used: str) -> None:
    """qwen2_attn_in returns q, k and v, of two widths; a loss of one of them hands the backward
    None for the others, which must become zeros shaped like those outputs (not like another
    one): the gradients equal autograd of the block's PyTorch reference."""
    fn = hf_attn_in_function("qwen2_attn_in", 1e-6, tune="off")
    block = get_block("qwen2_attn_in")
    sizes = {"M": 9, "d": 24, "Nq": 32, "Nkv": 16, "D": 16}
    inputs = block.make_inputs(sizes, torch.float32, seed=5)
    names = [n for n in fn.input_names if n not in ("cos", "sin")]
    leaves = [inputs[n].clone().requires_grad_() for n in names]
    args = [*leaves, inputs["cos"], inputs["sin"]]
    got = dict(zip(fn.output_names, fn(*args), strict=True))
    cot = torch.randn_like(got[used])
    got_grads = torch.autograd.grad(got[used], leaves, cot)
    want = block.reference({**inputs, **dict(zip(names, leaves, strict=True))})[used]
    want_grads = torch.autograd.grad(want, leaves, cot, materialize_grads=True)
    torch.testing.assert_close(got[used], want, atol=1e-4, rtol=1e-4)
    for name, g, w in zip(names, got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=name)


def test_a_runner_called_with_the_wrong_number_of_tensors_names_what_it_takes() -> None:
    fn = hf_attn_in_function("qwen2_attn_in", 1e-6, tune="off")
    x = torch.randn(4, 24)
    with pytest.raises(TypeError, match=r"takes 10 tensors \(x, gamma, w_q, .*\), not 1"):
        fn.runners[0](x)
