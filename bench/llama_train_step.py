"""The Llama entry of ``bench/train_step.py``: the same benchmark, ``--family llama`` (its default),
kept under this name so the commands recorded in bench/RESULTS.md run as they did. Every name of
``train_step`` is importable from here (``bench/host_work.py`` and the experiments use them).

    python3 bench/llama_train_step.py [train_step.py's arguments]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import *  # noqa: E402, F403  (this script is train_step.py under the Llama name)
from train_step import main as _main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """``train_step.main`` under this script's name (the no-GPU message names it)."""
    return _main(argv, script="llama_train_step.py")


if __name__ == "__main__":
    sys.exit(main())
