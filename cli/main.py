"""The ``coda-agent`` command: the composition root, the one place that may import every layer.

``app`` holds the agent's commands (``synthesize``, ``verify``, ``blocks``, ``show``:
``coda.cli.agent``) and the eval commands (``eval``, ``accept``, ``regress``,
``export-trajectories``: ``coda.cli.evals``); each module documents its commands' exit codes.
``main`` is the installed entry point.

Listing the commands, their options and ``--version`` imports no part of coda beyond this package
(no torch, Triton or pydantic models): the commands import what they use when they run, so
``coda-agent --help`` and shell completion answer at once.
"""

from __future__ import annotations

import difflib
import json
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import typer
from typer.core import TyperGroup

from . import agent, evals
from .common import stderr


class CommandGroup(TyperGroup):
    """Typer's group, with the closest command named when one is misspelled."""

    def resolve_command(self, ctx: typer.Context, args: list[str]) -> Any:
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            commands = self.list_commands(ctx)
            close = difflib.get_close_matches(name, commands, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            ctx.fail(f"no command {name!r}: {hint}known: {', '.join(commands)}")
        return super().resolve_command(ctx, args)


app = typer.Typer(
    cls=CommandGroup,
    no_args_is_help=True,
    help="Compose GEMM-epilogue Triton kernels for transformer blocks, verified.",
)
agent.register(app)
evals.register(app)


def package_version() -> str:
    """The installed distribution's version."""
    try:
        return version("coda-agent")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed: pip install -e .)"


def _print_version(value: bool) -> None:
    if value:
        print(f"coda-agent {package_version()}")
        raise typer.Exit(0)


@app.callback()
def root(
    show_version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    """Compose GEMM-epilogue Triton kernels for transformer blocks, verified."""


def main() -> None:
    """The ``coda-agent`` entry point. Usage errors that the option parser finds (an unknown
    option, a value out of range) keep their message on stderr; with ``--json`` they also print
    the one JSON object on stdout."""
    try:
        code = app(prog_name="coda-agent", standalone_mode=False)
    except typer.Abort:
        stderr().print("[yellow]interrupted[/]")
        sys.exit(130)
    except Exception as e:
        # Click's errors (UsageError, BadParameter, ...), whether Typer vendors Click (0.26 on) or
        # depends on it: each can show itself and has an exit code.
        if not (hasattr(e, "show") and hasattr(e, "exit_code")):
            raise
        e.show()
        status = getattr(e, "exit_code", 2)
        if "--json" in sys.argv[1:]:
            print(json.dumps({"error": e.format_message(), "exit_code": status}))
        sys.exit(status)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
