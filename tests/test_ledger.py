"""The run database is the one record of runs and slots: schema versions, and the migration of a volume written
by the release before the ledger (``tests/data/volume-v1``: its README says how it was made).

Run: ``python -m pytest tests/test_ledger.py -q`` (CPU; one short demo run, shared with other test files, and one
refused run that stops before training).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from app.cli import main
from app.errors import StateError
from app.run.state import choose_run, pick_run
from app.state import RunDB, run_list
from app.state_migrations import SCHEMA_VERSION

FIXTURE = Path(__file__).parent / "data" / "volume-v1"
NIGHTLY = "nightly-2026-11-21"  # exported, promoted
INTERRUPTED = "run-20261126T004059Z-34dc"  # an ad-hoc run stopped after its first checkpoint
FINGERPRINT = "ddde3030f0cb0fde112d14f925e03ebb3c2dd72d314a10a36c7bc978aefa3437"
SLOTS_V1 = ("id, slot, slot_time, status, reason, attempts, next_attempt_at, started_at, finished_at, metrics, bundle,"
            " audit_head, counter")


def _volume(tmp: Path) -> Path:
    """A copy of the fixture volume, its state.json files in the order a deployed volume wrote them (git keeps no
    file times): the interrupted run last."""
    out = tmp / "out"
    shutil.copytree(FIXTURE, out, ignore=shutil.ignore_patterns("README.md"))
    for i, run_id in enumerate((NIGHTLY, INTERRUPTED)):
        os.utime(out / "runs" / run_id / "state.json", (1_800_000_000 + i, 1_800_000_000 + i))
    return out


def _cfg(tmp: Path, out: Path, **training: object) -> str:
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump({"output": {"dir": str(out)},
                                    "training": {"max_steps": 2, "save_steps": 1, **training},
                                    "alerts": {"webhook_url_env": "CVM_TUNE_TEST_NO_WEBHOOK"}}))
    return str(path)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _raw(path: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_volume_v1_opens_with_its_history(tmp_path: Path) -> None:
    out = _volume(tmp_path)
    db_path = out / "state" / "runs.sqlite"
    slots_before = _raw(db_path, f"SELECT {SLOTS_V1} FROM runs ORDER BY id")
    legacy = {p.parent.name: p.read_bytes() for p in (out / "runs").glob("*/state.json")}
    assert _raw(db_path, "PRAGMA user_version") == [(0,)] and len(slots_before) == 3
    db = RunDB(out)
    assert db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    assert db.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert db.conn.execute(f"SELECT {SLOTS_V1} FROM slots ORDER BY id").fetchall() == slots_before
    assert db.counter() == 3
    runs = {r.id: r for r in db.runs()}
    assert set(runs) == {NIGHTLY, INTERRUPTED}
    for run_id, body in legacy.items():  # id, status, fingerprint, started_at and bundle kept
        s = json.loads(body)
        r = runs[run_id]
        assert (r.status, r.fingerprint, r.started_at, r.bundle) == (s["status"], s["fingerprint"], s["started_at"],
                                                                     s.get("bundle"))
    assert runs[NIGHTLY].promoted is True and runs[NIGHTLY].slot_id == NIGHTLY
    assert runs[INTERRUPTED].promoted is None and runs[INTERRUPTED].slot_id is None
    assert [r.id for r in db.runs()] == [INTERRUPTED, NIGHTLY]  # the order of their last writes
    db.close()
    # the old files are left in place, byte for byte, and unused: the ledger alone is the record now
    assert {p.parent.name: p.read_bytes() for p in (out / "runs").glob("*/state.json")} == legacy
    for path in (out / "runs").glob("*/state.json"):
        path.unlink()
    db = RunDB(out)
    assert {r.id for r in db.runs()} == {NIGHTLY, INTERRUPTED} and len(db.recent()) == 3
    db.close()


def test_second_open_is_a_no_op(tmp_path: Path) -> None:
    out = _volume(tmp_path)
    RunDB(out).close()
    dump = list(_dump(out))
    RunDB(out).close()
    assert list(_dump(out)) == dump


def _dump(out: Path) -> list[str]:
    conn = sqlite3.connect(out / "state" / "runs.sqlite")
    try:
        return [*conn.iterdump(), str(conn.execute("PRAGMA user_version").fetchone())]
    finally:
        conn.close()


def test_two_processes_opening_an_old_volume_migrate_it_once(tmp_path: Path) -> None:
    out = _volume(tmp_path)
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            RunDB(out).close()
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _raw(out / "state" / "runs.sqlite", "SELECT COUNT(*), MAX(seq) FROM runs") == [(2, 2)]


def test_status_shows_the_volume_v1_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _volume(tmp_path)
    cfg = _cfg(tmp_path, out)
    capsys.readouterr()
    assert main(["status", "--config", cfg]) == 0
    text = capsys.readouterr().out
    assert f"promoted adapter: {NIGHTLY}" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("nightly-")}
    assert set(lines) == {NIGHTLY, "nightly-2026-11-22", "nightly-2026-11-23"}
    assert "succeeded" in lines[NIGHTLY] and "skipped" in lines["nightly-2026-11-22"]
    assert "failed" in lines["nightly-2026-11-23"] and "retry at 2026-11-23T03:01:00Z" in lines["nightly-2026-11-23"]
    assert "ad-hoc runs (cvm-tune run)" in text and f"{INTERRUPTED}  running   started 2026-11-26T00:40:59Z" in text
    assert main(["status", "--config", cfg, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in doc["runs"]] == ["nightly-2026-11-23", "nightly-2026-11-22", NIGHTLY]
    assert [a["run_id"] for a in doc["adhoc_runs"]] == [INTERRUPTED]


def test_interrupted_run_resumes_with_the_same_inputs_only(tmp_path: Path) -> None:
    out = _volume(tmp_path)
    db = RunDB(out)
    assert pick_run(db, FINGERPRINT, None) == (INTERRUPTED, True)  # the newest run, still running
    assert pick_run(db, FINGERPRINT, INTERRUPTED) == (INTERRUPTED, True)
    assert choose_run(out, FINGERPRINT, None) == (INTERRUPTED, True, "2026-11-26T00:40:59Z")  # start time kept
    other, resuming = pick_run(db, "0" * 64, None)
    assert other.startswith("run-") and other != INTERRUPTED and not resuming  # other inputs: a new run
    with pytest.raises(StateError, match="started with other inputs"):
        pick_run(db, "0" * 64, INTERRUPTED)
    with pytest.raises(StateError, match=f"run {NIGHTLY} was already exported"):
        pick_run(db, FINGERPRINT, NIGHTLY)
    assert db.run(INTERRUPTED).status == "running"  # type: ignore[union-attr]
    db.close()


def test_resume_with_changed_inputs_is_refused_and_nothing_is_written(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = _volume(tmp_path)
    RunDB(out).close()  # migrated
    cfg = _cfg(tmp_path, out, learning_rate=1e-3)
    before = _dump(out)
    capsys.readouterr()
    assert main(["run", "--config", cfg, "--run-id", INTERRUPTED]) == 7
    assert "started with other inputs" in capsys.readouterr().err
    assert _dump(out) == before
    assert sorted(p.name for p in (out / "exports").iterdir()) == ["CANDIDATE", "PROMOTED", NIGHTLY]
    assert sorted(p.name for p in (out / "runs").iterdir()) == [NIGHTLY, INTERRUPTED]


def test_a_future_schema_version_is_refused_and_left_untouched(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = _volume(tmp_path)
    db_path = out / "state" / "runs.sqlite"
    conn = sqlite3.connect(db_path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    before = _files(out)
    with pytest.raises(StateError, match=f"schema version {SCHEMA_VERSION + 1}; this cvm-tune knows versions up to"):
        RunDB(out)
    with pytest.raises(StateError, match="schema version"):
        run_list(out, promoted=None)
    cfg = _cfg(tmp_path, out)
    capsys.readouterr()
    assert main(["status", "--config", cfg]) == 7
    assert capsys.readouterr().err.startswith("error: run database")
    assert _files(out) == before


def test_a_damaged_v1_database_is_exit_7_and_left_as_it_was(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _volume(tmp_path)
    db_path = out / "state" / "runs.sqlite"
    data = bytearray(db_path.read_bytes())
    data[4096:] = bytes(b ^ 0x5A for b in data[4096:])  # every page after the schema page flipped
    db_path.write_bytes(bytes(data))
    before = _files(out)
    cfg = _cfg(tmp_path, out)
    capsys.readouterr()
    assert main(["status", "--config", cfg]) == 7
    err = capsys.readouterr().err
    assert err.startswith("error: run database") and "Traceback" not in err
    assert _files(out) == before


def test_an_unreadable_state_json_stops_the_migration_and_nothing_changes(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = _volume(tmp_path)
    (out / "runs" / INTERRUPTED / "state.json").write_text('{"run_id": "' + INTERRUPTED + '", "status": "runn')
    before = _files(out)
    with pytest.raises(StateError, match=f"cannot import .*{INTERRUPTED}/state.json into the run database"):
        RunDB(out)
    capsys.readouterr()
    assert main(["status", "--config", _cfg(tmp_path, out)]) == 7
    assert "move it out of" in capsys.readouterr().err
    assert _files(out) == before  # still version 0: the slot table not renamed, nothing imported
    assert _raw(out / "state" / "runs.sqlite", "PRAGMA user_version") == [(0,)]


def test_a_volume_without_a_database_is_migrated_by_status(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = _volume(tmp_path)
    (out / "state" / "runs.sqlite").unlink()
    capsys.readouterr()
    assert main(["status", "--config", _cfg(tmp_path, out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runs"] == [] and [a["run_id"] for a in doc["adhoc_runs"]] == [INTERRUPTED, NIGHTLY]


def test_bundle_server_run_list_reads_the_database(tmp_path: Path) -> None:
    out = _volume(tmp_path)
    expected = [
        {"run_id": NIGHTLY, "status": "exported", "started_at": "2026-11-26T00:40:54Z", "exported": True,
         "promoted": True},
        {"run_id": INTERRUPTED, "status": "running", "started_at": "2026-11-26T00:40:59Z", "exported": False,
         "promoted": False},
    ]
    before = _files(out)
    assert run_list(out, promoted=NIGHTLY) == expected  # not migrated yet (read-only mount): as it will import them
    after = _files(out)  # a read-only connection may leave SQLite's shared-memory index and an empty WAL behind
    after.pop("state/runs.sqlite-shm", None)
    assert after.pop("state/runs.sqlite-wal", b"") == b"" and after == before
    RunDB(out).close()
    for path in (out / "runs").glob("*/state.json"):
        path.unlink()
    assert run_list(out, promoted=NIGHTLY) == expected  # from the ledger
    assert run_list(tmp_path / "empty", promoted=None) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_run_list_on_a_read_only_volume(tmp_path: Path) -> None:
    out = _volume(tmp_path)
    RunDB(out).close()  # migrated, closed: no -wal or -shm file left
    (out / "state").chmod(0o555)
    try:
        assert [r["run_id"] for r in run_list(out, promoted=None)] == [NIGHTLY, INTERRUPTED]
    finally:
        (out / "state").chmod(0o755)


def test_a_new_run_is_recorded_in_the_ledger_only(demo_bundle: tuple[Path, Path]) -> None:
    bundle, _ = demo_bundle
    out = bundle.parent.parent
    assert not list((out / "runs").glob("*/state.json"))
    db = RunDB.existing(out)
    assert db is not None
    run = db.run(bundle.name)
    assert run is not None and (run.status, run.bundle, run.promoted, run.slot_id) == ("exported", str(bundle), True,
                                                                                        None)
    assert run.finished_at is not None and run.started_at <= run.finished_at
    assert db.recent() == []  # an ad-hoc run has no slot
    db.close()


def test_a_run_killed_between_its_export_and_the_ledger_is_never_resumed(tmp_path: Path) -> None:
    out = _volume(tmp_path)
    (out / "exports" / INTERRUPTED).mkdir()
    (out / "exports" / INTERRUPTED / "manifest.json").write_text("{}")  # published, the ledger still says running
    db = RunDB(out)
    new, resuming = pick_run(db, FINGERPRINT, None)
    assert new != INTERRUPTED and not resuming
    run = db.run(INTERRUPTED)
    assert run is not None and (run.status, run.bundle) == ("exported", str(out / "exports" / INTERRUPTED))
    with pytest.raises(StateError, match=f"run {INTERRUPTED} was already exported"):
        pick_run(db, FINGERPRINT, INTERRUPTED)
    db.close()


class _Clock:
    def __init__(self, now: datetime) -> None:
        self.wall = now

    def now(self) -> datetime:
        return self.wall

    def monotonic(self) -> float:
        return 0.0


def test_the_service_records_a_slot_run_exported_before_its_row(tmp_path: Path) -> None:
    from app.config import Config
    from app.service.scheduler import Service

    out = _volume(tmp_path)
    cfg = Config.model_validate({"output": {"dir": str(out)}, "alerts": {"webhook_url_env": "CVM_TUNE_TEST_NO_WEBHOOK"}})
    slot = "nightly-2026-11-23"  # failed, retry due: its second attempt started, exported, and the process died
    db = RunDB(out)
    db.start_run(slot, fingerprint=FINGERPRINT, started_at="2026-11-23T03:01:00Z")
    assert db.run(slot).slot_id == slot  # type: ignore[union-attr]
    (out / "exports" / slot).mkdir()
    (out / "exports" / slot / "manifest.json").write_text("{}")
    calls: list[str] = []
    svc = Service(cfg, clock=_Clock(datetime(2026, 11, 23, 4, 0, tzinfo=timezone.utc)),
                  runner=lambda **kw: calls.append(kw["run_id"]))
    assert svc.tick() == f"recovered: {slot}" and calls == []
    run = db.run(slot)
    assert run is not None and (run.status, run.bundle) == ("exported", str(out / "exports" / slot))
    assert db.get(slot).status == "succeeded"  # type: ignore[union-attr]
    db.close()
    svc.db.close()
