"""Imports: ``coda.agent.transcript`` (which the evals read runs with) once failed with a circular
import when it was the first coda module imported; Ray and matplotlib are imported only on use."""

from __future__ import annotations

import subprocess
import sys


def test_transcript_and_the_evals_import_first_in_a_fresh_interpreter() -> None:
    """Also: the CLI and harness need neither Ray nor matplotlib until --ray or a plot."""
    code = (
        "import sys, coda.agent.transcript, coda.cli.main, coda.evals.harness, "
        "coda.evals.trajectories\n"
        "assert 'ray' not in sys.modules and 'matplotlib' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
