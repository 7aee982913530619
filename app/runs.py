"""Run directories on the output volume: ``runs/<run_id>/state.json`` and which run to resume.

A run is resumed only when it is the newest unfinished one (or named with ``--run-id``) and its
fingerprint (training config, dataset plaintext, base model) is unchanged.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.errors import StateError
from app.fsutil import atomic_write_bytes


def pick_run(out: Path, fingerprint: str, requested: str | None) -> tuple[str, bool]:
    """(run_id, resuming). Only the newest run may be resumed, and only with the same inputs."""
    runs = sorted((out / "runs").glob("*/state.json"), key=lambda p: p.stat().st_mtime)
    if requested:
        state = out / "runs" / requested / "state.json"
        if state.exists():
            s = json.loads(state.read_text())
            if s["status"] == "exported":
                raise StateError(f"run {requested} was already exported to {out / 'exports' / requested}",
                                 fix=f"verify it with `cvm-tune verify {out / 'exports' / requested}`, or pass a new "
                                 "--run-id to train again")
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


def write_run_state(run_dir: Path, state: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / "state.json", json.dumps(state, sort_keys=True, indent=2).encode())
