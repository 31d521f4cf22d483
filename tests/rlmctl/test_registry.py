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
    assert {"runs", "hosts", "launches", "restarts", "events"} <= tables


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


def test_run_lifecycle_records(tmp_path: Path) -> None:
    with Registry(tmp_path / "r.sqlite") as reg:
        reg.add_run("demo", "/shared/runs/demo", "inventory/local", "seed: 0\n")
        with pytest.raises(RlmctlError, match="already exists"):
            reg.add_run("demo", "/x", "inv", "")
        processes = [
            {"host": "n1", "address": "10.0.0.1", "pid": 10, "pgid": 10},
            {"host": "n2", "address": "10.0.0.2", "pid": 20, "pgid": 20},
        ]
        reg.record_launch("demo", "launch", processes, "demo-1-abc", "10.0.0.1:29500")
        reg.record_restart("demo", "trainer process gone on n2", 1, 120, ["n2"])
        reg.record_launch("demo", "resume", processes[:1], "demo-2-def", "10.0.0.1:29500")
        assert [h["host"] for h in reg.hosts("demo")] == ["n1"]  # n2 was left out
        assert [launch["kind"] for launch in reg.launches("demo")] == ["launch", "resume"]
        assert reg.restarts("demo")[0]["excluded"] == ["n2"]
        assert reg.run("demo")["state"] == "running"
        kinds = [e["kind"] for e in reg.events("demo")]
        assert kinds == ["registered", "launch", "restart", "resume"]
        with pytest.raises(RunNotFound, match="known runs: demo"):
            reg.run("nope")


def _write_events(path: str, writer: int, count: int) -> None:
    with Registry(path) as reg:
        for index in range(count):
            reg.event("shared", "test", f"{writer}-{index}")


def test_concurrent_writers_in_separate_processes_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "registry.sqlite")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_events, args=(path, w, 150)) for w in range(3)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
        assert process.exitcode == 0
    with Registry(path) as reg:
        messages = [e["message"] for e in reg.events("shared")]
    assert sorted(messages) == sorted(f"{w}-{i}" for w in range(3) for i in range(150))
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_registry_path_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert registry_module.registry_path(tmp_path) == tmp_path / "registry.sqlite"
    monkeypatch.setenv("RLM_REGISTRY", str(tmp_path / "local.sqlite"))
    assert registry_module.registry_path(Path("/lustre/runs")) == tmp_path / "local.sqlite"
