"""The tiny elementwise expression language of ``map`` (and later ``pairwise``).

Grammar (Python syntax, parsed with ``ast`` and then whitelisted)::

    expr  := number | name | expr (+ | - | * | /) expr | -expr | expr ** k   (k an integer, |k| ≤ 4)
           | f(expr) for f in exp, log, sigmoid, silu, tanh, erf, sqrt, rsqrt, abs
           | min(expr, expr) | max(expr, expr) | where(cond, expr, expr)
    cond  := expr (< | <= | > | >= | == | !=) expr

Names are epilogue values (tiles, row vectors, column vectors; they broadcast like tensors of shape
``[M, W]``, ``[M, 1]`` and ``[1, W]``). Everything is computed in fp32, so numbers must be finite
in fp32. Anything else — attribute access, subscripts, other functions, strings, lambdas — is
rejected with a message saying what is allowed. Expressions nest at most ``MAX_DEPTH`` levels (the
converters and printers recurse; a long flat chain ``x+x+…`` is a deep left-leaning tree). One
parsed ``Expr`` has three printers: Triton source, a PyTorch evaluation, and ``canonical`` — the
expression re-printed from its tree (comments, spacing and redundant parentheses gone), which is the
only form of an expression a validated Program keeps.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from .errors import ProgramError

UNARY = {
    "exp": ("tl.exp({0})", torch.exp),
    "log": ("tl.log({0})", torch.log),
    "sigmoid": ("tl.sigmoid({0})", torch.sigmoid),
    "silu": ("({0} * tl.sigmoid({0}))", torch.nn.functional.silu),
    # tanh(x) = 2·sigmoid(2x) − 1: Triton's core language has no tanh the interpreter also runs.
    "tanh": ("(2.0 * tl.sigmoid(2.0 * {0}) - 1.0)", torch.tanh),
    # erf is in Triton's core language on GPUs and in the interpreter (GELU's exact form).
    "erf": ("tl.erf({0})", torch.erf),
    "sqrt": ("tl.sqrt({0})", torch.sqrt),
    "rsqrt": ("tl.rsqrt({0})", torch.rsqrt),
    "abs": ("tl.abs({0})", torch.abs),
}
BINARY_FN = {
    "min": ("tl.minimum({0}, {1})", torch.minimum),
    "max": ("tl.maximum({0}, {1})", torch.maximum),
}
ARITH = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
COMPARE = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
ALLOWED_FUNCTIONS = sorted([*UNARY, *BINARY_FN, "where"])
MAX_LENGTH = 2000
MAX_POWER = 4
MAX_DEPTH = 64  # nesting of the syntax tree; Python's recursion limit is 1000 frames
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Expr:
    """A parsed, whitelisted expression (an immutable tree of tuples)."""

    source: str
    tree: tuple

    def variables(self) -> set[str]:
        return _variables(self.tree)

    def to_triton(self, var: Callable[[str], str]) -> str:
        return _triton(self.tree, var)

    def to_cute(self, var: Callable[[str], str]) -> str:
        """The expression on fp32 scalars of a CuTe DSL epilogue (``cute/epilogue.F``)."""
        return _cute(self.tree, var)

    def evaluate(self, values: Callable[[str], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return _torch(self.tree, values, dtype)

    def canonical(self) -> str:
        """The expression re-printed from its tree; ``parse(e.canonical()).tree == e.tree``."""
        return _source(self.tree)


def canonical(source: str) -> str:
    """Pydantic-validator form: parse ``source`` (raising ``ProgramError`` on anything outside the
    grammar) and return its canonical text, so no submitted character survives validation."""
    return parse(source).canonical()


def parse(source: str) -> Expr:
    """Parse and whitelist ``source``; raise ``ProgramError`` naming the offending construct."""
    return _parse_cached(source)


@lru_cache(maxsize=1024)
def _parse_cached(source: str) -> Expr:
    if not isinstance(source, str) or not source.strip():
        raise ProgramError("the expression is empty")
    if len(source) > MAX_LENGTH:
        raise ProgramError(f"the expression is longer than {MAX_LENGTH} characters")
    _check_text(source)
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as e:
        raise ProgramError(
            f"expression {source!r} is not valid syntax: {e.msg} (column {e.offset})"
        ) from None
    except (RecursionError, MemoryError):
        raise _too_deep(source) from None
    if tree_depth(node) > MAX_DEPTH:
        raise _too_deep(source)
    return Expr(source, _convert(node, source, in_where_cond=False))


def _check_text(source: str) -> None:
    """Plain ASCII only. NUL and lone surrogates cannot be compiled (Python raises ValueError or
    SyntaxError, depending on its version), and Python folds other characters of identifiers by
    NFKC ('ｏ' would silently read the value 'o'): name the first such character instead."""
    for column, char in enumerate(source, start=1):
        if not char.isascii() or char == "\x00":
            raise ProgramError(
                f"expression {source.encode('utf-8', 'backslashreplace').decode()!r} is not valid "
                f"text: character U+{ord(char):04X} at column {column} is not ASCII"
                + (" (NUL)" if char == "\x00" else ""),
                hint="write expressions in plain ASCII: value names use A-Z, a-z, digits and '_'",
            )


def tree_depth(root: ast.AST) -> int:
    """Nesting depth of the syntax tree, measured without recursion."""
    deepest, stack = 0, [(root, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _too_deep(source: str) -> ProgramError:
    shown = source if len(source) <= 60 else source[:57] + "..."
    return ProgramError(
        f"expression {shown!r} nests deeper than {MAX_DEPTH} levels (a long chain such as "
        "a + b + c + … nests one level per operator)",
        hint="split it into several map ops, each naming an intermediate value",
    )


def _number(node: ast.Constant, src: str) -> tuple:
    try:
        value = float(node.value)
    except OverflowError:
        value = math.inf
    if not abs(value) <= FLOAT32_MAX:
        raise _reject(
            src,
            f"the number {(ast.get_source_segment(src.strip(), node) or '')[:30]} is not a "
            "finite float32 number",
            hint="epilogue math is fp32: constants must lie within ±3.4e38",
        )
    return ("num", value)


def _reject(source: str, what: str, hint: str = "") -> ProgramError:
    allowed = (
        "numbers, epilogue value names, + - * /, unary -, ** with an integer exponent, "
        f"{', '.join(ALLOWED_FUNCTIONS)}, and comparisons inside where(...)"
    )
    return ProgramError(f"expression {source!r}: {what}", hint=hint or f"allowed: {allowed}")


def _convert(node: ast.AST, src: str, *, in_where_cond: bool) -> tuple:
    conv = lambda n, cond=False: _convert(n, src, in_where_cond=cond)  # noqa: E731
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _number(node, src)
    if isinstance(node, ast.Name):
        if node.id in ALLOWED_FUNCTIONS:
            raise _reject(src, f"{node.id!r} is a function; call it, e.g. {node.id}(x)")
        return ("var", node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = conv(node.operand)
        return ("neg", inner) if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and type(node.op) in ARITH:
        return ("bin", ARITH[type(node.op)], conv(node.left), conv(node.right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        k = node.right
        negated = isinstance(k, ast.UnaryOp) and isinstance(k.op, ast.USub)
        if negated and isinstance(k.operand, ast.Constant) and type(k.operand.value) is int:
            k = ast.Constant(-k.operand.value)
        if not (isinstance(k, ast.Constant) and type(k.value) is int and abs(k.value) <= MAX_POWER):
            raise _reject(
                src,
                "'**' needs an integer exponent between -4 and 4",
                hint="write x * x for squares, sqrt(x) / rsqrt(x) for halves, exp(k * log(x)) "
                "otherwise",
            )
        return ("pow", conv(node.left), k.value)
    if isinstance(node, ast.Compare):
        if not in_where_cond:
            raise _reject(src, "a comparison is allowed only as the first argument of where(...)")
        if len(node.ops) != 1 or type(node.ops[0]) not in COMPARE:
            raise _reject(src, "use one comparison (<, <=, >, >=, ==, !=) per condition")
        return ("cmp", COMPARE[type(node.ops[0])], conv(node.left), conv(node.comparators[0]))
    if isinstance(node, ast.Call):
        return _convert_call(node, src, conv)
    what = type(node).__name__
    if isinstance(node, ast.Constant):
        what = f"the constant {node.value!r} (only numbers are allowed)"
    elif isinstance(node, ast.Attribute):
        what = f"attribute access '.{node.attr}'"
    elif isinstance(node, ast.Subscript):
        what = "subscripting"
    elif isinstance(node, ast.BinOp):
        what = f"the operator {type(node.op).__name__}"
    raise _reject(src, f"{what} is not allowed")


def _convert_call(node: ast.Call, src: str, conv: Callable[..., tuple]) -> tuple:
    if not isinstance(node.func, ast.Name):
        raise _reject(src, "only plain function names can be called")
    name = node.func.id
    if node.keywords:
        raise _reject(src, f"{name}(...) takes positional arguments only")
    args = node.args
    if name in UNARY:
        if len(args) != 1:
            raise _reject(src, f"{name} takes 1 argument, got {len(args)}")
        return ("fn", name, conv(args[0]))
    if name in BINARY_FN:
        if len(args) != 2:
            raise _reject(src, f"{name} takes 2 arguments, got {len(args)}")
        return ("fn2", name, conv(args[0]), conv(args[1]))
    if name == "where":
        if len(args) != 3:
            raise _reject(src, f"where takes 3 arguments (cond, a, b), got {len(args)}")
        if not isinstance(args[0], ast.Compare):
            raise _reject(src, "the first argument of where must be a comparison such as x > 0")
        return ("where", conv(args[0], True), conv(args[1]), conv(args[2]))
    raise _reject(src, f"function {name!r} is not allowed")


def _variables(t: tuple) -> set[str]:
    if t[0] == "var":
        return {t[1]}
    out: set[str] = set()
    for child in t[1:]:
        if isinstance(child, tuple):
            out |= _variables(child)
    return out


def _code(t: tuple, var: Callable[[str], str], call: Callable[[str, list[str]], str]) -> str:
    """Print a tree as code of a target language: arithmetic as Python writes it, each function
    (and ``where``) through ``call(name, printed_arguments)``."""
    kind = t[0]
    if kind == "num":
        return repr(t[1])
    if kind == "var":
        return var(t[1])
    if kind == "neg":
        return f"(-{_code(t[1], var, call)})"
    if kind in ("bin", "cmp"):
        return f"({_code(t[2], var, call)} {t[1]} {_code(t[3], var, call)})"
    if kind == "pow":
        base, k = _code(t[1], var, call), t[2]
        if k == 0:
            return f"({base} * 0.0 + 1.0)"
        product = " * ".join([base] * abs(k))
        return f"({product})" if k > 0 else f"(1.0 / ({product}))"
    if kind in ("fn", "fn2", "where"):
        name = "where" if kind == "where" else t[1]
        first = 1 if kind == "where" else 2
        return call(name, [_code(a, var, call) for a in t[first:]])
    raise AssertionError(kind)


def _triton_call(name: str, args: list[str]) -> str:
    if name == "where":
        return f"tl.where({', '.join(args)})"
    return (UNARY.get(name) or BINARY_FN[name])[0].format(*args)


def _triton(t: tuple, var: Callable[[str], str]) -> str:
    return _code(t, var, _triton_call)


def _cute(t: tuple, var: Callable[[str], str]) -> str:
    """The CuTe backend's form: every function is ``F.<name>`` on fp32 scalars."""
    return _code(t, var, lambda name, args: f"F.{name}({', '.join(args)})")


# Binding strength of each printed construct (Python's): atoms and calls bind tightest.
_PREC_SUM, _PREC_PRODUCT, _PREC_NEG, _PREC_POW, _PREC_ATOM = 1, 2, 3, 4, 5
_PREC_ARITH = {"+": _PREC_SUM, "-": _PREC_SUM, "*": _PREC_PRODUCT, "/": _PREC_PRODUCT}


def _precedence(t: tuple) -> int:
    kind = t[0]
    if kind == "bin":
        return _PREC_ARITH[t[1]]
    if kind == "cmp":
        return 0
    return {"neg": _PREC_NEG, "pow": _PREC_POW}.get(kind, _PREC_ATOM)


def _number_text(value: float) -> str:
    """Integral values print as integers (``2``, not ``2.0``); others as Python's shortest repr."""
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def _source(t: tuple) -> str:
    """Print a tree as expression-language text with only the parentheses its structure needs."""
    kind = t[0]

    def wrap(child: tuple, tighter_than: int) -> str:
        text = _source(child)
        return f"({text})" if _precedence(child) <= tighter_than else text

    if kind == "num":
        return _number_text(t[1])
    if kind == "var":
        return t[1]
    if kind == "neg":  # -(-x) and -(a + b) keep their parentheses; -x ** 2 is -(x ** 2)
        return f"-{wrap(t[1], _PREC_NEG)}"
    if kind == "bin":  # left-associative: a - (b - c) needs them on the right, not the left
        prec = _PREC_ARITH[t[1]]
        return f"{wrap(t[2], prec - 1)} {t[1]} {wrap(t[3], prec)}"
    if kind == "cmp":
        return f"{_source(t[2])} {t[1]} {_source(t[3])}"
    if kind == "pow":
        return f"{wrap(t[1], _PREC_POW)} ** {t[2]}"
    if kind in ("fn", "fn2", "where"):
        name = "where" if kind == "where" else t[1]
        args = t[1:] if kind == "where" else t[2:]
        return f"{name}({', '.join(_source(a) for a in args)})"
    raise AssertionError(kind)


def _torch(t: tuple, values: Callable[[str], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    kind = t[0]
    ev = lambda c: _torch(c, values, dtype)  # noqa: E731
    if kind == "num":
        return torch.tensor(t[1], dtype=dtype)
    if kind == "var":
        return values(t[1])
    if kind == "neg":
        return -ev(t[1])
    if kind in ("bin", "cmp"):
        a, b = ev(t[2]), ev(t[3])
        return {
            "+": torch.add,
            "-": torch.sub,
            "*": torch.mul,
            "/": torch.div,
            "<": torch.lt,
            "<=": torch.le,
            ">": torch.gt,
            ">=": torch.ge,
            "==": torch.eq,
            "!=": torch.ne,
        }[t[1]](a, b)
    if kind == "pow":
        return torch.pow(ev(t[1]), t[2])
    if kind == "fn":
        return UNARY[t[1]][1](ev(t[2]))
    if kind == "fn2":
        return BINARY_FN[t[1]][1](ev(t[2]), ev(t[3]))
    if kind == "where":
        return torch.where(ev(t[1]), ev(t[2]), ev(t[3]))
    raise AssertionError(kind)
