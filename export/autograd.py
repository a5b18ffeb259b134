"""A verified forward Program plus its backward Program as one differentiable PyTorch op.

``export_autograd(forward, backward, backward_block)`` registers two ``torch.library`` custom ops,
``coda::<block>_<hash>_fwd`` and ``..._bwd``, each running its Program's kernels (Triton, the vendor
GEMM for plain products), each with a fake (meta) implementation that derives output shapes from
the Program's analysis — so ``torch.compile`` traces *around* them without a graph break — and ties
them together with ``torch.library.register_autograd``. The backward block's ``vjp`` op says which
forward output each cotangent belongs to, which inputs get gradients, and which forward values the
backward receives (``saved``): the forward Program returns those too (e.g. ``llama_mlp_train``'s
``g`` and ``u``), autograd keeps them for the backward, and the caller sees only the other outputs.

Prep steps (weight layouts such as gate/up interleaving) run inside every forward and backward
call: in training the weights change every step. They move weight-sized tensors once per call,
which is small next to the GEMMs at training batch sizes.

Mainloop configs are tuned on a GPU the first time each op meets a new set of input shapes
(``tune``: ``"quick"`` — the five-candidate ``QUICK_SPACE``, the default; ``"full"`` — the whole
Hopper space; ``"off"`` — the untuned default config). Winners are kept per shape in the op and in
the tuning cache (``$CODA_CACHE_DIR/tuning.json``), so a later process starts tuned.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from coda.blocks.autodiff import VJP, Pick
from coda.blocks.block import Block
from coda.primitives import backend  # noqa: F401  (first: selects the interpreter without a GPU)
from coda.primitives.analysis import analyze, bind_sizes
from coda.primitives.ir import OutputView, Program
from coda.primitives.runtime import CompiledProgram, compile_program
from coda.primitives.types import torch_dtype

_REGISTERED: dict[str, ExportedFunction] = {}

Tuning = Literal["quick", "full", "off"]


@dataclass
class _Runner:
    """One Program, compiled on first use (kernels do not depend on sizes), called by position."""

    program: Program
    compiled: CompiledProgram | None = None
    names: list[str] = field(default_factory=list)
    tune: Tuning = "quick"
    tuned: dict[tuple, dict] = field(default_factory=dict)  # configs per input shapes and dtypes

    def __post_init__(self) -> None:
        self.names = list(self.program.inputs)

    def bind(self, args: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, args, strict=True))

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        inputs = self.bind(args)
        if self.compiled is None:
            sizes = bind_sizes(self.program, {n: tuple(t.shape) for n, t in inputs.items()})
            self.compiled = compile_program(self.program, analyze(self.program, sizes))
        if self.tune != "off":
            self._pin_configs(inputs)
        outs = self.compiled(inputs)
        # An op's outputs may not alias one another (views of one fused gradient would): copy views.
        return [_owned(outs[name]) for name in self.program.outputs]

    def _pin_configs(self, inputs: dict[str, torch.Tensor]) -> None:
        """Pin the tuned configs of these shapes on the compiled Program (tuning them first if
        they are new to this op and to the tuning cache)."""
        from coda.primitives.codegen.tuning import QUICK_SPACE, tune_program

        assert self.compiled is not None
        key = tuple((tuple(t.shape), t.dtype) for t in inputs.values())
        if key not in self.tuned:
            space = QUICK_SPACE if self.tune == "quick" else None
            tune_program(self.compiled, self.compiled.prepare(inputs), space=space)
            self.tuned[key] = dict(self.compiled.configs)
        self.compiled.configs = dict(self.tuned[key])

    def fake(self, *args: torch.Tensor) -> list[torch.Tensor]:
        """Outputs with the right shapes and dtypes, allocated like ``args`` (meta / fake)."""
        inputs = self.bind(args)
        sizes = bind_sizes(self.program, {n: tuple(t.shape) for n, t in inputs.items()})
        info = analyze(self.program, sizes)
        act = _act_dtype(self.program, inputs)
        device = args[0].device
        outs = []
        for name, value in self.program.outputs.items():
            tensor = self.program.output_tensor(name)
            t = info.tensors[tensor]
            shape = t.shape
            if isinstance(value, OutputView):
                shape = tuple(value.apply(torch.empty(shape, device="meta"), sizes).shape)
            outs.append(torch.empty(shape, dtype=torch_dtype(t.dtype, act), device=device))
        return outs


def _owned(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format) if t._base is not None else t


def _act_dtype(program: Program, inputs: dict[str, torch.Tensor]) -> torch.dtype:
    acts = [inputs[n].dtype for n, d in program.inputs.items() if d.dtype == "act"]
    return acts[0] if acts else torch.float32


def _schema(program: Program) -> str:
    args = ", ".join(f"Tensor {name}" for name in program.inputs)
    n = len(program.outputs)
    ret = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"({args}) -> {ret}"


def _op_name(program: Program, kind: str) -> str:
    digest = hashlib.sha256(program.canonical_json().encode()).hexdigest()[:10]
    return f"{re.sub(r'[^0-9a-zA-Z_]', '_', program.block)}_{digest}_{kind}"


def _custom_op(program: Program, kind: str) -> tuple[Any, _Runner]:
    """Register one Program as ``coda::<name>`` with a real and a fake implementation."""
    runner = _Runner(program)
    single = len(program.outputs) == 1

    def impl(*args: torch.Tensor) -> Any:
        outs = runner(*args)
        return outs[0] if single else tuple(outs)

    def fake(*args: torch.Tensor) -> Any:
        outs = runner.fake(*args)
        return outs[0] if single else tuple(outs)

    name = f"coda::{_op_name(program, kind)}"
    op = torch.library.custom_op(name, impl, mutates_args=(), schema=_schema(program))
    op.register_fake(fake)
    return op, runner


@dataclass
class ExportedFunction:
    """A differentiable function of the forward block's inputs (in the Program's input order).

    Calling it returns the forward outputs other than the saved ones (one tensor, or a tuple in the
    Program's output order); ``torch.autograd`` runs the backward Program for gradients.
    ``forward_op``/``backward_op`` are the registered ``torch.ops.coda`` operators (the forward op
    returns every output of the forward Program, saved ones included).
    """

    forward: Program
    backward: Program
    forward_op: Any
    backward_op: Any
    input_names: list[str]
    output_names: list[str]  # what a call returns
    saved_names: list[str] = field(default_factory=list)
    runners: list[_Runner] = field(default_factory=list, repr=False)

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

    def __call__(self, *args: torch.Tensor) -> Any:
        outs = self.forward_op(*args)
        if not self.saved_names:
            return outs
        outs = outs if isinstance(outs, tuple) else (outs,)
        every = list(self.forward.outputs)
        kept = tuple(outs[every.index(n)] for n in self.output_names)
        return kept[0] if len(kept) == 1 else kept


def export_autograd(
    forward: Program, backward: Program, backward_block: Block, *, tune: Tuning = "quick"
) -> ExportedFunction:
    """Register ``forward`` + ``backward`` as a differentiable custom op (once per Program pair;
    a second call returns the same function, with ``tune`` set as asked).

    ``backward_block`` is the block ``backward`` was verified against: its ``vjp`` op maps forward
    outputs to cotangent inputs (``cotangents``) and names the inputs that get gradients (``wrt``);
    the backward Program's inputs must be the forward inputs followed by those cotangents.
    """
    key = _op_name(forward, "fwd") + _op_name(backward, "bwd")
    if key in _REGISTERED:
        _REGISTERED[key].tune = tune
        return _REGISTERED[key]
    vjp = _vjp_of(backward_block)
    _check_pair(forward, backward, vjp)
    (fwd_op, fwd_runner), (bwd_op, bwd_runner) = (
        _custom_op(forward, "fwd"),
        _custom_op(backward, "bwd"),
    )
    fwd_inputs, fwd_outputs = list(forward.inputs), list(forward.outputs)
    grad_names = {
        p.key: p.out for p in backward_block.graph if isinstance(p, Pick) and p.src == vjp.out
    }
    bwd_outputs = list(backward.outputs)

    saved_names = list(vjp.saved)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        outs = output if isinstance(output, tuple) else (output,)
        by_name = dict(zip(fwd_outputs, outs, strict=True))
        kept = [by_name[n] for n in saved_names]
        ctx.mark_non_differentiable(*kept)
        # Outputs nobody differentiated (saved activations, e.g. llama_mlp's g, u, a) reach
        # backward_fn as None, not as zero tensors of their size: for llama_mlp 3 fills of M·f
        # values a step (0.24 ms at d = 2048, 0.42 ms at d = 4096 on the H200,
        # bench/profile_export.py).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs, *kept)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]

    def backward_fn(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        saved = dict(zip([*fwd_inputs, *saved_names], ctx.saved_tensors, strict=True))
        cot = {}
        for (out, grad), (shape, dtype, device) in zip(
            zip(fwd_outputs, grads, strict=True), ctx.out_meta, strict=True
        ):
            if out in vjp.cotangents:
                zero = grad is None
                cot[vjp.cotangents[out]] = (
                    torch.zeros(shape, dtype=dtype, device=device) if zero else grad
                )
        args = [saved[n] if n in saved else cot[n] for n in backward.inputs]
        result = bwd_op(*args)
        result = result if isinstance(result, tuple) else (result,)
        by_name = dict(zip(bwd_outputs, result, strict=True))
        return tuple(by_name.get(grad_names.get(n, "")) for n in fwd_inputs)

    fwd_op.register_autograd(backward_fn, setup_context=setup_context)
    user_outputs = [n for n in fwd_outputs if n not in saved_names]
    exported = ExportedFunction(
        forward,
        backward,
        fwd_op,
        bwd_op,
        fwd_inputs,
        user_outputs,
        saved_names,
        [fwd_runner, bwd_runner],
    )
    exported.tune = tune
    _REGISTERED[key] = exported
    return exported


def _vjp_of(block: Block) -> VJP:
    found = [op for op in block.graph if isinstance(op, VJP)]
    if len(found) != 1:
        raise ValueError(
            f"block {block.name!r} is not a backward block (it has no single vjp op); pass the "
            "block the backward Program was verified against, e.g. from backward_block(...)"
        )
    return found[0]


def _check_pair(forward: Program, backward: Program, vjp: VJP) -> None:
    want = [*forward.inputs, *vjp.saved, *vjp.cotangents.values()]
    if list(backward.inputs) != want:
        raise ValueError(
            f"the backward Program's inputs {list(backward.inputs)} must be the forward inputs, "
            f"the saved values and the cotangents: {want}"
        )
    missing = [o for o in [*vjp.cotangents, *vjp.saved] if o not in forward.outputs]
    if missing:
        raise ValueError(
            f"the backward needs forward outputs {missing} that the forward Program lacks",
        )
