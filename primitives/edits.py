"""Single-node edits of a Program's JSON, for finding *where* a wrong Program is wrong.

A Report is only useful to whoever repairs the Program if it names the node at fault. When the
error surfaces downstream of its cause (a reduction on the wrong axis shows up as a vector of the
wrong length two steps later; a residual added twice as an output that does not match), the way
to find the cause is to look for the smallest edit that removes the error: this module enumerates
such edits, each a ``Candidate`` that names the JSON path it changes and says in words what it
changes. Which edits fix a Program is decided elsewhere: by the type rules (``analysis``) for
validate, by the block's reference for semantics (``coda.sandbox.localize``).

The edits are generic over the IR, read off the pydantic models: flip a ``Literal`` or ``bool``
field, swap two tensor fields of one node or a GEMM's operands, remove a node that maps one
value to another, insert a row or column scale by a vector the Program has, and change a size
expression or an output view's start. Numeric constants are not enumerated here: they are solved
for (``coda.sandbox.localize``).
"""

from __future__ import annotations

import copy
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .ir import GemmEpilogue, Program

Json = dict[str, Any]
# Fields that name things rather than choose behaviour: never flipped, swapped or renamed.
_NOT_CHOICES = {"op", "kind", "name", "config"}
_NAME_FIELDS = {"name", "op", "kind", "out", "to"}  # never a read of a tensor


@dataclass(frozen=True)
class Candidate:
    """A Program with one node edited: ``path`` (JSON path of the node or field), ``what``."""

    path: str
    what: str
    program: Json


def nodes(program: Json) -> Iterator[tuple[str, Json]]:
    """``(JSON path, node)`` of every prep step, step and epilogue op, in program order."""
    for i, node in enumerate(program.get("prep", [])):
        yield f"prep[{i}]", node
    for i, step in enumerate(program.get("steps", [])):
        yield f"steps[{i}]", step
        for j, op in enumerate(step.get("epilogue", []) or []):
            yield f"steps[{i}].epilogue[{j}]", op


def rename(node: Json, old: str, new: str) -> None:
    """Point every read of ``old`` in ``node`` (fields, operands, expressions) at ``new``."""
    for key, value in node.items():
        if isinstance(value, dict):
            rename(value, old, new)
        elif key.startswith("expr") and isinstance(value, str):
            node[key] = re.sub(rf"\b{re.escape(old)}\b", new, value)
        elif value == old and key not in _NAME_FIELDS:
            node[key] = new


def rename_after(program: Json, path: str, old: str, new: str) -> None:
    """Rename reads of ``old`` in every node after ``path``: in the same epilogue for an epilogue
    value, everywhere after it (and in the outputs) for a program tensor."""
    local = ".epilogue[" in path
    step = path.split(".")[0]
    seen = False
    for where, node in nodes(program):
        if seen and (not local or where.startswith(step + ".epilogue[")):
            rename(node, old, new)
        seen = seen or where == path
    if local:
        return
    for name, value in program["outputs"].items():
        if value == old:
            program["outputs"][name] = new
        elif isinstance(value, dict) and value.get("tensor") == old:
            value["tensor"] = new


def _at(program: Json, path: str) -> Json:
    return dict(nodes(program))[path]


def _edited(program: Json, path: str, change: typing.Callable[[Json], None]) -> Json:
    out = copy.deepcopy(program)
    change(_at(out, path))
    return out


# -- choices: Literal and bool fields -------------------------------------------------------------
def _choices(annotation: Any) -> list[Any]:
    """The values a ``Literal`` (or ``bool``, or ``X | None`` of one) field can take."""
    if annotation is bool:
        return [False, True]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return list(args)
    for arg in args:  # Optional[Literal[...]] and friends
        found = _choices(arg)
        if found:
            return found
    return []


def flips(program: Program) -> Iterator[Candidate]:
    """Every other value of every ``Literal``/``bool`` field (an operand's ``transpose``, a
    reduction's ``axis``, a store's ``dtype``, ``inverse``, ...)."""
    data = program.model_dump(mode="json")
    for path, model in _models(program):
        for key, info in type(model).model_fields.items():
            if key in _NOT_CHOICES:
                continue
            value = getattr(model, key)
            if isinstance(value, BaseModel):
                for sub, sub_info in type(value).model_fields.items():
                    for alt in _choices(sub_info.annotation):
                        if alt != getattr(value, sub):
                            yield _set(data, path, (key, sub), alt)
                continue
            for alt in _choices(info.annotation):
                if alt != value:
                    yield _set(data, path, (key,), alt)


def _set(data: Json, path: str, keys: tuple[str, ...], value: Any) -> Candidate:
    def change(node: Json) -> None:
        target = node
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value

    where = ".".join((path, *keys))
    return Candidate(where, f"set {where} to {value!r}", _edited(data, path, change))


def _models(program: Program) -> Iterator[tuple[str, BaseModel]]:
    for i, node in enumerate(program.prep):
        yield f"prep[{i}]", node
    for i, step in enumerate(program.steps):
        yield f"steps[{i}]", step
        if isinstance(step, GemmEpilogue):
            for j, op in enumerate(step.epilogue):
                yield f"steps[{i}].epilogue[{j}]", op


# -- swaps ----------------------------------------------------------------------------------------
def swaps(program: Json, tensors: set[str]) -> Iterator[Candidate]:
    """Two fields of one node that read program tensors, exchanged (``first``/``second`` of an
    interleave, ``cos``/``sin``, ...), and each GEMM's operands ``a``/``b``."""
    for path, node in nodes(program):
        if node.get("kind") == "gemm":
            yield Candidate(
                f"{path}.a", f"swap the operands a and b of {path}", _swap(program, path, "a", "b")
            )
            continue
        reads = [
            k
            for k, v in node.items()
            if k not in _NAME_FIELDS and isinstance(v, str) and v in tensors
        ]
        for x, k1 in enumerate(reads):
            for k2 in reads[x + 1 :]:
                if node[k1] != node[k2]:
                    yield Candidate(
                        f"{path}.{k1}", f"swap {path}.{k1} and .{k2}", _swap(program, path, k1, k2)
                    )


def _swap(program: Json, path: str, k1: str, k2: str) -> Json:
    def change(node: Json) -> None:
        node[k1], node[k2] = node[k2], node[k1]

    return _edited(program, path, change)


# -- removals -------------------------------------------------------------------------------------
def removals(program: Json) -> Iterator[Candidate]:
    """Each node that maps one value to another (``out`` from a source field) removed, its reads
    pointed at that source: a repeated or spurious op. Later nodes first: of two copies of one op
    the later is the extra one."""
    for path, node in reversed(list(nodes(program))):
        out = node.get("out")
        if not isinstance(out, str):
            continue
        for key in _sources(node):
            removed = copy.deepcopy(program)
            rename_after(removed, path, out, node[key])
            _delete(removed, path)
            yield Candidate(path, f"remove {path} ({_label(node)}), reading {node[key]!r}", removed)


def _sources(node: Json) -> list[str]:
    keys = ("src", "weight", "tensor", "first")
    return [k for k in keys if isinstance(node.get(k), str)]


def _delete(program: Json, path: str) -> None:
    found = re.fullmatch(r"(prep|steps)\[(\d+)\](?:\.epilogue\[(\d+)\])?", path)
    assert found, path
    kind, i, j = found.group(1), int(found.group(2)), found.group(3)
    if j is None:
        del program[kind][i]
    else:
        del program[kind][i]["epilogue"][int(j)]


def _label(node: Json) -> str:
    return str(node.get("op") or node.get("kind") or "node")


# -- insertions -----------------------------------------------------------------------------------
def insertions(program: Json, vectors: dict[str, str]) -> Iterator[Candidate]:
    """A ``scale_rows`` (``vectors[name] == "row"``) or ``scale_cols`` (``"col"``) by each vector,
    inserted right after each tile value of each epilogue is defined (``acc`` at the start)."""
    for i, step in enumerate(program["steps"]):
        if step.get("kind") != "gemm":
            continue
        defined = [(0, "acc")] + [
            (j + 1, op["out"])
            for j, op in enumerate(step["epilogue"])
            if isinstance(op.get("out"), str)
        ]
        for at, value in defined:
            for vector, side in vectors.items():
                op_name = "scale_rows" if side == "row" else "scale_cols"
                fresh = f"{value}_{op_name}_{vector}"
                new = copy.deepcopy(program)
                new_step = new["steps"][i]
                for later in new_step["epilogue"][at:]:
                    rename(later, value, fresh)
                new_step["epilogue"].insert(
                    at, {"op": op_name, "src": value, "vector": vector, "out": fresh}
                )
                path = f"steps[{i}].epilogue[{at}]"
                yield Candidate(
                    path, f"insert {op_name}(src={value!r}, vector={vector!r}) at {path}", new
                )


# -- sizes ----------------------------------------------------------------------------------------
def size_changes(program: Json, size_names: list[str]) -> Iterator[Candidate]:
    """Each size-expression field (``divide_by``, ``rotary_cols``, ``head_dim``) set to each size
    name and each sum of two; each strided output view's ``start`` set to each other offset."""
    options = list(size_names) + [
        f"{a} + {b}" for x, a in enumerate(size_names) for b in size_names[x:]
    ]
    for path, node in nodes(program):
        for key in ("divide_by", "rotary_cols", "head_dim"):
            if isinstance(node.get(key), str):
                for alt in options:
                    if alt != node[key]:
                        yield _set(program, path, (key,), alt)
    for name, value in program["outputs"].items():
        if isinstance(value, dict) and (value.get("step") or 1) > 1:
            for start in range(int(value["step"])):
                if str(start) != str(value.get("start") or "0"):
                    new = copy.deepcopy(program)
                    new["outputs"][name]["start"] = str(start)
                    where = f"outputs.{name}.start"
                    yield Candidate(where, f"set {where} to '{start}'", new)


# -- stores ---------------------------------------------------------------------------------------
def stores(program: Json, tensor: str) -> Iterator[Candidate]:
    """A ``store(src=v, to=tensor)`` appended to each GEMM's epilogue, for each tile value ``v``
    it has (``acc`` and every op's ``out``): a tensor the program reads but never writes."""
    for i, step in enumerate(program["steps"]):
        if step.get("kind") != "gemm":
            continue
        values = ["acc"] + [op["out"] for op in step["epilogue"] if isinstance(op.get("out"), str)]
        for value in values:
            new = copy.deepcopy(program)
            new["steps"][i]["epilogue"].append({"op": "store", "src": value, "to": tensor})
            path = f"steps[{i}].epilogue"
            yield Candidate(path, f"add store(src={value!r}, to={tensor!r}) to {path}", new)
