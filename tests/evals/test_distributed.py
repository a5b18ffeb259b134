"""Cells as Ray tasks, on a local Ray instance started here (2 CPUs, loopback only): results come
back with their run folders, and a task whose worker process dies is retried by Ray."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from coda.evals.distributed import RAY_MISSING, RayUnavailable
from coda.evals.harness import run_eval

from .common import BUILTIN, make_eval, model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def local_ray(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    # Ray's node address is the loopback one (by default it is this machine's network address),
    # and its workers import the scripted models from this checkout.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    import ray

    # Its own short temp folder (Ray's socket paths must stay short), removed afterwards.
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_cells_run_as_ray_tasks_and_a_dead_worker_is_retried(
    tmp_path: Path,
    local_ray,
    markers: Path,  # noqa: ANN001
) -> None:
    edir = make_eval(tmp_path / "ev", [model("crash_once"), BUILTIN])
    crashed, builtin = run_eval(edir, ray_address="auto", retries=1)
    # the first attempt's worker process exited (os._exit) before answering: Ray reran the task
    first_pid = int((markers / "crash_once-llama_mlp").read_text())
    assert first_pid != os.getpid()
    assert crashed.status == "done" and crashed.verified and crashed.stop == "finished"
    assert builtin.status == "done" and builtin.verified
    for r in (crashed, builtin):  # each run folder came back from its node into the eval
        assert (edir.path / r.run_dir / "transcript.jsonl").is_file()
        assert (edir.path / r.run_dir / "kernels" / "down.py").is_file()
    assert "2 of 2 done" in (edir.path / "results.md").read_text()


def test_without_ray_installed_the_flag_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    edir = make_eval(tmp_path / "ev", [BUILTIN])
    with pytest.raises(RayUnavailable) as e:
        run_eval(edir, ray_address="auto")
    assert str(e.value) == RAY_MISSING and "pip install 'coda-agent[ray]'" in RAY_MISSING
    assert edir.results() == {}
