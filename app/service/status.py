"""``cvm-tune status``: the last runs from the run database, the training API's saves, the heartbeat and the next
slot."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.config import Config
from app.run.privacy_budget import chain_entries, privacy_lines, trusted_spend
from app.run.privacy_budget import summary as privacy_summary
from app.service.api_saves import api_saves
from app.service.scheduler import DailySchedule
from app.state import RunDB, iso, read_heartbeat

STATUS_SCHEMA = "cvm-tune/status/v1"
_HEAD = ("RUN ID", "SLOT (UTC)", "STATUS", "TRY", "FINISHED (UTC)", "STEPS", "LOSS", "REASON / BUNDLE")
_SAVES_HEAD = ("RUN ID", "CHECKPOINT", "KIND", "OPS", "SAVED (UTC)", "BUNDLE")


def render_status(cfg: Config, *, limit: int = 10, as_json: bool = False, now: datetime | None = None) -> str:
    """The status text (a table) or JSON document."""
    out = Path(cfg.output.dir).resolve()
    now = now or datetime.now(timezone.utc)
    db = RunDB.existing(out)
    try:  # closed before anything else is read: a status leaves no database side files behind
        rows = db.recent(limit) if db is not None else []
        adhoc = adhoc_runs(db, {r.id for r in rows}, limit)
        saves = api_saves(out, limit, db.conn) if db is not None else []  # on this connection: no side file is left
    finally:
        if db is not None:
            db.close()
    beat = read_heartbeat(out)
    budget = privacy_summary(out / "state", trusted_spend(chain_entries(out / "state" / "audit.jsonl"),
                                                        out / "exports"))
    nxt = DailySchedule(cfg.schedule.time, cfg.schedule.timezone).next(now)
    if as_json:
        return json.dumps({"schema": STATUS_SCHEMA, "output": str(out), "heartbeat": beat,
                           "next_slot": {"run_id": nxt.run_id, "at": iso(nxt.at)},
                           "runs": [r.__dict__ for r in rows], "adapters": adapters(out),
                           "adhoc_runs": adhoc, "api_saves": saves, "privacy_budget": budget},
                          indent=2, sort_keys=True)
    lines = [f"cvm-tune service on {out}  (schedule {cfg.schedule.time} {cfg.schedule.timezone})"]
    if beat is None:
        lines.append("heartbeat: none (the service has not run on this volume)")
    else:
        age = now.timestamp() - float(beat["unix"])
        what = f"{beat.get('state')}" + (f" {beat['run_id']} step {beat.get('step')}" if beat.get("run_id") else "")
        lines.append(f"heartbeat: {beat['time']} ({age:.0f} s ago, pid {beat.get('pid')}, {what})")
    left = nxt.at - now
    lines.append(f"next slot: {nxt.run_id} at {iso(nxt.at)} (in {int(left.total_seconds() // 3600)} h "
                 f"{int(left.total_seconds() % 3600 // 60)} min)")
    ad = adapters(out)
    if ad["promoted"] or ad["candidate"]:
        lines.append(f"promoted adapter: {_describe(ad['promoted'])}")
        if ad["candidate"] and ad["candidate"] != ad["promoted"]:
            lines.append(f"last candidate:   {_describe(ad['candidate'])}")
    lines += privacy_lines(budget, cfg.training.privacy.lifetime_epsilon)
    lines.append("")
    table = [_HEAD]
    for r in rows:
        m = r.metrics or {}
        losses = m.get("losses") or []
        tail = (r.bundle if r.status == "succeeded" else r.reason) or ""
        if r.status == "succeeded" and r.reason:  # promotion refused, recovered after a crash
            tail += f" ({r.reason})"
        if r.status == "failed" and r.next_attempt_at:
            tail += f" (retry at {r.next_attempt_at})"
        table.append((r.id, r.slot_time.replace("T", " ").rstrip("Z"), r.status, str(r.attempts),
                      (r.finished_at or "").replace("T", " ").rstrip("Z"),
                      str(losses[-1][0]) if losses else "", f"{losses[-1][1]:.4f}" if losses else "", tail))
    if len(table) == 1 and not adhoc and not saves:
        lines.append("no runs yet")
    elif len(table) > 1:
        lines += columns(table)
    if adhoc:
        lines += ([] if lines[-1] == "" else [""]) + ["ad-hoc runs (cvm-tune run), newest first:"]
        lines += [f"  {a['run_id']}  {a['status']:8}  started {a['started_at']}  {a.get('bundle') or ''}".rstrip()
                  for a in adhoc]
    if saves:
        lines += ([] if lines[-1] == "" else [""]) + ["training API saves (cvm-tune api serve), newest first:"]
        lines += ["  " + line for line in columns([_SAVES_HEAD] + [
            (a["run_id"], a["checkpoint"], a["kind"], str(a["ops"]), a["saved_at"].replace("T", " ").rstrip("Z"),
             str(out / "exports" / a["run_id"]) if a["exported"] else "(bundle missing)") for a in saves])]
    return "\n".join(lines)


def columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as text columns, each as wide as its longest cell (the last one unpadded)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows]


def adhoc_runs(db: RunDB | None, scheduled: set[str], limit: int) -> list[dict[str, str]]:
    """Runs of the run database's ledger that are no service slot (``cvm-tune run``), newest start first."""
    runs = db.runs(1_000_000) if db is not None else []
    found = [{"run_id": r.id, "status": r.status, "started_at": r.started_at, "bundle": r.bundle or ""}
             for r in runs if r.slot_id is None and r.id not in scheduled]
    return sorted(found, key=lambda a: a["started_at"], reverse=True)[:limit]


def adapters(out: Path) -> dict[str, dict[str, Any] | None]:
    """The promoted bundle and the newest candidate (``exports/PROMOTED``, ``exports/CANDIDATE``): run id, dataset
    version, eval loss and promotion decision, read from their manifests."""
    found: dict[str, dict[str, Any] | None] = {}
    for key, name in (("promoted", "PROMOTED"), ("candidate", "CANDIDATE")):
        try:
            run_id = (out / "exports" / name).read_text(encoding="ascii").strip()
            m = json.loads((out / "exports" / run_id / "manifest.json").read_bytes())
        except (OSError, ValueError, UnicodeDecodeError):
            found[key] = None
            continue
        ev = m.get("evaluation") or {}
        found[key] = {"run_id": run_id, "dataset_version": (m.get("dataset") or {}).get("dataset_version"),
                      "parent_run_id": (m.get("lineage") or {}).get("parent_run_id"),
                      "eval_loss": ev.get("candidate_loss"), "promoted": ev.get("promote", True)}
    return found


def _describe(a: dict[str, Any] | None) -> str:
    if a is None:
        return "none"
    parts = [a["run_id"], f"dataset v{a['dataset_version']}",
             f"from {a['parent_run_id']}" if a["parent_run_id"] else "from the base model"]
    if a["eval_loss"] is not None:
        parts.append(f"eval loss {a['eval_loss']:.4f}")
    if not a["promoted"]:
        parts.append("promotion refused")
    return ", ".join(parts)
