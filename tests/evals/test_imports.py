"""Import order must not matter: ``coda.agent.transcript`` (which the evals read runs with) once
failed with a circular import when it was the first coda module imported."""

from __future__ import annotations

import subprocess
import sys


def test_transcript_and_the_evals_import_first_in_a_fresh_interpreter() -> None:
    code = "import coda.agent.transcript, coda.evals.cli, coda.evals.trajectories"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
