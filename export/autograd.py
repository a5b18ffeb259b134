"""A verified forward Program plus its backward Program as one differentiable PyTorch op.

``export_autograd(forward, backward, backward_block)`` registers two ``torch.library`` custom ops,
``coda::<block>_<hash>_fwd`` and ``..._bwd``, each running its Program's kernels (Triton, the vendor
GEMM for plain products), each with a fake (meta) implementation that derives output shapes from
the Program's analysis — so ``torch.compile`` traces *around* them without a graph break — and ties
them together with ``torch.library.register_autograd``. The backward block's ``vjp`` op says which
forward output each cotangent belongs to, which inputs get gradients, and which forward values the
backward receives (``saved``): the forward Program returns those too (e.g. ``llama_mlp_train``'s
``g`` and ``u``), autograd keeps them for the backward, and the caller sees only the other outputs.
A saved value may also be an output the caller gets and differentiates (``llama_attn_in``'s
``qkv``, which ``llama_attn_in_bwd_saved`` takes instead of recomputing the projection).

Prep steps (weight layouts such as gate/up interleaving) run inside every forward and backward
call: in training the weights change every step. They move weight-sized tensors once per call
(llama_mlp: gate/up interleaving in both passes, plus copies splitting the fused weight gradient
— measured in bench/RESULTS.md). ``packed=[PackedRows(...)]`` removes both for a model that
stores the pair as one interleaved tensor: the op takes it whole and returns its gradient whole.

Eager calls skip the dispatcher: where nothing traces (no ``torch.compile``, no fake or
functional tensors, no dispatch mode such as ``opcheck``'s), a call runs the same runners through
a plain ``torch.autograd.Function`` with the same saving and backward logic — a ``torch.library``
custom op costs tens of microseconds of host time per call (its Python dispatch, autograd wrapper
and aliasing check), which a training step pays twice per exported block (bench/RESULTS.md,
run 2026-12-01c). Anything that traces still sees the registered ops; ``CODA_DISPATCH_OPS=1`` in the
environment sends every call through them (to compare the two).

Mainloop configs are tuned on a GPU the first time each op meets a new set of input shapes
(``tune``: ``"quick"`` — the eight-candidate ``QUICK_SPACE``, the default; ``"full"`` — the whole
Hopper space; ``"off"`` — the untuned default config). Winners are kept per shape in the op and in
the tuning cache (``$CODA_CACHE_DIR/tuning.json``), so a later process starts tuned.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from coda.blocks.autodiff import VJP, Pick
from coda.blocks.block import Block
from coda.primitives.analysis import analyze, bind_sizes
from coda.primitives.ir import OutputView, Program
from coda.primitives.prep.layout import interleaved_buffer
from coda.primitives.runtime import CompiledProgram, compile_program
from coda.primitives.settings import current
from coda.primitives.tracing import traced
from coda.primitives.types import torch_dtype

_REGISTERED: dict[str, ExportedFunction] = {}
_profiler_enabled = torch._C._autograd._profiler_enabled
EAGER_CALLS = not current().dispatch_ops  # CODA_DISPATCH_OPS=1: every call through the ops

Tuning = Literal["quick", "full", "off"]


@dataclass(frozen=True)
class PackedRows:
    """One op argument standing for two Program inputs stored as its even and odd rows.

    ``PackedRows("w_gate_up", even="w_gate", odd="w_up")``: the op takes ``w_gate_up`` ``[2f, d]``
    and binds ``w_gate = w_gate_up[0::2]``, ``w_up = w_gate_up[1::2]`` (views: the Program's
    ``interleave_rows`` prep of the two is then free). Its gradient is the tensor whose even and
    odd rows the backward Program returns as the two parts' gradients (the interleaved ``dw_gu``
    of the fused weight-gradient GEMM), returned whole: no per-part copies. A model that keeps one
    interleaved ``[2f, d]`` parameter thus trains with no weight-layout traffic at all.
    """

    name: str
    even: str
    odd: str


@dataclass
class _Runner:
    """One Program, compiled on first use (kernels do not depend on sizes), called by position.

    ``args``: the op's arguments — the Program's inputs, each ``packed`` pair replaced by its
    packed tensor at the even part's place. ``whole``: op outputs that are the whole tensor under
    two view outputs of the Program (op output name → the even and odd rows' output names); the
    op returns that tensor in the even output's place and drops the odd one.
    """

    program: Program
    packed: tuple[PackedRows, ...] = ()
    whole: dict[str, tuple[str, str]] = field(default_factory=dict)
    compiled: CompiledProgram | None = None
    tune: Tuning = "quick"
    # per input shapes and dtypes: the tuned Triton configs and CuTe choices (CompiledProgram's)
    tuned: dict[tuple, tuple[dict, dict]] = field(default_factory=dict)
    op_name: str = ""  # its registered op, coda::<name> (set by _custom_op)
    keep_prepared: bool = False  # CompiledProgram.keep_prepared (ExportedFunction.keep_prepared)

    def __post_init__(self) -> None:
        # worked out now: torch.compile cannot trace their first use
        self.binding, self.plain_inputs  # noqa: B018

    @functools.cached_property
    def args(self) -> list[str]:
        """The op's arguments, in order (worked out once: read on every call)."""
        return _packed_names(list(self.program.inputs), self.packed)

    @functools.cached_property
    def outputs(self) -> list[str]:
        """The op's outputs, in order (worked out once: read on every call)."""
        pairs = [(even, odd, name) for name, (even, odd) in self.whole.items()]
        return _packed_names(list(self.program.outputs), [PackedRows(n, e, o) for e, o, n in pairs])

    @functools.cached_property
    def binding(self) -> tuple[tuple[str, int, slice | None], ...]:
        """Each Program input with its argument's position and, for a packed pair's part, the
        rows it takes of the packed argument (worked out once: ``bind`` runs on every call)."""
        where: dict[str, tuple[int, slice | None]] = {n: (i, None) for i, n in enumerate(self.args)}
        for p in self.packed:
            at = where[p.name][0]
            where[p.even], where[p.odd] = (at, slice(0, None, 2)), (at, slice(1, None, 2))
        return tuple((n, *where[n]) for n in self.program.inputs)

    @functools.cached_property
    def plain_inputs(self) -> tuple[str, ...] | None:
        """The Program's inputs, in the order of the op's arguments, where nothing is packed
        (each argument is the input of its place); None where a pair is."""
        return None if self.packed else tuple(self.program.inputs)

    def bind(self, args: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        """The Program's inputs for the op's arguments (packed ones as row views)."""
        if len(args) != len(self.args):
            raise TypeError(
                f"{self.op_name or self.program.block} takes {len(self.args)} tensors "
                f"({', '.join(self.args)}), not {len(args)}"
            )
        if self.plain_inputs is not None:
            return dict(zip(self.plain_inputs, args, strict=True))
        return {n: args[i] if rows is None else args[i][rows] for n, i, rows in self.binding}

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        inputs = self.bind(args)
        if self.compiled is None:
            sizes = bind_sizes(self.program, {n: tuple(t.shape) for n, t in inputs.items()})
            self.compiled = compile_program(self.program, analyze(self.program, sizes))
            self.compiled.keep_prepared = self.keep_prepared
        if self.tune != "off":
            self._pin_configs(inputs)
        outs, fresh = self.compiled.run_outputs(inputs)
        if self.whole:
            for name, (even, odd) in self.whole.items():
                outs[name] = _whole_rows(outs.pop(even), outs.pop(odd), name)
        returned = [outs[name] for name in self.outputs]
        if fresh.issuperset(self.outputs):
            return returned  # each made anew by this call: aliases nothing (_unaliased)
        return _unaliased(returned, args, [i for i, n in enumerate(self.outputs) if n in fresh])

    def as_op(self, *args: torch.Tensor) -> Any:
        """What its op returns for ``args`` (one tensor, or a tuple), run without the dispatcher;
        a profile names the call as the op (a record_function range, opened only while a
        profiler runs: it costs host time on every call)."""
        if not _profiler_enabled():
            return _op_result(self(*args))
        with torch.profiler.record_function(self.op_name):
            return _op_result(self(*args))

    def _pin_configs(self, inputs: dict[str, torch.Tensor]) -> None:
        """Pin the tuned configs of these shapes on the compiled Program (tuning them first if
        they are new to this op and to the tuning cache): Triton's and the CuTe backend's."""
        from coda.primitives.codegen.tuning import QUICK_SPACE, tune_program

        compiled = self.compiled
        assert compiled is not None
        key = tuple([(t.shape, t.dtype) for t in inputs.values()])  # torch.Size: a tuple
        tuned = self.tuned.get(key)
        if tuned is not None and (compiled.configs, compiled.cute_configs) == tuned:
            return  # pinned already (a tuned run comes here on every call: no copy each time)
        if tuned is None:
            space = QUICK_SPACE if self.tune == "quick" else None
            tune_program(compiled, compiled.prepare(inputs), space=space)
            tuned = self.tuned[key] = (dict(compiled.configs), dict(compiled.cute_configs))
        compiled.configs, compiled.cute_configs = dict(tuned[0]), dict(tuned[1])

    def fake(self, *args: torch.Tensor) -> list[torch.Tensor]:
        """Outputs with the right shapes and dtypes, allocated like ``args`` (meta / fake)."""
        inputs = self.bind(args)
        sizes = bind_sizes(self.program, {n: tuple(t.shape) for n, t in inputs.items()})
        info = analyze(self.program, sizes)
        act = _act_dtype(self.program, inputs)
        device = args[0].device
        wholes = {even: name for name, (even, _) in self.whole.items()}
        outs = {}
        for name, value in self.program.outputs.items():
            tensor = self.program.output_tensor(name)
            t = info.tensors[tensor]
            shape = t.shape
            if isinstance(value, OutputView) and name not in wholes:
                shape = tuple(value.apply(torch.empty(shape, device="meta"), sizes).shape)
            outs[wholes.get(name, name)] = torch.empty(
                shape, dtype=torch_dtype(t.dtype, act), device=device
            )
        return [outs[name] for name in self.outputs]


def _packed_names(names: list[str], packed: Sequence[PackedRows]) -> list[str]:
    """``names`` with each packed pair replaced by the packed name at the even part's place."""
    evens = {p.even: p.name for p in packed}
    odds = {p.odd for p in packed}
    return [evens.get(n, n) for n in names if n not in odds]


def _whole_rows(even: torch.Tensor, odd: torch.Tensor, name: str) -> torch.Tensor:
    """The ``[2r, c]`` tensor whose even and odd rows are ``even`` and ``odd``: their base tensor
    when they are its two row views (no copy), a copy when those rows lie inside a larger tensor
    (an op output may not alias it); an error when they are not one tensor's rows."""
    rows = interleaved_buffer(even, odd)
    if rows is None:
        raise RuntimeError(f"{name}: the backward's two gradients are not one tensor's rows")
    base = even._base
    if (
        base is not None
        and base.shape == rows.shape
        and base.stride() == rows.stride()
        and base.data_ptr() == rows.data_ptr()
    ):
        return base
    return rows.clone()


def _unaliased(
    outs: list[torch.Tensor], args: Sequence[torch.Tensor], made: Collection[int] = ()
) -> list[torch.Tensor]:
    """``outs`` with every view, and every tensor that shares memory with an argument or an
    earlier output, copied: a custom op's outputs may alias neither (views of one fused weight
    gradient, e.g. the Q, K and V rows of ``dw_qkv``, would). Memory is compared, not only
    ``_base``: under a dispatch mode such as ``opcheck``'s a view need not report its base.

    ``made``: the positions of outputs the call allocated anew as whole tensors
    (``CompiledProgram.run_outputs``), which alias no argument and no earlier output: they are
    kept as they are, and the arguments' memory is looked up only for an output that is neither
    one of them nor a view (a view is copied whatever it shares)."""
    taken: set[int] | None = None  # the memory of the arguments and of the outputs so far
    owned = []
    for i, t in enumerate(outs):
        if i in made:
            if taken is not None:
                taken.add(t.untyped_storage().data_ptr())
            owned.append(t)
            continue
        if t._base is not None:
            owned.append(t.clone(memory_format=torch.contiguous_format))  # new memory
            continue
        if taken is None:
            taken = {a.untyped_storage().data_ptr() for a in [*args, *owned]}
        memory = t.untyped_storage().data_ptr()
        if memory in taken:
            t = t.clone(memory_format=torch.contiguous_format)
            memory = t.untyped_storage().data_ptr()
        taken.add(memory)
        owned.append(t)
    return owned


def _act_dtype(program: Program, inputs: dict[str, torch.Tensor]) -> torch.dtype:
    acts = [inputs[n].dtype for n, d in program.inputs.items() if d.dtype == "act"]
    return acts[0] if acts else torch.float32


def _schema(runner: _Runner) -> str:
    args = ", ".join(f"Tensor {name}" for name in runner.args)
    n = len(runner.outputs)
    ret = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"({args}) -> {ret}"


def _op_name(program: Program, kind: str, packed: Sequence[PackedRows] = ()) -> str:
    key = program.canonical_json() + repr(sorted((p.name, p.even, p.odd) for p in packed))
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"{re.sub(r'[^0-9a-zA-Z_]', '_', program.block)}_{digest}_{kind}"


def _custom_op(runner: _Runner, kind: str) -> Any:
    """Register one Program's runner as ``coda::<name>`` with a real and a fake implementation."""

    def impl(*args: torch.Tensor) -> Any:
        return _op_result(runner(*args))

    def fake(*args: torch.Tensor) -> Any:
        return _op_result(runner.fake(*args))

    name = f"coda::{_op_name(runner.program, kind, runner.packed)}"
    runner.op_name = name
    op = torch.library.custom_op(name, impl, mutates_args=(), schema=_schema(runner))
    op.register_fake(fake)
    return op


@dataclass
class ExportedFunction:
    """A differentiable function of the forward block's inputs (``input_names``: the Program's
    input order, each packed pair as one argument at its even part's place).

    Calling it returns the forward outputs except those saved only for the backward (one tensor,
    or a tuple in the Program's output order); ``torch.autograd`` runs the backward Program for
    gradients.
    ``forward_op``/``backward_op`` are the registered ``torch.ops.coda`` operators (the forward op
    returns every output of the forward Program, saved ones included). ``inference_op``, when
    given, runs instead of ``forward_op`` where no gradient can flow (``torch.no_grad()``, or no
    argument requires grad): a Program that computes only what a call returns, so nothing is
    saved for a backward that will not run.
    """

    forward: Program
    backward: Program
    forward_op: Any
    backward_op: Any
    input_names: list[str]
    output_names: list[str]  # what a call returns
    saved_names: list[str] = field(default_factory=list)
    runners: list[_Runner] = field(default_factory=list, repr=False)
    inference_op: Any = None
    # The same forward and backward as a plain autograd.Function, for calls nothing traces.
    eager: Any = field(default=None, repr=False)
    # The positions of ``output_names`` among the forward op's outputs, or None when a call
    # returns every output (worked out here, not on first use: read on every call, and
    # torch.compile cannot trace a cached_property's first computation).
    returned_at: tuple[int, ...] | None = field(default=None, init=False, repr=False)
    # ``eager.apply`` as ``Function.apply`` runs it where no functorch transform is active
    # (``_direct_apply``), for the calls ``__call__`` sends to ``eager``
    eager_apply: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.output_names) != len(self.forward.outputs):
            every = list(self.forward.outputs)
            self.returned_at = tuple(every.index(n) for n in self.output_names)
        if self.eager is not None:
            self.eager_apply = _direct_apply(self.eager)

    @property
    def tune(self) -> Tuning:
        """How configs are tuned for new shapes on a GPU: ``quick``, ``full`` or ``off``."""
        return self.runners[0].tune if self.runners else "off"

    @tune.setter
    def tune(self, mode: Tuning) -> None:
        if mode not in ("quick", "full", "off"):
            raise ValueError(f"tune must be 'quick', 'full' or 'off', not {mode!r}")
        for runner in self.runners:
            runner.tune = mode

    @property
    def keep_prepared(self) -> bool:
        """Whether each Program keeps its last prep results (prepared weight layouts) and reuses
        them while the weights they came from are unchanged (same memory, same version counter:
        ``CompiledProgram._prepare``). Off by default: in training the weights change every step,
        so a kept copy would only cost memory (one prepared copy of the weights per Program);
        on for inference, generation or gradient accumulation with frozen weights, where it
        skips the prep work of every call. Not for a CUDA graph whose replays change the weights
        (a captured optimizer step): the check runs on the host, at capture, not in replays."""
        return bool(self.runners) and self.runners[0].keep_prepared

    @keep_prepared.setter
    def keep_prepared(self, keep: bool) -> None:
        for runner in self.runners:
            runner.keep_prepared = keep
            if runner.compiled is not None:
                runner.compiled.keep_prepared = keep
                runner.compiled.release_prepared()

    def check_arguments(self, *args: torch.Tensor) -> None:
        """Raise ``ProgramError`` unless every Program of this function — the forward, its
        backward, the inference one — accepts arguments of ``args``' shapes and dtypes: each is
        analysed at those sizes (the size rules of its steps, e.g. a head width an epilogue can
        hold) through the ops' fake implementations on meta tensors. Nothing is compiled or
        run, ``args`` are not read: a drop-in checks at construction, from its weights' shapes,
        what its first call would otherwise refuse."""
        meta = [
            torch.empty(a.shape, dtype=a.dtype, device="meta").requires_grad_(a.is_floating_point())
            for a in args
        ]
        if self.inference_op is not None:
            self.inference_op(*[m.detach() for m in meta])
        outs = self.forward_op(*meta)
        outs = outs if isinstance(outs, tuple) else (outs,)
        differentiable = [o for o in outs if o.requires_grad]
        wrt = [m for m in meta if m.requires_grad]
        if differentiable and wrt:
            cotangents = [torch.ones_like(o) for o in differentiable]
            torch.autograd.grad(differentiable, wrt, cotangents, allow_unused=True)

    def __deepcopy__(self, memo: dict) -> ExportedFunction:
        # registered once per process (torch.library ops do not copy): a copy is this function
        return self

    def __call__(self, *args: torch.Tensor) -> Any:
        eager = EAGER_CALLS and self.eager is not None and not traced(args)
        if self.inference_op is not None and not _needs_grad(args):
            inference = self.runners[-1]  # export_autograd appends it last
            return inference.as_op(*args) if eager else self.inference_op(*args)
        outs = self.eager_apply(*args) if eager else self.forward_op(*args)
        returned = self.returned_at
        if returned is None:  # none held for the backward only
            return outs
        outs = outs if isinstance(outs, tuple) else (outs,)
        return outs[returned[0]] if len(returned) == 1 else tuple(outs[i] for i in returned)


@dataclass(frozen=True)
class _Plumbing:
    """Where ``export_autograd``'s glue finds each value, by position — worked out once per
    function, as its setup and backward run on every training step. ``saved_at``: the forward
    outputs saved for the backward (saved after the inputs, in the vjp's order);
    ``saved_only_at``: those saved only (not differentiable); ``cot_at``: the outputs with a
    cotangent, in output order; ``bwd_sources``: each backward-Program input as ``(0, i)``, the
    ``i``-th saved tensor, or ``(1, j)``, the ``j``-th cotangent."""

    saved_at: tuple[int, ...]
    saved_only_at: tuple[int, ...]
    cot_at: tuple[int, ...]
    bwd_sources: tuple[tuple[int, int], ...]

    @classmethod
    def of(
        cls,
        fwd_inputs: list[str],
        fwd_outputs: list[str],
        saved_names: list[str],
        saved_only: list[str],
        bwd_inputs: list[str],
        vjp: VJP,
    ) -> _Plumbing:
        out_position = {name: i for i, name in enumerate(fwd_outputs)}
        cot_at = tuple(i for i, name in enumerate(fwd_outputs) if name in vjp.cotangents)
        saved = {name: i for i, name in enumerate([*fwd_inputs, *saved_names])}
        cotangents = {vjp.cotangents[fwd_outputs[i]]: j for j, i in enumerate(cot_at)}
        sources = []
        for name in bwd_inputs:
            if name not in saved and name not in cotangents:
                raise ValueError(
                    f"the backward Program's input {name!r} is neither a forward input, a saved "
                    f"value {saved_names} nor a cotangent {list(cotangents)}"
                )
            sources.append((0, saved[name]) if name in saved else (1, cotangents[name]))
        return cls(
            tuple(out_position[n] for n in saved_names),
            tuple(out_position[n] for n in saved_only),
            cot_at,
            tuple(sources),
        )


def kernels_used() -> dict[str, dict[str, dict[str, str]]]:
    """What ran the fused steps of every exported Program that has run in this process: per
    Program (its block's name), ``ran`` — step → ``"cute"`` or the Triton mainloop last
    launched —, ``not_cute`` — step → why it did not take the CuTe backend where that was
    asked for (``CODA_EPILOGUE_BACKEND``) — and ``cute_tuned`` — step → the CuTe config tuning
    pinned for the last shape it ran at, or ``"triton"`` where tuning timed Triton faster
    (``"cublas"`` for a plain product, which tuning under ``auto`` times against QuACK's GEMM)."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for exported in _REGISTERED.values():
        for runner in exported.runners:
            compiled = runner.compiled
            if compiled is None or not compiled.mainloops_used:
                continue
            entry = out.setdefault(
                runner.program.block, {"ran": {}, "not_cute": {}, "cute_tuned": {}}
            )
            entry["ran"].update(compiled.mainloops_used)
            entry["not_cute"].update(compiled.cute_refusals)
            entry["cute_tuned"].update(
                {n: _tuned_label(compiled, n, c) for n, c in compiled.cute_configs.items()}
            )
    return out


def _tuned_label(compiled: Any, step: str, config: Any) -> str:
    """What tuning pinned for ``step``: a CuTe config, or the kernel that runs it otherwise —
    ``"triton"`` for a fused step, ``"cublas"`` for a plain product."""
    if config is not None:
        return str(config)
    return "triton" if step in compiled.kernels else "cublas"


def _needs_grad(args: tuple[torch.Tensor, ...]) -> bool:
    return torch.is_grad_enabled() and any(a.requires_grad for a in args)


def _direct_apply(function: type[torch.autograd.Function]) -> Any:
    """``function.apply`` for calls made where no functorch transform is active (``traced``
    sends the others to the registered op): what ``Function.apply`` does then — each dead
    functorch wrapper unwrapped (a tensor that outlived its transform), then
    ``_FunctionBase.apply`` — without its Python around that (a ``setup_context`` check for a
    class that defines none, a generator and an ``isinstance`` per argument: every argument of
    an exported function is a tensor)."""
    if function.setup_context is not torch.autograd.Function.setup_context:
        raise TypeError(f"{function.__name__} defines setup_context: call its apply")
    base_apply = super(torch.autograd.Function, function).apply
    unwrap = getattr(torch._C._functorch, "unwrap_if_dead", None)
    if unwrap is None:  # a PyTorch without dead-wrapper unwrapping: Function.apply as it is
        return function.apply

    def apply(*args: torch.Tensor) -> Any:
        return base_apply(*map(unwrap, args))

    return apply


def _op_result(outs: list[torch.Tensor]) -> Any:
    """A runner's outputs as an op returns them: one tensor, or a tuple."""
    return outs[0] if len(outs) == 1 else tuple(outs)


def export_autograd(
    forward: Program,
    backward: Program,
    backward_block: Block,
    *,
    tune: Tuning = "quick",
    packed: Sequence[PackedRows] = (),
    inference: Program | None = None,
) -> ExportedFunction:
    """Register ``forward`` + ``backward`` as a differentiable custom op (once per Program pair
    and packing; a second call returns the same function, with ``tune`` set as asked).

    ``backward_block`` is the block ``backward`` was verified against: its ``vjp`` op maps forward
    outputs to cotangent inputs (``cotangents``) and names the inputs that get gradients (``wrt``);
    the backward Program's inputs must be the forward inputs followed by those cotangents. An
    input the vjp passes a cotangent through to (``passthrough``: a residual ``x`` of ``out = x +
    …``) gets that cotangent itself as its gradient, from no Program.
    ``packed``: pairs of forward inputs the function takes as one tensor of interleaved rows
    (``PackedRows``); the backward Program must return their gradients as the even and odd rows of
    one tensor, which becomes the packed tensor's gradient. ``inference``: a Program with the
    forward's inputs and only the outputs a call returns (e.g. ``llama_mlp`` for
    ``llama_mlp_train``), run when no gradient is needed.
    """
    packed = tuple(packed)
    key = _op_name(forward, "fwd", packed) + _op_name(backward, "bwd", packed)
    if inference is not None:
        key += _op_name(inference, "inf", packed)
    if key in _REGISTERED:
        _REGISTERED[key].tune = tune
        return _REGISTERED[key]
    vjp = _vjp_of(backward_block)
    _check_pair(forward, backward, vjp)
    grad_names = {
        p.key: p.out for p in backward_block.graph if isinstance(p, Pick) and p.src == vjp.out
    }
    _check_packing(forward, backward, grad_names, packed)
    # Saved values that are not also differentiable outputs (e.g. llama_mlp's g, u) are extra
    # outputs a call does not return; a saved output that is returned too (llama_attn_in's qkv,
    # which its backward takes instead of recomputing) stays an ordinary output.
    saved_only = [n for n in vjp.saved if n not in vjp.cotangents]
    if inference is not None:
        _check_inference(forward, inference, [n for n in forward.outputs if n not in saved_only])
    whole = {f"d{p.name}": (grad_names[p.even], grad_names[p.odd]) for p in packed}
    for p in packed:
        grad_names[p.name] = f"d{p.name}"
    fwd_runner = _Runner(forward, packed)
    bwd_runner = _Runner(backward, packed, whole)
    fwd_op, bwd_op = _custom_op(fwd_runner, "fwd"), _custom_op(bwd_runner, "bwd")
    fwd_inputs, fwd_outputs = fwd_runner.args, fwd_runner.outputs
    bwd_inputs, bwd_outputs = bwd_runner.args, bwd_runner.outputs
    saved_names = list(vjp.saved)
    plumbing = _Plumbing.of(fwd_inputs, fwd_outputs, saved_names, saved_only, bwd_inputs, vjp)
    grad_at = _gradient_sources(fwd_inputs, fwd_outputs, bwd_outputs, grad_names, plumbing, vjp)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        outs = output if isinstance(output, tuple) else (output,)
        if plumbing.saved_only_at:
            ctx.mark_non_differentiable(*[outs[i] for i in plumbing.saved_only_at])
        # Outputs nobody differentiated (saved activations, e.g. llama_mlp's g, u) reach
        # backward_fn as None, not as zero tensors of their size: for llama_mlp, when it saved
        # g, u and a, 3 fills of M·f values a step (0.24 ms at d = 2048, 0.42 ms at d = 4096 on
        # the H200, bench/profile_export.py).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs, *[outs[i] for i in plumbing.saved_at])
        # what a zero cotangent for an output whose gradient comes as None is made like
        ctx.out_meta = [(outs[i].shape, outs[i].dtype, outs[i].device) for i in plumbing.cot_at]

    def backward_fn(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        return backward_with(bwd_op, ctx, grads)

    def backward_with(run_backward: Any, ctx: Any, grads: tuple) -> tuple:
        cot = [
            torch.zeros(shape, dtype=dtype, device=device) if grads[i] is None else grads[i]
            for i, (shape, dtype, device) in zip(plumbing.cot_at, ctx.out_meta, strict=True)
        ]
        sources = (ctx.saved_tensors, cot)
        result = run_backward(*[sources[kind][at] for kind, at in plumbing.bwd_sources])
        result = result if isinstance(result, tuple) else (result,)
        grads_from = (result, cot)
        return tuple([None if at is None else grads_from[at[0]][at[1]] for at in grad_at])

    fwd_op.register_autograd(backward_fn, setup_context=setup_context)
    user_outputs = [n for n in fwd_outputs if n not in saved_only]
    runners = [fwd_runner, bwd_runner]
    inf_op = None
    if inference is not None:
        runners.append(_Runner(inference, packed))
        inf_op = _custom_op(runners[-1], "inf")

    def eager_forward(ctx: Any, *args: torch.Tensor) -> Any:
        # forward(ctx, *args) rather than a separate setup_context: with one, every
        # Function.apply binds its arguments through inspect.signature (host time per call)
        output = fwd_runner.as_op(*args)
        setup_context(ctx, args, output)
        return output

    eager = type(
        f"Eager_{_op_name(forward, 'fwd', packed)}",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(eager_forward),
            "backward": staticmethod(
                lambda ctx, *grads: backward_with(bwd_runner.as_op, ctx, grads)
            ),
        },
    )
    exported = ExportedFunction(
        forward,
        backward,
        fwd_op,
        bwd_op,
        fwd_inputs,
        user_outputs,
        saved_names,
        runners,
        inf_op,
        eager,
    )
    exported.tune = tune
    _REGISTERED[key] = exported
    return exported


def _gradient_sources(
    fwd_inputs: list[str],
    fwd_outputs: list[str],
    bwd_outputs: list[str],
    grad_names: dict[str, str],
    plumbing: _Plumbing,
    vjp: VJP,
) -> tuple[tuple[int, int] | None, ...]:
    """Where each forward input's gradient comes from: ``(0, i)``, the backward op's ``i``-th
    output; ``(1, j)``, the ``j``-th cotangent as is (an input the vjp passes its output's
    gradient through to: a residual, ``VJP.passthrough``); None, no gradient."""
    bwd_position = {name: i for i, name in enumerate(bwd_outputs)}
    cot_position = {fwd_outputs[i]: j for j, i in enumerate(plumbing.cot_at)}
    sources: list[tuple[int, int] | None] = []
    for name in fwd_inputs:
        if name in vjp.passthrough:
            sources.append((1, cot_position[vjp.passthrough[name]]))
        elif grad_names.get(name, "") in bwd_position:
            sources.append((0, bwd_position[grad_names[name]]))
        else:
            sources.append(None)
    return tuple(sources)


def _check_inference(forward: Program, inference: Program, returned: list[str]) -> None:
    if list(inference.inputs) != list(forward.inputs) or list(inference.outputs) != returned:
        raise ValueError(
            f"the inference Program must take the forward's inputs {list(forward.inputs)} and "
            f"return what a call returns, {returned}; it takes {list(inference.inputs)} and "
            f"returns {list(inference.outputs)}"
        )


def _check_packing(
    forward: Program, backward: Program, grad_names: dict[str, str], packed: tuple[PackedRows, ...]
) -> None:
    """Each packed pair: two forward inputs whose gradients are the even and odd rows of one
    backward tensor."""
    taken: set[str] = set()
    for p in packed:
        parts = [p.even, p.odd]
        unknown = [n for n in parts if n not in forward.inputs]
        if unknown or p.even == p.odd or taken & {*parts, p.name}:
            raise ValueError(
                f"cannot pack {p.even!r} and {p.odd!r} as {p.name!r}: each pair must name two "
                f"distinct, not yet packed forward inputs of {list(forward.inputs)}"
            )
        if p.name in forward.inputs:
            raise ValueError(f"the packed name {p.name!r} is already a forward input")
        taken |= {*parts, p.name}
        views = [backward.outputs.get(grad_names.get(n, "")) for n in parts]
        if not all(isinstance(v, OutputView) for v in views) or not _even_odd_rows(*views):
            raise ValueError(
                f"cannot pack {p.even!r} and {p.odd!r}: the backward Program must return their "
                "gradients as the even and odd rows of one tensor (views step 2 from row 0 and "
                f"row 1), not {views}"
            )


def _even_odd_rows(even: OutputView, odd: OutputView) -> bool:
    return (
        even.tensor == odd.tensor
        and (even.dim, odd.dim, even.step, odd.step) == (0, 0, 2, 2)
        and (even.start, odd.start) == ("0", "1")
        and even.stop is None
        and odd.stop is None
    )


def _vjp_of(block: Block) -> VJP:
    found = [op for op in block.graph if isinstance(op, VJP)]
    if len(found) != 1:
        raise ValueError(
            f"block {block.name!r} is not a backward block (it has no single vjp op); pass the "
            "block the backward Program was verified against, e.g. from backward_block(...)"
        )
    return found[0]


def _check_pair(forward: Program, backward: Program, vjp: VJP) -> None:
    given = [n for n in forward.inputs if n not in vjp.zeros]
    want = [*given, *vjp.saved, *vjp.cotangents.values()]
    if list(backward.inputs) != want:
        raise ValueError(
            f"the backward Program's inputs {list(backward.inputs)} must be the forward inputs "
            f"(but those no gradient depends on), the saved values and the cotangents: {want}"
        )
    missing = [o for o in [*vjp.cotangents, *vjp.saved] if o not in forward.outputs]
    if missing:
        raise ValueError(
            f"the backward needs forward outputs {missing} that the forward Program lacks",
        )
