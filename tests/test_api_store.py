"""The training API's records in the run database: what a kill -9 leaves (committed results stay, pending ones are
failed with the reason on the next start), and a database migrated from the previous schema keeps its runs."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from app.api.store import RESTARTED, Checkpoint, Store
from app.state import RunDB
from app.state_migrations import SCHEMA_VERSION


def test_results_survive_a_restart_and_pending_operations_fail_with_the_reason(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.add_model("s1:train:0", owner="o", session_id="s1", base_model="b", lora={"rank": 4}, dp=None,
                op_head="0" * 64, ops=0)
    s.add_future("done", owner="o", session_id="s1", model_id="s1:train:0", kind="forward_backward")
    s.add_future("queued", owner="o", session_id="s1", model_id="s1:train:0", kind="optim_step")
    s.finish("done", ok=True, content_type="application/x-protobuf", result=b"\x01\x02",
             head=("s1:train:0", "ab" * 32, 1))
    s.add_checkpoint(Checkpoint("tinker://s1:train:0/weights/a", "o", "s1:train:0", "training", "a", "/x", None,
                                "ab" * 32, 1, {"rank": 4}, "2026-11-26T00:00:00Z"))
    assert s.pending("s1") == 1
    s.close()  # what a kill -9 leaves: every commit, nothing else

    s2 = Store(tmp_path)  # the restarted server's (its Service fails what was left pending, as here)
    done = s2.future("done")
    assert (done.status, done.content_type, done.result) == ("done", "application/x-protobuf", b"\x01\x02")
    assert s2.future("queued").status == "pending"
    assert s2.fail_interrupted() == 1
    queued = s2.future("queued")
    assert queued.status == "failed" and json.loads(queued.result) == {"error": RESTARTED, "category": "server"}
    assert s2.checkpoint("tinker://s1:train:0/weights/a").op_head == "ab" * 32
    assert s2.conn.execute("SELECT op_head, ops FROM api_models").fetchall() == [("ab" * 32, 1)]
    assert s2.pending("s1") == 0


def test_a_version_2_database_gains_the_api_tables_and_keeps_its_runs(tmp_path: Path) -> None:
    db = RunDB(tmp_path)
    db.start_run("r1", fingerprint="f", started_at="2026-11-26T00:00:00Z")
    for table in ("api_checkpoints", "api_futures", "api_models"):
        db.conn.execute(f"DROP TABLE {table}")
    db.conn.execute("PRAGMA user_version = 2")  # as the release before wrote it
    db.close()
    store = Store(tmp_path)
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    assert store.db.run("r1") is not None and store.future("nope") is None
    store.close()
    raw = sqlite3.connect(tmp_path / "state" / "runs.sqlite")
    assert {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} >= {
        "runs", "slots", "api_models", "api_futures", "api_checkpoints"}
