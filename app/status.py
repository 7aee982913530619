"""``cvm-tune status``: the last runs from the run database, the heartbeat and the next slot."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from app.config import Config
from app.privacy_budget import summary as privacy_summary
from app.scheduler import DailySchedule
from app.state import RunDB, iso, read_heartbeat

STATUS_SCHEMA = "cvm-tune/status/v1"
_HEAD = ("RUN ID", "SLOT (UTC)", "STATUS", "TRY", "FINISHED (UTC)", "STEPS", "LOSS", "REASON / BUNDLE")


def render_status(cfg: Config, *, limit: int = 10, as_json: bool = False, now: datetime | None = None) -> str:
    """The status text (a table) or JSON document."""
    out = Path(cfg.output.dir).resolve()
    now = now or datetime.now(timezone.utc)
    rows = RunDB(out).recent(limit)
    beat = read_heartbeat(out)
    budget = privacy_summary(out / "state")
    nxt = DailySchedule(cfg.schedule.time, cfg.schedule.timezone).next(now)
    if as_json:
        return json.dumps({"schema": STATUS_SCHEMA, "output": str(out), "heartbeat": beat,
                           "next_slot": {"run_id": nxt.run_id, "at": iso(nxt.at)},
                           "runs": [r.__dict__ for r in rows], "privacy_budget": budget}, indent=2, sort_keys=True)
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
    cap = cfg.training.privacy.lifetime_epsilon
    for b in budget:
        lines.append(f"privacy: dataset {b['dataset_id']} v{b['dataset_version']}: epsilon {b['epsilon']:.4g} spent in "
                     f"{b['runs']} run(s) (delta {b['delta']:.3g})" + (f", lifetime cap {cap:g}" if cap is not None else ""))
    lines.append("")
    table = [_HEAD]
    for r in rows:
        m = r.metrics or {}
        losses = m.get("losses") or []
        tail = (r.bundle if r.status == "succeeded" else r.reason) or ""
        if r.status == "failed" and r.next_attempt_at:
            tail += f" (retry at {r.next_attempt_at})"
        table.append((r.id, r.slot_time.replace("T", " ").rstrip("Z"), r.status, str(r.attempts),
                      (r.finished_at or "").replace("T", " ").rstrip("Z"),
                      str(losses[-1][0]) if losses else "", f"{losses[-1][1]:.4f}" if losses else "", tail))
    if len(table) == 1:
        lines.append("no runs yet")
    else:
        widths = [max(len(row[i]) for row in table) for i in range(len(_HEAD) - 1)]
        for row in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return "\n".join(lines)
