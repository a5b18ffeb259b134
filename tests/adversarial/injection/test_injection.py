"""Nothing a Program, a transcript or a plugin name carries ever runs as code.

Each case puts a payload into one text-bearing field and asserts that the canary file it would
write stays absent, and how the payload was handled: refused at validate with a clear message, or
(a comment on an honest value) dropped by canonical printing, after which the kernels compile and
import in this process. A few cases run the full isolated sandbox: the original hole (a ``map``
comment closing the generated module's docstring), and transcripts replayed or resumed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from coda.agent.providers import ReplayProvider
from coda.agent.runs import RunDir
from coda.agent.synthesize import resume, synthesize
from coda.blocks import get_block
from coda.planner import lower
from coda.primitives import Program
from coda.primitives.analysis import analyze
from coda.primitives.runtime import compile_program
from coda.primitives.settings import Settings, override
from coda.sandbox import SandboxOptions, evaluate
from tests.adversarial.injection.cases import CODE, COMMENT, COMMENTS, REJECTED, at, map_expr
from tests.agent.scripted import BLOCK, FAST, Script, broken_program, finish, submit

IN_PROCESS = SandboxOptions(isolate=False, seeds=[0], dtypes=["float32"], profile=False)
ISOLATED = SandboxOptions(seeds=[0], dtypes=["float32"], profile=False)
LLAMA = get_block("llama_mlp")


def _fill(payload: Any, canary: Path) -> Any:
    return payload.format(canary=str(canary)) if isinstance(payload, str) else payload


@pytest.mark.parametrize(
    "field,build,payload,fragment",
    REJECTED,
    ids=[f"{i:02d}-{case[0]}" for i, case in enumerate(REJECTED)],
)
def test_payload_is_refused_at_validate(
    field: str, build: Any, payload: Any, fragment: str, tmp_path: Path
) -> None:
    canary = tmp_path / "canary"
    report = evaluate(build(_fill(payload, canary)), LLAMA, IN_PROCESS)
    failed = report.failed_stage
    assert failed is not None and (failed.stage, failed.cause) == ("validate", "program"), field
    assert fragment in failed.message, failed.message
    assert not canary.exists()


@pytest.mark.parametrize("block,path,value", COMMENTS, ids=[f"{c[0]}-{c[1][-1]}" for c in COMMENTS])
def test_a_comment_is_canonicalised_away_and_the_kernels_import(
    block: str, path: tuple, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    canary = tmp_path / "canary"
    data = lower(get_block(block)).model_dump(mode="json")
    assert at(data, path)[path[-1]] == value
    at(data, path)[path[-1]] = value + _fill(COMMENT, canary)
    program = Program.parse(data)
    assert at(program.model_dump(mode="json"), path)[path[-1]] == value
    text = program.canonical_json() + program.to_python()
    assert "#" not in text and str(canary) not in text
    compiled = compile_program(program, analyze(program, get_block(block).shapes.cpu[0]))
    with override(cache_dir=tmp_path / "cache"):
        compiled.load_all()
    for kernel in compiled.kernels.values():
        assert str(canary) not in kernel.source
    assert not canary.exists()


def test_the_docstring_escape_is_closed_in_an_isolated_run(tmp_path: Path) -> None:
    """The original hole: this comment closed the generated module's docstring, ran in the
    worker, and the Program still verified."""
    canary = tmp_path / "canary"
    report = evaluate(map_expr("o" + _fill(COMMENT, canary)), LLAMA, ISOLATED)
    assert report.verified, report.render_text()
    assert not canary.exists()


def test_plugin_names_are_only_ever_imported_as_what_they_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin spec is a module name (importlib) or a .py path (read as a file): never a shell
    command, never evaluated."""
    canary = tmp_path / "canary"
    specs = {
        f"os; touch {canary}": "does not exist",  # a '/' in it: read as a file path, nothing else
        "os; import sys": "could not be loaded: ModuleNotFoundError",
        "$(touch canary)": "could not be loaded: ModuleNotFoundError",
        "__import__('os').system('id')": "could not be loaded: ModuleNotFoundError",
        f"{tmp_path}/p.py; touch {canary}": "does not exist",
        f"`touch {canary}`.py": "does not exist",
    }
    for spec, fragment in specs.items():
        for options in (
            IN_PROCESS.model_copy(update={"plugins": [spec]}),
            _options_from_env(monkeypatch, spec),
        ):
            report = evaluate(map_expr("o"), LLAMA, options)
            failed = report.failed_stage
            assert (failed.stage, failed.cause) == ("validate", "plugin"), spec
            assert fragment in failed.message, failed.message
    assert not canary.exists()


def _options_from_env(monkeypatch: pytest.MonkeyPatch, spec: str) -> SandboxOptions:
    plugins = Settings.from_environ({"CODA_PLUGINS": spec}).plugins
    with override(plugins=plugins):  # as if $CODA_PLUGINS held it when the settings were read
        return SandboxOptions(isolate=False, seeds=[0], dtypes=["float32"], profile=False)


def test_a_program_cannot_choose_plugins() -> None:
    data = copy.deepcopy(map_expr("o"))
    data["plugins"] = ["evil_module"]
    report = evaluate(data, LLAMA, IN_PROCESS)
    failed = report.failed_stage
    assert failed.stage == "validate" and "plugins: unknown field" in failed.message
    assert "plugins" not in json.dumps(Program.model_json_schema())


def _tamper(transcript: Path, edit: Any) -> None:
    """Apply ``edit`` to every recorded submit_program call's program (as a tampering would)."""
    lines = []
    for line in transcript.read_text().splitlines():
        record = json.loads(line)
        message = record.get("message")
        for part in message.get("parts", []) if isinstance(message, dict) else []:
            if part.get("name") == "submit_program" and "arguments" in part:
                args = json.loads(part["arguments"])
                edit(args["program"])
                part["arguments"] = json.dumps(args)
        lines.append(json.dumps(record))
    transcript.write_text("\n".join(lines) + "\n")


def _payload_expr(canary: Path) -> Any:
    def edit(program: dict) -> None:
        program["steps"][2]["epilogue"].insert(
            1, {"op": "map", "expr": _fill(CODE, canary), "out": "o2"}
        )

    return edit


def test_a_tampered_transcript_replays_without_running_its_payload(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    original = synthesize(
        BLOCK,
        tmp_path / "a",
        provider=Script([submit(broken_program(), "c1"), finish()]),
        sandbox=FAST,
    )
    _tamper(original.run.transcript, _payload_expr(canary))
    replay = ReplayProvider(original.run.transcript)
    again = synthesize(BLOCK, tmp_path / "b", provider=replay, sandbox=FAST)
    (candidate,) = again.candidates
    failed = candidate.report.failed_stage
    assert (failed.stage, failed.cause) == ("validate", "program")
    assert "only plain function names can be called" in failed.message
    assert not canary.exists()


def test_resume_answers_a_tampered_pending_call_without_running_it(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    crash = RuntimeError("the machine went away")
    with pytest.raises(RuntimeError):
        synthesize(
            BLOCK,
            tmp_path,
            provider=Script([submit(broken_program(), "c1"), crash]),
            sandbox=FAST,
        )
    (folder,) = tmp_path.iterdir()
    run = RunDir.open(folder)
    lines = run.transcript.read_text().splitlines()
    run.transcript.write_text("\n".join(lines[:3]) + "\n")  # c1 asked, never answered
    _tamper(run.transcript, _payload_expr(canary))
    assert [c.id for c in RunDir.open(folder).state().pending_calls()] == ["c1"]
    resumed = resume(RunDir.open(folder), BLOCK, Script([finish()]), sandbox=FAST)
    failed = resumed.candidates[0].report.failed_stage
    assert failed.stage == "validate" and "only plain function names" in failed.message
    assert not canary.exists()


def test_resume_does_not_take_plugins_from_the_transcript(tmp_path: Path) -> None:
    """A run's recorded sandbox options may not choose code: a tampered run_start naming a plugin
    is resumed with the resuming caller's plugins ($CODA_PLUGINS), not the recorded ones."""
    canary = tmp_path / "canary"
    evil = tmp_path / "evil_plugin.py"
    evil.write_text(_fill(CODE, canary) + "\n")
    crash = RuntimeError("the machine went away")
    with pytest.raises(RuntimeError):
        synthesize(BLOCK, tmp_path / "runs", provider=Script([crash]), sandbox=FAST)
    (folder,) = (tmp_path / "runs").iterdir()
    transcript = RunDir.open(folder).transcript
    records = [json.loads(line) for line in transcript.read_text().splitlines()]
    records[0]["sandbox"] |= {"plugins": [str(evil)], "isolate": False}
    transcript.write_text("".join(json.dumps(r) + "\n" for r in records))
    script = Script([submit(broken_program(), "c1"), finish()])
    resumed = resume(RunDir.open(folder), BLOCK, script)
    assert resumed.candidates[0].report.failed_stage.stage == "semantics"  # it did evaluate
    assert not canary.exists()


def _crashed_run_naming(tmp_path: Path, block_file: Path) -> RunDir:
    """A run that died after its first records, whose run_start now names ``block_file``."""
    with pytest.raises(RuntimeError):
        synthesize(BLOCK, tmp_path / "runs", provider=Script([RuntimeError("crash")]))
    (folder,) = (tmp_path / "runs").iterdir()
    run = RunDir.open(folder)
    records = [json.loads(line) for line in run.transcript.read_text().splitlines()]
    records[0]["block_file"] = str(block_file)
    run.transcript.write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


@pytest.mark.parametrize("command", ["resume", "replay"])
def test_a_transcript_never_chooses_the_block_file_that_is_imported(
    tmp_path: Path, command: str
) -> None:
    """A tampered run_start naming a block file (code that would run on import, in the CLI and in
    every worker) is refused until the user names that file with --block-file themselves."""
    from typer.testing import CliRunner

    from coda.cli.main import app

    canary = tmp_path / "canary"
    evil = tmp_path / "evil_block.py"
    evil.write_text(_fill(CODE, canary) + "\n")
    run = _crashed_run_naming(tmp_path, evil)
    args = (
        ["synthesize", "--resume", str(run.path)]
        if command == "resume"
        else ["synthesize", "--provider", "replay", "--transcript", str(run.transcript)]
    )
    done = CliRunner().invoke(app, [*args, "--runs-dir", str(tmp_path / "new"), "--json"])
    assert done.exit_code == 2
    error = json.loads(done.stdout)["error"]
    assert f"from the file {evil}" in error and "a transcript never chooses code to run" in error
    assert f"--block-file {evil}" in error
    assert not canary.exists()


def test_an_eval_folder_never_chooses_the_block_files_that_are_imported(tmp_path: Path) -> None:
    """``eval --resume`` imports the block files an eval's spec records only when the user names
    them again; a tampered eval.json naming another file is refused before anything runs."""
    from typer.testing import CliRunner

    from coda.cli.main import app
    from coda.evals.results import EvalDir
    from coda.evals.spec import EvalSpec, ProviderSpec

    canary = tmp_path / "canary"
    evil = tmp_path / "evil_blocks.py"
    evil.write_text(_fill(CODE, canary) + "\n")
    spec = EvalSpec(
        blocks=["llama_mlp"],
        block_files={"llama_mlp": str(evil)},
        providers=[ProviderSpec.parse("builtin")],
    )
    edir = EvalDir.create(tmp_path / "eval", spec)
    done = CliRunner().invoke(app, ["eval", "--resume", str(edir.path)])
    assert done.exit_code == 2
    assert "an eval folder never chooses code to run" in done.output
    assert not canary.exists()


def test_a_transcript_never_chooses_where_the_api_key_is_sent(tmp_path: Path) -> None:
    """Resuming an openai run whose run_start was edited to name another server refuses until the
    user names that server with --base-url: the key would otherwise go wherever the file says."""
    from typer.testing import CliRunner

    from coda.cli.main import app

    run = _crashed_run_naming(tmp_path, tmp_path / "unused.py")
    records = [json.loads(line) for line in run.transcript.read_text().splitlines()]
    records[0] |= {"block_file": None, "provider": "openai", "base_url": "http://127.0.0.1:9/v1"}
    run.transcript.write_text("".join(json.dumps(r) + "\n" for r in records))
    done = CliRunner().invoke(app, ["synthesize", "--resume", str(run.path), "--json"])
    assert done.exit_code == 2
    error = json.loads(done.stdout)["error"]
    assert "never chooses where your API key is sent" in error
    assert "--base-url http://127.0.0.1:9/v1" in error


def test_an_eval_folder_never_chooses_python_providers_or_servers(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from coda.cli.main import app
    from coda.evals.results import EvalDir
    from coda.evals.spec import EvalSpec, ProviderSpec

    canary = tmp_path / "canary"
    (tmp_path / "evil_provider.py").write_text(_fill(CODE, canary) + "\n")
    specs = [
        ProviderSpec.parse("python:evil_provider:make"),
        ProviderSpec.parse("openai:m@http://127.0.0.1:9/v1"),
    ]
    edir = EvalDir.create(tmp_path / "eval", EvalSpec(blocks=["llama_mlp"], providers=specs))
    done = CliRunner().invoke(app, ["eval", "--resume", str(edir.path)])
    assert done.exit_code == 2
    assert "an eval folder never chooses" in done.output
    assert "python:evil_provider:make" in done.output
    assert not canary.exists()
