"""Golden Programs: what ``lower`` gives for every built-in block (and the blocks the planner tests
define) under every ``LoweringOptions`` the product uses — the four decompositions ``PlanSearch``
tries and one explicit mainloop config. ``test_golden_programs.py`` compares against the files in
``golden/``; after a deliberate change to the planner's output, regenerate them with
``python -m tests.planner.golden_programs`` and review the diff.
"""

from __future__ import annotations

import json
from itertools import product
from pathlib import Path
from typing import Any

from coda.blocks import Block
from coda.blocks.registry import builtin_blocks
from coda.planner import TUNING_CONFIGS, LoweringOptions, NoRule, lower

GOLDEN = Path(__file__).parent / "golden"

# label -> options; the labels are the golden files' keys
OPTIONS: dict[str, LoweringOptions] = {
    f"gamma={gamma},stats={stats}": LoweringOptions(gamma=gamma, stats=stats)
    for stats, gamma in product(("epilogue", "pass"), ("fold", "side_output"))
}
OPTIONS["config=tuning[3]"] = LoweringOptions(config=TUNING_CONFIGS[3])


def planner_test_blocks() -> list[Block]:
    """Blocks the planner tests define (they exercise rules no built-in block reaches, e.g. γ as
    a side output of a producing epilogue)."""
    from .test_planner import DECODER_TAIL
    from .test_planner_coda import TARGET_ONLY, USER_TAIL

    return [DECODER_TAIL, TARGET_ONLY, USER_TAIL]


def golden_blocks() -> list[Block]:
    return [*builtin_blocks(), *planner_test_blocks()]


def lowerings(block: Block) -> dict[str, Any]:
    """``{label: program JSON | {"no_rule": message} | {"same_as": earlier label}}``."""
    seen: dict[str, str] = {}
    result: dict[str, Any] = {}
    for label, options in OPTIONS.items():
        try:
            entry: Any = lower(block, options).model_dump(mode="json")
        except NoRule as e:
            entry = {"no_rule": str(e)}
        key = json.dumps(entry, sort_keys=True)
        if key in seen:
            entry = {"same_as": seen[key]}
        else:
            seen[key] = label
        result[label] = entry
    return result


def path_of(block: Block) -> Path:
    return GOLDEN / f"{block.name}.json"


def write_all() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for block in golden_blocks():
        text = json.dumps(lowerings(block), indent=1, sort_keys=True, ensure_ascii=False)
        path_of(block).write_text(text + "\n")


if __name__ == "__main__":
    write_all()
