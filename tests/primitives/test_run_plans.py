"""CompiledProgram.run records its decisions at each run signature and replays them: a replay
decides nothing (no step is planned again), allocates fresh tensors, and matches a program that
decides anew; anything a decision depends on — a tensor's dtype, layout or alignment, the
pinned configs, the mainloop asked for — is part of the signature and records a new plan."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from coda.blocks import Block, TensorSpec, get_block
from coda.planner import lower
from coda.primitives import analyze, compile_program
from coda.primitives.ir import MainloopConfig
from coda.primitives.runtime import CompiledProgram


def _decisions(monkeypatch: pytest.MonkeyPatch, compiled: CompiledProgram) -> list[str]:
    """Names of the gemm steps ``compiled`` decides (plans) from now on."""
    decided: list[str] = []
    run_gemm = CompiledProgram._run_gemm

    def recording(self, step, gemm, *args, **kwargs):  # noqa: ANN001, ANN202
        if self is compiled:
            decided.append(gemm.name)
        return run_gemm(self, step, gemm, *args, **kwargs)

    monkeypatch.setattr(CompiledProgram, "_run_gemm", recording)
    return decided


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor whose address is 2–4 bytes past a 16-byte boundary (on
    ``t``'s device)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.view(t.shape).copy_(t)


def test_a_replay_decides_nothing_and_matches_deciding_anew(
    mlp, monkeypatch: pytest.MonkeyPatch
) -> None:
    block, program, sizes = mlp
    compiled = compile_program(program, analyze(program, sizes))
    decided = _decisions(monkeypatch, compiled)
    first = compiled(block.make_inputs(sizes, torch.float32, seed=0))
    assert decided == list(compiled.kernels)  # the fused gemm steps
    used = dict(compiled.mainloops_used)
    decided.clear()
    for seed in (1, 2):
        inputs = block.make_inputs(sizes, torch.float32, seed=seed)
        got = compiled(inputs)
        want = compile_program(program, analyze(program, sizes))(inputs)
        for name in want:
            torch.testing.assert_close(got[name], want[name])
            assert got[name].data_ptr() != first[name].data_ptr()  # allocated anew
    assert decided == [] and compiled.mainloops_used == used


@pytest.mark.parametrize("change", ["dtype", "alignment", "config", "mainloop", "poison"])
def test_what_a_decision_depends_on_records_a_new_plan(
    mlp, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    block, program, sizes = mlp
    compiled = compile_program(program, analyze(program, sizes))
    inputs = block.make_inputs(sizes, torch.float32, seed=0)
    compiled(inputs)
    decided = _decisions(monkeypatch, compiled)
    kwargs = {}
    if change == "dtype":
        inputs = {n: t.half() for n, t in inputs.items()}
    elif change == "alignment":  # the weight's rows can no longer be a TMA descriptor's
        inputs["w_down"] = misaligned(inputs["w_down"])
    elif change == "config":
        small = MainloopConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4)
        compiled.configs = {"down": small}
    elif change == "mainloop":
        compiled.mainloop = "pointer"
    else:
        kwargs["poison"] = True
    got = compiled(inputs, **kwargs)
    assert decided == list(compiled.kernels)  # the fused gemm steps
    fresh = compile_program(program, analyze(program, sizes))
    fresh.configs, fresh.mainloop = dict(compiled.configs), compiled.mainloop
    want = fresh(inputs)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    assert compiled.mainloops_used == fresh.mainloops_used
    if change == "alignment":
        assert compiled.mainloops_used["down"] == "pointer"


def test_a_replay_s_descriptors_equal_checked_ones() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from coda.primitives.descriptors import unchecked_descriptor

    t = torch.zeros(64, 32)
    args = (t, [64, 32], [32, 1], [16, 32])
    unchecked = unchecked_descriptor(*args)
    assert type(unchecked) is TensorDescriptor and unchecked == TensorDescriptor(*args)


def test_with_replays_off_every_call_decides_anew(mlp, monkeypatch: pytest.MonkeyPatch) -> None:
    from coda.primitives import runtime

    block, program, sizes = mlp
    compiled = compile_program(program, analyze(program, sizes))
    inputs = block.make_inputs(sizes, torch.float32, seed=0)
    want = compiled(inputs)
    monkeypatch.setattr(runtime, "REPLAY", False)  # CODA_DECIDE_EVERY_RUN=1
    decided = _decisions(monkeypatch, compiled)
    for _ in range(2):
        got = compiled(inputs)
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)
    assert decided == list(compiled.kernels) * 2


def test_output_views_cut_once_per_binding_match_select_outputs() -> None:
    # llama_mlp_bwd_saved returns dw_gate, dw_up as every other row of one interleaved gradient
    from coda.primitives.analysis import bind_sizes

    block = get_block("llama_mlp_bwd_saved")
    program = lower(block)
    assert any(not isinstance(v, str) for v in program.outputs.values())
    compiled = compile_program(program, analyze(program, block.shapes.cpu[0]))
    for i, sizes in enumerate([block.shapes.cpu[0], block.shapes.cpu[1], block.shapes.cpu[0]]):
        inputs = block.make_inputs(sizes, torch.float32, seed=i)
        got = compiled(inputs)
        bound = bind_sizes(program, {n: tuple(t.shape) for n, t in inputs.items()})
        want = program.select_outputs(compiled.run(compiled.prepare(inputs)), bound)
        assert list(got) == list(want)
        for name in want:
            assert got[name].shape == want[name].shape and got[name].stride() == want[name].stride()
            torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)


@pytest.mark.parametrize("variant", ["tma", "pointer"])
def test_a_replay_s_arguments_equal_the_plan_s_on_another_call_s_tensors(mlp, variant: str) -> None:
    """A Relaunch works out strides, shapes and descriptor layouts once, from the tensors it was
    recorded on; on another call's tensors of the same run signature its arguments are the ones
    the launch plan builds from those tensors (descriptors with their base swapped)."""
    from coda.primitives.run_plans import Relaunch

    block, program, sizes = mlp
    compiled = compile_program(program, analyze(program, sizes))
    tensors = [compiled.run(compiled.prepare(block.make_inputs(sizes, torch.float32, seed=s)))
               for s in (0, 1)]  # fmt: skip
    info = compiled.info_for({n: tensors[0][n] for n in program.inputs})
    for name, gemm in info.gemms.items():
        if name not in compiled.kernels:
            continue
        cfg = compiled.config_for(name, gemm)
        plan = compiled._plan(gemm, cfg, info.sizes, torch.device("cpu"), variant, "ieee")
        relaunch = Relaunch(plan, tensors[0])
        got, want = relaunch.arguments(tensors[1]), plan.arguments(tensors[1])
        assert len(got) == len(want)
        descriptors = 0
        for g, w in zip(got, want, strict=True):
            if isinstance(w, torch.Tensor):
                assert g is w
            elif hasattr(w, "block_shape"):
                descriptors += 1
                assert g.base is w.base
                assert (g.shape, g.strides, g.block_shape) == (w.shape, w.strides, w.block_shape)
            else:
                assert g == w and type(g) is type(w)
        assert descriptors > 0 if variant == "tma" else descriptors == 0


def test_kept_prep_results_are_reused_only_while_their_inputs_are_unchanged(
    mlp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``keep_prepared``: the weights' prep (gate/up interleaving, γ folded in) runs again when a
    weight is changed in place, replaced by another tensor or given new memory through
    ``.data``; otherwise the last results serve, and every call equals a fresh program's."""
    from coda.primitives import runtime

    block, program, sizes = mlp
    compiled = compile_program(program, analyze(program, sizes))
    compiled.keep_prepared = True
    preps = []
    run_prep = runtime.run_prep
    monkeypatch.setattr(runtime, "run_prep", lambda *a: preps.append(1) or run_prep(*a))
    inputs = block.make_inputs(sizes, torch.float32, seed=0)
    inputs["w_gate"] = torch.nn.Parameter(inputs["w_gate"])

    def check(expect_prep: bool) -> None:
        preps.clear()
        got = compiled(inputs)
        assert preps == ([1] if expect_prep else [])
        want = compile_program(program, analyze(program, sizes))(inputs)
        torch.testing.assert_close(got["out"], want["out"], rtol=0, atol=0)

    check(expect_prep=True)
    inputs["x"] = block.make_inputs(sizes, torch.float32, seed=1)["x"]  # not read by prep
    check(expect_prep=False)
    with torch.no_grad():
        inputs["w_gate"].mul_(-1.5)  # an optimizer step: the version counter moves
    check(expect_prep=True)
    check(expect_prep=False)
    inputs["gamma"] = inputs["gamma"] * 2  # another tensor
    check(expect_prep=True)
    inputs["w_gate"].data = inputs["w_gate"].detach() + 1  # new memory under the same Parameter
    check(expect_prep=True)
    check(expect_prep=False)
    compiled.keep_prepared = False
    check(expect_prep=True)
    check(expect_prep=True)


@pytest.mark.parametrize("how", ["pinned", "not replayable", "temporary"])
def test_an_aux_step_replays_its_recorded_launches_pinned_where_it_can(
    mlp, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A replayable aux step (rstd) whose launches read only the run's tensors replays them
    pinned, without calling its ``launch``; a step not marked replayable, or one that launched
    on a tensor the run does not hold, is called anew, its launches pinned in the order it made
    them. Every replay equals a fresh program."""
    from coda.primitives.aux.rstd import Rstd
    from coda.primitives.launch import PinnedLaunch
    from coda.primitives.run_plans import AuxLaunch, PinnedAuxLaunch

    block, program, sizes = mlp
    launches: list[str] = []
    real = Rstd.launch

    def launch(self, env) -> None:  # noqa: ANN001
        launches.append(self.out)
        if how != "temporary":
            return real(self, env)
        src = env.tensors[self.src]
        env.tensors[self.src] = src.clone()  # a temporary copy the run does not hold
        try:
            real(self, env)
        finally:
            env.tensors[self.src] = src

    monkeypatch.setattr(Rstd, "launch", launch)
    if how == "not replayable":
        monkeypatch.setattr(Rstd, "replayable", False)
    compiled = compile_program(program, analyze(program, sizes))
    compiled(block.make_inputs(sizes, torch.float32, seed=0))
    (plan,) = compiled._run_plans.values()
    (action,) = [a for a in plan.actions if getattr(getattr(a, "step", None), "kind", "") == "rstd"]
    assert type(action) is (PinnedAuxLaunch if how == "pinned" else AuxLaunch)
    launches.clear()
    pinned: list[str] = []  # the kernels launched through a PinnedLaunch
    real_pinned = PinnedLaunch.__call__

    def pinned_call(self: PinnedLaunch, *args: object) -> object:
        pinned.append(self.kernel.__name__)
        return real_pinned(self, *args)

    monkeypatch.setattr(PinnedLaunch, "__call__", pinned_call)
    inputs = block.make_inputs(sizes, torch.float32, seed=1)
    got = compiled(inputs)
    assert launches == ([] if how == "pinned" else ["rstd_h"])
    assert pinned.count("_rstd_kernel") == 1
    want = compile_program(program, analyze(program, sizes))(inputs)
    torch.testing.assert_close(got["out"], want["out"], rtol=0, atol=0)


def _attn_out_backward_with_dx() -> Block:
    """``attn_out``'s backward returning the residual's gradient too: the planner copies
    ``dx_out`` into ``dx`` with a ``rescale_rows`` without a vector (the shipped ``attn_out_bwd``
    hands ``dx_out`` on instead)."""
    from coda.blocks.autodiff import backward_block

    forward = get_block("attn_out")
    return backward_block(
        forward,
        name="attn_out_bwd_dx",
        cotangents={"x_out": TensorSpec(shape=["M", "d"])},
        wrt=list(forward.inputs),
        zeros=["x"],
    )


@pytest.mark.parametrize(
    ("block", "kind", "src"),
    [
        (_attn_out_backward_with_dx, "rescale_rows", "dx_out"),
        (lambda: get_block("gemma2_attn_out"), "norm_rows", "x"),
    ],
    ids=["attn_out_bwd_dx", "gemma2_attn_out"],
)
def test_row_kernels_replay_pinned_and_follow_a_changed_layout(
    block: Callable[[], Block], kind: str, src: str
) -> None:
    """``rescale_rows`` and ``norm_rows`` launch only their kernels on the run's tensors: a run
    plan replays them pinned. A replay equals a fresh program's run, and the same call with
    the step's source tensor laid out otherwise (transposed storage) records a plan of its own
    that is right too — the pinned strides are those of the signature it was recorded at."""
    from coda.primitives.run_plans import PinnedAuxLaunch

    block = block()
    program, sizes = lower(block), block.shapes.cpu[0]
    compiled = compile_program(program, analyze(program, sizes))
    compiled(block.make_inputs(sizes, torch.float32, seed=0))
    (plan,) = compiled._run_plans.values()
    (action,) = [a for a in plan.actions if getattr(getattr(a, "step", None), "kind", "") == kind]
    assert type(action) is PinnedAuxLaunch
    inputs = block.make_inputs(sizes, torch.float32, seed=1)
    strided = {**inputs, src: inputs[src].T.contiguous().T}  # same values, column-major
    for call in (inputs, strided, inputs):
        got = compiled(call)
        want = compile_program(program, analyze(program, sizes))(call)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    assert len(compiled._run_plans) == 2


def test_an_input_only_prep_reads_reaches_the_run_signature_by_shape_and_dtype_only(
    mlp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama_mlp's GEMMs read the interleaved, γ-folded ``w_gu``, never ``w_gate`` or ``w_up``:
    a call whose ``w_gate`` is misaligned and ``w_up`` column-major replays the recorded plan
    (prep makes the same ``w_gu`` layout), and equals a program deciding anew; a new dtype
    still records a new plan."""
    block, program, sizes = mlp
    compiled = compile_program(program, analyze(program, sizes))
    assert {"w_gate", "w_up"}.isdisjoint(compiled.read_by_steps)
    inputs = block.make_inputs(sizes, torch.float32, seed=0)
    compiled(inputs)
    decided = _decisions(monkeypatch, compiled)
    inputs["w_gate"] = misaligned(inputs["w_gate"])
    inputs["w_up"] = inputs["w_up"].T.contiguous().T
    got = compiled(inputs)
    assert decided == [] and len(compiled._run_plans) == 1
    want = compile_program(program, analyze(program, sizes))(inputs)
    torch.testing.assert_close(got["out"], want["out"], rtol=0, atol=0)
    compiled({n: t.half() for n, t in inputs.items()})
    assert len(compiled._run_plans) == 2


def test_fresh_outputs_are_the_whole_tensors_a_run_allocates() -> None:
    """``run_outputs`` names the outputs each run made anew as whole tensors: llama_attn_in's
    backward returns dx, dgamma and (written apart by unpair_rows) dw_q, dw_k, dw_v so; the
    MLP's backward returns dw_gate and dw_up as row views of one gradient (not fresh); on a
    replay too, and the fresh ones share memory with no input and no other output."""
    for name, want in [
        ("llama_attn_in_bwd_saved", {"dx", "dgamma", "dw_q", "dw_k", "dw_v"}),
        ("llama_mlp_bwd_saved", {"dx", "dgamma", "dw_down"}),
    ]:
        _check_fresh_outputs(get_block(name), want)


def _check_fresh_outputs(block: Block, want: set[str]) -> None:
    program = lower(block)
    sizes = block.shapes.cpu[0]
    compiled = compile_program(program, analyze(program, sizes))
    for seed in (0, 1):  # recorded, then replayed
        inputs = block.make_inputs(sizes, torch.float32, seed=seed)
        outputs, fresh = compiled.run_outputs(inputs)
        assert fresh == want, block.name
        memory = [t.untyped_storage().data_ptr() for t in inputs.values()]
        for name in sorted(fresh):
            assert outputs[name]._base is None
            assert outputs[name].untyped_storage().data_ptr() not in memory, name
            memory.append(outputs[name].untyped_storage().data_ptr())


def test_fresh_tensors_leave_out_shared_storage_and_steps_that_launch_themselves() -> None:
    """An ``Allocate``'s outputs and a ``VendorProduct``'s are fresh; an output that takes over
    another tensor's storage is not, nor are the outputs allocated for a step replayed through
    its own ``launch`` (``AuxLaunch``: it may bind them to other tensors)."""
    from coda.primitives.run_plans import Allocate, AuxLaunch, VendorProduct, fresh_tensors

    cpu = torch.device("cpu")
    f32 = torch.float32
    vendor = next(
        VendorProduct(step, f32)
        for step in lower(get_block("llama_mlp_bwd_saved")).steps
        if getattr(step, "epilogue", None) and len(step.epilogue) == 1
    )
    actions = [
        Allocate((("a", (2,), f32), ("b", (2,), f32)), cpu, False),
        Allocate((), cpu, False, shared=(("c", "a"),)),
        Allocate((("d", (2,), f32),), cpu, False),
        AuxLaunch(step=None),
        vendor,
    ]
    assert fresh_tensors(actions) == {"a", "b", vendor.operands[4]}


def test_a_replay_builds_a_run_env_only_for_a_step_that_launches_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only an ``AuxLaunch`` reads the ``RunEnv``: a replay of a plan without one (llama_mlp)
    builds none, nor does llama_attn_in's backward (its aux steps replay pinned launches); the
    Qwen2 attention input's backward, whose ``rotary_input_grad`` launches itself, builds one."""
    from coda.primitives import runtime
    from coda.primitives.run_plans import AuxLaunch

    built = []
    env = runtime.RunEnv
    monkeypatch.setattr(runtime, "RunEnv", lambda *a, **k: built.append(1) or env(*a, **k))
    for name, launches_itself in [
        ("llama_mlp", False),
        ("llama_attn_in_bwd_saved", False),
        ("qwen2_attn_in_bwd", True),
    ]:
        block = get_block(name)
        program = lower(block)
        sizes = block.shapes.cpu[0]
        compiled = compile_program(program, analyze(program, sizes))
        inputs = block.make_inputs(sizes, torch.float32, seed=0)
        compiled.run(compiled.prepare(inputs))
        prepared = compiled.prepare(inputs)
        (plan,) = compiled._run_plans.values()
        assert plan.needs_env == any(isinstance(a, AuxLaunch) for a in plan.actions)
        assert plan.needs_env == launches_itself
        built.clear()
        compiled.run(prepared)
        assert built == ([1] if launches_itself else []), name


def test_bf16_products_in_the_interpreter_are_refused_and_collecting_them_is_not(mlp) -> None:
    """Triton's interpreter computes wrong bf16 ``tl.dot`` products: a run of generated kernels
    in bf16 on a machine without a GPU raises ``TypeError`` naming the steps and what to do,
    on a first call and on a call that would replay, where it once returned wrong values;
    collecting the launches (nothing runs: compiling ahead, the sm_90 compile checks) is not
    refused, and float16 runs."""
    block, program, sizes = mlp
    compiled = compile_program(program, analyze(program, sizes))
    bf16 = block.make_inputs(sizes, torch.bfloat16, seed=0)
    assert compiled.collect_launches(bf16)
    with pytest.raises(TypeError, match=r"bfloat16 on the CPU .* steps \['gate_up', 'down'\]"):
        compiled(bf16)
    with pytest.raises(TypeError, match="use float32 or float16"):
        compiled(bf16)
    compiled(block.make_inputs(sizes, torch.float16, seed=0))
