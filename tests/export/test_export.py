"""coda.export: Hugging Face's LlamaMLP (+ its RMSNorm and residual) on CODA kernels, forward and
backward, through the Triton interpreter — outputs and gradients against the original modules."""

from __future__ import annotations

import math

import pytest
import torch

from coda.export import CodaLlamaMLPBlock, llama_mlp_function

transformers = pytest.importorskip("transformers")


def _hf_modules(seed: int = 0, dtype: torch.dtype = torch.float32, **config):  # noqa: ANN003, ANN202
    """LlamaRMSNorm + LlamaMLP from a random LlamaConfig (no downloads), randomised weights."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    cfg = LlamaConfig(
        **{"hidden_size": 48, "intermediate_size": 80, "num_attention_heads": 4, **config}
    )
    torch.manual_seed(seed)
    norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    mlp = LlamaMLP(cfg)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(cfg.hidden_size))
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.weight.normal_(0, proj.in_features**-0.5)
    return norm.to(dtype), mlp.to(dtype)


def _grads(module: torch.nn.Module, x: torch.Tensor, dout: torch.Tensor, forward) -> list:  # noqa: ANN001
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = forward(x)
    out.backward(dout)
    return [out.detach(), x.grad, *[p.grad for p in module.parameters()]]


@pytest.mark.parametrize(
    "eps,saved", [(1e-6, True), (1e-5, False)], ids=["eps1e-6-saved", "eps1e-5-recompute"]
)
def test_drop_in_matches_hugging_face_outputs_and_gradients(eps: float, saved: bool) -> None:
    norm, mlp = _hf_modules(rms_norm_eps=eps)
    # the new epsilon's Programs are verified by the sandbox once; llama_mlp's are in tests/agent
    block = CodaLlamaMLPBlock(norm, mlp, verify=eps == 1e-6, saved=saved)
    x = torch.randn(2, 9, 48)  # [batch, seq, hidden]: 18 tokens, not a tile multiple
    dout = torch.randn(2, 9, 48)
    want = _grads(block, x, dout, lambda t: t + mlp(norm(t)))
    got = _grads(block, x, dout, block)
    names = ["out", "dx", "dgamma", "dw_gate", "dw_up", "dw_down"]
    for name, g, w in zip(names, got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5, msg=name)


@pytest.mark.parametrize("fuse", [False, True], ids=["hf-params", "fused-gate-up"])
def test_torch_compile_traces_around_the_custom_ops(fuse: bool) -> None:
    norm, mlp = _hf_modules(seed=1, rms_norm_eps=1e-5)
    block = CodaLlamaMLPBlock(norm, mlp, verify=False, fuse_gate_up=fuse)
    x, dout = torch.randn(11, 48), torch.randn(11, 48)
    eager = _grads(block, x, dout, block)
    compiled = torch.compile(lambda t: block(t) * 2, backend="aot_eager", fullgraph=True)
    got = _grads(block, x, dout, compiled)
    for g, w in zip(got, eager, strict=True):
        torch.testing.assert_close(g, w * 2, atol=1e-5, rtol=1e-5)


def test_the_custom_op_passes_torch_opcheck() -> None:
    fn = llama_mlp_function(1e-5, verify=False)
    norm, mlp = _hf_modules(seed=2)
    args = (
        torch.randn(7, 48),
        norm.weight.detach(),
        *[p.weight.detach() for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)],
    )
    torch.library.opcheck(fn.forward_op, args, test_utils=("test_schema", "test_faketensor"))
    # the backward returns dw_gate and dw_up from one interleaved gradient: copies, not aliases
    saved = fn.forward_op(*args)[1:]  # g, u and rstd_h, as the forward returns them
    assert fn.saved_names == ["g", "u", "rstd_h"] and saved[-1].shape == (7,)
    backward_args = (*args, *saved, torch.randn(7, 48))
    torch.library.opcheck(fn.backward_op, backward_args, test_utils=("test_schema",))


def test_the_packed_ops_pass_torch_opcheck() -> None:
    """Packed gate/up: the forward op takes one [2f, d] weight, the backward op returns its
    gradient as one [2f, d] tensor — real and fake implementations agree on both."""
    from coda.export.mlp import interleave_gate_up

    fn = llama_mlp_function(1e-5, verify=False, packed_gate_up=True)
    assert fn.input_names == ["x", "gamma", "w_gate_up", "w_down"]
    norm, mlp = _hf_modules(seed=2)
    gate_up = interleave_gate_up(mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach())
    x, weights = torch.randn(7, 48), [norm.weight.detach(), gate_up, mlp.down_proj.weight.detach()]
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(fn.forward_op, (x, *weights), test_utils=checks)
    saved = fn.forward_op(x, *weights)[1:]  # g, u and rstd_h
    backward_args = (x, *weights, *saved, torch.randn(7, 48))
    torch.library.opcheck(fn.backward_op, backward_args, test_utils=checks)
    dx, dgamma, dw_gate_up, dw_down = fn.backward_op(*backward_args)
    assert dw_gate_up.shape == (160, 48) and dw_down.shape == (48, 80)


def test_drop_in_rejects_what_the_block_does_not_compute() -> None:
    norm, mlp = _hf_modules(mlp_bias=True)
    with pytest.raises(ValueError, match="gate_proj has a bias"):
        CodaLlamaMLPBlock(norm, mlp, verify=False)
    norm, mlp = _hf_modules(hidden_act="gelu")
    no_kernel = "no shipped kernel computes a GELU GLU MLP under an RMSNorm x̂ · w; shipped: a SiLU"
    with pytest.raises(ValueError, match=no_kernel):
        CodaLlamaMLPBlock(norm, mlp, verify=False)
    norm, mlp = _hf_modules()
    block = CodaLlamaMLPBlock(norm, mlp, verify=False)
    with pytest.raises(TypeError, match="cast the modules to the activation dtype"):
        block(torch.randn(3, 48, dtype=torch.float64))
    half = CodaLlamaMLPBlock(*_hf_modules(dtype=torch.float16), verify=False, tune="off")
    with pytest.raises(TypeError, match="or run under torch.autocast"):
        half(torch.randn(3, 48))  # fp16 weights, fp32 activations, no autocast
    with torch.autocast("cpu", dtype=torch.float16):  # already in the autocast dtype: runs
        assert half(torch.randn(3, 48, dtype=torch.float16)).dtype == torch.float16


def test_configs_are_tuned_once_per_new_shape_and_tuning_can_be_switched_off() -> None:
    fn = llama_mlp_function(1e-5, verify=False)  # tune="quick"
    norm, mlp = _hf_modules(seed=3)
    weights = [norm.weight, *[p.weight for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]]
    forward_runner = fn.runners[2]  # under no_grad the inference Program runs (nothing to save)
    assert forward_runner.program.block == "llama_mlp"
    forward_runner.tuned.clear()
    with torch.no_grad():
        fn(torch.randn(5, 48), *weights)
        fn(torch.randn(5, 48), *weights)  # same shapes: no second tuning
        assert len(forward_runner.tuned) == 1
        fn(torch.randn(9, 48), *weights)
        assert len(forward_runner.tuned) == 2
        ((configs, cute),) = [c for k, c in forward_runner.tuned.items() if k[0][0] == (9, 48)]
        assert set(configs) == {"gate_up", "down"}  # every fused gemm step has its config
        assert cute == {}  # no step ran on the CuTe backend (a CPU): no CuTe choice to pin
        fn.tune = "off"
        fn(torch.randn(13, 48), *weights)
        assert len(forward_runner.tuned) == 2
    assert llama_mlp_function(1e-5, verify=False).tune == "quick"  # asking again sets it back
    with pytest.raises(ValueError, match="tune must be 'quick', 'full' or 'off'"):
        fn.tune = "fast"


@pytest.mark.parametrize(
    "saved,fuse",
    [(True, False), (False, False), (True, True), (False, True)],
    ids=["saved", "recompute", "fused", "fused-recompute"],
)
def test_training_steps_follow_hugging_face(saved: bool, fuse: bool) -> None:
    """A few SGD steps through the drop-in: weights change every step (prep runs per call, the
    saved g, u, a belong to that step) and land where the original modules' steps land."""
    import copy

    from torch import nn

    norm, mlp = _hf_modules(seed=4)
    reference = nn.ModuleDict({"norm": norm, "mlp": mlp})
    coda = copy.deepcopy(reference)
    block = CodaLlamaMLPBlock(
        coda["norm"], coda["mlp"], verify=False, saved=saved, fuse_gate_up=fuse
    )
    coda = nn.ModuleDict({"block": block})  # the fused parameter lives on the block
    runs = {
        "hf": (reference, lambda t: t + reference["mlp"](reference["norm"](t))),
        "coda": (coda, block),
    }
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(2, 9, 48, generator=gen) for _ in range(3)]
    losses: dict[str, list[float]] = {"hf": [], "coda": []}
    for name, (modules, forward) in runs.items():
        opt = torch.optim.SGD(modules.parameters(), lr=0.5)
        for x in batches:
            opt.zero_grad()
            loss = forward(x).square().mean()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    torch.testing.assert_close(losses["coda"], losses["hf"], atol=1e-5, rtol=1e-5)
    assert losses["hf"][0] != losses["hf"][-1]  # the steps moved the weights
    got = {k.removeprefix("block."): v for k, v in coda.state_dict().items()}
    assert sorted(got) == sorted(reference.state_dict())
    for n, want in reference.state_dict().items():
        torch.testing.assert_close(got[n], want, atol=1e-5, rtol=1e-5, msg=n)


def test_fused_gate_up_is_one_parameter_with_hugging_face_state_dict_keys() -> None:
    from coda.export.mlp import interleave_gate_up

    norm, mlp = _hf_modules(seed=6)
    gate, up = mlp.gate_proj.weight.detach().clone(), mlp.up_proj.weight.detach().clone()
    hf_state = {f"norm.{k}": v.clone() for k, v in norm.state_dict().items()}
    hf_state |= {f"mlp.{k}": v.clone() for k, v in mlp.state_dict().items()}
    block = CodaLlamaMLPBlock(norm, mlp, verify=False, fuse_gate_up=True)
    names = [n for n, _ in block.named_parameters()]
    assert names == ["gate_up_weight", "norm.weight", "mlp.down_proj.weight"]
    assert block.gate_up_weight.shape == (160, 48) and block.gate_up_weight.is_contiguous()
    torch.testing.assert_close(block.gate_weight, gate, atol=0, rtol=0)
    torch.testing.assert_close(block.up_weight, up, atol=0, rtol=0)
    assert not hasattr(mlp.gate_proj, "weight")  # the old parameters are gone, not stale
    # gradients: the interleaved layout of Hugging Face's two, in one contiguous tensor
    x, dout = torch.randn(13, 48), torch.randn(13, 48)
    block(x).backward(dout)
    ref = _hf_modules(seed=6)
    xr = x.clone().requires_grad_()
    (xr + ref[1](ref[0](xr))).backward(dout)
    want = interleave_gate_up(ref[1].gate_proj.weight.grad, ref[1].up_proj.weight.grad)
    assert block.gate_up_weight.grad.is_contiguous()
    torch.testing.assert_close(block.gate_up_weight.grad, want, atol=2e-5, rtol=2e-5)
    # state dicts in Hugging Face's keys, both ways
    saved = block.state_dict()
    assert sorted(saved) == sorted(hf_state)
    for k, v in hf_state.items():
        torch.testing.assert_close(saved[k], v, atol=0, rtol=0, msg=k)
    other = CodaLlamaMLPBlock(*_hf_modules(seed=7), verify=False, fuse_gate_up=True)
    assert not torch.equal(other.gate_up_weight, block.gate_up_weight)
    other.load_state_dict(hf_state)
    torch.testing.assert_close(other.gate_up_weight, interleave_gate_up(gate, up), atol=0, rtol=0)


def test_packed_gate_up_moves_no_weight_layouts() -> None:
    """Packed, the op interleaves no weights (the prep sees views of the packed tensor) and splits
    no weight gradient; unpacked it copies weights into the interleaved layout and back."""
    from torch.profiler import ProfilerActivity, profile

    from coda.export.mlp import interleave_gate_up

    norm, mlp = _hf_modules(seed=8)
    f, d = mlp.gate_proj.weight.shape
    w_gate, w_up = mlp.gate_proj.weight, mlp.up_proj.weight
    packed = interleave_gate_up(w_gate.detach(), w_up.detach()).requires_grad_()
    calls = {
        "packed": (True, [norm.weight, packed, mlp.down_proj.weight]),
        "unpacked": (False, [norm.weight, w_gate, w_up, mlp.down_proj.weight]),
    }
    copied = {}
    for name, (is_packed, weights) in calls.items():
        fn = llama_mlp_function(1e-5, verify=False, tune="off", packed_gate_up=is_packed)
        x = torch.randn(9, d, requires_grad=True)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = fn(x, *weights)
            torch.autograd.grad(out, [x, *weights], torch.randn_like(out))
        copies = ("aten::stack", "aten::cat", "aten::clone", "aten::copy_", "aten::contiguous")
        weight_sized = ([f, d], [2 * f, d])
        copied[name] = [
            e.input_shapes[0]
            for e in prof.events()
            if e.name in copies and e.input_shapes and list(e.input_shapes[0]) in weight_sized
        ]
    assert copied["unpacked"], "the unpacked op should interleave and split (or this test is blind)"
    assert not copied["packed"], copied["packed"]


def test_packing_needs_two_inputs_whose_gradients_are_one_tensors_rows() -> None:
    from coda.blocks.llama import llama_mlp_bwd_saved, llama_mlp_train
    from coda.export import PackedRows, export_autograd
    from coda.planner import lower

    forward, backward = lower(llama_mlp_train), lower(llama_mlp_bwd_saved)
    bad = {
        "w_bias": PackedRows("w", even="w_bias", odd="w_up"),
        "w_gate": PackedRows("w", even="w_gate", odd="w_gate"),
        "w_down": PackedRows("w", even="w_gate", odd="w_down"),
        "forward input": PackedRows("x", even="w_gate", odd="w_up"),
    }
    for expected, packing in bad.items():
        with pytest.raises(ValueError, match=expected if expected != "w_down" else "views step 2"):
            export_autograd(forward, backward, llama_mlp_bwd_saved, packed=[packing])


def test_the_backward_fills_no_zero_gradients_for_the_saved_activations() -> None:
    # g, u and a are outputs of the forward op that nobody differentiates: autograd must hand the
    # backward None for them, not zero tensors of the activations' size (a fill each, every step).
    from torch.profiler import ProfilerActivity, profile

    fn = llama_mlp_function(1e-5, verify=False, tune="off")
    norm, mlp = _hf_modules(seed=4)
    weights = [norm.weight, *[p.weight for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]]
    x = torch.randn(9, 48, requires_grad=True)
    out = fn(x, *weights)
    dout = torch.randn_like(out)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        grads = torch.autograd.grad(out, [x, *weights], dout)
    f = mlp.gate_proj.weight.shape[0]
    fills = [
        e.input_shapes
        for e in prof.events()
        if e.name in ("aten::zeros", "aten::zeros_like", "aten::fill_", "aten::zero_")
    ]
    activation_sized = [s for s in fills if s and s[0] and math.prod(s[0]) >= 9 * f]
    assert not activation_sized, f"zero fills of activation size: {fills}"
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("fuse", [False, True], ids=["hf-params", "fused-gate-up"])
def test_the_drop_in_survives_deepcopy_and_torch_save(fuse: bool, tmp_path) -> None:  # noqa: ANN001
    """Reference models, EMA copies and checkpoints of whole modules: a copy resolves the same
    exported op again, owns its parameters, and computes what the original does."""
    import copy

    block = CodaLlamaMLPBlock(*_hf_modules(seed=9), verify=False, fuse_gate_up=fuse, tune="off")
    torch.save(block, tmp_path / "block.pt")
    copies = [copy.deepcopy(block), torch.load(tmp_path / "block.pt", weights_only=False)]
    x, dout = torch.randn(6, 48), torch.randn(6, 48)
    want = _grads(block, x, dout, block)
    assert copy.deepcopy(block.function) is block.function  # one registered op per process
    for clone in copies:
        assert clone.function is block.function and clone.function.tune == "off"
        assert all(
            a is not b and a.data_ptr() != b.data_ptr()
            for a, b in zip(clone.parameters(), block.parameters(), strict=True)
        )
        for got, expected in zip(_grads(clone, x, dout, clone), want, strict=True):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
    with torch.no_grad():
        next(copies[0].parameters()).add_(1.0)
    assert not torch.equal(copies[0](x), block(x))  # the copy's weights are its own


def test_without_gradients_the_plain_forward_runs_and_saves_nothing() -> None:
    # Evaluation passes (torch.no_grad, or frozen weights and inputs) need no g, u, a: the
    # inference op (the llama_mlp Program) runs instead of llama_mlp_train, same output.
    from torch.profiler import ProfilerActivity, profile

    fn = llama_mlp_function(1e-5, verify=False, tune="off")
    norm, mlp = _hf_modules(seed=10)
    weights = [norm.weight, *[p.weight for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]]
    frozen = [w.detach() for w in weights]
    x = torch.randn(9, 48)

    def ops_run(call) -> tuple[torch.Tensor, set[str]]:  # noqa: ANN001
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = call()
        return out, {e.name.rsplit("_", 1)[-1] for e in prof.events() if "coda::" in e.name}

    with torch.no_grad():
        plain, ran = ops_run(lambda: fn(x, *weights))
    assert ran == {"inf"}
    _, ran = ops_run(lambda: fn(x, *frozen))  # grad mode on, nothing requires grad
    assert ran == {"inf"}
    trained, ran = ops_run(lambda: fn(x.clone().requires_grad_(), *weights))
    assert ran == {"fwd"} and trained.requires_grad
    torch.testing.assert_close(plain, trained.detach(), atol=0, rtol=0)
    assert llama_mlp_function(1e-5, verify=False, saved=False).inference_op is None


def test_eager_calls_skip_the_dispatcher_and_traced_calls_use_the_ops(monkeypatch) -> None:  # noqa: ANN001
    """Eager calls (the training loop's) run the runners through a plain autograd.Function, same
    bits as the registered ops; fake tensors (what torch.compile and opcheck trace with) still go
    through the ops, whose fake implementations give the shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fn = llama_mlp_function(1e-5, verify=False, tune="off")
    norm, mlp = _hf_modules(seed=11)
    weights = [norm.weight, *[p.weight for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]]
    x = torch.randn(9, 48, requires_grad=True)
    dout = torch.randn(9, 48)
    op_out = fn.forward_op(x.detach(), *[w.detach() for w in weights])[0]
    op_grads = fn.backward_op(
        x.detach(),
        *[w.detach() for w in weights],
        *[t.detach() for t in fn.forward_op(x.detach(), *[w.detach() for w in weights])[1:]],
        dout,
    )

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("an eager call went through the dispatcher")

    with monkeypatch.context() as patched:
        for attr in ("forward_op", "backward_op", "inference_op"):
            patched.setattr(fn, attr, refuse)
        out = fn(x, *weights)
        out.backward(dout)
        with torch.no_grad():
            plain = fn(x, *weights)
    assert torch.equal(out.detach(), op_out) and torch.equal(plain, op_out)
    for got, want in zip([x.grad, *[w.grad for w in weights]], op_grads, strict=True):
        assert torch.equal(got, want)
    with FakeTensorMode() as mode:
        fake = fn(mode.from_tensor(x), *[mode.from_tensor(w) for w in weights])
    assert fake.shape == (9, 48) and fake.dtype == torch.float32
    from coda.export import autograd

    with monkeypatch.context() as patched:  # under a torch.func transform: through the ops
        patched.setattr(fn, "forward_op", refuse)
        with pytest.raises(AssertionError, match="dispatcher"):
            torch.func.grad(lambda t: fn(t, *weights).sum())(x.detach())
    with monkeypatch.context() as patched:  # CODA_DISPATCH_OPS=1: every call through the ops
        patched.setattr(autograd, "EAGER_CALLS", False)
        patched.setattr(fn, "forward_op", refuse)
        with pytest.raises(AssertionError, match="dispatcher"):
            fn(x, *weights)


def test_an_eager_call_is_named_as_its_op_in_a_profile() -> None:
    # the record_function range opens only while a profiler runs (it costs host time per call)
    from torch.profiler import ProfilerActivity, profile

    fn = llama_mlp_function(1e-5, verify=False, tune="off")
    norm, mlp = _hf_modules(seed=12)
    weights = [norm.weight, *[p.weight for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]]
    x = torch.randn(9, 48, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(x, *weights).sum().backward()
    names = {e.name for e in prof.events()}
    forward, backward = (r.op_name for r in fn.runners[:2])
    assert forward.startswith("coda::") and {forward, backward} <= names


@pytest.mark.parametrize("fuse", [False, True], ids=["hf-params", "fused-gate-up"])
def test_an_empty_batch_gives_what_hugging_face_gives(fuse: bool) -> None:
    # No tokens (an empty micro-batch, a rank with nothing routed to it): an empty output, zero
    # weight gradients — no launch of a kernel over zero rows.
    norm, mlp = _hf_modules(seed=11)
    ref = _hf_modules(seed=11)
    block = CodaLlamaMLPBlock(norm, mlp, verify=False, tune="off", fuse_gate_up=fuse)
    x, dout = torch.randn(2, 0, 48), torch.randn(2, 0, 48)
    got = _grads(block, x, dout, block)
    want = _grads(torch.nn.ModuleList(ref), x, dout, lambda t: t + ref[1](ref[0](t)))
    assert got[0].shape == (2, 0, 48) and got[1].shape == (2, 0, 48)
    for g in got[2:]:
        assert g is not None and not g.any()
    assert sum(g.numel() for g in got[2:]) == sum(w.numel() for w in want[2:])


@pytest.mark.parametrize("fuse", [False, True], ids=["hf-params", "fused-gate-up"])
def test_under_autocast_it_runs_like_hugging_face_mixed_precision(fuse: bool) -> None:
    """fp32 parameters and residual stream under torch.autocast (fp16 here: the interpreter's
    bf16 dot is wrong; bf16 in tests/gpu): the branch in the autocast dtype, ``x +`` in fp32,
    gradients in fp32 — held to the sandbox's rule against an fp32 run, next to Hugging Face's
    own autocast error."""
    from coda.blocks import get_block
    from coda.sandbox import check_output

    norm, mlp = _hf_modules(seed=4)
    block = CodaLlamaMLPBlock(*_hf_modules(seed=4), verify=False, tune="off", fuse_gate_up=fuse)
    x, dout = torch.randn(2, 9, 48), torch.randn(2, 9, 48)
    hf_params = [norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]

    def run(forward, params: list) -> list:  # noqa: ANN001
        t = x.clone().requires_grad_()
        out = forward(t)
        return [out, *torch.autograd.grad(out, [t, *params], dout)]

    ref32 = run(lambda t: t + mlp(norm(t)), hf_params)
    with torch.autocast("cpu", dtype=torch.float16):
        theirs = run(lambda t: t + mlp(norm(t)), hf_params)
        if fuse:
            params = [block.norm.weight, block.gate_up_weight, block.mlp.down_proj.weight]
            out, dx, dgamma, dw_gu, dw_down = run(block, params)
            got = [out, dx, dgamma, dw_gu[0::2], dw_gu[1::2], dw_down]
        else:
            params = [block.norm.weight, block.gate_weight, block.up_weight]
            got = run(block, [*params, block.mlp.down_proj.weight])
    tol = get_block("llama_mlp").tolerance
    names = ["out", "dx", "dgamma", "dw_gate", "dw_up", "dw_down"]
    for name, g, want, hf in zip(names, got, ref32, theirs, strict=True):
        assert g.dtype == hf.dtype == torch.float32, name  # as Hugging Face's
        c = check_output(name, g, want, hf, tol, sizes={}, seed=0, run_dtype=torch.float16)
        assert c.passed, c.summary()


def test_autocast_path_compiles_and_resolves_late() -> None:
    """torch.compile(fullgraph) traces the autocast path to the same values; a block built in
    fp16 and met under autocast with fp32 activations resolves its branch op then."""
    block = CodaLlamaMLPBlock(*_hf_modules(seed=5), verify=False, tune="off")
    x, dout = torch.randn(7, 48), torch.randn(7, 48)
    with torch.autocast("cpu", dtype=torch.float16):
        eager = _grads(block, x, dout, block)
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        for g, w in zip(_grads(block, x, dout, compiled), eager, strict=True):
            torch.testing.assert_close(g, w, atol=0, rtol=0)
    half = CodaLlamaMLPBlock(*_hf_modules(seed=5, dtype=torch.float16), verify=False, tune="off")
    assert half.branch_function is None  # no fp32 parameters: not resolved up front
    with torch.autocast("cpu", dtype=torch.float16):
        assert half(torch.randn(3, 48)).dtype == torch.float32
    assert half.branch_function is not None


def test_the_attention_input_keeps_its_output_for_a_backward_without_the_projection() -> None:
    """llama_attn_in's qkv is both what a call returns (and differentiates) and what its backward
    takes (llama_attn_in_bwd_saved), with the input norm's statistic rstd_h the training forward
    returns too: gradients match autograd of the PyTorch reference, the ops pass opcheck, and the
    backward Program runs no GEMM of the forward projection and no pass over x for rstd."""
    from coda.blocks import get_block
    from coda.export import llama_attn_in_function
    from tests.helpers import rope_tables

    fn = llama_attn_in_function(1e-5, verify=False, tune="off")
    assert fn.output_names == ["qkv"] and fn.saved_names == ["qkv", "rstd_h"]
    assert [s.name for s in fn.backward.steps if s.kind == "gemm"] == ["qkv_bwd", "w_qkv_grad"]
    assert not any(s.kind == "rstd" for s in fn.backward.steps)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 24, generator=gen)
    gamma = 1 + 0.1 * torch.randn(24, generator=gen)
    w_q, w_k, w_v = (torch.randn(n, 24, generator=gen) / 5 for n in (32, 16, 16))
    cos, sin = rope_tables(9, 8, torch.float32)
    leaves = [t.requires_grad_() for t in (x, gamma, w_q, w_k, w_v)]
    dqkv = torch.randn(9, 64, generator=gen)
    got = fn(*leaves, cos, sin)
    got_grads = torch.autograd.grad(got, leaves, dqkv)
    inputs = dict(zip(("x", "gamma", "w_q", "w_k", "w_v"), leaves, strict=True))
    want = get_block("llama_attn_in").reference({**inputs, "cos": cos, "sin": sin})["qkv"]
    want_grads = torch.autograd.grad(want, leaves, dqkv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    checks = ("test_schema", "test_faketensor")
    args = [t.detach() for t in (*leaves, cos, sin)]
    torch.library.opcheck(fn.forward_op, tuple(args), test_utils=checks)
    qkv, rstd = fn.forward_op(*args)
    assert torch.equal(qkv, got.detach()) and rstd.dtype == torch.float32
    torch.library.opcheck(fn.backward_op, (*args, qkv, rstd, dqkv), test_utils=checks)
    # traced whole (a saved output through AOT autograd): the same values and gradients
    compiled = torch.compile(lambda *t: fn(*t) * 2, backend="aot_eager", fullgraph=True)
    twice = compiled(*leaves, cos, sin)
    twice_grads = torch.autograd.grad(twice, leaves, dqkv)
    torch.testing.assert_close(twice, got * 2)
    for g, w in zip(twice_grads, got_grads, strict=True):
        torch.testing.assert_close(g, w * 2)


def test_the_attention_outputs_residual_gets_the_incoming_gradient_itself() -> None:
    """x_out = x + attn @ w_oᵀ: x's gradient is dx_out as is — the backward Program returns no
    dx and copies nothing (its two GEMMs only); autograd gets dx_out's own storage."""
    from coda.export.attn_out import ATTN_OUT, attention_output_function

    fn = attention_output_function(ATTN_OUT, 1e-5, tune="off")
    assert [s.kind for s in fn.backward.steps] == ["gemm", "gemm"]
    assert "dx" not in fn.backward.outputs
    gen = torch.Generator().manual_seed(5)
    attn, w_o = torch.randn(7, 32, generator=gen), torch.randn(24, 32, generator=gen) / 6
    x = torch.randn(7, 24, generator=gen)
    leaves = [t.requires_grad_() for t in (attn, w_o, x)]
    dx_out = torch.randn(7, 24, generator=gen)
    out = fn(*leaves)
    dattn, dw_o, dx = torch.autograd.grad(out, leaves, dx_out)
    assert dx.data_ptr() == dx_out.data_ptr()  # no copy
    want = x + attn @ w_o.T
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    want_grads = torch.autograd.grad(want, leaves, dx_out)
    for g, w in zip((dattn, dw_o, dx), want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # traced whole, through the registered ops: the same gradients
    compiled = torch.compile(lambda *t: fn(*t) * 2, backend="aot_eager", fullgraph=True)
    twice_grads = torch.autograd.grad(compiled(*leaves), leaves, dx_out)
    for g, w in zip(twice_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w * 2, atol=1e-5, rtol=1e-5)


def test_kept_prepared_weights_follow_an_optimizer_step_and_a_swapped_parameter() -> None:
    """``keep_prepared`` reuses the prepared weights (γ folded into gate/up) between calls with
    unchanged weights; an in-place update or a new Parameter is seen on the next call: it gives
    what the same Program gives preparing anew (``saved=False`` runs it, keeping nothing)."""
    fn = llama_mlp_function(1e-5, verify=False, tune="off")
    fresh = llama_mlp_function(1e-5, verify=False, saved=False, tune="off")
    norm, mlp = _hf_modules(seed=11)
    x = torch.randn(9, 48)

    def check() -> None:
        weights = [norm.weight, *[p.weight for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]]
        with torch.no_grad():
            torch.testing.assert_close(fn(x, *weights), fresh(x, *weights), atol=0, rtol=0)

    fn.keep_prepared = True
    try:
        assert fn.keep_prepared and all(r.keep_prepared for r in fn.runners)
        check()
        check()
        optimizer = torch.optim.SGD([norm.weight, mlp.gate_proj.weight], lr=0.5)
        for p in optimizer.param_groups[0]["params"]:
            p.grad = torch.randn_like(p)
        optimizer.step()
        check()
        mlp.up_proj.weight = torch.nn.Parameter(torch.randn_like(mlp.up_proj.weight) * 0.1)
        check()
    finally:
        fn.keep_prepared = False
    assert not any(r.compiled is not None and r.compiled._kept for r in fn.runners)


def test_kernels_used_names_what_ran_each_exported_step() -> None:
    from coda.export import kernels_used

    norm, mlp = _hf_modules(seed=6)
    block = CodaLlamaMLPBlock(norm, mlp, verify=False)
    x = torch.randn(2, 5, 48, requires_grad=True)
    block(x).sum().backward()
    used = kernels_used()
    forward = next(b for b in used if b.startswith("llama_mlp") and "bwd" not in b)
    backward = next(b for b in used if b.startswith("llama_mlp") and "bwd" in b)
    assert used[forward]["ran"] and used[backward]["ran"]  # each fused step and its kernel
    # on a CPU the CuTe backend is not asked for: no step says why it did not take it
    assert all(kind != "cute" for entry in used.values() for kind in entry["ran"].values())
    assert used[backward]["not_cute"] == {} and used[backward]["cute_tuned"] == {}
    # what tuning pinned is named: a CuTe config by its tile and cluster, Triton as "triton",
    # cuBLAS (a plain product kept off QuACK's GEMM) as "cublas"
    from coda.primitives.cute.launch import CuteConfig

    # (this block's own backward runner: other tests' exported functions share the registry)
    runner = next(
        r for r in block.function.runners if r.compiled is not None and "bwd" in r.program.block
    )
    runner.compiled.cute_configs.update(
        {"down_bwd": None, "gate_up_bwd": CuteConfig(128, 128, 1, 2), "w_down_grad": None}
    )
    try:
        tuned = kernels_used()[runner.program.block]["cute_tuned"]
    finally:
        runner.compiled.cute_configs.clear()
    assert tuned == {
        "down_bwd": "triton", "gate_up_bwd": "128x128 cluster 1x2 pingpong", "w_down_grad": "cublas"
    }  # fmt: skip
