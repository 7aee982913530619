"""The training API's records in the run database: what a kill -9 leaves (committed results stay, pending ones are
failed with the reason on the next start), and a database migrated from the previous schema keeps its runs."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from app.api.proof.store import RESTARTED, Checkpoint, Store
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
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    assert store.db.run("r1") is not None and store.future("nope") is None
    store.close()
    raw = sqlite3.connect(tmp_path / "state" / "runs.sqlite")
    assert {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} >= {
        "runs", "slots", "api_models", "api_futures", "api_checkpoints"}


def test_completion_queues_trim_by_cursor_and_ack_keep_clones_apart_and_wake_long_polls() -> None:
    """retrieve_futures' queues (in memory): what a poll has seen or retrieved is dropped, clones are separate
    queues, an idle queue is removed, and a long poll is woken by a completion from another thread."""
    import asyncio
    import threading

    from tinker import types

    from app.api.completions import Completions

    def req(clone: int = 0, cursor: int = 0, timeout: float | None = 0,
            acks: tuple[str, ...] = ()) -> types.FuturesRetrieveRequest:
        return types.FuturesRetrieveRequest(target=types.SamplingSessionFuturesTarget(
            sampling_session_id="s", cloned_sampler_id=clone), prev_cursor=cursor, timeout=timeout,
            retrieved_request_ids=list(acks))

    async def run() -> None:
        c = Completions(long_poll_s=5)
        c.finished("s", 3, "a", ok=True)
        c.finished("s", 2_000_000_001, "clone", ok=True)
        c.finished("s", 4, "b", ok=False)
        got = await c.poll(req())
        assert [(x.request_id, x.state) for x in got.completions] == [("a", "finished"), ("b", "failed")]
        assert got.cursor == 3
        assert [x.request_id for x in (await c.poll(req(clone=2))).completions] == ["clone"]
        assert (await c.poll(req(cursor=1, acks=("b",)))).completions == []  # a: seen by cursor; b: retrieved
        assert (await c.poll(req(clone=2, cursor=3))).completions == [] and not c._queues  # nothing idle is kept
        threading.Timer(0.2, c.finished, ("s", 5, "late", True)).start()
        got = await asyncio.wait_for(c.poll(req(cursor=3, timeout=None)), 3)
        assert [x.request_id for x in got.completions] == ["late"] and got.cursor == 4

    asyncio.run(run())
