"""Validation and shape resolution: the rule table in front of both executors.

``analyze(program, sizes)`` walks the program at one binding of its symbolic sizes (``{"M": 67,
"d": 48, ...}``) and returns a ``ProgramInfo`` (every tensor's shape and dtype class, every GEMM's
sizes and epilogue value types), or raises the first ``ProgramError`` with its location. Codegen
only uses what is the same at every binding (value kinds and column spaces), so one analysis
generates the kernels and each run's analysis sizes its buffers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from . import edits
from .checking import CheckEnv, ProgramEnv
from .errors import ProgramError, did_you_mean
from .ir import GemmEpilogue, MainloopConfig, Operand, OutputView, Program
from .types import LocalType, TensorInfo


@dataclass
class GemmInfo:
    """One ``GemmEpilogue`` at one binding."""

    name: str
    index: int
    M: int
    N: int
    K: int
    locals: dict[str, LocalType]
    writes: dict[str, TensorInfo]  # tensors this kernel creates
    accumulates: set[str]  # existing tensors it adds into
    vendor: bool  # plain store: runs on torch.matmul (cuBLAS on a GPU)
    column_multiple: int = 1  # EPI_N must be a multiple of this (``CheckEnv.require_columns``)


@dataclass
class ProgramInfo:
    """The analysed program at one binding of its sizes."""

    sizes: dict[str, int]
    tensors: dict[str, TensorInfo]
    gemms: dict[str, GemmInfo] = field(default_factory=dict)

    def signature(self) -> Any:
        """What codegen depends on (identical at every binding), for consistency checks."""
        return {n: (g.vendor, sorted(g.locals.items(), key=str)) for n, g in self.gemms.items()}


def resolve_inputs(program: Program, sizes: dict[str, int]) -> dict[str, TensorInfo]:
    """Concrete shapes of the program's inputs under ``sizes``."""
    out = {}
    for name, decl in program.inputs.items():
        shape = []
        for dim in decl.shape:
            if isinstance(dim, int):
                shape.append(dim)
            elif dim in sizes:
                shape.append(sizes[dim])
            else:
                raise ProgramError(
                    f"input {name!r} uses size {dim!r}, which has no value",
                    loc=f"inputs.{name}",
                    hint=did_you_mean(dim, sizes),
                )
        out[name] = TensorInfo(tuple(shape), decl.dtype, "input")
    return out


def bind_sizes(program: Program, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Read the symbolic sizes off actual input shapes, checking that they agree."""
    sizes: dict[str, int] = {}
    where: dict[str, str] = {}
    for name, decl in program.inputs.items():
        if name not in shapes:
            raise ProgramError(f"input {name!r} was not given", hint=did_you_mean(name, shapes))
        shape = tuple(shapes[name])
        if len(shape) != len(decl.shape):
            raise ProgramError(
                f"input {name!r} must have {len(decl.shape)} dimensions {decl.shape}, got {shape}"
            )
        for i, (dim, actual) in enumerate(zip(decl.shape, shape, strict=True)):
            here = f"{name}.shape[{i}]"
            if isinstance(dim, int):
                if dim != actual:
                    raise ProgramError(f"{here} must be {dim}, got {actual}")
            elif dim in sizes and sizes[dim] != actual:
                raise ProgramError(
                    f"size {dim!r} is {sizes[dim]} in {where[dim]} but {actual} in {here}"
                )
            else:
                sizes[dim], where[dim] = actual, here
    return sizes


def _operand(env: ProgramEnv, op: Operand, role: str) -> tuple[int, int, TensorInfo]:
    """(rows, cols) of an operand after its transpose."""
    info = env.matrix(op.tensor, role=f"operand {role}")
    rows, cols = info.shape
    return (cols, rows, info) if op.transpose else (rows, cols, info)


def _check_gemm(env: ProgramEnv, step: GemmEpilogue, name: str, index: int) -> GemmInfo:
    M, K, a = _operand(env, step.a, "a")
    K_b, N, b = _operand(env, step.b, "b")
    if K_b != K:
        raise ProgramError(
            f"A = {step.a.text()} is [{M}, {K}] but B = {step.b.text()} is [{K_b}, {N}]: the inner "
            "sizes differ",
            hint="A must be [M, K] and B [K, N]; an nn.Linear weight [out, in] is used as 'w.T'",
        )
    if a.dtype != b.dtype:
        raise ProgramError(
            f"operands have different dtypes: {step.a.tensor!r} is {a.dtype}, {step.b.tensor!r} "
            f"is {b.dtype}",
            hint="store the intermediate with dtype='auto' to match the weights",
        )
    cenv = CheckEnv(program=env, M=M, N=N, K=K, locals={"acc": LocalType("tile")})
    for j, op in enumerate(step.epilogue):
        try:
            op.check(cenv)
        except ProgramError as e:
            raise with_field(e, op).at(f"epilogue[{j}] ({op.op})") from None
    if not cenv.writes and not cenv.accumulates:
        raise ProgramError(
            "the epilogue writes nothing",
            loc="epilogue",
            hint="end it with store(...) or partial_reduce(...)",
        )
    cfg, multiple = step.config, cenv.column_multiple
    if isinstance(cfg, MainloopConfig) and cfg.epilogue_block_n % multiple:
        raise ProgramError(
            f"the epilogue needs sub-tiles of a multiple of {multiple} columns, but config "
            f"block_n={cfg.block_n} with epilogue_subtiles={cfg.epilogue_subtiles} gives "
            f"{cfg.epilogue_block_n}",
            loc="config",
            hint=f"use block_n // epilogue_subtiles = a multiple of {multiple}, or config 'auto'",
        )
    return GemmInfo(
        name,
        index,
        M,
        N,
        K,
        cenv.locals,
        cenv.writes,
        cenv.accumulates,
        step.is_plain_store,
        multiple,
    )


def analyze(program: Program, sizes: dict[str, int]) -> ProgramInfo:
    """Type-check ``program`` at ``sizes``; raise the first ``ProgramError`` with its location."""
    env = ProgramEnv(resolve_inputs(program, sizes), sizes=dict(sizes))
    info = ProgramInfo(dict(sizes), env.tensors)
    for i, step in enumerate(program.prep):
        env.where = f"prep[{i}]"
        try:
            step.check(env)
        except ProgramError as e:
            raise with_field(e, step).at(f"prep[{i}] ({step.kind})") from None
    for i, (step, name) in enumerate(zip(program.steps, program.step_names(), strict=True)):
        env.where = name
        loc = f"steps[{i}] ({step.kind} {name!r})"
        try:
            if isinstance(step, GemmEpilogue):
                gemm = _check_gemm(env, step, name, i)
                for tname, tinfo in gemm.writes.items():
                    env.define(tname, tinfo)
                info.gemms[name] = gemm
            else:
                step.check(env)
        except ProgramError as e:
            if not isinstance(step, GemmEpilogue):
                e = with_field(e, step)
            raise _unstored(e.at(loc), info) from None
    try:
        _check_outputs(program, env)
    except ProgramError as e:
        raise _unstored(e, info) from None
    return info


def with_field(error: ProgramError, node: Any) -> ProgramError:
    """The error located at the field of ``node`` that holds the name it is about.

    Primitives raise about a name (``vector 'r' must be ...``) without knowing which field held
    it; the first quoted name of the message that is the value of exactly one string field of
    the node (or of an operand's ``tensor``) gives that field. Unchanged when none does.
    """
    if error.loc:
        return error
    values: dict[str, list[str]] = {}
    for key in type(node).model_fields:
        value = getattr(node, key)
        if isinstance(value, Operand):
            values.setdefault(value.tensor, []).append(key)
        elif isinstance(value, str) and key not in ("op", "kind", "name"):
            values.setdefault(value, []).append(key)
    for quoted in re.findall(r"'([^']+)'", error.message):
        if len(values.get(quoted, [])) == 1:
            return ProgramError(
                error.message, loc=values[quoted][0], hint=error.hint, subject=error.subject
            )
    return error


def _unstored(error: ProgramError, info: ProgramInfo) -> ProgramError:
    """A read of a tensor no step writes, where an earlier GEMM computes an epilogue value of
    that name: the fault is the missing store in that GEMM, so the error points there."""
    name = error.subject
    gemm = next((g for g in info.gemms.values() if name and name in g.locals), None)
    if gemm is None:
        return error
    return ProgramError(
        f"steps[{gemm.index}] (gemm {gemm.name!r}) computes {name!r} in its epilogue but never "
        f"stores it, so {error.loc or 'a later read'} cannot read it",
        loc=f"steps[{gemm.index}] (gemm {gemm.name!r}).epilogue",
        hint=f"add store(src={name!r}, to={name!r}) to that epilogue",
        subject=name,
    )


def _check_outputs(program: Program, env: ProgramEnv) -> None:
    for out, value in program.outputs.items():
        tensor = program.output_tensor(out)
        loc = f"outputs.{out}"
        if tensor not in env.tensors:
            raise ProgramError(
                f"output {out!r} names {tensor!r}, which no step writes",
                loc=loc,
                hint=did_you_mean(tensor, env.tensors),
                subject=tensor,
            )
        t = env.tensors[tensor]
        if t.producer == "input":
            raise ProgramError(
                f"output {out!r} is the block input {tensor!r} itself",
                loc=loc,
                hint="outputs must be computed by the program's steps",
            )
        if t.partials is not None:
            raise ProgramError(
                f"output {out!r} names {tensor!r}, a partials buffer",
                loc=loc,
                hint="finish partials with an aux step first",
            )
        if isinstance(value, OutputView):
            if len(t.shape) != 2:
                raise ProgramError(f"output view of {tensor!r} needs a 2-D tensor", loc=loc)
            try:
                value.bounds(env.sizes, t.shape[value.dim])
            except ProgramError as e:
                raise e.at(loc) from None


def analyze_all(program: Program, size_sets: list[dict[str, int]]) -> list[ProgramInfo]:
    """Analyse at every binding and check that codegen-relevant types agree across them."""
    infos = []
    for sizes in size_sets:
        try:
            infos.append(analyze(program, sizes))
        except ProgramError as e:
            where = ", ".join(f"{k}={v}" for k, v in sizes.items())
            hint = (e.hint + f" [at {where}]").strip()
            raise ProgramError(e.message, loc=e.loc, hint=hint, subject=e.subject) from None
    if infos and any(i.signature() != infos[0].signature() for i in infos[1:]):
        raise ProgramError(
            "the epilogue value types differ between shape sets (a tensor's width relative to the "
            "GEMM's N changes with the sizes)",
            hint="tile tensors must have N/2, N or 2N columns at every size",
        )
    return infos


def upstream_fix(
    program: Program,
    size_sets: list[dict[str, int]],
    error: ProgramError,
    also: Callable[[Program, list[ProgramInfo]], None] | None = None,
) -> ProgramError:
    """Where a type error comes from, when that is not where it surfaces.

    A reduction on the wrong axis surfaces as a vector of the wrong length steps later; a store in
    the wrong dtype as mismatched GEMM operands. Tries single edits (``edits.flips``: another
    value of a Literal or bool field; ``edits.swaps``: two tensor fields or a GEMM's operands
    exchanged) at the failing node and then upstream, nearest first; the first edit under which
    the whole program type-checks at every shape set names the node. Errors about a name that
    does not exist are local and returned as they are, and so is any error no single edit
    removes. ``also``, given, is a further check an edit must pass (the caller's, e.g. that the
    outputs have the block's shapes).
    """
    if error.path is None:
        return error
    try:
        if error.subject:
            return _missing_store(program, size_sets, error, also)
        return _search_upstream(program, size_sets, error, also)
    except Exception:  # noqa: BLE001 - a diagnosis that fails must not hide the error itself
        return error


def _search_upstream(
    program: Program,
    size_sets: list[dict[str, int]],
    error: ProgramError,
    also: Callable[[Program, list[ProgramInfo]], None] | None,
) -> ProgramError:
    tensors = set(program.inputs) | _produced(program)
    data = program.model_dump(mode="json")
    order = _node_order(data)
    here = _position(error.path, order)
    candidates = [*edits.flips(program), *edits.swaps(data, tensors)]
    ranked = sorted(
        candidates,
        key=lambda c: (
            (0, here - _position(c.path, order))
            if _position(c.path, order) <= here
            else (1, _position(c.path, order))
        ),
    )
    for cand in ranked:
        if _type_checks(cand.program, size_sets, also):
            if cand.path.startswith(error.path):
                return ProgramError(
                    error.message,
                    loc=error.loc,
                    hint=f"{cand.what} makes the program type-check — {error.hint}".strip(" —"),
                    path=cand.path,
                )
            return ProgramError(
                f"{error.loc}: {error.message}" if error.loc else error.message,
                loc=cand.path,
                hint=f"this surfaces downstream of {cand.path}: {cand.what} makes the whole "
                f"program type-check ({error.hint})",
            )
    return error


def _missing_store(
    program: Program,
    size_sets: list[dict[str, int]],
    error: ProgramError,
    also: Callable[[Program, list[ProgramInfo]], None] | None,
) -> ProgramError:
    """An output no step writes: the GEMM whose epilogue can store it (a store appended there
    makes the program type-check, ``also`` included) is where it is missing — if exactly one
    GEMM can. Other reads of a missing name are misspellings, reported where they are."""
    if not error.path.startswith("outputs."):
        return error
    data = program.model_dump(mode="json")
    fits = [
        c for c in edits.stores(data, error.subject) if _type_checks(c.program, size_sets, also)
    ]
    if not fits or len({c.path for c in fits}) != 1:
        return error
    return ProgramError(
        f"{error.loc}: {error.message}",
        loc=fits[0].path,
        hint=f"the output is never stored: {fits[0].what}"
        + (f" (or {len(fits) - 1} other values of that epilogue fit)" if len(fits) > 1 else ""),
        subject=error.subject,
    )


def _produced(program: Program) -> set[str]:
    names = set()
    for _, node in edits.nodes(program.model_dump(mode="json")):
        for key in ("out", "to"):
            if isinstance(node.get(key), str):
                names.add(node[key])
    return names


def _node_order(data: dict[str, Any]) -> list[str]:
    return [path for path, _ in edits.nodes(data)]


def _position(path: str, order: list[str]) -> int:
    """Index of the deepest node of ``order`` that ``path`` lies in (outputs: after the last)."""
    best = len(order)
    for k, node in enumerate(order):
        if path == node or path.startswith(node + ".") or path.startswith(node + "["):
            best = k
    return best


def _type_checks(
    data: dict[str, Any],
    size_sets: list[dict[str, int]],
    also: Callable[[Program, list[ProgramInfo]], None] | None,
) -> bool:
    try:
        candidate = Program.model_validate(data)  # a candidate edit, not a submission
        infos = [analyze(candidate, sizes) for sizes in size_sets]
        if also is not None:
            also(candidate, infos)
    except (ProgramError, ValidationError):
        return False
    return True
