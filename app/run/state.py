"""A run's identity on the output volume: its id, whether it resumes, and what it committed to when it started.

The run database's ledger (``state/runs.sqlite``, table ``runs``: :class:`app.state.RunDB`) says ``running`` or
``exported`` with the fingerprint of the inputs each run started with; only the newest run may be resumed, and only
with those inputs (the audit chain's ``run.start``/``run.resume`` entries are the record of what they were).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from attestation.bundle import manifest as B

from app.audit import AuditLog, utc_now
from app.errors import StateError
from app.state import RunDB, RunRecord, publish_anchor

RUN_ID = re.compile(B.RUN_ID_PATTERN)


def choose_run(out: Path, fingerprint: str, requested: str | None) -> tuple[str, bool, str]:
    """(run_id, resuming, started_at): :func:`pick_run` on the volume's run database (a resumed run keeps its start).
    A volume without a database yet has nothing to resume, and nothing is written to it here: the run's first write
    comes after its inputs were decrypted and validated."""
    db = RunDB.existing(out)
    if db is None:
        return requested or new_run_id(), False, utc_now()
    try:
        run_id, resuming = pick_run(db, fingerprint, requested)
        run = db.run(run_id) if resuming else None
        return run_id, resuming, run.started_at if run is not None else utc_now()
    finally:
        db.close()


def record_start(out: Path, run_id: str, *, fingerprint: str, started_at: str) -> None:
    """The run is ``running`` (and the newest) from now on: resumable with the same inputs. Its working directory
    (``runs/<run_id>``: checkpoints, the adapter) is created."""
    (Path(out) / "runs" / run_id).mkdir(parents=True, exist_ok=True)
    with _ledger(out) as db:
        db.start_run(run_id, fingerprint=fingerprint, started_at=started_at)


def record_export(out: Path, run_id: str, *, bundle: Path) -> None:
    """The run's bundle is published: ``exported``, never run again."""
    with _ledger(out) as db:
        db.finish_run(run_id, bundle=str(bundle), finished_at=utc_now())


def record_promotion(out: Path, run_id: str, *, promoted: bool) -> None:
    """The promotion decision of an exported run (the gate passed or was off: promoted)."""
    with _ledger(out) as db:
        db.set_promoted(run_id, promoted)


@contextmanager
def _ledger(out: Path) -> Iterator[RunDB]:
    db = RunDB(out)
    try:
        yield db
    finally:
        db.close()


def pick_run(db: RunDB, fingerprint: str, requested: str | None) -> tuple[str, bool]:
    """(run_id, resuming). Only the newest run may be resumed, and only with the same inputs.

    Raises:
        StateError: ``requested`` was exported already, or started with other inputs.
    """
    if requested:
        run = db.run(requested)
        if run is None:
            return requested, False
        if _exported(db, run):
            raise StateError(f"run {requested} was already exported to {run.bundle or db.out / 'exports' / requested}",
                             fix="a run is exported once: verify that bundle, or train again under a new --run-id")
        if run.fingerprint != fingerprint:
            raise StateError(f"run {requested} was started with other inputs (config, dataset or base model)",
                             fix="choose a new --run-id")
        return requested, True
    newest = db.runs(1)
    if newest and newest[0].status == "running" and newest[0].fingerprint == fingerprint \
            and not _exported(db, newest[0]):
        return newest[0].id, True
    return new_run_id(), False


def new_run_id() -> str:
    """``run-<UTC time>-<4 hex>``."""
    return f"run-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(2)}"


def _exported(db: RunDB, run: RunRecord) -> bool:
    """Exported, or its bundle is published although the process died before the ledger said so (recorded now)."""
    if run.status == "exported":
        return True
    bundle = db.out / "exports" / run.id
    if not (bundle / B.MANIFEST).is_file():
        return False
    db.finish_run(run.id, bundle=str(bundle), finished_at=utc_now())
    return True


def resume_changes(log: AuditLog, run_id: str, commitment: dict[str, str]) -> str:
    """Refuse a resume whose inputs differ from those the run started with (beyond settings outside training).

    Returns a note when only ``config_sha256`` changed (output, schedule, alert settings: recorded by the
    ``run.resume`` entry, which the verifier accepts); raises StateError for anything that shapes the adapter.
    """
    opened = [e for e in log.run_slice(run_id) if e.type == "run.start" or (e.type == "run.resume" and "config_sha256" in e.data)]
    before = opened[-1].data if opened else {}
    differ = [k for k, v in commitment.items() if k != "config_sha256" and k in before and before[k] != v]
    if "training_config_sha256" not in before and before.get("config_sha256") not in (None, commitment["config_sha256"]):
        differ.append("config_sha256")
    if differ:
        raise StateError(f"run {run_id} cannot be resumed: {', '.join(sorted(differ))} changed since it started",
                         fix="restore the inputs it started with, or start a new run (cvm-tune run --run-id NEW_ID)")
    return "config changed" if before.get("config_sha256") not in (None, commitment["config_sha256"]) else ""


def publish_head(anchor: Path | None, out: Path, audit_head: str) -> None:
    """Publish a new audit head during a run (an anchored checkpoint): a volume rolled back behind it is refused at
    the next start even when the run never finishes."""
    if anchor is None:
        return
    db = RunDB(out)
    try:
        publish_anchor(anchor, counter=db.counter(), audit_head=audit_head)
    finally:
        db.close()
