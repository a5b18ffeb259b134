"""What a candidate in a worker can see of its caller: only allowed environment variables, and not
the caller's ``/proc/<pid>/environ`` (API keys live there). Observed from inside a real worker —
the ``snoop`` fault of ``faulty_block.py`` records what it finds — plus the allowlist alone."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coda.sandbox import SandboxOptions, evaluate
from coda.sandbox.fences import (
    SNOOPING_CAPABILITIES,
    allowed,
    caller_undumpable,
    drop_ptrace,
    worker_environment,
)
from tests.sandbox.test_isolation import BLOCK, BLOCK_FILE, PROGRAM, QUICK

SECRETS = {
    "DATABASE_URL": "postgres://admin:hunter2@db/prod",
    "GITHUB_PAT": "ghp_secretvalue",
    "ANTHROPIC_API_KEY": "sk-ant-secretvalue",
    "AWS_SECRET_ACCESS_KEY": "aws-secretvalue",
    "CODA_API_KEY": "coda-secretvalue",  # an allowed prefix does not let a secret marker through
}


def test_the_allowlist_keeps_what_python_triton_and_cuda_need() -> None:
    parent = {
        **SECRETS,
        "PATH": "/usr/bin",
        "HOME": "/root",
        "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0",
        "TRITON_INTERPRET": "1",
        "LD_LIBRARY_PATH": "/usr/lib",
        "CODA_TEST_FAULT": "none",
        "SLACK_WEBHOOK_URL": "https://hooks.example/x",
        "LD_PRELOAD": "/tmp/evil.so",
    }
    env = worker_environment(parent)
    assert set(env) == {
        "PATH", "HOME", "LC_ALL", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET", "LD_LIBRARY_PATH",
        "CODA_TEST_FAULT",
    }  # fmt: skip
    assert not allowed("NPM_CONFIG__AUTH") and not allowed("CODA_TOKEN")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")
def test_a_worker_sees_no_secret_and_cannot_read_its_callers_environ(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    snoop = tmp_path / "snoop.json"
    monkeypatch.setenv("CODA_TEST_FAULT", "snoop")
    monkeypatch.setenv("CODA_TEST_SNOOP_FILE", str(snoop))
    # Without the fences any child reads this process's /proc environ (where a key exported in
    # the shell that started it lives).
    _child_reads_our_environ()
    report = evaluate(PROGRAM, BLOCK, SandboxOptions(**QUICK), block_file=BLOCK_FILE)
    assert report.verified, report.render_text()
    seen = json.loads(snoop.read_text())
    assert not set(SECRETS) & set(seen["env"]), seen["env"].keys()
    assert not any(v in json.dumps(seen["env"]) for v in SECRETS.values())
    assert seen["parent_environ"].startswith("PermissionError"), seen["parent_environ"]
    if os.geteuid() == 0:  # root: the capabilities that would bypass dumpability are gone for good
        bits = sum(1 << n for n in SNOOPING_CAPABILITIES.values())
        assert not int(seen["caps"]["CapEff"], 16) & bits, seen["caps"]
        assert not int(seen["caps"]["CapBnd"], 16) & bits, seen["caps"]
    _child_reads_our_environ()  # ... and again once the worker is gone


def _child_reads_our_environ() -> None:
    code = f"print(len(open('/proc/{os.getpid()}/environ', 'rb').read()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and int(done.stdout) > 0, done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_the_caller_is_undumpable_only_while_workers_run() -> None:
    def dumpable() -> int:
        import ctypes

        return ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)

    before = dumpable()
    with caller_undumpable() as note, caller_undumpable():
        assert note == "caller non-dumpable while the worker runs"
        assert dumpable() == 0
    assert dumpable() == before


def test_drop_ptrace_degrades_to_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert drop_ptrace() == "CAP_SYS_PTRACE not dropped: no prctl on darwin"
    with caller_undumpable() as note:
        assert note == "caller left dumpable: no prctl on darwin"


@pytest.mark.parametrize(
    "note,warned",
    [
        ("CAP_SYS_PTRACE/CAP_SYS_ADMIN/CAP_PERFMON dropped; dropped from the bounding set", False),
        ("CAP_SYS_PTRACE/CAP_SYS_ADMIN/CAP_PERFMON not dropped: Operation not permitted", True),
        ("CAP_SYS_PTRACE/... dropped; bounding set unchanged (Operation not permitted)", True),
    ],
)
def test_the_caller_warns_when_the_worker_kept_its_capabilities(
    note: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from coda.sandbox.runner import _Collected

    with caplog.at_level(logging.WARNING, logger="coda.sandbox.runner"):
        _Collected([]).absorb("limits", note)
    assert bool(caplog.records) == warned
    if warned:
        assert note in caplog.text and "may read this process's /proc files" in caplog.text
