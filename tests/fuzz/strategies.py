"""Hypothesis strategies that feed the sandbox everything an agent might write.

* ``programs(block)`` — programs built from the node registries (so plugins are fuzzed too): every
  field is drawn from its annotation — names from what is in scope (mostly well-typed), literals
  from their choices, expressions from the expression grammar — with a small chance of anything
  else (a wrong name, a junk value, a missing or unknown field): well-typed and ill-typed at once.
* ``edits(base)`` — honest programs with a few random edits (replace, delete, duplicate, swap,
  insert a generated node, rename a name everywhere): near-misses that reach semantics and compile.
* ``expressions(names)`` — text for ``map``: the grammar, its edges (huge numbers, deep nesting,
  long chains) and junk.
* ``json_values()`` / ``json_texts()`` — random JSON, as data and as (possibly broken) text.
"""

from __future__ import annotations

import copy
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from pydantic.fields import FieldInfo

from coda.blocks import Block
from coda.primitives import AuxStep, EpilogueOp, PrepStep
from coda.primitives.base import _check_name

Json = dict[str, Any]

# Names that are legal but collide with something in the generated code or the IR's vocabulary.
TRICKY_NAMES = [
    "acc", "a", "b", "a_tensor", "b_tensor", "accumulator", "tl", "triton", "M", "N", "K",
    "pid_m", "offs_cm", "mask_cm", "x_tile", "v_x", "p_a_gate", "a_ptr", "stride_am", "out",
    "am", "bn", "x_m", "z_tile", "esc_x_",
]  # fmt: skip
JUNK_NAMES = ["", "1x", "class", "x-y", "x.T", "a" * 70, "ünïcode", " x", "None", "acc.T"]
FUNCTIONS = ["exp", "log", "sigmoid", "silu", "tanh", "sqrt", "rsqrt", "abs", "softmax"]


@dataclass
class Scope:
    """What a generated program has defined so far (names only: shapes are not tracked, so many
    draws are ill-typed — which is the point)."""

    tensors: list[str]
    locals: list[str] = field(default_factory=list)
    fresh: int = 0

    def new_name(self, prefix: str) -> str:
        self.fresh += 1
        return f"{prefix}{self.fresh}"


# -- leaves ----------------------------------------------------------------------------------------
def texts(max_size: int) -> st.SearchStrategy[str]:
    """Text, sometimes with lone surrogates (which JSON decoders can produce from escapes)."""
    odd = st.characters(categories=["Cs", "Lu", "Nd", "Po", "Zs"])
    return st.text(max_size=max_size) | st.text(odd, max_size=max_size)


def json_values() -> st.SearchStrategy[Any]:
    leaves = st.none() | st.booleans() | st.integers() | st.floats() | texts(12)
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts(8), inner, max_size=4),
        max_leaves=12,
    )


def json_texts() -> st.SearchStrategy[str]:
    """Valid JSON text, truncated JSON text, and arbitrary text."""
    valid = json_values().map(json.dumps)
    broken = st.tuples(valid, st.integers(0, 40)).map(lambda p: p[0][: p[1]])
    return valid | broken | texts(60)


def names(pool: list[str]) -> st.SearchStrategy[str]:
    """Mostly a name from ``pool`` (about 30 in 33); sometimes a tricky or an invalid one."""
    good = st.sampled_from(pool) if pool else st.sampled_from(TRICKY_NAMES)
    return st.integers(0, 32).flatmap(
        lambda roll: (
            good if roll < 30 else st.sampled_from(TRICKY_NAMES if roll < 32 else JUNK_NAMES)
        )
    )


def numbers() -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers(-5, 5).map(str),
        st.floats(allow_nan=False, allow_infinity=False, width=32).map(repr),
        st.sampled_from(["1e999", "-1e999", "1e-999", "0.0", "1e38", "3e38", "0x10", "1_000"]),
    )


def expressions(pool: list[str]) -> st.SearchStrategy[str]:
    """Expression text over the epilogue values in ``pool``."""
    leaf = st.one_of(names(pool or ["acc"]), numbers())

    def grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        binary = st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "//", "%"]), inner)
        return st.one_of(
            binary.map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            inner.map(lambda x: f"-{x}"),
            st.tuples(inner, st.sampled_from(["2", "-1", "0", "4", "5", "0.5", "x"])).map(
                lambda t: f"{t[0]} ** {t[1]}"
            ),
            st.tuples(st.sampled_from(FUNCTIONS), inner).map(lambda t: f"{t[0]}({t[1]})"),
            st.tuples(st.sampled_from(["min", "max"]), inner, inner).map(
                lambda t: f"{t[0]}({t[1]}, {t[2]})"
            ),
            st.tuples(inner, st.sampled_from(["<", ">=", "=="]), inner, inner, inner).map(
                lambda t: f"where({t[0]} {t[1]} {t[2]}, {t[3]}, {t[4]})"
            ),
        )

    grammar = st.recursive(leaf, grow, max_leaves=10)
    v = pool[0] if pool else "acc"
    edges = st.one_of(
        st.tuples(names(pool or ["acc"]), st.integers(1, 900)).map(
            lambda t: " + ".join([t[0]] * t[1])
        ),
        st.integers(1, 1500).map(lambda n: "-" * n + v),
        st.integers(1, 300).map(lambda n: "(" * n + v + ")" * n),
        st.integers(1, 120).map(lambda n: "exp(" * n + v + ")" * n),
        texts(30),
    )
    return st.one_of(grammar, grammar, grammar, edges)


# -- nodes from the registries ---------------------------------------------------------------------
def _is_name(info: FieldInfo) -> bool:
    return any(getattr(m, "func", None) is _check_name for m in info.metadata)


def _role(family: str, field_name: str) -> str:
    """What a Name field refers to, by convention: read a value in registers, define one, define a
    program tensor, or read a program tensor."""
    if family == "epilogue":
        return {"src": "local", "out": "new_local", "to": "new_tensor"}.get(field_name, "tensor")
    return "new_tensor" if field_name in ("out", "to") else "tensor"


@st.composite
def field_value(draw: st.DrawFn, family: str, name: str, info: FieldInfo, scope: Scope) -> Any:
    if draw(st.integers(0, 80)) == 0:
        return draw(json_values())  # anything at all
    if _is_name(info):
        role = _role(family, name)
        if role == "local":
            return draw(names(["acc", *scope.locals]))
        if role == "tensor":
            return draw(names(scope.tensors))
        fresh = scope.new_name("v" if role == "new_local" else "t")
        (scope.locals if role == "new_local" else scope.tensors).append(fresh)
        return draw(st.sampled_from([fresh] * 9 + TRICKY_NAMES[:4]))
    if name == "expr":
        return draw(expressions(["acc", *scope.locals]))
    annotation = info.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return draw(st.sampled_from(list(typing.get_args(annotation)) * 8 + ["bogus"]))
    if annotation is float:
        return draw(st.sampled_from([1e-5, 1e-6, 0.5, 1.0]) | st.floats() | st.integers(-3, 3))
    if annotation is bool:
        return draw(st.booleans())
    return draw(json_values())


@st.composite
def node(
    draw: st.DrawFn, registry: dict[str, type], tag_field: str, family: str, scope: Scope
) -> Json:
    tag = draw(st.sampled_from(sorted(registry)))
    cls = registry[tag]
    data: Json = {tag_field: tag}
    for name, info in cls.model_fields.items():
        if name == tag_field:
            continue
        if not info.is_required() and draw(st.booleans()):
            continue  # leave the default
        data[name] = draw(field_value(family, name, info, scope))
    roll = draw(st.integers(0, 60))
    if roll == 0 and len(data) > 1:
        data.pop(draw(st.sampled_from(sorted(k for k in data if k != tag_field))))
    elif roll == 1:
        data[draw(st.sampled_from(["scale", "axis2", "eps", "note"]))] = draw(json_values())
    return data


@st.composite
def _operand(draw: st.DrawFn, scope: Scope) -> Any:
    name = draw(names(scope.tensors))
    form = draw(st.integers(0, 9))
    if form < 5:
        return f"{name}.T"
    if form < 9:
        return name
    return {"tensor": name, "transpose": draw(st.booleans())}


@st.composite
def _config(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 4)):
        return "auto"
    sizes = st.sampled_from([16, 32, 64, 128, 256, 8, 48, 512])
    return {
        "block_m": draw(sizes),
        "block_n": draw(sizes),
        "block_k": draw(sizes),
        "group_m": draw(st.sampled_from([1, 4, 8, 0, 65])),
        "num_warps": draw(st.sampled_from([1, 2, 4, 8, 3])),
        "num_stages": draw(st.sampled_from([1, 2, 3, 9])),
    }


@st.composite
def gemm_step(draw: st.DrawFn, scope: Scope, index: int) -> Json:
    step: Json = {"kind": "gemm", "a": draw(_operand(scope)), "b": draw(_operand(scope))}
    if draw(st.booleans()):
        step["name"] = draw(names([f"g{index}", "gate_up", "down", "g0"]))
    scope.locals = []
    before = set(scope.tensors)
    count = draw(st.integers(1, 6))
    step["epilogue"] = [
        draw(node(EpilogueOp.registry, "op", "epilogue", scope)) for _ in range(count)
    ]
    # a realistic tail: store the last value defined (what most epilogues end with)
    if draw(st.integers(0, 3)):
        last = scope.locals[-1] if scope.locals else "acc"
        to = scope.new_name("t")
        step["epilogue"].append({"op": "store", "src": last, "to": to})
        scope.tensors.append(to)
    step["config"] = draw(_config())
    scope.tensors = list(dict.fromkeys([*before, *scope.tensors]))
    return step


@st.composite
def programs(draw: st.DrawFn, block: Block) -> Json:
    """A program for ``block`` built from the registries: inputs exactly the block's (mostly)."""
    scope = Scope(tensors=list(block.inputs))
    prep = [
        draw(node(PrepStep.registry, "kind", "prep", scope)) for _ in range(draw(st.integers(0, 2)))
    ]
    steps = []
    for i in range(draw(st.integers(1, 4))):
        if AuxStep.registry and draw(st.integers(0, 3)) == 0:
            steps.append(draw(node(AuxStep.registry, "kind", "aux", scope)))
        else:
            steps.append(draw(gemm_step(scope, i)))
    produced = [t for t in scope.tensors if t not in block.inputs] or list(block.inputs)
    outputs = {o: draw(names(produced[-2:] + produced)) for o in block.outputs}
    inputs: Any = block.program_inputs()
    if draw(st.integers(0, 15)) == 0:
        inputs = draw(json_values())
    return {"block": block.name, "inputs": inputs, "prep": prep, "steps": steps, "outputs": outputs}


# -- edits of honest programs ----------------------------------------------------------------------
def _paths(value: Any, here: tuple = ()) -> list[tuple]:
    out = [here]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*here, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*here, i))
    return out


def _at(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


def _name_keys() -> set[str]:
    """Fields that hold names (of any registered node), plus the GEMM's operands."""
    keys = {"a", "b", "tensor", "name"}
    for registry, _tag, _family in _FAMILIES:
        for cls in registry.values():
            keys |= {n for n, info in cls.model_fields.items() if _is_name(info)}
    return keys


def _program_names(data: Any) -> list[str]:
    """The tensor and value names a program uses (not its tags or literal choices)."""
    found: set[str] = set()
    keys = _name_keys()

    def visit(value: Any, key: Any = None) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(v, k)
        elif isinstance(value, list):
            for v in value:
                visit(v, key)
        elif isinstance(value, str) and key in keys:
            found.add(value.removesuffix(".T"))

    visit(data)
    if isinstance(data, dict):
        for part in ("inputs", "outputs"):
            if isinstance(data.get(part), dict):
                found |= {k for k in data[part] if isinstance(k, str)}
                found |= {v for v in data[part].values() if isinstance(v, str)}
    return sorted(n for n in found if n.isidentifier())


def _rename(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return new if value == old else (f"{new}.T" if value == f"{old}.T" else value)
    if isinstance(value, dict):
        return {k: _rename(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_rename(v, old, new) for v in value]
    return value


def _nodes(data: Any) -> list[Json]:
    """Every node (a dict with an ``op`` or ``kind``) in a program's JSON."""
    found = [data] if isinstance(data, dict) and ("op" in data or "kind" in data) else []
    children = data.values() if isinstance(data, dict) else data if isinstance(data, list) else []
    for child in children:
        found += _nodes(child)
    return found


_FAMILIES = (
    (EpilogueOp.registry, "op", "epilogue"),
    (AuxStep.registry, "kind", "aux"),
    (PrepStep.registry, "kind", "prep"),
)


@st.composite
def _retype_field(draw: st.DrawFn, data: Json, pool: list[str]) -> None:
    """Redraw one field of one node from its annotation (a well-typed but different value)."""
    nodes = _nodes(data)
    if not nodes:
        return
    target = draw(st.sampled_from(nodes))
    scope = Scope(tensors=pool, locals=pool)
    for registry, tag_field, family in _FAMILIES:
        cls = (
            registry.get(target.get(tag_field)) if isinstance(target.get(tag_field), str) else None
        )
        if cls is not None:
            fields = [f for f in cls.model_fields if f != tag_field]
            if fields:
                name = draw(st.sampled_from(fields))
                target[name] = draw(field_value(family, name, cls.model_fields[name], scope))
            return
    if target.get("kind") == "gemm":
        key = draw(st.sampled_from(["a", "b", "config"]))
        target[key] = draw(_config() if key == "config" else _operand(scope))


@st.composite
def _edit_once(draw: st.DrawFn, data: Json) -> Json:
    paths = [p for p in _paths(data) if p]
    if not paths:  # earlier edits deleted every field: nothing left to edit
        return data
    path = draw(st.sampled_from(paths))
    parent, key = _at(data, path[:-1]), path[-1]
    pool = _program_names(data)
    kind = draw(st.sampled_from([*"MMMMMRRRRRNNNPPSSDXIJ"]))
    if kind == "M":  # a map over one value, spliced in front of the op that reads it
        draw(_splice_map(data))
    elif kind == "R":  # a well-typed redraw of one field of one node
        draw(_retype_field(data, pool))
    elif kind == "N" and pool:  # rename a name everywhere (the program stays consistent)
        old = draw(st.sampled_from(pool))
        data = _rename(data, old, draw(names(TRICKY_NAMES + [n + "_2" for n in pool])))
    elif kind == "P" and isinstance(parent, dict) and key in _name_keys():
        parent[key] = draw(names(pool))  # another name of the program, in this place
    elif kind == "S" and isinstance(parent, list) and len(parent) > 1:
        other = draw(st.integers(0, len(parent) - 1))
        parent[key], parent[other] = parent[other], parent[key]
    elif kind == "D" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif kind == "X":
        del parent[key]
    elif kind == "I":
        draw(_insert_node(data, pool))
    else:
        parent[key] = draw(json_values())
    return data


def _epilogues(data: Json) -> list[list]:
    """The epilogue lists of the program's GEMM steps, as edited so far.

    Earlier edits may have put anything anywhere (``steps`` may be ``None``, a number or text; an
    ``epilogue`` a dict), so only the parts that still have the shape of a program are returned:
    an edit must never fail to generate, whatever the edits before it did."""
    steps = data.get("steps")
    if not isinstance(steps, list):
        return []
    return [
        s["epilogue"] for s in steps if isinstance(s, dict) and isinstance(s.get("epilogue"), list)
    ]


@st.composite
def _splice_map(draw: st.DrawFn, data: Json) -> None:
    """``op(src=v)`` → ``w = map(expr over v); op(src=w)``: well-typed, semantics-changing."""
    sites = [
        (op, epilogue)
        for epilogue in _epilogues(data)
        for op in epilogue
        if isinstance(op, dict) and isinstance(op.get("src"), str)
    ]
    if not sites:
        return
    target, epilogue = draw(st.sampled_from(sites))
    fresh = f"m{len(_paths(data))}"
    expr = draw(expressions([target["src"]]))
    epilogue.insert(epilogue.index(target), {"op": "map", "expr": expr, "out": fresh})
    target["src"] = fresh


@st.composite
def _insert_node(draw: st.DrawFn, data: Json, pool: list[str]) -> None:
    scope = Scope(tensors=pool, locals=pool)
    where = draw(st.sampled_from(["prep", "steps", "epilogue"]))
    if where == "epilogue":
        epilogues = _epilogues(data)
        if epilogues:
            target = draw(st.sampled_from(epilogues))
            new = draw(node(EpilogueOp.registry, "op", "epilogue", scope))
            target.insert(draw(st.integers(0, len(target))), new)
    elif isinstance(data.get(where), list):
        registry, family = (
            (AuxStep.registry, "aux") if where == "steps" else (PrepStep.registry, "prep")
        )
        if registry:
            data[where].insert(0, draw(node(registry, "kind", family, scope)))


@st.composite
def edits(draw: st.DrawFn, base: Json, block: Block) -> Json:
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        data = draw(_edit_once(data))
    return data


def cases(blocks: dict[str, Block], honest: dict[str, Json]) -> st.SearchStrategy[tuple[Any, str]]:
    """(candidate, block name): edits of honest programs, registry-built programs, random JSON."""

    def for_block(name: str) -> st.SearchStrategy[tuple[Any, str]]:
        block = blocks[name]
        candidate = st.one_of(  # 3 : 2 : 2 — near misses, built programs, raw JSON
            edits(honest[name], block),
            edits(honest[name], block),
            edits(honest[name], block),
            programs(block),
            programs(block),
            json_texts(),
            json_values(),
        )
        return st.tuples(candidate, st.just(name))

    return st.sampled_from(sorted(honest)).flatmap(for_block)
