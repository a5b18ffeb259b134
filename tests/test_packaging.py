"""The distribution ships every package: each folder with an ``__init__.py`` under a mapped
top-level folder must be listed in ``pyproject.toml`` (an editable install hides the omission;
a wheel install on the GPU machine does not)."""

from __future__ import annotations

import tomllib
from pathlib import Path

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
