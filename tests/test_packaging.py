"""The distribution ships every package: each folder with an ``__init__.py`` under a mapped
top-level folder must be listed in ``pyproject.toml`` (an editable install hides the omission;
a wheel install on the GPU machine does not). A built wheel holds the license, each package's
``py.typed`` marker, the package data and the ``coda-agent`` entry point."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    expected = set()
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            expected.add(".".join([package, *rel.parts]))
    assert expected - listed == set(), (
        f"add to pyproject.toml packages: {sorted(expected - listed)}"
    )
    assert listed - expected == set(), f"listed but missing: {sorted(listed - expected)}"


def test_prompts_ship_as_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "coda.prompts" in config["package-data"]


# What a checkout holds besides its sources: environments, caches and earlier builds.
BUILD_LEFTOVERS = (
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    "runs",
    ".hypothesis",
)


def mapped_packages() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def test_every_package_has_a_py_typed_marker() -> None:
    missing = [f for f in mapped_packages().values() if not (ROOT / f / "py.typed").is_file()]
    assert missing == [], f"add an empty py.typed to: {missing}"


@pytest.mark.slow
def test_the_wheel_ships_the_license_the_markers_and_the_package_data(tmp_path: Path) -> None:
    """What an installed (not editable) coda-agent has: built as a user's pip builds it, from a
    copy of the sources (setuptools' in-tree build/ folder would keep files of earlier builds)."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("coda_agent-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert f"{info}/licenses/LICENSE" in names
    for package in mapped_packages():
        assert f"{package.replace('.', '/')}/py.typed" in names, package
    for data in (
        "coda/prompts/system.md",
        "coda/prompts/task.md",
        "coda/evals/suites/smoke.toml",
        "coda/evals/suites/families.toml",
        "coda/evals/suites/families/gemma.py",  # a suite's block files
        "coda/blocks/capture/capture.py",
    ):
        assert data in names, data
    assert any(n.startswith("coda/evals/regression/") and n.endswith(".json") for n in names)
    assert "coda-agent = coda.cli.main:main" in entry_points
    assert "License-Expression: Apache-2.0" in metadata
    for url in ("Homepage", "Documentation", "Source", "Issues"):
        assert f"Project-URL: {url}, https://github.com/coda-agent/coda-agent" in metadata
