"""The training API's records in the run database (``state/runs.sqlite``, tables of migration ``m003_api``, columns
of ``m004_api_storage``; kind ``external`` since ``m005_api_external``).

Every accepted operation is a row before its future is returned; its result bytes are committed before the engine
takes the next operation, so a kill -9 loses no completed result. Operations still pending when the server died are
failed on the next start (their model's in-memory state is gone; the client loads its last saved state). One
connection, one lock: the HTTP handlers and the engine thread share it.

Futures are committed with ``synchronous=NORMAL`` (WAL): a commit survives the death of the process (kill -9: the
WAL is in the operating system's page cache); an OS crash or a power loss may drop the last ones, and their client
sends them again. Checkpoint records are committed with ``synchronous=FULL``, as the rest of the run database.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.audit import utc_now
from app.state import RunDB

RETRY_WINDOW = 1024  # requests per model whose answer a retry gets again (Store.once)
RESTARTED = "the server restarted before this operation ran; load the model's last saved state and send it again"


@dataclass(frozen=True)
class Future:
    id: str
    owner: str
    session_id: str
    model_id: str | None
    kind: str
    status: str
    content_type: str | None
    result: bytes | None


@dataclass(frozen=True)
class Checkpoint:
    path: str
    owner: str
    model_id: str
    kind: str
    name: str
    dir: str
    bundle: str | None
    op_head: str
    ops: int
    lora: dict[str, Any]
    created_at: str
    expires_at: str | None = None  # UTC (utc_now's form); None: kept until deleted
    removed_at: str | None = None  # when its sealed files were removed (expired); None: still there
    state_bytes: int = 0  # the sealed state's bytes on the volume
    bundle_bytes: int = 0  # its export bundle's bytes (0: none)


class Store:
    def __init__(self, out: Path) -> None:
        self.db = RunDB(out)  # migrated to the current schema (the API tables included)
        self.conn = self.db.conn
        self.lock = threading.Lock()
        self.conn.execute("PRAGMA synchronous=NORMAL")  # futures; see the module docstring
        self._owners: dict[str, str] = {}  # model id -> owner: asked on every operation, and never changes
        self._requests: dict[tuple[str, str], dict[int, tuple[str, str, dict[str, Any]]]] = {}  # (owner, model) -> seq

    # --- retries -----------------------------------------------------------------------------------

    def once(self, owner: str, model_id: str, seq_id: int | None, kind: str, body: bytes,
             accept: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The future of a training client's request ``seq_id`` (the SDK numbers each request of a client from 1 and
        keeps the number when it sends the request again after a lost answer): ``accept()``'s, or, for the same
        request sent again, the one it answered then, so that it is applied once. Kept in memory for the last
        :data:`RETRY_WINDOW` requests of each model: a model's training state is in memory too (after a restart a
        retry finds no model either).

        Raises:
            BadRequest: the model's ``seq_id`` was taken by another request (another body or kind: not a retry).
        """
        if not seq_id or seq_id <= 0:  # not numbered (0: the field left out)
            return accept()
        digest, seen = hashlib.sha256(body).hexdigest(), self._requests.get((owner, model_id), {})
        if seq_id in seen:
            if seen[seq_id][:2] != (kind, digest):
                from app.api.errors import BadRequest

                raise BadRequest(f"seq_id {seq_id} of model {model_id} was taken by another request "
                                 f"({seen[seq_id][0]}): each request of a training client has its own seq_id; a "
                                 "retry sends the same request again")
            return seen[seq_id][2]
        future = accept()  # refused (a 4xx, an unknown model): nothing kept, a retry is judged afresh
        seen = self._requests.setdefault((owner, model_id), seen)
        if len(seen) >= RETRY_WINDOW:  # the oldest first: the SDK sends a request again within minutes
            del seen[next(iter(seen))]
        seen[seq_id] = (kind, digest, future)
        return future

    def _tx(self, sql: str, args: tuple[Any, ...] = (), *more: tuple[str, tuple[Any, ...]]) -> None:
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                self.conn.execute(sql, args)
                for statement, values in more:
                    self.conn.execute(statement, values)
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self.lock:
            return self.conn.execute(sql, args).fetchall()

    def fail_interrupted(self) -> int:
        """Fail every operation left pending by a server that died; returns how many."""
        n = len(self._all("SELECT id FROM api_futures WHERE status = 'pending'"))
        body = json.dumps({"error": RESTARTED, "category": "server"}).encode()
        self._tx("UPDATE api_futures SET status = 'failed', content_type = 'application/json', result = ?,"
                 " finished_at = ? WHERE status = 'pending'", (body, utc_now()))
        return n

    # --- futures -----------------------------------------------------------------------------------

    def add_future(self, fid: str, *, owner: str, session_id: str, model_id: str | None, kind: str) -> None:
        self._tx("INSERT INTO api_futures (id, owner, session_id, model_id, kind, status, created_at)"
                 " VALUES (?, ?, ?, ?, ?, 'pending', ?)", (fid, owner, session_id, model_id, kind, utc_now()))

    def finish(self, fid: str, *, ok: bool, content_type: str, result: bytes,
               head: tuple[str, str, int] | None = None) -> None:
        """Record a future's result and, when given, its model's op-chain head (one commit)."""
        more = [("UPDATE api_models SET op_head = ?, ops = ? WHERE id = ?", (head[1], head[2], head[0]))] if head else []
        self._tx("UPDATE api_futures SET status = ?, content_type = ?, result = ?, finished_at = ? WHERE id = ?",
                 ("done" if ok else "failed", content_type, result, utc_now(), fid), *more)

    def future(self, fid: str) -> Future | None:
        rows = self._all("SELECT id, owner, session_id, model_id, kind, status, content_type, result FROM api_futures"
                         " WHERE id = ?", (fid,))
        return Future(*rows[0]) if rows else None

    def pending(self, session_id: str) -> int:
        return self._all("SELECT COUNT(*) FROM api_futures WHERE session_id = ? AND status = 'pending'",
                         (session_id,))[0][0]

    # --- models ------------------------------------------------------------------------------------

    def add_model(self, model_id: str, *, owner: str, session_id: str, base_model: str, lora: dict[str, Any],
                  dp: dict[str, Any] | None, op_head: str, ops: int) -> None:
        self._tx("INSERT OR REPLACE INTO api_models (id, owner, session_id, base_model, lora, dp, op_head, ops,"
                 " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                 (model_id, owner, session_id, base_model, json.dumps(lora), json.dumps(dp) if dp else None, op_head,
                  ops, utc_now()))
        self._owners[model_id] = owner

    def model(self, model_id: str) -> dict[str, Any] | None:
        """A model's record (owner, base model, LoRA, created_at) and ``last_request``: when its last operation came."""
        rows = self._all("SELECT owner, base_model, lora, created_at, (SELECT MAX(created_at) FROM api_futures"
                         " WHERE model_id = api_models.id) FROM api_models WHERE id = ?", (model_id,))
        if not rows:
            return None
        owner, base, lora, created, last = rows[0]
        return {"owner": owner, "base_model": base, "lora": json.loads(lora), "created_at": created,
                "last_request": last or created}

    def drop_model(self, model_id: str) -> None:
        """Forget a model that never came to exist (its load was refused); its futures stay."""
        self._tx("DELETE FROM api_models WHERE id = ?", (model_id,))
        self._owners.pop(model_id, None)

    def model_owner(self, model_id: str) -> str | None:
        owner = self._owners.get(model_id)
        if owner is None:
            rows = self._all("SELECT owner FROM api_models WHERE id = ?", (model_id,))
            if rows:
                owner = self._owners[model_id] = rows[0][0]
        return owner

    # --- checkpoints -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _durable(self) -> Iterator[None]:
        """Checkpoint records commit with ``synchronous=FULL`` (see the module docstring)."""
        with self.lock:
            self.conn.execute("PRAGMA synchronous=FULL")
        try:
            yield
        finally:
            with self.lock:
                self.conn.execute("PRAGMA synchronous=NORMAL")

    def add_checkpoint(self, c: Checkpoint) -> None:
        with self._durable():
            self._add_checkpoint(c)

    def _add_checkpoint(self, c: Checkpoint) -> None:
        self._tx(f"INSERT OR REPLACE INTO api_checkpoints ({_CKPT}) VALUES ({', '.join('?' * _CKPT.count(','))}, ?)",
                 (c.path, c.owner, c.model_id, c.kind, c.name, c.dir, c.bundle, c.op_head, c.ops, json.dumps(c.lora),
                  c.created_at, c.expires_at, c.removed_at, c.state_bytes, c.bundle_bytes))

    def set_bundle(self, path: str, bundle: str, size: int) -> None:
        """Record the export bundle made for a saved state after its save."""
        with self._durable():
            self._tx("UPDATE api_checkpoints SET bundle = ?, bundle_bytes = ? WHERE path = ?", (bundle, size, path))

    def expired(self, now: str) -> list[Checkpoint]:
        """Saved states past their expiry (``now``: utc_now's form) whose sealed files are still there."""
        return [_ckpt(r) for r in self._all(f"SELECT {_CKPT} FROM api_checkpoints WHERE removed_at IS NULL"
                                            " AND expires_at IS NOT NULL AND expires_at <= ? ORDER BY expires_at",
                                            (now,))]

    def mark_removed(self, path: str, when: str) -> None:
        with self._durable():
            self._tx("UPDATE api_checkpoints SET removed_at = ? WHERE path = ?", (when, path))

    def set_expiry(self, path: str, expires_at: str | None) -> None:
        """A saved state's new expiry (``set_checkpoint_ttl``; None: kept until deleted)."""
        with self._durable():
            self._tx("UPDATE api_checkpoints SET expires_at = ? WHERE path = ?", (expires_at, path))

    def forget(self, path: str) -> None:
        """Remove a checkpoint's record (deleted, and nothing of it left on the volume)."""
        with self._durable():
            self._tx("DELETE FROM api_checkpoints WHERE path = ?", (path,))

    def saved_bytes(self) -> int:
        """Bytes the API's saved states still there and every export bundle hold on the volume."""
        return int(self._all("SELECT COALESCE(SUM(CASE WHEN removed_at IS NULL THEN state_bytes ELSE 0 END)"
                             " + SUM(bundle_bytes), 0) FROM api_checkpoints")[0][0])

    def checkpoint(self, path: str) -> Checkpoint | None:
        rows = self._all(f"SELECT {_CKPT} FROM api_checkpoints WHERE path = ?", (path,))
        return _ckpt(rows[0]) if rows else None

    def checkpoints(self, model_id: str) -> list[Checkpoint]:
        return [_ckpt(r) for r in self._all(f"SELECT {_CKPT} FROM api_checkpoints WHERE model_id = ?"
                                            " ORDER BY created_at, path", (model_id,))]

    def owned_checkpoints(self, owner: str, limit: int, offset: int) -> tuple[list[Checkpoint], int]:
        """One page of a key's checkpoints still there, newest first, and how many there are."""
        where = "WHERE owner = ? AND removed_at IS NULL"
        rows = self._all(f"SELECT {_CKPT} FROM api_checkpoints {where} ORDER BY created_at DESC, path DESC"
                         " LIMIT ? OFFSET ?", (owner, limit, offset))
        return [_ckpt(r) for r in rows], self._all(f"SELECT COUNT(*) FROM api_checkpoints {where}", (owner,))[0][0]

    def close(self) -> None:
        self.db.close()


_CKPT = ("path, owner, model_id, kind, name, dir, bundle, op_head, ops, lora, created_at, expires_at, removed_at,"
         " state_bytes, bundle_bytes")


def _ckpt(r: tuple[Any, ...]) -> Checkpoint:
    return Checkpoint(*r[:9], json.loads(r[9]), *r[10:])
