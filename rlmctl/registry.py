"""The run registry: an index from run names to run directories and the hosts they ran on.

A run's state, events and restarts live in its run directory (runcontract.rundir), not here: the
registry can be rebuilt from the run directories at any time (`rlmctl reindex`), and a read
command opens it read-only. One SQLite file in the run root
(`<rlm_shared_dir>/runs/registry.sqlite`) so that every operator on every login node sees the same
runs. Writers take the database lock up front (`BEGIN IMMEDIATE`) and wait for each other (busy
timeout) instead of failing half-way. The rollback journal (not WAL) is used because WAL needs
shared memory that network filesystems do not provide; on filesystems with unreliable POSIX locks
(some Lustre/NFS mounts) set RLM_REGISTRY to a local path (docs/rlmctl.md).
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
    # 2: an index, not a second state machine: state, events and restarts live in run dirs.
    """
    DROP INDEX events_by_run;
    DROP TABLE events;
    DROP TABLE restarts;
    ALTER TABLE runs DROP COLUMN state;
    ALTER TABLE runs DROP COLUMN updated;
    ALTER TABLE runs DROP COLUMN config;
    """,
]
REINDEX_HINT = "rlmctl reindex"


def registry_path(runs_dir: Path) -> Path:
    override = os.environ.get(REGISTRY_ENV)
    return Path(override) if override else Path(runs_dir) / "registry.sqlite"


def _unreadable(path: Path, error: Exception) -> RlmctlError:
    return RlmctlError(
        f"run registry {path} is not a readable SQLite database ({error}); it is only an index: "
        f"move it aside (mv {path} {path}.bad) and rebuild it with `{REINDEX_HINT}`"
    )


class Registry:
    """`readonly`: for commands that only look; never creates, migrates or writes the file."""

    def __init__(self, path: Path | str, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        try:
            if readonly:
                if not self.path.is_file():
                    raise RunNotFound(
                        f"no run registry at {self.path} yet: no run was launched with this "
                        f"rlm_shared_dir; launch one or `{REINDEX_HINT}`"
                    )
                uri = f"{self.path.resolve().as_uri()}?mode=ro"
                self._db = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        except (OSError, sqlite3.Error) as error:
            raise RlmctlError(
                f"cannot open the run registry {self.path}: {error}; "
                f"check rlm_shared_dir or set {REGISTRY_ENV}=/local/path/registry.sqlite"
            ) from None
        self._db.row_factory = sqlite3.Row
        try:
            if readonly:
                self._check_version()
            else:
                self._db.execute("PRAGMA foreign_keys = ON")
                self.migrate()
        except sqlite3.DatabaseError as error:
            self._db.close()
            raise _unreadable(self.path, error) from None

    def _check_version(self) -> None:
        version = self.version
        if version != len(MIGRATIONS):
            newer = version > len(MIGRATIONS)
            raise RlmctlError(
                f"registry {self.path} has schema {version}, this rlmctl reads {len(MIGRATIONS)}; "
                + ("upgrade rlmctl" if newer else f"upgrade it once with `{REINDEX_HINT}`")
            )

    def close(self) -> None:
        self._db.close()

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as error:
            raise _unreadable(self.path, error) from None

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
    def add_run(
        self, name: str, run_dir: str, inventory: str, created: float | None = None
    ) -> None:
        with self.transaction() as db:
            if db.execute("SELECT 1 FROM runs WHERE name = ?", (name,)).fetchone():
                raise RlmctlError(
                    f"run {name!r} already exists; pick another --name or `rlmctl resume {name}`"
                )
            db.execute(
                "INSERT INTO runs (name, run_dir, inventory, created) VALUES (?, ?, ?, ?)",
                (name, run_dir, inventory, created or time.time()),
            )

    def remove_run(self, name: str) -> None:
        """Forget a run that never started anywhere (a launch interrupted before its start)."""
        with self.transaction() as db:
            db.execute("DELETE FROM hosts WHERE run = ?", (name,))
            db.execute("DELETE FROM launches WHERE run = ?", (name,))
            db.execute("DELETE FROM runs WHERE name = ?", (name,))

    def run(self, name: str) -> dict[str, Any]:
        rows = self._query("SELECT * FROM runs WHERE name = ?", (name,))
        if not rows:
            known = [r["name"] for r in self._query("SELECT name FROM runs ORDER BY created")]
            hint = f"known runs: {', '.join(known[-5:])}" if known else "no runs yet"
            raise RunNotFound(f"no run {name!r} in {self.path} ({hint}); see `rlmctl runs`")
        return dict(rows[0])

    def runs(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._query("SELECT * FROM runs ORDER BY created")]

    # launches and hosts ---------------------------------------------------------------------------
    def record_launch(
        self,
        run: str,
        kind: str,
        processes: list[dict[str, Any]],
        rdzv_id: str,
        rdzv_endpoint: str,
        when: float | None = None,
    ) -> int:
        """`processes`: [{host, address, pid, pgid}] of what was started."""
        now = when or time.time()
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
        assert launch_id is not None
        return launch_id

    def complete_launch(
        self,
        launch_id: int,
        processes: list[dict[str, Any]],
        rdzv_id: str,
        rdzv_endpoint: str,
    ) -> None:
        """What a launch recorded beforehand (`record_launch` with the hosts it goes to) did
        start: each host's PID/PGID, the rendezvous id (or Slurm job id) and endpoint."""
        with self.transaction() as db:
            db.execute(
                "UPDATE launches SET rdzv_id = ?, rdzv_endpoint = ? WHERE id = ?",
                (rdzv_id, rdzv_endpoint, launch_id),
            )
            for p in processes:
                db.execute(
                    "UPDATE hosts SET pid = ?, pgid = ? WHERE launch_id = ? AND host = ?",
                    (p.get("pid"), p.get("pgid"), launch_id, p["host"]),
                )

    def hosts(self, run: str, current_only: bool = True) -> list[dict[str, Any]]:
        query = "SELECT * FROM hosts WHERE run = ?"
        if current_only:
            query += " AND state != 'replaced'"
        return [dict(r) for r in self._query(query + " ORDER BY rowid", (run,))]

    def launches(self, run: str) -> list[dict[str, Any]]:
        rows = self._query("SELECT * FROM launches WHERE run = ? ORDER BY id", (run,))
        return [dict(r) | {"hosts": json.loads(r["hosts"])} for r in rows]


def reindex(registry: Registry, runs_root: Path) -> list[str]:
    """Add every run directory under `runs_root` that the registry lacks, with the hosts of its
    newest launch (hosts/<host>/launch.json); the names added."""
    from runcontract.rundir import RunDir, read_json

    known = {r["name"] for r in registry.runs()}
    added = []
    for path in sorted(p for p in Path(runs_root).iterdir() if (p / "config.yaml").is_file()):
        run = RunDir(path)
        if run.name in known:
            continue
        record = read_json(run.run_record_path) or {}
        created = record.get("created") or run.config_path.stat().st_mtime
        registry.add_run(run.name, str(run.path), str(record.get("inventory", "")), created)
        found = [
            (p.stat().st_mtime, read_json(p)) for p in sorted(run.path.glob("hosts/*/launch.json"))
        ]
        launches = [(t, r) for t, r in found if isinstance(r, dict) and "host" in r]
        if launches:
            when, newest = max(launches, key=lambda item: item[0])
            hosts = [r for _, r in launches if r.get("rdzv_id") == newest.get("rdzv_id")]
            registry.record_launch(
                run.name,
                str(newest.get("kind", "launch")),
                hosts,
                str(newest.get("rdzv_id", "")),
                str(newest.get("rdzv_endpoint", "")),
                when,
            )
        added.append(run.name)
    return added
