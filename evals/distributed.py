"""Eval cells as Ray tasks on an existing cluster (``coda-agent eval --ray ADDRESS``).

Nothing here is imported unless ``--ray`` is given, and Ray is imported only then: without the
flag Ray is not needed at all. Every node must have coda-agent (same version) installed.

Each cell is one task (``num_gpus=1`` when the cluster has GPUs, else ``num_cpus=1``). Nodes need
not share a filesystem: a task gets the cell's folder so far as a tar archive (an interrupted run
continues from its transcript), runs ``cell.run_cell`` in a temporary folder on its node, and
returns the result with the cell's folder packed again; the driver unpacks it into the eval
folder. A task whose worker process dies (node lost, out of memory, a crash) is retried by Ray up
to ``retries`` times from the same starting folder; after that the cell is recorded as an
``error`` (a later ``--resume`` tries it again).

Retries inside Ray are not counted in a result's ``attempts``. A ``--block-file`` must exist at
the same path on every node.

``ADDRESS`` is what ``ray.init(address=...)`` takes (``auto``, ``HOST:6379``,
``ray://HOST:10001``), or ``local`` to start a Ray instance on this machine. A process that has
already called ``ray.init`` keeps its connection.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .results import CellResult, EvalDir
from .spec import Cell, EvalSpec

RAY_MISSING = (
    "--ray needs the `ray` package: pip install 'coda-agent[ray]' (on this machine and every node "
    "of the cluster)"
)


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached; the message says what to do."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable(RAY_MISSING) from None
    return ray


def connect(address: str) -> Any:
    ray = import_ray()
    if ray.is_initialized():
        return ray
    try:
        if address == "local":
            ray.init(include_dashboard=False)
        else:
            ray.init(address=address, include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayUnavailable(f"cannot connect to the Ray cluster at {address!r}: {e}") from None
    return ray


def pack(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        if folder.is_dir():
            for child in sorted(folder.iterdir()):
                tar.add(child, arcname=child.name)
    return buffer.getvalue()


def unpack(data: bytes, folder: Path) -> None:
    """Replace ``folder``'s contents with the archive's."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(folder, filter="data")


def cell_task(spec_json: str, cell_json: str, folder: bytes) -> tuple[str, bytes]:
    """The body of one Ray task (runs on a cluster node)."""
    from .cell import run_cell

    spec = EvalSpec.model_validate_json(spec_json)
    cell = Cell.model_validate_json(cell_json)
    root = Path(tempfile.mkdtemp(prefix="coda-eval-cell-"))
    try:
        cell_dir = root / "cells" / cell.id
        unpack(folder, cell_dir)
        result = run_cell(spec, cell, cell_dir)
        return result.model_dump_json(), pack(cell_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_on_ray(
    edir: EvalDir,
    spec: EvalSpec,
    cells: list[Cell],
    address: str,
    *,
    retries: int = 2,
    gpus_per_cell: float | None = None,
) -> Iterator[CellResult]:
    """Submit every cell, then yield results as tasks finish (any order)."""
    ray = connect(address)
    if gpus_per_cell is None:
        gpus_per_cell = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    task = ray.remote(cell_task).options(
        num_cpus=1, num_gpus=gpus_per_cell, max_retries=retries, name="coda-eval-cell"
    )
    spec_json = spec.model_dump_json()
    refs = {
        task.remote(spec_json, c.model_dump_json(), pack(edir.cell_dir(c.id))): c for c in cells
    }
    waiting = list(refs)
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1)
        cell = refs[ready[0]]
        yield _receive(ray, ready[0], cell, edir, retries)


def _receive(ray: Any, ref: Any, cell: Cell, edir: EvalDir, retries: int) -> CellResult:
    try:
        result_json, folder = ray.get(ref)
    except ray.exceptions.RayError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return CellResult(
            cell=cell.id,
            block=cell.block,
            provider=cell.provider.label,
            model=cell.provider.model or "",
            seed=cell.seed,
            status="error",
            error=f"the Ray task failed after {retries + 1} attempt(s): {type(e).__name__}: "
            f"{first}",
            attempts=retries + 1,
        )
    unpack(folder, edir.cell_dir(cell.id))
    return CellResult.model_validate_json(result_json)
