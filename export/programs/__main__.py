"""``python -m coda.export.programs``: check or rewrite the shipped drop-in Programs.

* ``--check`` (default): exit 1, naming each file, unless every file is what the planner writes
  now (a second or so; no sandbox).
* ``--write``: verify the planner's Program for every shipped block in the sandbox (float32 and
  float16 through the interpreter on a CPU; one that fails stops it with exit 1 before any file
  changes), then rewrite the files. Run it after a change to the planner or the blocks, and
  commit the files.
"""

from __future__ import annotations

import argparse
import sys

from coda.export.resolve import NotVerified, verified_program

from . import shipped_blocks, stale_files, write_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coda.export.programs", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare the files (the default)")
    mode.add_argument("--write", action="store_true", help="verify, then rewrite the files")
    args = parser.parse_args(argv)
    if args.write:
        for block, options in shipped_blocks():
            try:
                verified_program(block, options)
            except NotVerified as e:
                print(f"not written: {e}", file=sys.stderr)
                return 1
            print(f"verified {block.name}", flush=True)
        for path in write_all():
            print(f"wrote {path}")
        return 0
    stale = stale_files()
    for path in stale:
        print(f"{path}: not what the planner writes now; rewrite with --write", file=sys.stderr)
    if not stale:
        print(f"all {len(shipped_blocks())} shipped Programs are the planner's")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
