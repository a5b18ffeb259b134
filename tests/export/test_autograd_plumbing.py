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
    """A tuned function pins each input shape's tuned configs (Triton's and the CuTe backend's
    choices) on its compiled Program on every call, and skips pinning while the compiled Program
    holds them: alternating shapes, a config replaced in the compiled Program, the compiled
    Program's dict replaced and a tuned entry replaced between calls each leave the right configs
    pinned."""
    from coda.export import llama_mlp_function
    from coda.primitives.cute.launch import CuteConfig

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
        cute = {5: {"gate_up": CuteConfig(128, 128, 1, 2)}, 9: {"gate_up": None}}
        runner.tuned.update({keys[m]: (dict(tuned[m]), dict(cute[m])) for m in xs})

        def pinned_after(m: int) -> dict:
            with torch.no_grad():
                fn(xs[m], *weights)
            assert runner.compiled.cute_configs == cute[m]
            return dict(runner.compiled.configs)

        assert pinned_after(5) == tuned[5] and pinned_after(9) == tuned[9]
        assert pinned_after(5) == tuned[5] and pinned_after(5) == tuned[5]
        other = tuned[9]["down"]
        runner.compiled.configs["down"] = other  # changed in place
        assert pinned_after(5) == tuned[5]
        runner.compiled.configs = {}  # replaced
        assert pinned_after(5) == tuned[5]
        runner.tuned[keys[5]] = ({**tuned[5], "down": other}, cute[5])  # a new tuned entry
        assert pinned_after(5) == {**tuned[5], "down": other}
        runner.tuned[keys[5]][0]["down"] = tuned[5]["down"]  # that entry changed in place
        assert pinned_after(5) == tuned[5]
        runner.compiled.cute_configs["gate_up"] = None  # a CuTe choice changed in place
        assert pinned_after(5) == tuned[5]
    finally:
        fn.tune = "off"
        for key in keys.values():
            runner.tuned.pop(key, None)
        runner.compiled.configs, runner.compiled.cute_configs = {}, {}


def test_outputs_a_run_made_anew_are_kept_and_every_other_one_is_checked() -> None:
    """``_unaliased``: an output the call allocated anew (``made``) is returned as it is; a view
    is copied; an output sharing memory with an argument or with an earlier output (a made one
    included) is copied — the arguments' memory looked up only when such an output comes."""
    from coda.export.autograd import _unaliased

    arg, other = torch.randn(4, 3), torch.randn(4, 3)
    made = torch.randn(4, 3)
    assert _unaliased([made], [arg], made=[0])[0] is made
    outs = _unaliased([made, arg, arg[1:], made.view(12), other], [arg], made=[0])
    assert outs[0] is made and outs[4] is other
    for i, t in enumerate(outs[1:4], start=1):  # the argument, a view of it, a view of made
        assert t._base is None and t.untyped_storage().data_ptr() not in {
            arg.untyped_storage().data_ptr(),
            made.untyped_storage().data_ptr(),
        }, i
    same = other.detach()  # other's memory, not a view (no _base), after made
    outs = _unaliased([made, other, same], [arg], made=[0])
    assert outs[1] is other and outs[2] is not same
    assert outs[2].untyped_storage().data_ptr() != other.untyped_storage().data_ptr()
    alias_of_made = made.detach()  # made's memory behind a tensor that was not made
    outs = _unaliased([made, alias_of_made], [arg], made=[0])
    assert outs[1].untyped_storage().data_ptr() != made.untyped_storage().data_ptr()


def test_eager_calls_apply_the_function_without_function_apply(monkeypatch) -> None:  # noqa: ANN001
    """An eager call reaches ``_FunctionBase.apply`` directly (``Function.apply``'s Python per
    call left out) with the same values and gradients; a dead functorch wrapper (a tensor that
    outlived its ``torch.func`` transform) still reaches the forward unwrapped, as
    ``Function.apply`` would hand it."""
    from coda.export import llama_mlp_function
    from coda.export.autograd import EAGER_CALLS, _direct_apply

    if not EAGER_CALLS:
        pytest.skip("CODA_DISPATCH_OPS=1: every call goes through the registered ops")
    fn = llama_mlp_function(1e-5, verify=False, tune="off")
    gen = torch.Generator().manual_seed(3)
    weights = [1 + 0.1 * torch.randn(48, generator=gen)]
    weights += [torch.randn(*s, generator=gen) / 7 for s in ((80, 48), (80, 48), (48, 80))]
    weights = [w.requires_grad_() for w in weights]
    x = torch.randn(9, 48, generator=gen, requires_grad=True)
    want = fn.eager.apply(x, *weights)[0]
    want_grads = torch.autograd.grad(want.sum(), [x, *weights])

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("Function.apply ran")

    with monkeypatch.context() as patched:
        patched.setattr(torch.autograd.Function, "apply", classmethod(refuse))
        got = fn(x, *weights)
        got_grads = torch.autograd.grad(got.sum(), [x, *weights])
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.equal(g, w)

    leaked = []
    torch.func.grad(lambda t: leaked.append(t) or (t * t).sum())(torch.randn(3))
    assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])
    seen = []

    class Recorder(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):  # noqa: ANN001, ANN205
            seen.append(torch._C._functorch.is_functorch_wrapped_tensor(t))
            return t * 2

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            return g * 2

    Recorder.apply(leaked[0])
    _direct_apply(Recorder)(leaked[0])
    assert seen == [False, False]
