"""The SQLite run registry: schema migrations and concurrent writers."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from rlmctl import registry as registry_module
from rlmctl.errors import RlmctlError, RunNotFound
from rlmctl.registry import MIGRATIONS, Registry


def test_fresh_registry_is_migrated_to_the_newest_schema(tmp_path: Path) -> None:
    with Registry(tmp_path / "runs" / "registry.sqlite") as reg:
        assert reg.version == len(MIGRATIONS)
        tables = {
            r[0] for r in reg._db.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
    assert {"runs", "hosts", "launches"} <= tables and not {"restarts", "events"} & tables


def test_migrations_run_once_and_only_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "registry.sqlite"
    Registry(path).close()
    extra = "ALTER TABLE runs ADD COLUMN owner TEXT"
    monkeypatch.setattr(registry_module, "MIGRATIONS", [*MIGRATIONS, extra])
    with Registry(path) as reg:  # upgraded in place: the new column exists, old data kept
        assert reg.version == len(MIGRATIONS) + 1
        reg._db.execute("SELECT owner FROM runs")
    monkeypatch.setattr(registry_module, "MIGRATIONS", MIGRATIONS)
    with pytest.raises(RlmctlError, match="newer than this rlmctl"):
        Registry(path)


def test_run_index_records(tmp_path: Path) -> None:
    with Registry(tmp_path / "r.sqlite") as reg:
        reg.add_run("demo", "/shared/runs/demo", "inventory/local")
        with pytest.raises(RlmctlError, match="already exists"):
            reg.add_run("demo", "/x", "inv")
        processes = [
            {"host": "n1", "address": "10.0.0.1", "pid": 10, "pgid": 10},
            {"host": "n2", "address": "10.0.0.2", "pid": 20, "pgid": 20},
        ]
        reg.record_launch("demo", "launch", processes, "demo-1-abc", "10.0.0.1:29500")
        reg.record_launch("demo", "resume", processes[:1], "demo-2-def", "10.0.0.1:29500")
        assert [h["host"] for h in reg.hosts("demo")] == ["n1"]  # n2 was left out
        assert [launch["kind"] for launch in reg.launches("demo")] == ["launch", "resume"]
        assert "state" not in reg.run("demo")  # the state lives in the run directory
        with pytest.raises(RunNotFound, match="known runs: demo"):
            reg.run("nope")
        reg.remove_run("demo")
        assert reg.runs() == []


def test_schema_1_registry_is_upgraded_keeping_its_runs(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])
    db.execute("INSERT INTO runs VALUES ('old', '/r/old', 'inv', 'seed: 0', 'running', 1.0, 2.0)")
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    with pytest.raises(RlmctlError, match="rlmctl reindex"):
        Registry(path, readonly=True)  # a read command does not migrate
    with Registry(path) as reg:
        assert reg.runs() == [
            {"name": "old", "run_dir": "/r/old", "inventory": "inv", "created": 1.0}
        ]
    with Registry(path, readonly=True) as reg:
        assert reg.run("old")["run_dir"] == "/r/old"


def _add_runs(path: str, writer: int, count: int) -> None:
    with Registry(path) as reg:
        for index in range(count):
            reg.add_run(f"{writer}-{index}", f"/runs/{writer}-{index}", "inv")


def test_concurrent_writers_in_separate_processes_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "registry.sqlite")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_add_runs, args=(path, w, 100)) for w in range(3)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    with Registry(path) as reg:
        names = [r["name"] for r in reg.runs()]
    assert sorted(names) == sorted(f"{w}-{i}" for w in range(3) for i in range(100))
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
