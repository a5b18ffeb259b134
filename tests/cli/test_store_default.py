"""Where ``accept`` writes without ``--store`` (the user's store, never the installed package) and
what ``regress`` checks without it (the built-in entries, and the user's store once it exists);
``regress --block`` names the closest stored block."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from coda.agent.synthesize import synthesize
from coda.cli.main import app
from coda.evals.store import STORE_DIR, default_stores, user_store
from tests.agent.scripted import BLOCK, FAST, Script, finish, good_program, submit

runner = CliRunner()


def test_the_user_store_is_coda_store_else_xdg_data_home_else_local_share(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CODA_STORE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert user_store() == tmp_path / "mine"
    monkeypatch.delenv("CODA_STORE")
    assert user_store() == tmp_path / "data" / "coda-agent" / "store"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_store() == tmp_path / ".local" / "share" / "coda-agent" / "store"


def test_accept_writes_to_the_user_store_and_regress_then_checks_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = tmp_path / "mine"
    monkeypatch.setenv("CODA_STORE", str(store))
    assert default_stores() == [STORE_DIR]  # not created yet
    program = good_program()
    program["steps"][1]["name"] = "gate_up_v2"  # verified, and not a built-in entry
    provider = Script([submit(program, "c1"), finish()])
    run = synthesize(BLOCK, tmp_path / "runs", provider=provider, sandbox=FAST).run.path
    done = runner.invoke(app, ["accept", str(run), "--name", "planner"])
    assert done.exit_code == 0, done.output
    assert (store / "llama_mlp" / "planner.json").is_file()
    assert not (STORE_DIR / "llama_mlp" / "planner.json").exists()
    assert default_stores() == [STORE_DIR, store]


def test_a_built_in_program_is_not_accepted_again_into_the_user_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``regress`` checks the built-in entries beside the user's store: the planner's program,
    already a built-in entry, would be a second identical row there."""
    store = tmp_path / "mine"
    monkeypatch.setenv("CODA_STORE", str(store))
    run = synthesize(BLOCK, tmp_path / "runs", provider=None, sandbox=FAST).run.path
    (builtin,) = (STORE_DIR / "llama_mlp").glob("*.json")
    done = runner.invoke(app, ["accept", str(run), "--name", "planner"])
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())
    assert f"already stored: the same program is the built-in entry llama_mlp/{builtin.stem}" in (
        text
    )
    assert "nothing was added" in text and not store.exists()
    assert default_stores() == [STORE_DIR]
    # a store named with --store is checked alone (`regress --store`): the program goes there
    other = tmp_path / "ci-store"
    done = runner.invoke(app, ["accept", str(run), "--store", str(other), "--name", "planner"])
    assert done.exit_code == 0 and (other / "llama_mlp" / "planner.json").is_file()


def test_regress_block_names_the_closest_stored_block(tmp_path: Path) -> None:
    done = runner.invoke(app, ["regress", "--store", str(STORE_DIR), "--block", "lama_mlp"])
    assert done.exit_code == 2
    assert "no kernels for block 'lama_mlp': did you mean 'llama_mlp'?" in " ".join(
        done.output.split()
    )
