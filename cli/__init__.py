"""coda.cli — the ``coda-agent`` command line, the composition root: the only package that imports
every other one, and that no other package imports.

* ``main`` — the Typer app and the ``coda-agent`` entry point (``--version``, ``--help``);
* ``agent`` — ``synthesize``, ``verify``, ``blocks``, ``show``;
* ``evals`` — ``eval``, ``accept``, ``regress``, ``export-trajectories``;
* ``common`` — errors and ``--json`` output, the provider choice, loading block files.
"""
