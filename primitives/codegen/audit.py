"""The allowlist a generated module must pass before it is imported: ``check_generated_module``.

Codegen writes modules of one fixed shape: a docstring, ``import triton`` and ``import
triton.language as tl``, then ``@triton.jit`` functions whose bodies assign, branch, loop over
``range``/``tl.range`` and call ``tl.*`` functions, functions of the same module and the tensor
methods ``.to``/``.load``/``.store``. Anything else in a module — another import, a top-level
statement, a call to a builtin, an attribute such as ``__class__``, a lambda, a string where codegen
writes none — means text that did not come from codegen reached it, and the module is refused
before a single line of it runs. The check is structural (``ast``), so it cannot be talked past by
comments or spelling: what it does not list is refused.
"""

from __future__ import annotations

import ast

# The module's imports, exactly: (module, alias).
IMPORTS = frozenset({("triton", None), ("triton.language", "tl")})
# Builtins a kernel body may call: the K loop's ``range``, and ``float`` for ``float("-inf")``.
BUILTIN_CALLS = frozenset({"range", "float"})
FLOAT_WORDS = frozenset({"inf", "-inf", "nan"})
# Methods of tensors, pointers and descriptors that kernel bodies call; data attributes they read.
METHODS = frozenset({"to", "load", "store"})
DATA_ATTRIBUTES = frozenset({"dtype", "element_ty", "T"})
# ``triton.*`` names a body may use (``triton.jit`` is the decorator) and ``tl.*`` names it may not.
TRITON_NAMES = frozenset({"cdiv", "next_power_of_2"})
TL_REFUSED = frozenset({"inline_asm_elementwise"})
# Calls whose arguments may hold a string: ``tl.static_assert(cond, "message")``.
MESSAGE_CALLS = frozenset({"static_assert", "device_assert"})

_STATEMENTS = (ast.Assign, ast.AugAssign, ast.Expr, ast.If, ast.For, ast.Return, ast.Pass)
_PLAIN_EXPRESSIONS = (
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.IfExp,
    ast.Tuple,
    ast.List,
    ast.Subscript,
    ast.Slice,
)

_OPERATORS = (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)


class GeneratedCodeError(RuntimeError):
    """A generated module holds something codegen never writes; it was not imported."""


def check_generated_module(source: str, *, name: str = "<generated>") -> None:
    """Refuse ``source`` unless it has exactly the shape codegen emits (see the module docstring);
    the error names the construct and its line."""
    try:
        tree = ast.parse(source, filename=name)
    except (SyntaxError, ValueError) as e:
        raise GeneratedCodeError(f"generated module {name} does not parse: {e}") from None
    _Auditor(name, tree).run()


class _Auditor:
    def __init__(self, name: str, tree: ast.Module) -> None:
        self.name = name
        self.tree = tree
        self.functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        self.protected = self.functions | {"tl", "triton"} | BUILTIN_CALLS
        self.locals: set[str] = set()

    def refuse(self, node: ast.AST, what: str) -> GeneratedCodeError:
        line = getattr(node, "lineno", "?")
        return GeneratedCodeError(
            f"generated module {self.name}, line {line}: {what} — codegen never writes this, so "
            "the module was refused before it ran (text from a Program reached generated code; "
            "a primitive's emit() must write only Triton built from parsed fields)"
        )

    # -- module level ----------------------------------------------------------------------------
    def run(self) -> None:
        body = list(self.tree.body)
        if body and _is_docstring(body[0]):
            body = body[1:]
        seen_imports = set()
        for node in body:
            if isinstance(node, ast.Import):
                seen_imports.add(self.import_(node))
            elif isinstance(node, ast.FunctionDef):
                self.function(node)
            else:
                raise self.refuse(node, f"a top-level {type(node).__name__} statement")
        if seen_imports != IMPORTS:
            raise self.refuse(self.tree, "not exactly the imports 'triton' and 'triton.language'")

    def import_(self, node: ast.Import) -> tuple[str, str | None]:
        if len(node.names) != 1 or (node.names[0].name, node.names[0].asname) not in IMPORTS:
            listed = ", ".join(a.name for a in node.names)
            raise self.refuse(node, f"import of {listed}")
        return node.names[0].name, node.names[0].asname

    def function(self, node: ast.FunctionDef) -> None:
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if decorators != ["triton.jit"]:
            raise self.refuse(node, f"function {node.name!r} decorated with {decorators or 'none'}")
        if _dunder(node.name) or node.returns is not None or getattr(node, "type_params", None):
            raise self.refuse(node, f"the definition of function {node.name!r}")
        args = node.args
        if args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg or args.defaults:
            raise self.refuse(node, f"function {node.name!r} takes *args, keywords or defaults")
        self.locals = set()
        for arg in args.args:
            if arg.annotation is not None and ast.unparse(arg.annotation) != "tl.constexpr":
                raise self.refuse(arg, f"parameter {arg.arg!r} annotated other than tl.constexpr")
            self.bind(arg, arg.arg)
        for child in ast.walk(node):  # names assigned anywhere in the body are its locals
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                self.bind(child, child.id)
        body = node.body[1:] if node.body and _is_docstring(node.body[0]) else node.body
        for statement in body:
            self.statement(statement)

    def bind(self, node: ast.AST, name: str) -> None:
        """A parameter or local (any name but the module's functions, ``tl``, ``triton`` and the
        callable builtins: a local of the same name would change what a call runs)."""
        if name in self.protected:
            raise self.refuse(node, f"assignment to {name!r}")
        self.locals.add(name)

    # -- statements ------------------------------------------------------------------------------
    def statement(self, node: ast.stmt) -> None:
        if not isinstance(node, _STATEMENTS):
            raise self.refuse(node, f"a {type(node).__name__} statement")
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                self.target(target)
            self.expression(node.value)
        elif isinstance(node, ast.Expr):
            if not isinstance(node.value, ast.Call):
                raise self.refuse(node, "an expression statement that is not a call")
            self.expression(node.value)
        elif isinstance(node, ast.If):
            self.expression(node.test)
            for child in [*node.body, *node.orelse]:
                self.statement(child)
        elif isinstance(node, ast.For):
            if node.orelse:
                raise self.refuse(node, "a for loop with an else branch")
            self.target(node.target)
            self.expression(node.iter)
            for child in node.body:
                self.statement(child)
        elif isinstance(node, ast.Return) and node.value is not None:
            self.expression(node.value)

    def target(self, node: ast.expr) -> None:
        if isinstance(node, ast.Tuple):
            for element in node.elts:
                self.target(element)
        elif not isinstance(node, ast.Name):
            raise self.refuse(node, f"assignment to a {type(node).__name__}")

    # -- expressions -----------------------------------------------------------------------------
    def expression(self, node: ast.expr) -> None:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str | bytes) or type(node.value) is complex:
                raise self.refuse(node, f"the constant {node.value!r:.60}")
        elif isinstance(node, ast.Name):
            if node.id not in self.locals and node.id not in self.functions | {"tl"}:
                raise self.refuse(node, f"the name {node.id!r} (not a parameter or local)")
        elif isinstance(node, ast.Call):
            self.call(node)
        elif isinstance(node, ast.Attribute):
            self.attribute(node, call=False)
        elif isinstance(node, _PLAIN_EXPRESSIONS):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expression(child)
                elif not isinstance(child, _OPERATORS):
                    raise self.refuse(node, f"a {type(child).__name__}")
        else:
            raise self.refuse(node, f"a {type(node).__name__} expression")

    def call(self, node: ast.Call) -> None:
        func = node.func
        strings_allowed = False
        if isinstance(func, ast.Name):
            if func.id == "float":
                self.float_call(node)
                return
            if func.id not in self.functions and func.id != "range":
                raise self.refuse(node, f"a call to {func.id!r}")
        elif isinstance(func, ast.Attribute):
            self.attribute(func, call=True)
            strings_allowed = _is_tl(func) and func.attr in MESSAGE_CALLS
        else:
            raise self.refuse(node, f"a call to a {type(func).__name__}")
        for keyword in node.keywords:
            if keyword.arg is None:
                raise self.refuse(node, "a call with **keywords")
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            if isinstance(arg, ast.Starred):
                raise self.refuse(arg, "a call with *arguments")
            if strings_allowed and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                continue
            self.expression(arg)

    def float_call(self, node: ast.Call) -> None:
        args = node.args
        if node.keywords or len(args) != 1 or not isinstance(args[0], ast.Constant):
            raise self.refuse(node, "float(...) of anything but 'inf', '-inf' or 'nan'")
        if args[0].value not in FLOAT_WORDS:
            raise self.refuse(node, f"float({args[0].value!r:.40})")

    def attribute(self, node: ast.Attribute, *, call: bool) -> None:
        if _dunder(node.attr):
            raise self.refuse(node, f"the attribute {node.attr!r}")
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id == "tl":
            if node.attr in TL_REFUSED:
                raise self.refuse(node, f"tl.{node.attr}")
            return
        if isinstance(owner, ast.Name) and owner.id == "triton":
            if node.attr not in TRITON_NAMES:
                raise self.refuse(node, f"triton.{node.attr}")
            return
        allowed = METHODS if call else DATA_ATTRIBUTES
        if node.attr not in allowed:
            kind = "method" if call else "attribute"
            raise self.refuse(node, f"the {kind} .{node.attr} (allowed: {sorted(allowed)})")
        self.expression(owner)


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _is_tl(func: ast.Attribute) -> bool:
    return isinstance(func.value, ast.Name) and func.value.id == "tl"


def _dunder(name: str) -> bool:
    return name.startswith("__") or name.endswith("__")
