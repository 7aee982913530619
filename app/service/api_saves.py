"""The training API's saved checkpoints (``cvm-tune api serve``), for ``cvm-tune status`` and the bundle server's run
list: every save is an export bundle under ``exports/`` and a row of the run database's ``api_checkpoints`` table
(:mod:`app.state_migrations`, ``m003_api``). Read without writing anything, as :func:`app.state_migrations.read_runs`
reads the ledger: the bundle server's volume is mounted read-only.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from app.errors import StateError
from app.state_migrations import _read_only, version

API_SCHEMA_VERSION = 3  # the migration that added the api_* tables


def api_saves(out: Path, limit: int | None = None, conn: sqlite3.Connection | None = None) -> list[dict[str, Any]]:
    """The saves whose export bundle was written, newest first: ``run_id`` (the bundle's directory under
    ``exports/``), ``checkpoint`` (its ``tinker://`` path), ``kind`` (``training`` or ``sampler``), ``model_id``,
    ``ops`` (op-chain length), ``saved_at`` and ``exported`` (its manifest is on the volume). External-weights
    exports (kind ``external``: temporary bundles made to be downloaded, removed when they expire) are not saves.

    Raises:
        StateError: the database is damaged or newer than this code.
    """
    path = Path(out) / "state" / "runs.sqlite"
    if conn is None and not path.is_file():
        return []
    try:
        db = conn if conn is not None else _read_only(path)  # ``conn``: the caller's open connection (status)
        try:
            if version(db, path) < API_SCHEMA_VERSION:
                return []
            rows = db.execute("SELECT bundle, path, kind, model_id, ops, created_at FROM api_checkpoints"
                              " WHERE bundle IS NOT NULL AND kind != 'external'"
                              " ORDER BY created_at DESC, path DESC LIMIT ?",
                              (-1 if limit is None else limit,)).fetchall()
        finally:
            if conn is None:
                db.close()
    except sqlite3.Error as exc:
        raise StateError(f"run database {path} is damaged: {type(exc).__name__}: {exc}",
                         fix="restore state/runs.sqlite from a backup") from exc
    exports = Path(out) / "exports"
    return [{"run_id": Path(bundle).name, "checkpoint": ckpt, "kind": kind, "model_id": model_id, "ops": ops,
             "saved_at": saved_at, "exported": (exports / Path(bundle).name / "manifest.json").is_file()}
            for bundle, ckpt, kind, model_id, ops, saved_at in rows]
