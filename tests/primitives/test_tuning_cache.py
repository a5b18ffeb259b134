"""The tuning cache file under concurrent writers: processes that tune at once (parallel eval
workers) keep each other's entries."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from coda.primitives.codegen.tuning import TuningCache
from coda.primitives.ir import MainloopConfig

WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from coda.primitives.codegen.tuning import TuningCache
    from coda.primitives.ir import MainloopConfig

    path, writer, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    start = float(sys.argv[4])
    config = MainloopConfig(block_m=16, block_n=32, block_k=16)
    time.sleep(max(0.0, start - time.time()))  # every writer starts at the same moment
    for i in range(count):
        TuningCache(path).put(f"{writer}-{i}", config, float(i))
    """
)


def test_concurrent_writers_keep_every_entry(tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    writers, count = 4, 40
    start = time.time() + 4.0  # after every interpreter has imported coda
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), f"w{w}", str(count), str(start)])
        for w in range(writers)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0] * writers
    entries = json.loads(path.read_text())
    missing = {f"w{w}-{i}" for w in range(writers) for i in range(count)} - set(entries)
    assert not missing, f"{len(missing)} entries lost, e.g. {sorted(missing)[:5]}"
    assert TuningCache(path).get("w3-39") == MainloopConfig(block_m=16, block_n=32, block_k=16)
    assert not list(tmp_path.glob("*.tmp"))  # no temporary file left behind


def test_a_put_keeps_entries_another_process_wrote_since_this_one_read(tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    config = MainloopConfig(block_m=16, block_n=32, block_k=16)
    mine, theirs = TuningCache(path), TuningCache(path)
    theirs.put("theirs", config, 1.0)
    mine.put("mine", config, 2.0)
    assert set(json.loads(path.read_text())) == {"theirs", "mine"}
    assert mine.get("theirs") == config
