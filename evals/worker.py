"""One eval cell in its own process: ``python -m coda.evals.worker EVAL_DIR CELL_ID ATTEMPT``.

Started by ``harness.run_in_workers`` with the slot's GPU in ``CUDA_VISIBLE_DEVICES``; writes the
cell's ``CellResult`` to ``cells/<id>/result.json`` (atomically) and exits 0. Dying without that
file is what the harness retries. Exit 130 when interrupted (the run's transcript records it).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .cell import run_cell
from .harness import write_result
from .results import EvalDir


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m coda.evals.worker EVAL_DIR CELL_ID ATTEMPT", file=sys.stderr)
        return 2
    edir = EvalDir.open(Path(argv[0]))
    spec = edir.spec()
    cells = {c.id: c for c in spec.cells()}
    if argv[1] not in cells:
        print(f"{argv[1]!r} is not a cell of {edir.path}", file=sys.stderr)
        return 2
    cell_dir = edir.cell_dir(argv[1])
    try:
        result = run_cell(spec, cells[argv[1]], cell_dir, attempts=int(argv[2]))
    except KeyboardInterrupt:
        return 130
    write_result(cell_dir, result)
    print(f"{result.cell}: {result.status}, verified={result.verified}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
