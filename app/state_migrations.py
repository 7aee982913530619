"""Schema versions of the run database (``state/runs.sqlite``) and the migrations between them.

The version is SQLite's ``PRAGMA user_version``. :data:`MIGRATIONS` is append-only: migration ``i`` takes a
database from version ``i`` to ``i + 1``, and each runs in its own ``BEGIN IMMEDIATE`` transaction that also sets
the new version, so a kill or an error leaves the database at the last version that committed (nothing half
done). The version is read again inside each transaction: two processes opening an old database at once migrate
it once. A database newer than :data:`SCHEMA_VERSION` is refused before anything is written (never a downgrade).

* **0 → 1** ``m001_slots``: the layout of the first releases, one row per scheduled slot (then named ``runs``)
  and ``meta`` (the run counter). Those releases set no ``user_version``: a database at 0 that has these tables
  is at version 1 already, so opening it runs only the migrations after it (nothing is written before them).
* **1 → 2** ``m002_run_ledger``: the ledger of runs. The slot table becomes ``slots``; a new ``runs`` table holds
  one row per run (ad-hoc or scheduled): its id, ``running``/``exported``, the fingerprint of the inputs it
  started with (resume rule), start and finish times, bundle path, the promotion decision at export and the slot
  it ran for. Every ``runs/<id>/state.json`` the release before wrote is imported, in the order they were last
  written (their file times: the order the resume rule used), keeping id, status, fingerprint, started_at and
  bundle. The files stay where they are, unread from then on: the import is part of the database transaction and
  the files are its input, so a failed or interrupted migration has nothing on disk to undo and the files remain
  the record of what was imported.
* **2 → 3** ``m003_api``: the training API's records (``app.api``): ``api_models`` (one row per trained model: its
  owner's key hash, LoRA configuration, op-chain head and op count), ``api_futures`` (every accepted operation: its
  owner, session, model, kind, status and, once done, the result bytes and their content type) and
  ``api_checkpoints`` (every saved state: its ``tinker://`` path, files and export bundle).
* **3 → 4** ``m004_api_storage``: what bounds the API's storage: per saved state its expiry (``expires_at``, UTC,
  NULL: none), when its sealed files were removed (``removed_at``, NULL: still there) and the bytes its sealed state
  and its export bundle hold (``state_bytes``, ``bundle_bytes``; 0 for states saved before). New columns only.
* **4 → 5** ``m005_api_external``: ``api_checkpoints`` also holds checkpoints of kind ``external`` (an export bundle
  to download, ``save_weights_external``). SQLite cannot widen a CHECK constraint, so the table is built again with
  the same columns and every row copied as it was.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.errors import StateError

Migration = Callable[[sqlite3.Connection, Path], None]
MIGRATIONS: list[Migration] = []
migration = MIGRATIONS.append
LEGACY_STATE = "state.json"  # runs/<id>/state.json: the per-run record before schema version 2
_RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")  # attestation.bundle.manifest.RUN_ID_PATTERN
_DATE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
RUN_STATUSES = ("running", "exported")


@migration
def m001_slots(conn: sqlite3.Connection, out: Path) -> None:
    """The slot table and the run counter, as the first releases created them."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS runs (id TEXT PRIMARY KEY, slot TEXT NOT NULL UNIQUE, slot_time TEXT NOT NULL,"
        " status TEXT NOT NULL CHECK (status IN ('pending','running','succeeded','failed','skipped')),"
        " reason TEXT, attempts INTEGER NOT NULL DEFAULT 0, next_attempt_at TEXT, started_at TEXT,"
        " finished_at TEXT, metrics TEXT, bundle TEXT, audit_head TEXT, counter INTEGER)")
    conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


@migration
def m002_run_ledger(conn: sqlite3.Connection, out: Path) -> None:
    """Slots move to ``slots``; ``runs`` becomes the ledger of runs, filled from ``runs/*/state.json``."""
    conn.execute("ALTER TABLE runs RENAME TO slots")
    conn.execute(
        "CREATE TABLE runs (id TEXT PRIMARY KEY, status TEXT NOT NULL CHECK (status IN ('running','exported')),"
        " fingerprint TEXT NOT NULL, started_at TEXT NOT NULL, finished_at TEXT, bundle TEXT,"
        " promoted INTEGER CHECK (promoted IN (0, 1)), slot_id TEXT, seq INTEGER NOT NULL UNIQUE)")
    slots = {row[0] for row in conn.execute("SELECT id FROM slots")}
    for seq, run in enumerate(legacy_runs(out), start=1):
        conn.execute("INSERT INTO runs (id, status, fingerprint, started_at, bundle, promoted, slot_id, seq)"
                     " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                     (run["run_id"], run["status"], run["fingerprint"], run["started_at"], run["bundle"],
                      run["promoted"], run["run_id"] if run["run_id"] in slots else None, seq))


@migration
def m003_api(conn: sqlite3.Connection, out: Path) -> None:
    """The training API's models, futures and checkpoints (new tables; nothing existing changes)."""
    conn.execute("CREATE TABLE api_models (id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT NOT NULL,"
                 " base_model TEXT NOT NULL, lora TEXT NOT NULL, dp TEXT, op_head TEXT NOT NULL, ops INTEGER NOT NULL,"
                 " created_at TEXT NOT NULL)")
    conn.execute("CREATE TABLE api_futures (id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT NOT NULL,"
                 " model_id TEXT, kind TEXT NOT NULL, status TEXT NOT NULL CHECK (status IN ('pending','done','failed')),"
                 " content_type TEXT, result BLOB, created_at TEXT NOT NULL, finished_at TEXT)")
    conn.execute("CREATE INDEX api_futures_pending ON api_futures (status, session_id)")
    conn.execute("CREATE TABLE api_checkpoints (path TEXT PRIMARY KEY, owner TEXT NOT NULL, model_id TEXT NOT NULL,"
                 " kind TEXT NOT NULL CHECK (kind IN ('training','sampler')), name TEXT NOT NULL, dir TEXT NOT NULL,"
                 " bundle TEXT, op_head TEXT NOT NULL, ops INTEGER NOT NULL, lora TEXT NOT NULL,"
                 " created_at TEXT NOT NULL)")


@migration
def m004_api_storage(conn: sqlite3.Connection, out: Path) -> None:
    """Expiry and size of each saved state of the training API (new columns; existing rows: no expiry, size 0)."""
    for column in ("expires_at TEXT", "removed_at TEXT", "state_bytes INTEGER NOT NULL DEFAULT 0",
                   "bundle_bytes INTEGER NOT NULL DEFAULT 0"):
        conn.execute(f"ALTER TABLE api_checkpoints ADD COLUMN {column}")


@migration
def m005_api_external(conn: sqlite3.Connection, out: Path) -> None:
    """Checkpoints of kind ``external`` (the table again, with the wider CHECK; every row kept as it was)."""
    columns = ("path, owner, model_id, kind, name, dir, bundle, op_head, ops, lora, created_at, expires_at, removed_at,"
               " state_bytes, bundle_bytes")
    conn.execute("ALTER TABLE api_checkpoints RENAME TO api_checkpoints_m004")
    conn.execute("CREATE TABLE api_checkpoints (path TEXT PRIMARY KEY, owner TEXT NOT NULL, model_id TEXT NOT NULL,"
                 " kind TEXT NOT NULL CHECK (kind IN ('training','sampler','external')), name TEXT NOT NULL,"
                 " dir TEXT NOT NULL, bundle TEXT, op_head TEXT NOT NULL, ops INTEGER NOT NULL, lora TEXT NOT NULL,"
                 " created_at TEXT NOT NULL, expires_at TEXT, removed_at TEXT, state_bytes INTEGER NOT NULL DEFAULT 0,"
                 " bundle_bytes INTEGER NOT NULL DEFAULT 0)")
    conn.execute(f"INSERT INTO api_checkpoints ({columns}) SELECT {columns} FROM api_checkpoints_m004")
    conn.execute("DROP TABLE api_checkpoints_m004")


SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection, out: Path, path: Path) -> int:
    """Bring an open database to :data:`SCHEMA_VERSION`; returns the version it had.

    Raises:
        StateError: the database is newer than this code (nothing written), a legacy file cannot be imported,
            or SQLite fails (the database stays at the last version that committed).
    """
    found = version(conn, path)
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            current = version(conn, path)  # again under the write lock: another process may have migrated it
            if current == SCHEMA_VERSION:
                conn.execute("ROLLBACK")
                return found
            problems = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:  # never carry damage into a new version
                raise sqlite3.DatabaseError(f"quick_check: {problems[0]}")
            MIGRATIONS[current](conn, out)
            conn.execute(f"PRAGMA user_version = {current + 1}")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")


def version(conn: sqlite3.Connection, path: Path) -> int:
    """The schema version; refuses one this code does not know.

    Raises:
        StateError: newer than :data:`SCHEMA_VERSION` (written by a later release) or negative.
    """
    found = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if found == 0 and conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone():
        found = 1  # written by a release before schema versions (the slot table was named runs)
    if found > SCHEMA_VERSION or found < 0:
        raise StateError(f"run database {path} has schema version {found}; this cvm-tune knows versions up to "
                         f"{SCHEMA_VERSION}",
                         fix="run the cvm-tune release that wrote it (or a later one); the database is never "
                         "downgraded")
    return found


def legacy_runs(out: Path) -> list[dict[str, Any]]:
    """The runs recorded by ``runs/<id>/state.json`` files (schema version < 2), oldest write first.

    Raises:
        StateError: a file that is not such a record (it is named; nothing is imported until it is fixed or moved).
    """
    found = []
    runs = Path(out) / "runs"
    for path in sorted(runs.glob(f"*/{LEGACY_STATE}")) if runs.is_dir() else ():
        try:
            mtime = os.stat(path).st_mtime_ns
            s = json.loads(path.read_bytes())
            ok = (isinstance(s, dict) and s.get("run_id") == path.parent.name and _RUN_ID.fullmatch(s["run_id"])
                  and s.get("status") in RUN_STATUSES and isinstance(s.get("fingerprint"), str)
                  and isinstance(s.get("started_at"), str) and _DATE.fullmatch(s["started_at"])
                  and isinstance(s.get("bundle"), (str, type(None))))
        except (OSError, ValueError) as exc:
            raise _unreadable(path, f"{type(exc).__name__}: {exc}") from exc
        if not ok:
            raise _unreadable(path, "not a run record (run_id, status, fingerprint, started_at)")
        promoted = _promotion(Path(out) / "exports" / s["run_id"]) if s["status"] == "exported" else None
        found.append(({"run_id": s["run_id"], "status": s["status"], "fingerprint": s["fingerprint"],
                       "started_at": s["started_at"], "bundle": s.get("bundle"), "promoted": promoted},
                      (mtime, s["started_at"], s["run_id"])))
    return [run for run, _key in sorted(found, key=lambda item: item[1])]


def _promotion(bundle: Path) -> int | None:
    """The promotion decision an exported bundle's manifest records (1/0), or None when it cannot be read."""
    try:
        ev = json.loads((bundle / "manifest.json").read_bytes()).get("evaluation")
        return 1 if ev is None or bool(ev["promote"]) else 0
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _unreadable(path: Path, why: str) -> StateError:
    return StateError(f"cannot import {path} into the run database: {why}",
                      fix=f"restore that file, or move it out of {path.parent.parent} to leave that run out of the "
                      "history; then start again (the database was not changed)")


def read_runs(out: Path) -> list[tuple[str, str, str]]:
    """(run id, status, started_at) of every run, by run id, without writing anything (a read-only mount):
    from the ledger; on a volume whose database a release before it wrote (not migrated yet), or that has none,
    the runs :func:`m002_run_ledger` will import.

    Raises:
        StateError: the database is damaged or newer than this code, or a legacy record is unreadable.
    """
    path = Path(out) / "state" / "runs.sqlite"
    rows: list[tuple[str, str, str]] | None = None
    if path.is_file():
        try:
            conn = _read_only(path)
            try:
                if version(conn, path) >= 2:
                    rows = [tuple(r) for r in conn.execute("SELECT id, status, started_at FROM runs").fetchall()]
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StateError(f"run database {path} is damaged: {type(exc).__name__}: {exc}",
                             fix="restore state/runs.sqlite from a backup") from exc
    if rows is None:
        rows = [(r["run_id"], r["status"], r["started_at"]) for r in legacy_runs(out)]
    return sorted(rows)


def _read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection. WAL needs the ``-shm`` file: it exists while a writer has the database open; when
    none has (no ``-wal`` left either) and it cannot be created (read-only mount), the file is the whole database."""
    uri = "file:" + urllib.parse.quote(str(path))
    conn = sqlite3.connect(uri + "?mode=ro", uri=True, timeout=30)
    try:
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError:
        conn.close()
        if Path(f"{path}-wal").exists():
            raise
        return sqlite3.connect(uri + "?mode=ro&immutable=1", uri=True)
