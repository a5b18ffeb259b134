"""Plugins in the sandbox: loaded by the caller and by the worker, or refused by name."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from coda.primitives import EpilogueOp, plugin_scope
from coda.primitives.settings import Settings, override
from coda.sandbox import SandboxOptions, evaluate
from tests.adversarial.programs import BLOCKS, LLAMA

PLUGIN = str(Path(__file__).parents[1] / "primitives" / "plugin_ops.py")
LLAMA_SHAPES = BLOCKS["llama_mlp"].shapes.cpu
QUICK = {"seeds": [0], "dtypes": ["float32"], "shapes": [LLAMA_SHAPES[0], LLAMA_SHAPES[-1]]}


@pytest.fixture(autouse=True)
def _scoped_plugins():
    with plugin_scope():
        yield


def _residual_by_plugin() -> dict:
    data = copy.deepcopy(LLAMA)
    down = data["steps"][2]["epilogue"]
    down[0] = {"op": "add_tile_scaled", "src": "acc", "tensor": "x", "alpha": 1.0, "out": "o"}
    return data


def test_a_plugin_primitive_verifies_in_an_isolated_worker() -> None:
    options = SandboxOptions(plugins=[PLUGIN], **QUICK)
    report = evaluate(_residual_by_plugin(), BLOCKS["llama_mlp"], options)
    assert report.verified, report.render_text()


def test_plugins_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with override(plugins=Settings.from_environ({"CODA_PLUGINS": PLUGIN}).plugins):
        assert SandboxOptions().plugins == [PLUGIN]
        options = SandboxOptions(isolate=False, **QUICK)  # plugins: the default, from settings
    report = evaluate(_residual_by_plugin(), BLOCKS["llama_mlp"], options)
    assert report.verified, report.render_text()
    assert "add_tile_scaled" in EpilogueOp.registry


def test_a_plugin_that_does_not_load_fails_validate(tmp_path: Path) -> None:
    bad = tmp_path / "broken_ops.py"
    bad.write_text("raise RuntimeError('half-written plugin')\n")
    report = evaluate(LLAMA, BLOCKS["llama_mlp"], SandboxOptions(plugins=[str(bad)]))
    failed = report.failed_stage
    assert (failed.stage, failed.cause) == ("validate", "plugin")
    assert f"plugin {str(bad)!r} could not be loaded: RuntimeError: half-written plugin" in (
        failed.message
    )
    assert not report.verified and len(report.stages) == 1
