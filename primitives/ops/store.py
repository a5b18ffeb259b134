"""Store family: write an epilogue value out to a program tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from ..base import EpilogueOp, Name, Port
from ..errors import ProgramError
from ..types import StoreDtype, TensorInfo

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..cute.emit import CuteEmitContext
    from ..reference import RefEnv


class Store(EpilogueOp):
    """Write tile ``src`` to program tensor ``to`` (``[M, W]``, W = src's width), rounding once.

    ``dtype``: ``auto`` (the run's activation dtype, e.g. bfloat16), or ``float32`` / ``float16`` /
    ``bfloat16``. ``mode="write"`` creates ``to`` (a new name); ``mode="accumulate"`` adds ``src``
    to an existing tensor produced by an earlier step (gradients from several branches), keeping its
    dtype. Block inputs are never written.
    """

    op: Literal["store"] = "store"
    port: ClassVar = Port.SINK

    src: Name
    to: Name
    dtype: StoreDtype = "auto"
    mode: Literal["write", "accumulate"] = "write"

    def check(self, env: CheckEnv) -> None:
        t = env.tile(self.src)
        shape = (env.M, env.cols(t.scale))
        if self.mode == "write":
            dtype = "act" if self.dtype == "auto" else self.dtype
            env.define_tensor(self.to, TensorInfo(shape, dtype, env.program.where))
        else:
            self._check_accumulate(env, shape)
            env.accumulates.add(self.to)

    def _check_accumulate(self, env: CheckEnv, shape: tuple[int, int]) -> None:
        info = env.tensor(self.to, role="accumulate target")
        if info.producer == "input":
            raise ProgramError(
                f"cannot accumulate into block input {self.to!r}: inputs are never written",
                hint="write a new tensor instead (mode='write')",
            )
        if info.shape != shape or info.partials is not None:
            raise ProgramError(
                f"accumulate target {self.to!r} is {info.describe()}, but src {self.src!r} is "
                f"[{shape[0]}, {shape[1]}]"
            )
        if self.dtype != "auto" and self.dtype != info.dtype:
            raise ProgramError(
                f"accumulate keeps {self.to!r}'s dtype ({info.dtype}); dtype={self.dtype!r} "
                "differs",
                hint="leave dtype='auto' when accumulating",
            )

    def reference(self, env: RefEnv) -> None:
        value = env.locals[self.src]
        if self.mode == "accumulate":
            old = env.tensors[self.to]
            env.tensors[self.to] = (old.to(value.dtype) + value).to(old.dtype)
        else:
            env.tensors[self.to] = value.to(env.store_dtype(self.dtype))

    def emit(self, ctx: EmitContext) -> None:
        scale = ctx.type_of(self.src).scale
        ctx.store_tile(self.to, ctx.var(self.src), scale, accumulate=self.mode == "accumulate")

    def emit_cute(self, ctx: CuteEmitContext) -> None:
        # mode="accumulate" never gets here: a step that accumulates stays on Triton (emit.generate)
        ctx.store(self.to, ctx.parts(self.src))
