"""The drop-ins' shipped Programs (coda.export.programs): each file still verifies in the sandbox
and is exactly what the planner writes now; a drop-in uses it only when the planner's Program is
that one up to the RMSNorm epsilon, with no sandbox worker — and otherwise verifies in the
sandbox, with a warning."""

from __future__ import annotations

import json
import shutil
import tomllib
import warnings
from pathlib import Path

import pytest

import coda.export.programs as programs
import coda.export.resolve as resolve
from coda.blocks import RMSNorm
from coda.export.programs import (
    FAMILIES,
    SHIPPED_EPS,
    ShippedMismatch,
    lowered,
    program_file,
    render,
    shipped_blocks,
    shipped_program,
)
from coda.export.programs.__main__ import main
from coda.primitives.ir import Program
from coda.sandbox import SandboxOptions, evaluate

REWRITE = "python -m coda.export.programs --write"


@pytest.mark.slow
@pytest.mark.parametrize("shipped", shipped_blocks(), ids=lambda s: s.block.name)
def test_each_shipped_program_is_the_planners_and_verifies(shipped) -> None:  # noqa: ANN001
    block = shipped.block
    text = program_file(block.name).read_text()
    assert text == render(shipped), f"{program_file(block.name)} is stale: run `{REWRITE}`"
    program = Program.parse(json.loads(text)["program"])
    report = evaluate(program, block, SandboxOptions(profile=False, seeds=[0]))
    assert report.verified, report.render_compact()
    assert {c.dtype for c in report.checks} == {"float32", "float16"}


def test_every_family_resolves_at_any_epsilon_without_the_sandbox(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Llama 3's 1e-5 (the shipped blocks) and Hugging Face's default 1e-6 (variants) alike."""
    import coda.sandbox

    def no_worker(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a shipped Program was verified in the sandbox")

    monkeypatch.setattr(coda.sandbox, "evaluate", no_worker)
    for eps in (SHIPPED_EPS, 1e-6):
        for name, family in FAMILIES.items():
            got = resolve.dropin_programs(name, family.keys, eps, verify=False)
            blocks = family.blocks(eps)
            assert [p.block for p in got] == [blocks[k].name for k in family.keys]
            # a family without a norm (attn_out: o_proj + residual) sets no epsilon at all
            normed = any(isinstance(op, RMSNorm) for op in blocks["forward"].graph)
            for key, program in zip(family.keys, got, strict=True):
                assert program == lowered(blocks[key], family.options)
                # every epsilon a step sets (a norm's rstd — two in a sandwich —, Qwen3's q/k
                # norms' backward) is eps
                epsilons = {getattr(s, "eps", None) for s in program.steps} - {None}
                if "rstd_h" in program.inputs:  # a backward given the norm's statistic: only
                    assert epsilons <= {eps}, name  # a post-norm's own rstd sets one
                else:
                    assert epsilons == ({eps} if normed else set()), name


def test_a_planner_change_is_refused_naming_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    data = lowered(FAMILIES["llama_mlp"].blocks(1e-6)["train"]).model_dump(mode="json")
    data["steps"][1]["name"] = "gate_up_v2"  # what a planner that names steps otherwise writes
    other = Program.parse(data)
    monkeypatch.setattr(programs, "lowered", lambda block, options=None: other)
    with pytest.raises(ShippedMismatch) as e:
        shipped_program("llama_mlp", "train", 1e-6)
    message = str(e.value)
    assert "llama_mlp_eps1e-06_train" in message and "llama_mlp_train.json" in message
    assert "the planner changed" in message and REWRITE in message


def test_only_the_requested_epsilon_is_taken_for_the_shipped_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Program for the 1e-6 block that still says 1e-5 (an epsilon lost on the way) is not the
    shipped Program up to the epsilon: the model's epsilon must be the one it computes with."""
    shipped = lowered(FAMILIES["llama_attn_in"].blocks(SHIPPED_EPS)["forward"])
    renamed = Program.parse({**shipped.model_dump(mode="json"), "block": "llama_attn_in_eps1e-06"})
    monkeypatch.setattr(programs, "lowered", lambda block, options=None: renamed)
    with pytest.raises(ShippedMismatch, match="llama_attn_in_eps1e-06"):
        shipped_program("llama_attn_in", "forward", 1e-6)


def _copy_programs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "programs"
    shutil.copytree(programs.PROGRAMS_DIR, folder, ignore=shutil.ignore_patterns("*.py", "__*"))
    monkeypatch.setattr(programs, "PROGRAMS_DIR", folder)
    return folder


def test_an_edited_or_missing_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _copy_programs(tmp_path, monkeypatch)
    path = folder / "llama_lm_head_ce.json"
    entry = json.loads(path.read_text())
    entry["program"]["steps"][0]["eps"] = 1e-3
    path.write_text(json.dumps(entry))
    try:
        with pytest.raises(ShippedMismatch, match=r"llama_lm_head_ce\.json was edited.*--write"):
            shipped_program("llama_lm_head_ce", "forward", SHIPPED_EPS)
        (folder / "llama_attn_in.json").unlink()
        with pytest.raises(ShippedMismatch, match=r"no shipped Program llama_attn_in\.json"):
            shipped_program("llama_attn_in", "forward", 1e-6)
        assert main(["--check"]) == 1
    finally:
        programs._read.cache_clear()


def test_a_mismatch_falls_back_to_the_sandbox_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def mismatch(family: str, key: str, eps: float) -> Program:
        raise ShippedMismatch(f"{family}/{key}: not the shipped one")

    verified: list[str] = []

    def sandbox(block, options=None):  # noqa: ANN001, ANN202
        verified.append(block.name)
        return lowered(block)

    monkeypatch.setattr(resolve, "shipped_program", mismatch)
    monkeypatch.setattr(resolve, "verified_program", sandbox)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = resolve.dropin_programs("llama_mlp", ("forward",), 1e-6, verify=False)
    assert verified == ["llama_mlp_eps1e-06"] and got[0].block == "llama_mlp_eps1e-06"
    [warning] = caught
    assert warning.category is resolve.ShippedProgramWarning
    assert (
        "llama_mlp/forward: not the shipped one; verifying llama_mlp_eps1e-06 in the sandbox"
        in (str(warning.message))
    )
    verified.clear()
    resolve.dropin_programs("llama_mlp", ("train", "forward"), 1e-5, verify=True)
    assert verified == ["llama_mlp_train", "llama_mlp"]  # verify=True: always the sandbox


def test_the_check_command_passes_on_the_shipped_files(capsys: pytest.CaptureFixture) -> None:
    assert main(["--check"]) == 0
    assert (
        f"all {len(shipped_blocks())} shipped Programs are the planner's" in capsys.readouterr().out
    )


def test_the_files_ship_as_package_data() -> None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    setuptools = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    assert "*.json" in setuptools["package-data"]["coda.export.programs"]


def test_the_mlp_families_ship_their_pre_norm_in_a_row_pass() -> None:
    """The MLP Programs write ``h = r ⊙ x ⊙ γ`` once instead of folding γ into the [2f, d]
    gate/up weight each call — with ``r``, in one launch (aux ``rms_rows``: x is the block's
    input, no epilogue summed its squares); the attention inputs keep the fold."""
    for name in ("llama_mlp", "llama_mlp_branch", "gemma_mlp", "gemma2_mlp_branch"):
        family = FAMILIES[name]
        assert family.options.gamma == "rows", name
        train = shipped_program(name, "train", SHIPPED_EPS)
        assert all(p.kind != "fold_norm_weight" for p in train.prep), name
        rows = [s for s in train.steps if s.kind == "rms_rows" and s.src == "x"]
        gate_up = next(s for s in train.steps if s.kind == "gemm")
        assert len(rows) == 1 and gate_up.a.tensor == rows[0].out, name
        assert rows[0].stat_out in train.outputs and train.steps[0] is rows[0], name
        assert not any(s.kind == "rstd" and s.src == "x" for s in train.steps), name
    attention = shipped_program("llama_attn_in", "train", SHIPPED_EPS)
    assert [p.kind for p in attention.prep][-1] == "fold_norm_weight"
