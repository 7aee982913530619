"""Service state on the output volume: the run lock, the run database, the heartbeat, the rollback anchor.

* the run lock — ``fcntl.flock`` (exclusive, non-blocking) on the output directory's own fd, so
  deleting or replacing any file cannot side-step it. The kernel drops it when the holder dies, so
  a crash (kill -9, power loss) leaves nothing to clean up. ``state/lock`` holds the pid (for people).
* ``state/runs.sqlite`` — one row per scheduled slot (``RunDB``). SQLite commits are atomic and
  durable (``synchronous=FULL``), so a kill at any point leaves the last committed state.
* ``state/heartbeat.json`` — written atomically every service tick and training step.
* ``state.rollback_anchor`` (optional, outside the volume) — the run counter and audit-chain head,
  published after every run; a volume restored behind it is refused (threats-and-faults case 41).

Status values: ``pending`` (due, not started or stopped by SIGTERM), ``running``, ``succeeded``,
``failed`` (``next_attempt_at`` set = a retry is scheduled; unset = final), ``skipped`` (+ reason).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.errors import ConfigError, StateError
from app.fsutil import atomic_write_bytes

STATUSES = ("pending", "running", "succeeded", "failed", "skipped")
HEARTBEAT_SCHEMA = "cvm-tune/heartbeat/v1"
ANCHOR_SCHEMA = "cvm-tune/rollback-anchor/v1"
_COLUMNS = ("id", "slot", "slot_time", "status", "reason", "attempts", "next_attempt_at", "started_at", "finished_at",
            "metrics", "bundle", "audit_head", "counter")


def state_dir(out: Path) -> Path:
    """``<output>/state`` (created).

    Raises:
        ConfigError: ``out`` exists and is not a directory.
    """
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"output.dir {out} is not a directory", fix="point output.dir at a directory")
    path = Path(out) / "state"
    path.mkdir(parents=True, exist_ok=True)
    return path


def iso(t: datetime) -> str:
    """UTC ISO-8601 with a ``Z`` (seconds precision)."""
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: str) -> datetime:
    """Inverse of :func:`iso`."""
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


class Locked(Exception):
    """Another process or thread holds the output volume's run lock."""


@contextlib.contextmanager
def run_lock(out: Path) -> Iterator[Path]:
    """Hold the output volume's exclusive lock for the duration of the block.

    The flock is taken on the output directory itself (its open fd), not on a file inside it: a
    stray ``rm state/lock`` cannot hand a second process a fresh lock. ``state/lock`` only records
    the holder's pid for people. Each call opens its own file description, so a second thread of the
    same process is refused exactly like a second process.

    Raises:
        Locked: somebody else holds it (the caller logs ``skipped: locked`` and exits 0).
    """
    out = Path(out)
    info = state_dir(out) / "lock"
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Locked(str(out)) from None
        atomic_write_bytes(info, f"{os.getpid()}\n".encode())  # informational only: the lock is the flock
        yield out
    finally:
        os.close(fd)  # releases the flock


@dataclass(frozen=True)
class RunRow:
    """One row of the run database."""

    id: str
    slot: str
    slot_time: str
    status: str
    reason: str | None
    attempts: int
    next_attempt_at: str | None
    started_at: str | None
    finished_at: str | None
    metrics: dict[str, Any] | None
    bundle: str | None
    audit_head: str | None
    counter: int | None

    @property
    def final(self) -> bool:
        """Nothing more will happen for this slot."""
        return self.status in ("succeeded", "skipped") or (self.status == "failed" and self.next_attempt_at is None)


class RunDB:
    """The run database (``state/runs.sqlite``). One connection per instance; short transactions."""

    def __init__(self, out: Path) -> None:
        self.path = state_dir(out) / "runs.sqlite"
        try:
            self.conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            with self._tx():
                self.conn.execute(
                    "CREATE TABLE IF NOT EXISTS runs (id TEXT PRIMARY KEY, slot TEXT NOT NULL UNIQUE, slot_time TEXT NOT NULL,"
                    " status TEXT NOT NULL CHECK (status IN ('pending','running','succeeded','failed','skipped')),"
                    " reason TEXT, attempts INTEGER NOT NULL DEFAULT 0, next_attempt_at TEXT, started_at TEXT,"
                    " finished_at TEXT, metrics TEXT, bundle TEXT, audit_head TEXT, counter INTEGER)")
                self.conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        except sqlite3.Error as exc:
            raise StateError(f"run database {self.path} is unusable: {exc}",
                             fix="check the output volume; restore state/runs.sqlite from a backup") from exc

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()

    @classmethod
    def recent_if_present(cls, out: Path, limit: int) -> list[RunRow]:
        """Read-only callers (``status``): the newest rows, or none when there is no database; creates nothing.

        Raises:
            ConfigError: ``out`` exists but is not a directory.
            StateError: the database is damaged.
        """
        if Path(out).exists() and not Path(out).is_dir():
            raise ConfigError(f"output.dir {out} is not a directory", fix="point output.dir at a directory")
        if not (Path(out) / "state" / "runs.sqlite").is_file():
            return []
        db = cls(out)
        try:
            return db.recent(limit)
        finally:
            db.close()

    @contextlib.contextmanager
    def _damaged(self) -> Iterator[None]:
        """A flipped page or truncated file surfaces on read: a StateError, not a crash."""
        try:
            yield
        except (sqlite3.Error, ValueError) as exc:
            raise StateError(f"run database {self.path} is unusable: {exc}",
                             fix="check the output volume; restore state/runs.sqlite from a backup") from exc

    def get(self, run_id: str) -> RunRow | None:
        with self._damaged():
            cur = self.conn.execute(f"SELECT {','.join(_COLUMNS)} FROM runs WHERE id = ?", (run_id,))
            row = cur.fetchone()
        return _row(row) if row else None

    def recent(self, limit: int = 10) -> list[RunRow]:
        """Newest slots first."""
        with self._damaged():
            cur = self.conn.execute(f"SELECT {','.join(_COLUMNS)} FROM runs ORDER BY slot DESC LIMIT ?", (limit,))
            return [_row(r) for r in cur.fetchall()]

    def newest_slot(self) -> str | None:
        return self.conn.execute("SELECT MAX(slot) FROM runs").fetchone()[0]

    def unfinished(self) -> list[RunRow]:
        """Rows that are not final (pending, running, failed with a retry scheduled), oldest first."""
        return [r for r in reversed(self.recent(1000)) if not r.final]

    def counter(self) -> int:
        row = self.conn.execute("SELECT value FROM meta WHERE key = 'counter'").fetchone()
        return int(row[0]) if row else 0

    def upsert(self, run_id: str, *, slot: str, slot_time: str, **fields: Any) -> RunRow:
        """Create or update a row; ``metrics`` is stored as JSON. Finishing states bump the run counter."""
        bad = set(fields) - set(_COLUMNS)
        if bad or fields.get("status", "pending") not in STATUSES:
            raise StateError(f"bad run update {sorted(bad) or fields.get('status')}")
        if "metrics" in fields and fields["metrics"] is not None:
            fields["metrics"] = json.dumps(fields["metrics"], sort_keys=True)
        with self._tx():
            self.conn.execute("INSERT OR IGNORE INTO runs (id, slot, slot_time, status) VALUES (?, ?, ?, 'pending')",
                              (run_id, slot, slot_time))
            if fields.get("status") in ("succeeded", "failed", "skipped"):
                counter = self.counter() + 1
                self.conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('counter', ?)", (str(counter),))
                fields["counter"] = counter
            if fields:
                cols = ", ".join(f"{k} = ?" for k in fields)
                self.conn.execute(f"UPDATE runs SET {cols} WHERE id = ?", (*fields.values(), run_id))
        row = self.get(run_id)
        if row is None:
            raise StateError(f"run {run_id} vanished from {self.path}")
        return row


def _row(values: tuple[Any, ...]) -> RunRow:
    data = dict(zip(_COLUMNS, values, strict=True))
    data["metrics"] = json.loads(data["metrics"]) if data["metrics"] else None
    return RunRow(**data)


def write_heartbeat(out: Path, **fields: Any) -> None:
    """Atomically replace ``state/heartbeat.json`` (no data: state, run id, step, times)."""
    now = time.time()
    body = {"schema": HEARTBEAT_SCHEMA, "unix": round(now, 3), "time": iso(datetime.fromtimestamp(now, timezone.utc)),
            "pid": os.getpid(), **fields}
    atomic_write_bytes(state_dir(out) / "heartbeat.json", json.dumps(body, sort_keys=True).encode() + b"\n")


def read_heartbeat(out: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(out) / "state" / "heartbeat.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == HEARTBEAT_SCHEMA else None


class RollbackDetected(StateError):
    """The output volume is older than the state published to the rollback anchor."""

    default_fix = ("the output volume was restored to an older snapshot (or the anchor belongs to another volume): "
                   "restore the newest volume; nothing is exported until local state catches up with the anchor")


def check_anchor(anchor: Path | None, *, counter: int, audit_hashes: set[str]) -> None:
    """Compare local state with the anchor (no anchor configured or written yet: nothing to compare).

    Raises:
        RollbackDetected: the anchor's counter is ahead of ours, or its audit head is not in our chain.
        StateError: the anchor exists but cannot be read.
    """
    if anchor is None or not Path(anchor).exists():
        return
    try:
        body = json.loads(Path(anchor).read_text())
        published, head = int(body["counter"]), str(body["audit_head"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StateError(f"rollback anchor {anchor} is unreadable", fix="restore it, or remove it deliberately") from exc
    if published > counter:
        raise RollbackDetected(f"rollback detected: the anchor has run counter {published}, the volume {counter}")
    if head != "0" * 64 and head not in audit_hashes:
        raise RollbackDetected(f"rollback detected: the anchored audit head {head[:16]}… is not in the local chain")


def publish_anchor(anchor: Path | None, *, counter: int, audit_head: str) -> None:
    """Write the anchor atomically (after a run finished)."""
    if anchor is None:
        return
    body = {"schema": ANCHOR_SCHEMA, "counter": counter, "audit_head": audit_head, "time": iso(datetime.now(timezone.utc))}
    Path(anchor).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(anchor), json.dumps(body, sort_keys=True).encode() + b"\n")
