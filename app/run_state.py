"""A run's identity on the output volume: its id, whether it resumes, and what it committed to when it started.

``runs/<run_id>/state.json`` says ``running`` or ``exported``; only the newest run may be resumed, and only with
the inputs it started with (the audit chain's ``run.start``/``run.resume`` entries are the record of those).
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from attestation import bundle as B

from app.audit import AuditLog
from app.errors import StateError
from app.fsutil import atomic_write_bytes

RUN_ID = re.compile(B.RUN_ID_PATTERN)


def pick_run(out: Path, fingerprint: str, requested: str | None) -> tuple[str, bool]:
    """(run_id, resuming). Only the newest run may be resumed, and only with the same inputs."""
    runs = sorted((out / "runs").glob("*/state.json"), key=lambda p: p.stat().st_mtime)
    if requested:
        state = out / "runs" / requested / "state.json"
        if state.exists():
            s = json.loads(state.read_text())
            if s["status"] == "exported":
                raise StateError(f"run {requested} was already exported to {s.get('bundle') or out / 'exports' / requested}",
                                 fix="a run is exported once: verify that bundle, or train again under a new --run-id")
            if s["fingerprint"] != fingerprint:
                raise StateError(f"run {requested} was started with other inputs (config, dataset or base model)",
                                 fix="choose a new --run-id")
            return requested, True
        return requested, False
    if runs:
        s = json.loads(runs[-1].read_text())
        if s["status"] == "running" and s["fingerprint"] == fingerprint:
            return s["run_id"], True
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"run-{stamp}-{secrets.token_hex(2)}", False


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


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / "state.json", json.dumps(state, sort_keys=True, indent=2).encode())
