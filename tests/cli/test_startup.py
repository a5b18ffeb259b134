"""The command line starts light: ``--help``, ``--version`` and a command's ``--help`` import no
torch, Triton, NumPy nor any coda package outside ``coda.cli`` (the blocks, the pydantic IR, the
sandbox, the agent: the commands import them when they run), and no package but ``coda.cli``
imports the command line. ``--provider`` is a choice; a provider whose SDK is missing is a usage
error that names the extra to install."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coda.cli.common import PROVIDERS, complete_provider
from coda.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
HEAVY = (
    "torch",
    "triton",
    "numpy",
    "coda.primitives",
    "coda.blocks",
    "coda.sandbox",
    "coda.agent",
    "coda.evals",
    "coda.export",
)

# Run the entry point with the arguments given after the code; report which heavy modules it
# imported (on stderr, after whatever the command printed).
IMPORTS = """
import sys
sys.argv = ["coda-agent", *sys.argv[1:]]
from coda.cli.main import main
try:
    main()
finally:
    loaded = [m for m in {heavy!r} if m in sys.modules]
    print("LOADED=" + ",".join(loaded), file=sys.stderr)
"""


def run_cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = prelude + IMPORTS.format(heavy=HEAVY)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )


def loaded(done: subprocess.CompletedProcess) -> list[str]:
    line = [x for x in done.stderr.splitlines() if x.startswith("LOADED=")][-1]
    return [m for m in line.removeprefix("LOADED=").split(",") if m]


@pytest.mark.parametrize("args", [["--help"], ["synthesize", "--help"], ["--version"]])
def test_help_and_version_import_no_torch_nor_the_rest_of_coda(args: list[str]) -> None:
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert loaded(done) == []
    if args == ["--help"]:
        for command in ("synthesize", "verify", "blocks", "show", "eval", "accept", "regress"):
            assert command in done.stdout


def test_version_is_the_installed_distributions() -> None:
    done = CliRunner().invoke(app, ["--version"])
    assert done.exit_code == 0
    assert done.stdout.strip() == f"coda-agent {version('coda-agent')}"


def test_a_misspelled_command_names_the_closest() -> None:
    done = CliRunner().invoke(app, ["synthesise"])
    assert done.exit_code == 2
    assert "no command 'synthesise': did you mean 'synthesize'?" in done.output


def test_the_provider_choices_are_the_providers_make_provider_builds() -> None:
    from coda.agent.providers import PROVIDERS as built

    assert tuple(built) == PROVIDERS
    assert complete_provider("") == list(built) and complete_provider("an") == ["anthropic"]


def test_an_unknown_provider_is_a_usage_error_naming_the_closest_choice() -> None:
    """Refused by the option parser, before the command imports anything."""
    done = run_cli("synthesize", "-b", "llama_mlp", "--provider", "antropic", "--json")
    assert done.returncode == 2 and loaded(done) == []
    error = json.loads(done.stdout)["error"]
    assert "unknown provider 'antropic': did you mean 'anthropic'? choose one of builtin" in error


@pytest.mark.parametrize("sdk", ["anthropic", "openai"])
def test_a_missing_sdk_is_exit_2_naming_the_extra(sdk: str) -> None:
    hide = f"import sys\nsys.modules[{sdk!r}] = None  # as if the SDK were not installed\n"
    done = run_cli("synthesize", "-b", "llama_mlp", "--provider", sdk, "--json", prelude=hide)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    error = json.loads(done.stdout)["error"]
    assert f"--provider {sdk} needs the {sdk!r} package" in error
    assert "pip install 'coda-agent[llm]'" in error


def test_no_package_but_cli_imports_the_command_line() -> None:
    """The composition root is imported by nothing: every other package stays usable (and
    importable) without it."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    offenders = []
    for package, folder in folders.items():
        if package == "coda.cli":
            continue
        for path in (ROOT / folder).rglob("*.py"):
            if any(imports_cli(node) for node in ast.walk(ast.parse(path.read_text()))):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def imports_cli(node: ast.AST) -> bool:
    """Whether ``node`` imports ``coda.cli`` (absolutely, or relatively from a sibling)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level >= 2:
        names = [f"coda.{node.module or ''}"] + [f"coda.{a.name}" for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
        return False
    return any(n == "coda.cli" or n.startswith("coda.cli.") for n in names)
