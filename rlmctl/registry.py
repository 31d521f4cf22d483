"""The run registry: which runs exist, where, on which hosts, and what happened to them.

One SQLite file in the run root (`<rlm_shared_dir>/runs/registry.sqlite`) so that every operator
on every login node sees the same runs. Writers take the database lock up front
(`BEGIN IMMEDIATE`) and wait for each other (busy timeout) instead of failing half-way. The
rollback journal (not WAL) is used because WAL needs shared memory that network filesystems do
not provide; on filesystems with unreliable POSIX locks (some Lustre/NFS mounts) set
RLM_REGISTRY to a local path (docs/rlmctl.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlmctl.errors import RlmctlError, RunNotFound

REGISTRY_ENV = "RLM_REGISTRY"
BUSY_TIMEOUT_S = 60.0

# Each entry moves the schema from version i to i+1; never edit one that has shipped.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE runs (
        name TEXT PRIMARY KEY,
        run_dir TEXT NOT NULL,
        inventory TEXT NOT NULL,
        config TEXT NOT NULL,
        state TEXT NOT NULL,
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE hosts (
        run TEXT NOT NULL REFERENCES runs(name),
        host TEXT NOT NULL,
        address TEXT NOT NULL,
        launch_id INTEGER,
        pid INTEGER,
        pgid INTEGER,
        state TEXT NOT NULL,
        PRIMARY KEY (run, host)
    );
    CREATE TABLE launches (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run TEXT NOT NULL REFERENCES runs(name),
        time REAL NOT NULL,
        kind TEXT NOT NULL,
        hosts TEXT NOT NULL,
        rdzv_id TEXT NOT NULL,
        rdzv_endpoint TEXT NOT NULL
    );
    CREATE TABLE restarts (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run TEXT NOT NULL REFERENCES runs(name),
        time REAL NOT NULL,
        reason TEXT NOT NULL,
        exit_code INTEGER,
        step INTEGER,
        excluded TEXT NOT NULL
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run TEXT NOT NULL,
        time REAL NOT NULL,
        kind TEXT NOT NULL,
        host TEXT,
        message TEXT NOT NULL
    );
    CREATE INDEX events_by_run ON events(run, time);
    """,
]


def registry_path(runs_dir: Path) -> Path:
    override = os.environ.get(REGISTRY_ENV)
    return Path(override) if override else Path(runs_dir) / "registry.sqlite"


class Registry:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        except (OSError, sqlite3.Error) as error:
            raise RlmctlError(
                f"cannot open the run registry {self.path}: {error}; "
                f"check rlm_shared_dir or set {REGISTRY_ENV}=/local/path/registry.sqlite"
            ) from None
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA foreign_keys = ON")
        self.migrate()

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One writer at a time: the write lock is taken before anything is read."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @property
    def version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def migrate(self) -> None:
        with self.transaction() as db:
            # Re-read inside the lock: a concurrent rlmctl may have migrated meanwhile.
            current = db.execute("PRAGMA user_version").fetchone()[0]
            if current > len(MIGRATIONS):
                raise RlmctlError(
                    f"registry {self.path} has schema {current}, newer than this rlmctl knows "
                    f"({len(MIGRATIONS)}); upgrade rlmctl"
                )
            for version in range(current, len(MIGRATIONS)):
                for statement in MIGRATIONS[version].split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {version + 1}")

    # runs -----------------------------------------------------------------------------------------
    def add_run(self, name: str, run_dir: str, inventory: str, config: str) -> None:
        now = time.time()
        with self.transaction() as db:
            if db.execute("SELECT 1 FROM runs WHERE name = ?", (name,)).fetchone():
                raise RlmctlError(
                    f"run {name!r} already exists; pick another --name or `rlmctl resume {name}`"
                )
            db.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, 'launching', ?, ?)",
                (name, run_dir, inventory, config, now, now),
            )
            self._event(db, name, "registered", None, f"run dir {run_dir}")

    def run(self, name: str) -> dict[str, Any]:
        row = self._db.execute("SELECT * FROM runs WHERE name = ?", (name,)).fetchone()
        if row is None:
            known = [r["name"] for r in self._db.execute("SELECT name FROM runs ORDER BY created")]
            hint = f"known runs: {', '.join(known[-5:])}" if known else "no runs yet"
            raise RunNotFound(f"no run {name!r} in {self.path} ({hint}); see `rlmctl runs`")
        return dict(row)

    def runs(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._db.execute("SELECT * FROM runs ORDER BY created")]

    def set_state(self, name: str, state: str, message: str = "") -> None:
        with self.transaction() as db:
            db.execute(
                "UPDATE runs SET state = ?, updated = ? WHERE name = ?", (state, time.time(), name)
            )
            self._event(db, name, f"state:{state}", None, message or state)

    # launches and hosts ---------------------------------------------------------------------------
    def record_launch(
        self,
        run: str,
        kind: str,
        processes: list[dict[str, Any]],
        rdzv_id: str,
        rdzv_endpoint: str,
    ) -> int:
        """`processes`: [{host, address, pid, pgid}] of what was started."""
        now = time.time()
        with self.transaction() as db:
            cursor = db.execute(
                "INSERT INTO launches (run, time, kind, hosts, rdzv_id, rdzv_endpoint) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (
                    run,
                    now,
                    kind,
                    json.dumps([p["host"] for p in processes]),
                    rdzv_id,
                    rdzv_endpoint,
                ),
            )
            launch_id = cursor.lastrowid
            db.execute("UPDATE hosts SET state = 'replaced' WHERE run = ?", (run,))
            for p in processes:
                db.execute(
                    "INSERT OR REPLACE INTO hosts VALUES (?, ?, ?, ?, ?, ?, 'started')",
                    (run, p["host"], p["address"], launch_id, p.get("pid"), p.get("pgid")),
                )
            db.execute("UPDATE runs SET state = 'running', updated = ? WHERE name = ?", (now, run))
            self._event(db, run, kind, None, f"{len(processes)} hosts, rendezvous {rdzv_endpoint}")
        return launch_id

    def hosts(self, run: str, current_only: bool = True) -> list[dict[str, Any]]:
        query = "SELECT * FROM hosts WHERE run = ?"
        if current_only:
            query += " AND state != 'replaced'"
        return [dict(r) for r in self._db.execute(query + " ORDER BY rowid", (run,))]

    def launches(self, run: str) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM launches WHERE run = ? ORDER BY id", (run,))
        return [dict(r) | {"hosts": json.loads(r["hosts"])} for r in rows]

    def record_restart(
        self, run: str, reason: str, exit_code: int | None, step: int | None, excluded: list[str]
    ) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO restarts (run, time, reason, exit_code, step, excluded) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (run, time.time(), reason, exit_code, step, json.dumps(excluded)),
            )
            self._event(db, run, "restart", None, reason)

    def restarts(self, run: str) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM restarts WHERE run = ? ORDER BY id", (run,))
        return [dict(r) | {"excluded": json.loads(r["excluded"])} for r in rows]

    # events ---------------------------------------------------------------------------------------
    def event(self, run: str, kind: str, message: str, host: str | None = None) -> None:
        with self.transaction() as db:
            self._event(db, run, kind, host, message)

    @staticmethod
    def _event(db: sqlite3.Connection, run: str, kind: str, host: str | None, message: str) -> None:
        db.execute(
            "INSERT INTO events (run, time, kind, host, message) VALUES (?, ?, ?, ?, ?)",
            (run, time.time(), kind, host, message),
        )

    def events(self, run: str) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM events WHERE run = ? ORDER BY id", (run,))
        return [dict(r) for r in rows]
