"""The packages' imports point one way (docs/architecture.md):

    primitives, blocks → planner, sandbox → agent → evals;  export → primitives, blocks, planner;
    cli → everything; prompts is data.

Every ``import coda.<package>`` and ``from coda.<package> import …`` in a package's modules, at
module level or inside a function, must name a package its layer may use. The export reaches the
sandbox only inside a function (to verify a Program on request), never when it is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MAY_IMPORT: dict[str, set[str]] = {
    "primitives": set(),
    "blocks": {"primitives"},
    "prompts": set(),
    "planner": {"primitives", "blocks"},
    "sandbox": {"primitives", "blocks"},
    "agent": {"primitives", "blocks", "planner", "sandbox", "prompts"},
    "evals": {"primitives", "blocks", "planner", "sandbox", "agent", "prompts"},
    "export": {"primitives", "blocks", "planner"},
    "cli": {"primitives", "blocks", "planner", "sandbox", "agent", "evals", "export", "prompts"},
}
ONLY_INSIDE_FUNCTIONS: dict[str, set[str]] = {"export": {"sandbox"}}


def _coda_imports(tree: ast.AST) -> list[tuple[str, bool, int]]:
    """(package, inside a function, line) of every absolute ``coda.<package>`` import."""
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                names = [child.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "coda" and len(parts) > 1:
                    found.append((parts[1], in_function, child.lineno))
            visit(child, nested)

    visit(tree, False)
    return found


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target, in_function, line in _coda_imports(tree):
            if target == package:
                continue
            lazy_ok = in_function and target in ONLY_INSIDE_FUNCTIONS.get(package, set())
            if target not in MAY_IMPORT[package] and not lazy_ok:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports coda.{target}")
    assert not wrong, f"{package} may import only {sorted(MAY_IMPORT[package])}: " + "; ".join(
        wrong
    )


def test_the_rule_sees_an_upward_import() -> None:
    """The checker itself: a module-level import of the sandbox from the export is found, and so
    is an upward import hidden in a function."""
    tree = ast.parse("import coda.sandbox\ndef f():\n    from coda.cli.main import app\n")
    assert _coda_imports(tree) == [("sandbox", False, 1), ("cli", True, 3)]


def test_every_package_of_the_distribution_has_a_layer() -> None:
    """A new top-level package must be placed in the order before it can be imported."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for line in pyproject.splitlines():
        line = line.strip()
        if line.startswith('"coda.') and "=" in line:
            package = line.split("=")[0].strip().strip('"').split(".")[1]
            assert package in MAY_IMPORT, f"coda.{package} has no place in MAY_IMPORT"
