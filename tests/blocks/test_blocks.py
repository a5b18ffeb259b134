"""Blocks: the reference matches Hugging Face Llama semantics; inputs are seeded and scaled;
malformed blocks and block files are rejected clearly."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from coda.blocks import (
    Add,
    Block,
    BlockFileError,
    BlockNotFound,
    Linear,
    RMSNorm,
    ShapeSets,
    TensorSpec,
    get_block,
    load_block_file,
)


def hf_llama_mlp(x, gamma, w_gate, w_up, w_down, eps):  # noqa: ANN001, ANN201
    """Written independently from transformers' LlamaRMSNorm + LlamaMLP (+ the residual)."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    h = gamma * hidden.to(input_dtype)
    gate = torch.nn.functional.linear(h, w_gate)
    up = torch.nn.functional.linear(h, w_up)
    return x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_llama_mlp_reference_matches_hugging_face(dtype: torch.dtype) -> None:
    block = get_block("llama_mlp")
    inputs = block.make_inputs({"M": 9, "d": 32, "f": 48}, dtype, seed=3)
    got = block.reference(inputs)["out"]
    want = hf_llama_mlp(**inputs, eps=1e-5)
    assert got.dtype == dtype
    assert torch.equal(got, want)


def test_reference_source_is_what_runs() -> None:
    block = get_block("llama_mlp")
    source = block.reference_source()
    assert "def llama_mlp(x, gamma, w_gate, w_up, w_down):" in source
    assert "h = rms_norm(x, gamma, eps=1e-05)" in source
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102
    inputs = block.make_inputs({"M": 4, "d": 8, "f": 16}, torch.float64, seed=0)
    assert torch.equal(namespace["llama_mlp"](**inputs)["out"], block.reference(inputs)["out"])


def test_input_factory_is_seeded_and_scaled() -> None:
    block = get_block("llama_mlp")
    sizes = {"M": 256, "d": 512, "f": 1024}
    a = block.make_inputs(sizes, torch.float32, seed=1)
    b = block.make_inputs(sizes, torch.float32, seed=1)
    c = block.make_inputs(sizes, torch.float32, seed=2)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["x"], c["x"])
    # nn.Linear-like scale: x @ W.T stays O(1), so no branch hides under the residual
    assert 0.9 < float((a["x"] @ a["w_gate"].T).std()) < 1.1
    assert 0.05 < float(a["gamma"].std()) < 0.2 and abs(float(a["gamma"].mean()) - 1) < 0.05


def test_flops_and_trace() -> None:
    block = get_block("llama_mlp")
    sizes = {"M": 16384, "d": 2048, "f": 8192}
    assert block.flops(sizes) == 2 * 16384 * 2048 * 8192 * 3
    assert block.trace(sizes)["a"] == (16384, 8192)


def test_cpu_shapes_include_ragged_sizes() -> None:
    block = get_block("llama_mlp")
    assert len(block.shapes.cpu) >= 3
    assert any(s["M"] % 32 or s["d"] % 32 for s in block.shapes.cpu)


def _spec(*shape: str, **kw) -> TensorSpec:  # noqa: ANN003
    return TensorSpec(shape=list(shape), **kw)


@pytest.mark.parametrize(
    "graph,fragment",
    [
        ([Linear(x="h", weight="w", out="y")], "reads 'h', which is not defined yet"),
        ([Linear(x="x", weight="w", out="y"), Add(a="x", b="y", out="y")], "redefines 'y'"),
        ([RMSNorm(x="x", weight="w", out="y")], "output 'z' is not computed"),
    ],
)
def test_malformed_blocks_are_rejected(graph, fragment: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as err:
        Block(
            name="bad",
            description="",
            inputs={"x": _spec("M", "d"), "w": _spec("d", "d")},
            graph=graph,
            outputs=["z" if "computed" in fragment else "y"],
            shapes=ShapeSets(cpu=[{"M": 4, "d": 8}]),
        )
    assert fragment in str(err.value)


def test_unused_input_and_missing_size_are_rejected() -> None:
    graph = [Linear(x="x", weight="w", out="y")]
    with pytest.raises(ValueError, match="inputs \\['extra'\\] are not used"):
        Block(
            name="bad",
            description="",
            graph=graph,
            outputs=["y"],
            inputs={"x": _spec("M", "d"), "w": _spec("d", "d"), "extra": _spec("d")},
            shapes=ShapeSets(cpu=[{"M": 4, "d": 8}]),
        )
    with pytest.raises(ValueError, match="lacks sizes \\['d'\\]"):
        Block(
            name="bad",
            description="",
            graph=graph,
            outputs=["y"],
            inputs={"x": _spec("M", "d"), "w": _spec("d", "d")},
            shapes=ShapeSets(cpu=[{"M": 4}]),
        )


def test_unknown_block_name_suggests() -> None:
    with pytest.raises(BlockNotFound, match="did you mean 'llama_mlp'"):
        get_block("llama_mpl")


def _residual_block_file(name: str, sizes: str = '{"M": 8, "d": 16}', imports: str = "") -> str:
    """A block file defining ``name``: ``x + x @ w.T`` at CPU ``sizes`` (Python source)."""
    return textwrap.dedent(f"""
        from coda.blocks import Block, Linear, Add, ShapeSets, TensorSpec
        {imports}
        {name} = Block(
            name="{name}", description="x + x @ w.T",
            inputs={{"x": TensorSpec(shape=["M", "d"]),
                    "w": TensorSpec(shape=["d", "d"], init="linear_weight")}},
            graph=[Linear(x="x", weight="w", out="y"), Add(a="x", b="y", out="out")],
            outputs=["out"], shapes=ShapeSets(cpu=[{sizes}]))
    """)


def test_block_file(tmp_path: Path) -> None:
    path = tmp_path / "my_block.py"
    path.write_text(_residual_block_file("proj_residual"))
    (block,) = load_block_file(path)
    assert block.name == "proj_residual" and get_block("proj_residual") is block
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_block_file(tmp_path / "missing.py")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no Block"):
        load_block_file(empty)


def test_a_block_file_cannot_take_a_built_in_block_s_name(tmp_path: Path) -> None:
    """A file block named like a built-in one would be planned for one block and verified
    against the other (the built-ins register when first needed); refused, and the registry
    left as it was even when the file registered the block itself."""
    builtin = get_block("llama_mlp")
    path = tmp_path / "clash.py"
    source = _residual_block_file("llama_mlp", imports="from coda.blocks import register")
    path.write_text(source + "register(llama_mlp)\n")
    with pytest.raises(BlockFileError, match="defines block 'llama_mlp', the name of a built-in"):
        load_block_file(path)
    assert get_block("llama_mlp") is builtin


def test_a_block_file_that_hangs_when_imported_is_stopped_at_the_given_time(
    tmp_path: Path,
) -> None:
    hangs = tmp_path / "hangs.py"
    hangs.write_text("while True:\n    pass\n")
    with pytest.raises(BlockFileError, match="did not finish within 1 s"):
        load_block_file(hangs, probe=True, probe_timeout_s=1.0)


def test_a_block_file_imports_the_modules_beside_it(tmp_path: Path) -> None:
    """As ``python file.py`` would: the file's folder is on ``sys.path`` while it is imported
    (directly and in the probe's subprocess), and ``sys.path`` is as before afterwards."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "sibling_widths_for_blocks.py").write_text("CPU_SIZES = {'M': 8, 'd': 16}\n")
    path = folder / "sibling_block.py"
    imports = "from sibling_widths_for_blocks import CPU_SIZES"
    path.write_text(_residual_block_file("sibling_residual", "CPU_SIZES", imports))
    before = list(sys.path)
    try:
        (block,) = load_block_file(path, probe=True)
    finally:
        sys.modules.pop("sibling_widths_for_blocks", None)
    assert block.shapes.cpu == [{"M": 8, "d": 16}]
    assert sys.path == before


@pytest.mark.parametrize(
    "body,message",
    [
        ("x = 1\nraise KeyError('w')", r"raised KeyError at .*bad\.py:2: 'w'"),
        ("def f(:\n  pass", r"bad\.py:1: the block file is not valid Python"),
        ("import sys\nsys.exit(0)", r"called exit\(0\): a block file must only define blocks"),
    ],
    ids=["exception", "syntax", "exit"],
)
def test_a_block_file_that_fails_on_import_is_a_block_file_error(
    tmp_path: Path, body: str, message: str
) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(body + "\n")
    before = set(sys.modules)
    with pytest.raises(BlockFileError, match=message):
        load_block_file(bad)
    assert set(sys.modules) == before  # the half-imported module is not left behind
