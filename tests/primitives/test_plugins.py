"""Plugins: extra primitives registered after import parse, reach the schema, compile and run — and
can be scoped, so a test's primitives never leak into other tests."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from coda.primitives import (
    EpilogueOp,
    PluginError,
    Program,
    ProgramError,
    load_plugins,
    plugin_scope,
)
from coda.sandbox import assert_close
from tests.helpers import gemm_program, make_inputs, run_both

PLUGIN = str(Path(__file__).with_name("plugin_ops.py"))
SCALED = [
    {"op": "add_tile_scaled", "src": "acc", "tensor": "r", "alpha": 0.5, "out": "y"},
    {"op": "store", "src": "y", "to": "y"},
]


def _program() -> Program:
    return gemm_program(SCALED, {"r": ["M", "N"]})


def test_an_unloaded_plugin_op_is_an_unknown_tag() -> None:
    with pytest.raises(ProgramError) as err:
        _program()
    assert "unknown op 'add_tile_scaled'" in str(err.value)
    assert "add_tile_scaled" not in json.dumps(Program.model_json_schema())


def test_a_loaded_plugin_parses_compiles_and_runs() -> None:
    with plugin_scope():
        load_plugins([PLUGIN])
        program = _program()
        schema = json.dumps(Program.model_json_schema())
        assert '"add_tile_scaled"' in schema
        assert "Add ``alpha`` times a program tensor" in schema  # the LLM-facing docstring
        namespace: dict = {}
        exec(program.to_python(), namespace)  # noqa: S102 - the builder knows the new op too
        assert namespace["program"] == program
        sizes = {"M": 37, "N": 50, "K": 29}
        inputs = make_inputs(program, sizes, torch.float32)
        got, ref, exact = run_both(program, inputs)
        formula = inputs["a"].double() @ inputs["b"].double().T + 0.5 * inputs["r"].double()
        assert_close(exact["y"], formula, atol=1e-12, rtol=1e-12, what="reference executor")
        assert_close(got["y"], ref["y"], atol=2e-5, rtol=2e-5, what="kernel")
    assert "add_tile_scaled" not in EpilogueOp.registry
    with pytest.raises(ProgramError):
        _program()


def test_loading_twice_registers_once_and_survives_a_scope() -> None:
    before = dict(EpilogueOp.registry)
    for _ in range(2):
        with plugin_scope():
            load_plugins([PLUGIN, PLUGIN])
            assert EpilogueOp.registry["add_tile_scaled"].__name__ == "AddTileScaled"
            _program()
    assert EpilogueOp.registry == before


def test_a_dotted_module_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_ops_pkg.py").write_text(Path(PLUGIN).read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    with plugin_scope():
        load_plugins(["my_ops_pkg"])
        assert EpilogueOp.registry["add_tile_scaled"].__module__ == "my_ops_pkg"
        _program()
    sys.modules.pop("my_ops_pkg", None)


TAKEN = '''
from typing import Literal
from coda.primitives.ops.store import Store

class MyStore(Store):
    """A store that would silently replace the built-in one."""
    op: Literal["store"] = "store"
'''


@pytest.mark.parametrize(
    "source,fragments",
    [
        (
            TAKEN,
            [
                "EpilogueOp op='store' is already registered by coda.primitives.ops.store.Store",
                "must use another op",
            ],
        ),
        ("X = 1\n", ["defines no EpilogueOp, AuxStep or PrepStep subclass"]),
        ("import does_not_exist_anywhere\n", ["ModuleNotFoundError", "does_not_exist_anywhere"]),
    ],
    ids=["taken-tag", "no-nodes", "import-error"],
)
def test_bad_plugins_are_refused_by_name(tmp_path: Path, source: str, fragments: list) -> None:
    path = tmp_path / "bad_plugin.py"
    path.write_text(textwrap.dedent(source))
    before = dict(EpilogueOp.registry)
    with plugin_scope(), pytest.raises(PluginError) as err:
        load_plugins([str(path)])
    for fragment in fragments:
        assert fragment in str(err.value)
    assert str(path) in str(err.value)
    assert EpilogueOp.registry == before


def test_a_missing_plugin_file() -> None:
    with pytest.raises(PluginError, match="does not exist"):
        load_plugins(["/nonexistent/ops.py"])
