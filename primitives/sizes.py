"""Size expressions: integer arithmetic over a program's symbolic sizes (``"Nq + Nkv"``, ``"d"``).

Some primitives need a size that is not the width of the tile they work on — how many leading
columns RoPE rotates (the Q and K heads of a fused QKV projection), the head width a weight
permutation works in, the ``d`` that turns a sum into a mean, where a block output's slice starts.
Sizes are bound from the input shapes when a program runs (``bind_sizes``), so these fields are
written as small expressions over size names and evaluated at each binding.

Grammar: integers, size names, ``+ - *`` (and unary minus) and parentheses. Everything else is
rejected — floor division and modulo included: no field needs them (every size a primitive needs
is a sum of the inputs' sizes or a multiple of one), and with them an expression can be right at
the sizes a block checks and wrong past a threshold (``N + N // 81 * N``). An expression of
``+ - *`` alone is a polynomial; one right only at the checked sizes is caught where the
semantics stage draws fresh shapes.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from typing import Annotated

from pydantic import AfterValidator

from .errors import ProgramError, did_you_mean
from .expr import tree_depth

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
MAX_LENGTH = 500  # characters; "Nq + Nkv" is 8
MAX_DEPTH = 64  # nesting of the syntax tree (a chain a + b + c + … nests one level per operator)
_NOT_ALLOWED = {  # what a size expression may look for, and why it is refused
    ast.FloorDiv: "floor division '//'",
    ast.Div: "division '/'",
    ast.Mod: "modulo '%'",
    ast.Pow: "a power '**'",
}


@lru_cache(maxsize=512)
@lru_cache(maxsize=1024)  # runtime steps evaluate the same few expressions every call
def _parse(source: str) -> ast.AST:
    if len(source) > MAX_LENGTH:
        raise _too_big(source, f"is {len(source)} characters long, over the {MAX_LENGTH} allowed")
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as e:
        raise ProgramError(f"size expression {source!r} is not valid syntax: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise _too_big(source, f"({len(source)} characters) nests too deeply to parse") from None
    if tree_depth(tree) > MAX_DEPTH:
        raise _too_big(source, f"nests deeper than {MAX_DEPTH} levels")
    for node in ast.walk(tree):
        allowed = (ast.Name, ast.Load, ast.BinOp, ast.UnaryOp, ast.USub, *_OPS)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            continue
        if not isinstance(node, allowed):
            what = _NOT_ALLOWED.get(type(node), type(node).__name__)
            raise ProgramError(
                f"size expression {source!r}: {what} is not allowed",
                hint="use integers, size names (e.g. 'd', 'Nq'), + - * and parentheses: every "
                "size a primitive needs is a sum of sizes or a multiple of one (e.g. 'Nq + Nkv', "
                "'2 * d'); a size that depends on a threshold is wrong past it",
            )
    return tree


def _too_big(source: str, what: str) -> ProgramError:
    shown = source if len(source) <= 40 else source[:37] + "..."
    return ProgramError(
        f"size expression {shown!r} {what}",
        hint="a size is a short sum of sizes or a multiple of one (e.g. 'Nq + Nkv', '2 * d')",
    )


def check_size_expr(source: str) -> str:
    """Pydantic validator: the text parses as a size expression."""
    if not isinstance(source, str) or not source.strip():
        raise ProgramError("a size expression must be a non-empty string such as 'd' or 'Nq + Nkv'")
    return canonical_size_expr(source)


# Printed forms and binding strengths of the operators (Python's), for ``canonical_size_expr``.
_SYMBOLS = {ast.Add: ("+", 1), ast.Sub: ("-", 1), ast.Mult: ("*", 2)}
_PREC_NEG, _PREC_ATOM = 3, 4


def canonical_size_expr(source: str) -> str:
    """The size expression re-printed from its parsed tree (comments, spacing and redundant
    parentheses gone): a validated Program keeps this text, never the submitted one. ASCII only:
    Python folds identifiers by NFKC, so 'ｄ' would silently be the size 'd'."""
    if not source.isascii():
        char = next(c for c in source if not c.isascii())
        raise ProgramError(
            f"size expression {source.encode('utf-8', 'backslashreplace').decode()!r}: character "
            f"U+{ord(char):04X} is not ASCII",
            hint="size names use only the letters A-Z, a-z, digits and '_'",
        )
    return _print(_parse(source), source)


def _print_prec(node: ast.AST) -> int:
    if isinstance(node, ast.BinOp):
        return _SYMBOLS[type(node.op)][1]
    return _PREC_NEG if isinstance(node, ast.UnaryOp) else _PREC_ATOM


def _print(node: ast.AST, source: str) -> str:
    def wrap(child: ast.AST, tighter_than: int) -> str:
        text = _print(child, source)
        return f"({text})" if _print_prec(child) <= tighter_than else text

    if isinstance(node, ast.Constant):
        return str(int(node.value))
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.UnaryOp):
        return f"-{wrap(node.operand, _PREC_NEG)}"
    assert isinstance(node, ast.BinOp)
    symbol, prec = _SYMBOLS[type(node.op)]
    return f"{wrap(node.left, prec - 1)} {symbol} {wrap(node.right, prec)}"


SizeExpr = Annotated[str, AfterValidator(check_size_expr)]
"""An integer expression over the program's size names, e.g. ``"Nq + Nkv"``."""


def size_names(source: str) -> set[str]:
    return set(_names(source))


@lru_cache(maxsize=1024)
def _names(source: str) -> frozenset[str]:
    return frozenset(n.id for n in ast.walk(_parse(source)) if isinstance(n, ast.Name))


def evaluate(source: str, sizes: dict[str, int], *, what: str = "size expression") -> int:
    """The value of ``source`` at one binding of the sizes; unknown names are named in the error."""
    if source in sizes:  # a size's own name (host code evaluates these on every call)
        return sizes[source]
    for name in sorted(_names(source)):
        if name not in sizes:
            raise ProgramError(
                f"{what} {source!r} uses size {name!r}, which this program does not bind",
                hint="sizes are the symbolic dimensions of the inputs; "
                + did_you_mean(name, sizes),
            )
    return _eval(_parse(source), sizes)


def _eval(node: ast.AST, sizes: dict[str, int]) -> int:
    if isinstance(node, ast.Constant):
        return int(node.value)
    if isinstance(node, ast.Name):
        return sizes[node.id]
    if isinstance(node, ast.UnaryOp):
        return -_eval(node.operand, sizes)
    assert isinstance(node, ast.BinOp)
    return _OPS[type(node.op)](_eval(node.left, sizes), _eval(node.right, sizes))


# Plain integer helpers for host code that runs on every launch (``triton.cdiv`` and
# ``triton.next_power_of_2`` are constexpr functions there: microseconds per call).
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive integers."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (1 for n ≤ 1)."""
    return 1 << max(n - 1, 0).bit_length()


def row_tile(
    rows: int, cols: int, *, max_cols: int, elements: int, max_rows: int = 64, min_cols: int = 1
) -> tuple[int, int]:
    """The (rows, columns) one program of a row-wise aux kernel takes at a time: the columns a
    power of two covering ``cols`` between ``min_cols`` and ``max_cols``, the rows a power of two
    no more than ``rows`` needs, ``max_rows`` or ``elements`` over the columns allow (at least
    one)."""
    block_cols = max(min_cols, min(next_power_of_2(cols), max_cols))
    block_rows = max(1, min(max_rows, elements // block_cols, next_power_of_2(rows)))
    return block_rows, block_cols
