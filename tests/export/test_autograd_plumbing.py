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


def test_pinned_configs_follow_the_call_s_shapes_and_every_change_to_them() -> None:
    """A tuned function pins each input shape's tuned configs on its compiled Program on every
    call, and skips pinning while the compiled Program holds them: alternating shapes, a config
    replaced in the compiled Program, the compiled Program's dict replaced and a tuned entry
    replaced between calls each leave the right configs pinned."""
    from coda.export import llama_mlp_function

    fn = llama_mlp_function(1e-5, verify=False, tune="off")
    runner = fn.runners[2]  # under no_grad the inference Program runs
    gen = torch.Generator().manual_seed(0)
    weights = [1 + 0.1 * torch.randn(48, generator=gen)]
    weights += [torch.randn(*shape, generator=gen) / 7 for shape in ((80, 48), (80, 48), (48, 80))]
    xs = {m: torch.randn(m, 48, generator=gen) for m in (5, 9)}
    keys, tuned = {}, {}
    with torch.no_grad():
        for m, x in xs.items():
            fn(x, *weights)  # compiles (untuned)
            inputs = runner.bind((x, *weights))
            keys[m] = tuple((tuple(t.shape), t.dtype) for t in inputs.values())
            defaults = runner.compiled.configs_for(runner.compiled.info_for(inputs))
            tuned[m] = {
                n: c.model_copy(update={"num_stages": {5: 2, 9: 4}[m]}) for n, c in defaults.items()
            }
    try:
        fn.tune = "quick"
        runner.tuned.update({keys[m]: dict(tuned[m]) for m in xs})

        def pinned_after(m: int) -> dict:
            with torch.no_grad():
                fn(xs[m], *weights)
            return dict(runner.compiled.configs)

        assert pinned_after(5) == tuned[5] and pinned_after(9) == tuned[9]
        assert pinned_after(5) == tuned[5] and pinned_after(5) == tuned[5]
        other = tuned[9]["down"]
        runner.compiled.configs["down"] = other  # changed in place
        assert pinned_after(5) == tuned[5]
        runner.compiled.configs = {}  # replaced
        assert pinned_after(5) == tuned[5]
        runner.tuned[keys[5]] = {**tuned[5], "down": other}  # a new tuned entry
        assert pinned_after(5) == {**tuned[5], "down": other}
        runner.tuned[keys[5]]["down"] = tuned[5]["down"]  # that entry changed in place
        assert pinned_after(5) == tuned[5]
    finally:
        fn.tune = "off"
        for key in keys.values():
            runner.tuned.pop(key, None)
        runner.compiled.configs = {}
