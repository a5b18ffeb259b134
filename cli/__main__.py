"""``python -m coda.cli``: the ``coda-agent`` command."""

from .main import main

main()
