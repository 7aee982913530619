"""Service state on the output volume: the run lock, the run database, the heartbeat, the rollback anchor.

* ``state/lock`` — ``fcntl.flock`` (exclusive, non-blocking). The kernel drops it when the holder
  dies, so a crash (kill -9, power loss) leaves nothing to clean up; the file itself stays.
* ``state/runs.sqlite`` — the one record of runs and slots (``RunDB``): ``runs``, one row per run (ad-hoc or
  scheduled: status, the inputs' fingerprint, times, bundle, promotion, slot), and ``slots``, one row per scheduled
  slot. Schema versions and migrations: :mod:`app.state_migrations`. SQLite commits are atomic and durable
  (``synchronous=FULL``), so a kill at any point leaves the last committed state. Writers hold the run lock.
* ``state/heartbeat.json`` — written atomically every service tick and training step.
* ``state.rollback_anchor`` (optional, outside the volume) — the run counter and audit-chain head,
  published after every run; a volume restored behind it is refused (threats-and-faults case 41).

Slot status values: ``pending`` (due, not started or stopped by SIGTERM), ``running``, ``succeeded``,
``failed`` (``next_attempt_at`` set = a retry is scheduled; unset = final), ``skipped`` (+ reason). Run status
values: ``running`` (started, resumable with the same inputs), ``exported``.
"""

from __future__ import annotations

import contextlib
import functools
import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from app.errors import ConfigError, StateError
from app.fsutil import atomic_write_bytes
from app.state_migrations import LEGACY_STATE, migrate, read_runs, version

T = TypeVar("T")
STATUSES = ("pending", "running", "succeeded", "failed", "skipped")
HEARTBEAT_SCHEMA = "cvm-tune/heartbeat/v1"
ANCHOR_SCHEMA = "cvm-tune/rollback-anchor/v1"
_COLUMNS = ("id", "slot", "slot_time", "status", "reason", "attempts", "next_attempt_at", "started_at", "finished_at",
            "metrics", "bundle", "audit_head", "counter")
_RUN_COLUMNS = ("id", "status", "fingerprint", "started_at", "finished_at", "bundle", "promoted", "slot_id")


def state_dir(out: Path) -> Path:
    """``<output>/state`` (created).

    Raises:
        ConfigError: ``output.dir`` (or its ``state``) exists and is not a directory.
    """
    check_output_dir(out)
    path = Path(out) / "state"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ConfigError(f"{path} exists and is not a directory", fix="point output.dir at a directory of its own") from exc
    return path


def check_output_dir(out: Path) -> None:
    """``output.dir`` must be a directory or not exist yet.

    Raises:
        ConfigError: it is a file (or another non-directory).
    """
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"output.dir {out} is not a directory", fix="point output.dir at a directory (created if missing)")


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

    The lock is an ``flock`` on the output directory itself, not on a file inside it: deleting
    ``state/lock`` (or all of ``state/``) cannot hand a second process a fresh lock while a run holds
    it. Each call opens its own file description, so a second thread of the same process is refused
    exactly like a second process. ``state/lock`` only records the holder's pid, for people.

    Raises:
        Locked: somebody else holds it (``serve`` logs ``skipped: locked``; others use :func:`claim_volume`).
    """
    info = state_dir(out) / "lock"
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Locked(str(out)) from None
        with contextlib.suppress(OSError):  # informational only: the lock is the flock on the directory
            atomic_write_bytes(info, f"{os.getpid()}\n".encode())
        yield info
    finally:
        os.close(fd)  # releases the flock


def claim_volume(stack: contextlib.ExitStack, out: Path) -> None:
    """Hold ``out``'s run lock (:func:`run_lock`) until ``stack`` closes, for a process that writes the volume's audit
    chain and ``exports/`` outside the nightly scheduler (the training API, a federated client's round): one writer
    per volume; a nightly ``serve`` on it meanwhile says ``skipped: locked``, a ``run`` exits 7.

    Raises:
        StateError: another cvm-tune process holds it (its pid, from ``state/lock``).
    """
    try:
        stack.enter_context(run_lock(out))
    except Locked:
        try:
            holder = f"pid {int((Path(out) / 'state' / 'lock').read_text())}"
        except (OSError, ValueError):
            holder = "pid unknown"
        raise StateError(f"the output volume {out} is in use by another cvm-tune process ({holder})",
                         fix="stop it (a nightly `serve` or `run`), or give this one its own output.dir") from None


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


def _db_errors(method: Callable[..., T]) -> Callable[..., T]:
    """A damaged database (a flipped page, a row that is not ours) is a StateError, never an internal error."""

    @functools.wraps(method)
    def wrapper(self: RunDB, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except (sqlite3.Error, ValueError, TypeError) as exc:
            if isinstance(exc, StateError):
                raise
            raise StateError(f"run database {self.path} is damaged: {type(exc).__name__}: {exc}",
                             fix="restore state/runs.sqlite from a backup, or move it away to start a new history "
                             "(exports and the audit log are kept)") from exc

    return wrapper


class RunDB:
    """The run database (``state/runs.sqlite``), migrated to :data:`SCHEMA_VERSION` when opened. One connection per
    instance; short transactions. Write only under :func:`run_lock` (``status`` writes only a migration)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.path = state_dir(out) / "runs.sqlite"
        self._open()

    @classmethod
    def existing(cls, out: Path) -> RunDB | None:
        """The database if the volume has one, or state files of a release before it (migrated now); never creates
        the output directory (``status`` is a read)."""
        check_output_dir(out)
        if not (Path(out) / "state" / "runs.sqlite").is_file() and not _legacy_files(Path(out)):
            return None
        return cls(out)

    def _open(self) -> None:
        try:
            self.conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            try:
                version(self.conn, self.path)  # a newer database is refused before anything is written to it
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.execute("PRAGMA synchronous=FULL")
                migrate(self.conn, self.out, self.path)
            except BaseException:
                self.conn.close()
                raise
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

    # --- slots (the service's schedule) -------------------------------------------------------------

    @_db_errors
    def get(self, run_id: str) -> RunRow | None:
        """The slot row of ``run_id``."""
        cur = self.conn.execute(f"SELECT {','.join(_COLUMNS)} FROM slots WHERE id = ?", (run_id,))
        row = cur.fetchone()
        return _row(row) if row else None

    @_db_errors
    def recent(self, limit: int = 10) -> list[RunRow]:
        """Newest slots first."""
        cur = self.conn.execute(f"SELECT {','.join(_COLUMNS)} FROM slots ORDER BY slot DESC LIMIT ?", (limit,))
        return [_row(r) for r in cur.fetchall()]

    @_db_errors
    def newest_slot(self) -> str | None:
        return self.conn.execute("SELECT MAX(slot) FROM slots").fetchone()[0]

    def unfinished(self) -> list[RunRow]:
        """Rows that are not final (pending, running, failed with a retry scheduled), oldest first."""
        return [r for r in reversed(self.recent(1000)) if not r.final]

    @_db_errors
    def counter(self) -> int:
        row = self.conn.execute("SELECT value FROM meta WHERE key = 'counter'").fetchone()
        return int(row[0]) if row else 0

    @_db_errors
    def upsert(self, run_id: str, *, slot: str, slot_time: str, **fields: Any) -> RunRow:
        """Create or update a slot row; ``metrics`` is stored as JSON. Finishing states bump the run counter."""
        bad = set(fields) - set(_COLUMNS)
        if bad or fields.get("status", "pending") not in STATUSES:
            raise StateError(f"bad run update {sorted(bad) or fields.get('status')}")
        if "metrics" in fields and fields["metrics"] is not None:
            fields["metrics"] = json.dumps(fields["metrics"], sort_keys=True)
        with self._tx():
            self.conn.execute("INSERT OR IGNORE INTO slots (id, slot, slot_time, status) VALUES (?, ?, ?, 'pending')",
                              (run_id, slot, slot_time))
            if fields.get("status") in ("succeeded", "failed", "skipped"):
                counter = self.counter() + 1
                self.conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('counter', ?)", (str(counter),))
                fields["counter"] = counter
            if fields:
                cols = ", ".join(f"{k} = ?" for k in fields)
                self.conn.execute(f"UPDATE slots SET {cols} WHERE id = ?", (*fields.values(), run_id))
        row = self.get(run_id)
        if row is None:
            raise StateError(f"run {run_id} vanished from {self.path}")
        return row

    # --- runs (every run, ad-hoc or scheduled) ------------------------------------------------------

    @_db_errors
    def run(self, run_id: str) -> RunRecord | None:
        """The ledger row of ``run_id``."""
        row = self.conn.execute(f"SELECT {','.join(_RUN_COLUMNS)} FROM runs WHERE id = ?", (run_id,)).fetchone()
        return _run(row) if row else None

    @_db_errors
    def runs(self, limit: int = 10) -> list[RunRecord]:
        """Most recently started or finished first (the order ``runs/*/state.json`` writes had)."""
        cur = self.conn.execute(f"SELECT {','.join(_RUN_COLUMNS)} FROM runs ORDER BY seq DESC LIMIT ?", (limit,))
        return [_run(r) for r in cur.fetchall()]

    @_db_errors
    def start_run(self, run_id: str, *, fingerprint: str, started_at: str) -> RunRecord:
        """Record a run as ``running`` (new, or resumed: its start time and fingerprint are kept) and make it the
        newest; a run of a scheduled slot is linked to its slot row."""
        with self._tx():
            self.conn.execute(
                "INSERT INTO runs (id, status, fingerprint, started_at, slot_id, seq) VALUES (?, 'running', ?, ?,"
                " (SELECT id FROM slots WHERE id = ?), (SELECT COALESCE(MAX(seq), 0) + 1 FROM runs))"
                " ON CONFLICT (id) DO UPDATE SET status = 'running', seq = excluded.seq,"
                " slot_id = COALESCE(runs.slot_id, excluded.slot_id)",
                (run_id, fingerprint, started_at, run_id))
        return self._must(run_id)

    @_db_errors
    def finish_run(self, run_id: str, *, bundle: str, finished_at: str, promoted: bool | None = None) -> RunRecord:
        """Record a run ``exported`` to ``bundle`` (and its promotion decision, when known)."""
        with self._tx():
            cur = self.conn.execute(
                "UPDATE runs SET status = 'exported', bundle = ?, finished_at = ?, promoted = COALESCE(?, promoted),"
                " seq = (SELECT MAX(seq) + 1 FROM runs) WHERE id = ?",
                (bundle, finished_at, None if promoted is None else int(promoted), run_id))
            if cur.rowcount != 1:
                raise StateError(f"run {run_id} is not in {self.path}")
        return self._must(run_id)

    @_db_errors
    def set_promoted(self, run_id: str, promoted: bool) -> None:
        """The promotion decision of an exported run."""
        with self._tx():
            self.conn.execute("UPDATE runs SET promoted = ? WHERE id = ?", (int(promoted), run_id))

    def _must(self, run_id: str) -> RunRecord:
        row = self.run(run_id)
        if row is None:
            raise StateError(f"run {run_id} vanished from {self.path}")
        return row


@dataclass(frozen=True)
class RunRecord:
    """One run of the ledger (``runs`` table)."""

    id: str
    status: str
    fingerprint: str
    started_at: str
    finished_at: str | None
    bundle: str | None
    promoted: bool | None
    slot_id: str | None


def _run(values: tuple[Any, ...]) -> RunRecord:
    data = dict(zip(_RUN_COLUMNS, values, strict=True))
    data["promoted"] = None if data["promoted"] is None else bool(data["promoted"])
    return RunRecord(**data)


def _legacy_files(out: Path) -> bool:
    return (out / "runs").is_dir() and any((out / "runs").glob(f"*/{LEGACY_STATE}"))


def run_list(out: Path, *, promoted: str | None) -> list[dict[str, Any]]:
    """Every run, for the bundle server (``GET /v1/runs``), by run id: ``run_id``, ``status``,
    ``started_at``, ``exported`` (its bundle's manifest is on the volume) and ``promoted`` (it is the run
    ``promoted`` names: ``exports/PROMOTED``). Opens the database read-only (see :func:`read_runs`).

    Raises:
        StateError: the database is damaged, newer than this code, or a legacy run record is unreadable.
    """
    return [{"run_id": run_id, "status": status, "started_at": started_at,
             "exported": (Path(out) / "exports" / run_id / "manifest.json").is_file(), "promoted": run_id == promoted}
            for run_id, status, started_at in read_runs(Path(out))]


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
