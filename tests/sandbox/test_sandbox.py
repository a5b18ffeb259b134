"""The sandbox end to end: a verified kernel, and each kind of failure reported at the right stage
with a message that says what is wrong — never an exception in the caller."""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path

import pytest

from coda.blocks import get_block, load_block_file
from coda.blocks.block import Tolerance
from coda.planner import lower
from coda.primitives.settings import override
from coda.sandbox import SandboxOptions, evaluate
from coda.sandbox.runner import worker_env
from tests.helpers import residual_program

BLOCK = get_block("llama_mlp")
FAST = SandboxOptions(isolate=False)


@pytest.fixture(scope="module")
def program_json() -> dict:
    return lower(BLOCK).model_dump(mode="json")


def test_llama_mlp_verifies_in_an_isolated_worker(program_json: dict, tmp_path: Path) -> None:
    report = evaluate(program_json, BLOCK, SandboxOptions(), kernels_dir=tmp_path)
    assert report.verified, report.render_text()
    assert [s.stage for s in report.stages] == [
        "validate",
        "semantics",
        "compile",
        "verify",
        "profile",
    ]
    # ≥ 3 shapes (incl. ragged) × fp32, fp16 × 2 seeds, one output
    assert len(report.checks) == len(BLOCK.shapes.cpu) * 2 * 2
    assert {c.dtype for c in report.checks} == {"float32", "float16"}
    assert all(c.nan == 0 and c.max_abs_err <= c.allowed for c in report.checks)
    assert report.stage("profile").status == "skipped"
    assert "not measured" in report.stage("profile").message
    assert not report.profile  # no invented numbers
    assert sorted(p.name for p in tmp_path.glob("*.py")) == ["down.py", "gate_up.py"]
    assert "VERIFIED" in report.render_text()


def test_missing_residual_fails_at_semantics(program_json: dict) -> None:
    data = copy.deepcopy(program_json)
    down = data["steps"][2]
    down["epilogue"] = [{"op": "store", "src": "acc", "to": "out"}]
    report = evaluate(data, BLOCK, FAST)
    assert not report.verified
    assert report.failed_stage.stage == "semantics"
    assert (
        "output 'out' does not match the block's reference in float64"
        in report.failed_stage.message
    )
    assert report.stage("compile") is None  # nothing ran after the first failure


def test_malformed_json_fails_at_validate() -> None:
    report = evaluate('{"block": "llama_mlp", "steps": [', BLOCK, FAST)
    assert report.failed_stage.stage == "validate"
    assert "invalid program" in report.failed_stage.message
    assert report.headline().startswith("FAILED at validate")


def test_program_for_another_block_fails_at_validate(program_json: dict) -> None:
    report = evaluate({**program_json, "block": "llama_attn"}, BLOCK, FAST)
    assert "the program is for block 'llama_attn', not 'llama_mlp'" in report.failed_stage.message
    data = copy.deepcopy(program_json)
    del data["inputs"]["gamma"]
    report = evaluate(data, BLOCK, FAST)
    assert "missing input 'gamma'" in report.failed_stage.message


def test_verify_failure_reports_mismatches(program_json: dict) -> None:
    strict = BLOCK.model_copy(update={"tolerance": Tolerance(ratio=0.0, floor={}, rel={})})
    report = evaluate(program_json, strict, SandboxOptions(isolate=False, seeds=[0]))
    assert report.failed_stage.stage == "verify"
    assert "output checks failed" in report.failed_stage.message
    bad = [c for c in report.checks if not c.passed]
    assert bad and bad[0].first_bad and bad[0].mismatches > 0
    assert "elements exceed the allowed error" in bad[0].reason
    assert "first:" in report.render_compact()


def test_worker_timeout_becomes_a_failed_stage(program_json: dict) -> None:
    report = evaluate(program_json, BLOCK, SandboxOptions(timeout_s=0.5))
    assert not report.verified
    failed = report.failed_stage
    # killed while still starting up: the first stage the worker runs is semantics
    assert failed.stage == "semantics" and "timed out after" in failed.message
    assert "the worker was still starting up" in failed.message
    assert "the worker was killed" in failed.message
    # the command line's flag first, then the Python API's name
    assert "a larger --timeout (SandboxOptions.timeout_s from Python)" in failed.message


CRASHY_BLOCK = '''
import os, signal
import torch
from typing import ClassVar, Literal
from coda.blocks import Block, Linear, ShapeSets, TensorSpec
from coda.blocks.ops import GraphOp


def crashy_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b — but it kills its own process when run inside a sandbox worker below float64."""
    if "coda-worker-" in os.getcwd() and a.dtype != torch.float64:
        os.kill(os.getpid(), signal.SIGSEGV)
    return a + b


class CrashyAdd(GraphOp):
    op: Literal["crashy_add"] = "crashy_add"
    helper: ClassVar = staticmethod(crashy_add)
    a: str
    b: str

    def inputs(self):
        return [self.a, self.b]


crashy = Block(
    name="crashy", description="x + x @ w.T",
    inputs={"x": TensorSpec(shape=["M", "d"]),
            "w": TensorSpec(shape=["d", "d"], init="linear_weight")},
    graph=[Linear(x="x", weight="w", out="y"), CrashyAdd(a="x", b="y", out="out")],
    outputs=["out"], shapes=ShapeSets(cpu=[{"M": 8, "d": 16}]))
'''


def test_worker_crash_becomes_a_failed_stage(tmp_path: Path) -> None:
    path = tmp_path / "crashy.py"
    path.write_text(CRASHY_BLOCK)
    (block,) = load_block_file(path)
    report = evaluate(residual_program(block), block, SandboxOptions(), block_file=str(path))
    assert not report.verified
    assert report.stage("semantics").status == "passed"  # the same reference, in float64
    failed = report.failed_stage
    assert failed.stage == "verify"
    assert "the worker died during verify: killed by SIGSEGV" in failed.message


def test_worker_environment_has_no_secrets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("NPM_CONFIG__AUTH", "npm_secret")
    env = worker_env(tmp_path)
    assert not any(
        v in ("sk-ant-secret", "sk-secret", "hf_secret", "npm_secret") for v in env.values()
    )
    assert not {"ANTHROPIC_API_KEY", "OPENAI_API_KEY", "HF_TOKEN", "NPM_CONFIG__AUTH"} & set(env)
    assert env["CODA_SANDBOX_WORKER"] == "1"
    assert not env["TRITON_CACHE_DIR"].startswith(str(tmp_path))  # the sandbox's: shared


def test_workers_share_the_sandboxs_caches_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Compiled kernels and tuned configs carry over between candidates (both caches are keyed
    by content) in caches of the sandbox's own — never the caller's, which trusted code loads
    kernels from; ``shared_caches=False`` gives each worker private ones under its folder."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    with override(cache_dir=tmp_path / "coda"):
        shared = worker_env(tmp_path / "w")
        again = worker_env(tmp_path / "w2")
        private = worker_env(tmp_path / "w", shared_caches=False)
    assert shared["TRITON_CACHE_DIR"] == str(tmp_path / "coda" / "sandbox" / "triton")
    assert shared["CODA_CACHE_DIR"] == str(tmp_path / "coda" / "sandbox" / "coda")
    assert again == shared
    assert not shared["TRITON_CACHE_DIR"].startswith(str(tmp_path / "mine"))
    assert private["TRITON_CACHE_DIR"] == str(tmp_path / "w" / "triton")
    assert private["CODA_CACHE_DIR"] == str(tmp_path / "w" / "coda")


def test_report_json_round_trip(program_json: dict) -> None:
    report = evaluate(program_json, BLOCK, SandboxOptions(isolate=False, seeds=[0]))
    data = json.loads(report.model_dump_json())
    assert data["verified"] is True
    assert type(report).model_validate(data) == report
    text = textwrap.dedent(report.render_text())
    assert "✓ verify" in text and "timings: not measured" in text


def test_a_failure_is_summarised_once_and_its_detail_follows() -> None:
    from coda.sandbox.report import Report, StageResult

    stages = [
        StageResult(
            stage="validate",
            status="failed",
            cause="program",
            message="invalid program:\n  steps.0: first problem\n  steps.1: second problem",
        )
    ]
    report = Report(verified=False, block="b", program_hash="h", device="cpu", stages=stages)
    assert stages[0].summary() == "invalid program: steps.0: first problem"
    assert stages[0].detail() == ["  steps.1: second problem"]
    headline = "FAILED at validate [program]: invalid program: steps.0: first problem"
    assert report.headline() == headline
    for text in (report.render_text(), report.render_compact()):
        assert text.count("first problem") == 1 and text.count("second problem") == 1
    printed = report.render_text(stages_printed=True)  # the stage's own line showed the summary
    assert "first problem" not in printed and "second problem" in printed
    assert printed.splitlines()[1] == "FAILED at validate [program]"


def test_fp32_output_of_a_half_precision_run_is_held_to_that_runs_bounds() -> None:
    # A loss or row statistic is fp32 even when the block runs in fp16; its error comes from the
    # fp16 inputs (PyTorch's own reference is off by ~3e-4 here), so fp32's 1e-5 relative bound
    # cannot apply: the bounds are looked up by the run's dtype.
    import torch

    from coda.sandbox import check_output

    ref = torch.linspace(1, 2, 50, dtype=torch.float64)
    torch_out = (ref * (1 + 3e-4)).float()
    out = (ref * (1 + 2e-5)).float()
    tol = Tolerance()
    as_fp32 = check_output("loss", out, ref, torch_out, tol, sizes={}, seed=0)
    assert not as_fp32.passed and "relative error" in as_fp32.reason
    run = check_output("loss", out, ref, torch_out, tol, sizes={}, seed=0, run_dtype=torch.float16)
    assert run.passed and run.dtype == "float16"
    worse = check_output(
        "loss", (ref * 1.01).float(), ref, torch_out, tol, sizes={}, seed=0, run_dtype=torch.float16
    )
    assert not worse.passed  # still 2× PyTorch's error at most


def test_a_profile_row_holds_every_mainloop_config_field() -> None:
    """The profile stage stores each step's config dump; ``maxnreg`` is None unless a config caps
    registers (a row that refused None failed every GPU profile once maxnreg existed)."""
    from coda.primitives import MainloopConfig
    from coda.sandbox.report import ProfileRow

    configs = {"default": MainloopConfig(), "capped": MainloopConfig(maxnreg=128)}
    row = ProfileRow(
        sizes={"M": 64},
        dtype="bfloat16",
        program_ms=1.0,
        gemms_ms=1.0,
        tflops=1.0,
        configs={n: c.model_dump() for n, c in configs.items()},
    )
    assert row.configs["default"]["maxnreg"] is None and row.configs["capped"]["maxnreg"] == 128
    again = ProfileRow.model_validate_json(row.model_dump_json())
    assert {n: MainloopConfig(**c) for n, c in again.configs.items()} == configs


def test_the_report_names_configs_tuning_rejected_for_wrong_results() -> None:
    from coda.sandbox.report import ProfileRow, Report

    row = ProfileRow(
        sizes={"M": 4096},
        dtype="bfloat16",
        program_ms=1.0,
        gemms_ms=1.0,
        tflops=1.0,
        tuning_rejected={
            "down": ["{'block_m': 128}: out: max |error| 3 against max |reference| 2"]
        },
    )
    report = Report(
        verified=True, block="b", program_hash="h", device="H200", stages=[], profile=[row]
    )
    text = report.render_text()
    assert "tuning rejected for down (wrong results): {'block_m': 128}: out: max |error| 3" in text


def test_verify_checks_the_configured_backend_and_tritons_pointer_mainloop(
    program_json: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``CODA_EPILOGUE_BACKEND=auto`` verify's runs alternate between the configured
    backend (the steps CuTe covers on QuACK's GEMM, on a Hopper GPU) and Triton's pointer
    mainloop — CuTe has none, so without the switch its steps would be checked twice and their
    Triton kernels, which tuning may pin, never. The kernels compiled ahead follow the same
    runs, and the program is left on its own backend and mainloop."""
    from coda.primitives import analyze, compile_program
    from coda.primitives.ir import Program
    from coda.sandbox import stages

    program = Program.model_validate(program_json)
    shape = {"M": 8, "d": 16, "f": 24}
    with override(epilogue_backend="auto"):
        compiled = compile_program(program, analyze(program, shape))
    assert compiled.epilogue_backend == "auto"
    checked, ahead = [], []

    def verify_one(compiled, block, sizes, dtype, seed):  # noqa: ANN001, ANN202
        checked.append((compiled.mainloop, compiled.epilogue_backend, seed))
        return []

    def collect_launches(inputs, poison):  # noqa: ANN001, ANN202
        ahead.append((compiled.mainloop, compiled.epilogue_backend))
        return []

    monkeypatch.setattr(stages, "verify_one", verify_one)
    monkeypatch.setattr(stages, "compile_ahead_of", lambda collect: collect())
    monkeypatch.setattr(stages, "screen_program", lambda *a, **k: "screened")
    monkeypatch.setattr(compiled, "collect_launches", collect_launches)
    stages.verify(compiled, BLOCK, [shape], ["float16"], [0, 1, 2], [])
    assert checked == [("auto", "auto", 0), ("pointer", "triton", 1), ("auto", "auto", 2)]
    assert ahead == [("auto", "auto"), ("pointer", "triton"), ("auto", "auto")]
    assert (compiled.mainloop, compiled.epilogue_backend) == ("auto", "auto")
