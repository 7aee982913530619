"""The nightly service's policy on a controllable clock (threats-and-faults cases 42-50, 41, 26), no sleeping.

The runner is replaced by a recorder where the case is about scheduling; the pipeline itself runs
for real in tests/test_service_process.py and in the alert/failure tests below.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from app import alerts
from app.config import AlertSettings, Config
from app.errors import DataError, StateError
from app.service.scheduler import DailySchedule, Service, Slot, health, serve
from app.state import Locked, RunDB, run_lock
from app.training import TrainingStopped

UTC = timezone.utc


class FakeClock:
    """Wall and monotonic time that only move when told to (a jump moves wall time only)."""

    def __init__(self, start: datetime) -> None:
        self.wall = start
        self.mono = 1000.0

    def now(self) -> datetime:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, **kw: float) -> None:
        delta = timedelta(**kw)
        self.wall += delta
        self.mono += delta.total_seconds()

    def jump(self, **kw: float) -> None:
        self.wall += timedelta(**kw)


@dataclass
class FakeResult:
    bundle_dir: Path
    report: dict[str, Any] = field(default_factory=lambda: {"losses": [[3, 1.25]]})
    audit_head: str = "ab" * 32


class Runner:
    """Records each run; ``behaviour`` decides what a run does (default: succeed at once)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.calls: list[tuple[str, datetime]] = []
        self.behaviour: Any = None

    def __call__(self, *, run_id: str, slot: Slot, should_stop: Any, on_step: Any) -> FakeResult:
        self.calls.append((run_id, self.clock.now()))
        if self.behaviour is not None:
            self.behaviour(run_id=run_id, should_stop=should_stop, on_step=on_step)
        return FakeResult(Path("/exports") / run_id)

    @property
    def ids(self) -> list[str]:
        return [r for r, _ in self.calls]


def _cfg(tmp: Path, **schedule: Any) -> Config:
    return Config.model_validate({"output": {"dir": str(tmp / "out")}, "schedule": schedule,
                                  "alerts": {"webhook_url_env": "CVM_TUNE_TEST_WEBHOOK"}})


def _service(tmp: Path, start: datetime, **schedule: Any) -> tuple[Service, FakeClock, Runner]:
    clock = FakeClock(start)
    runner = Runner(clock)
    return Service(_cfg(tmp, **schedule), clock=clock, runner=runner), clock, runner


def _statuses(svc: Service) -> dict[str, tuple[str, str | None]]:
    return {r.id: (r.status, r.reason) for r in svc.db.recent(100)}


def _run_ticks(svc: Service, clock: FakeClock, hours: float, every_min: float = 10) -> None:
    for _ in range(int(hours * 60 / every_min)):
        svc.tick()
        clock.advance(minutes=every_min)


# --- slots --------------------------------------------------------------------------------------------


def test_slot_arithmetic_utc() -> None:
    s = DailySchedule("02:00", "UTC")
    assert s.due(datetime(2026, 11, 23, 1, 59, tzinfo=UTC)).run_id == "nightly-2026-11-22"
    assert s.due(datetime(2026, 11, 23, 2, 0, tzinfo=UTC)).run_id == "nightly-2026-11-23"
    assert s.next(datetime(2026, 11, 23, 2, 0, tzinfo=UTC)).at == datetime(2026, 11, 24, 2, 0, tzinfo=UTC)
    assert [x.run_id for x in s.between(date(2026, 11, 20), date(2026, 11, 23))] == ["nightly-2026-11-21", "nightly-2026-11-22"]


def test_slot_instants_across_dst_gap_and_fold() -> None:
    s = DailySchedule("02:30", "Europe/Berlin")
    # Spring forward (02:00 -> 03:00 on 2026-03-29): 02:30 does not exist; it runs at 03:30 CEST.
    assert s.slot(date(2026, 3, 29)).at == datetime(2026, 3, 29, 1, 30, tzinfo=UTC)
    # Fall back (03:00 -> 02:00 on 2026-10-25): 02:30 happens twice; it runs at the first one (CEST).
    assert s.slot(date(2026, 10, 25)).at == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    assert s.slot(date(2026, 10, 26)).at == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)


@pytest.mark.parametrize("start", [datetime(2026, 3, 27, 12, tzinfo=UTC), datetime(2026, 10, 23, 12, tzinfo=UTC)])
def test_case50_dst_exactly_one_run_per_calendar_day(tmp_path: Path, start: datetime) -> None:
    """Case 50: TZ=Europe/Berlin, 02:30 local, clock stepped every 30 min across the gap / fold."""
    svc, clock, runner = _service(tmp_path, start, time="02:30", timezone="Europe/Berlin")
    _run_ticks(svc, clock, hours=4 * 24, every_min=30)
    days = [r.removeprefix("nightly-") for r in runner.ids]
    assert days == sorted(set(days)) and len(days) == 5  # the due slot at start + one per following day
    for run_id, at in runner.calls[1:]:
        local = at.astimezone(DailySchedule("02:30", "Europe/Berlin").zone)
        assert local.date().isoformat() == run_id.removeprefix("nightly-")  # each ran on its own calendar day


# --- downtime, clock jumps ------------------------------------------------------------------------------


def test_case44_down_over_the_slot_runs_one_catch_up(tmp_path: Path) -> None:
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 22, 3, 0, tzinfo=UTC))
    assert svc.tick() == "succeeded: nightly-2026-11-22"
    clock.advance(hours=30)  # "container down" from 03:00 on the 22nd to 09:00 on the 23rd: the 02:00 slot was missed
    assert svc.tick() == "succeeded: nightly-2026-11-23"  # caught up on start, under the slot's own run id
    assert svc.tick() == "idle: nightly-2026-11-23 succeeded"
    assert runner.ids == ["nightly-2026-11-22", "nightly-2026-11-23"]


def test_case45_down_three_days_coalesces_into_one_run(tmp_path: Path) -> None:
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 20, 2, 5, tzinfo=UTC))
    svc.tick()
    clock.advance(days=3, hours=6)
    svc.tick()
    svc.tick()
    assert runner.ids == ["nightly-2026-11-20", "nightly-2026-11-23"]
    st = _statuses(svc)
    for day in ("21", "22"):
        assert st[f"nightly-2026-11-{day}"] == ("skipped", "missed (service not running); coalesced into nightly-2026-11-23")


def test_case46_clock_jumps_forward_26h(tmp_path: Path) -> None:
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 20, 1, 0, tzinfo=UTC))
    _run_ticks(svc, clock, hours=2)  # the 20th at 02:00
    clock.jump(hours=26)
    _run_ticks(svc, clock, hours=3)
    assert runner.ids == ["nightly-2026-11-19", "nightly-2026-11-20", "nightly-2026-11-21"]
    assert len(set(runner.ids)) == len(runner.ids)


def test_case47_clock_jumps_backward_never_reruns(tmp_path: Path) -> None:
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 20, 2, 10, tzinfo=UTC))
    svc.tick()
    clock.jump(hours=-2)  # back before the 02:00 slot that just ran: the 19th's slot is due again by wall time
    assert svc.tick().startswith("idle: the clock (2026-11-20T00:10:00Z) is behind the newest slot")
    clock.jump(days=-3)
    assert svc.tick().startswith("idle: the clock")  # never reopens an old slot
    clock.jump(days=3, hours=2)
    assert svc.tick() == "idle: nightly-2026-11-20 succeeded"
    assert runner.ids == ["nightly-2026-11-20"]


# --- overrun, watchdog, failures ------------------------------------------------------------------------


def test_case48_overrun_skips_the_next_slot_and_alerts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[dict] = []
    monkeypatch.setattr(alerts, "send", lambda settings, event, output: sent.append(dict(event)) or True)
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 20, 2, 0, tzinfo=UTC), max_run_hours=48)
    runner.behaviour = lambda **_kw: clock.advance(hours=30)  # a 30 h run (the period is 24 h)
    assert svc.tick() == "succeeded: nightly-2026-11-20"
    runner.behaviour = None
    assert svc.tick() == "idle: nightly-2026-11-21 skipped"  # not run late, not overlapped
    assert _statuses(svc)["nightly-2026-11-21"] == ("skipped", "overlap: nightly-2026-11-20 was still running at this slot's time")
    assert {"event": "skipped", "run_id": "nightly-2026-11-21",
            "reason": "overlap: nightly-2026-11-20 was still running at this slot's time"} in sent
    clock.advance(hours=20)
    assert svc.tick() == "succeeded: nightly-2026-11-22"


def test_case48_watchdog_stops_a_run_at_a_step_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[dict] = []
    monkeypatch.setattr(alerts, "send", lambda settings, event, output: sent.append(dict(event)) or True)
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 20, 2, 0, tzinfo=UTC), max_run_hours=5)

    def long_training(*, should_stop: Any, on_step: Any, **_kw: Any) -> None:
        for step in range(1, 100):
            clock.advance(hours=1)
            on_step(step)
            if (reason := should_stop()) is not None:
                raise TrainingStopped(f"{reason}: stopped at step {step} after sealing checkpoint-{step}")

    runner.behaviour = long_training
    outcome = svc.tick()
    assert outcome == "failed: nightly-2026-11-20 attempt 1, retry in 60 s"
    status, reason = _statuses(svc)["nightly-2026-11-20"]
    assert status == "failed" and "watchdog: the run exceeded schedule.max_run_hours (5 h)" in reason
    assert "stopped at step 6" in reason
    assert sent[-1]["event"] == "failed" and "watchdog" in sent[-1]["reason"]


def test_case49_exception_in_the_job_retries_with_capped_backoff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[dict] = []
    monkeypatch.setattr(alerts, "send", lambda settings, event, output: sent.append(dict(event)) or True)
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 20, 2, 0, tzinfo=UTC), max_attempts=4,
                                  retry_backoff_s=60, retry_backoff_max_s=100)

    def boom(**_kw: Any) -> None:
        raise ZeroDivisionError("not a CvmTuneError")

    runner.behaviour = boom
    assert svc.tick() == "failed: nightly-2026-11-20 attempt 1, retry in 60 s"
    assert svc.tick() == "waiting: nightly-2026-11-20 retry at 2026-11-20T02:01:00Z"
    clock.advance(seconds=60)
    assert svc.tick() == "failed: nightly-2026-11-20 attempt 2, retry in 100 s"  # 120 s capped at 100 s
    clock.advance(seconds=100)
    runner.behaviour = lambda **_kw: (_ for _ in ()).throw(DataError("dataset file missing"))
    assert svc.tick() == "failed: nightly-2026-11-20 attempt 3, retry in 100 s"
    clock.advance(seconds=100)
    assert svc.tick() == "failed: nightly-2026-11-20 attempt 4, final"
    clock.advance(hours=1)
    assert svc.tick() == "idle: nightly-2026-11-20 failed"
    row = svc.db.get("nightly-2026-11-20")
    assert (row.attempts, row.reason, row.next_attempt_at) == (4, "DataError: dataset file missing", None)
    assert [e["attempt"] for e in sent if e["event"] == "failed"] == [1, 2, 3, 4]
    assert sent[0]["reason"] == "ZeroDivisionError: internal error (ZeroDivisionError)"
    runner.behaviour = None
    clock.advance(days=1)
    assert svc.tick() == "succeeded: nightly-2026-11-21"  # the service survived all of it


def test_case49_a_broken_tick_never_kills_the_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 20, 2, 0, tzinfo=UTC))
    monkeypatch.setattr(svc.db, "get", lambda _id: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    assert svc.tick() == "error: OSError: [Errno 5] Input/output error"
    monkeypatch.undo()
    assert svc.tick() == "succeeded: nightly-2026-11-20"


def test_sigterm_stop_is_not_an_attempt_and_resumes(tmp_path: Path) -> None:
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 20, 2, 0, tzinfo=UTC), max_attempts=1)

    def stopped(*, should_stop: Any, **_kw: Any) -> None:
        svc.request_stop("SIGTERM")
        raise TrainingStopped(f"{should_stop()}: stopped at step 3 after sealing checkpoint-3")

    runner.behaviour = stopped
    assert svc.tick() == "stopped: nightly-2026-11-20"
    row = svc.db.get("nightly-2026-11-20")
    assert (row.status, row.attempts) == ("pending", 0) and "SIGTERM received" in row.reason
    svc.stop_event.clear()
    runner.behaviour = None
    assert svc.tick() == "succeeded: nightly-2026-11-20"


def test_crash_counts_as_an_attempt_and_an_exported_run_is_recovered(tmp_path: Path) -> None:
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 20, 2, 0, tzinfo=UTC), max_attempts=2)
    svc.db.upsert("nightly-2026-11-20", slot="2026-11-20", slot_time="2026-11-20T02:00:00Z", status="running", attempts=2)
    assert svc.tick() == "failed: nightly-2026-11-20 gave up"  # crash loops are bounded
    assert "died" in svc.db.get("nightly-2026-11-20").reason
    clock.advance(days=1)
    bundle = tmp_path / "out" / "exports" / "nightly-2026-11-21"
    (bundle / "report").mkdir(parents=True)  # exported, then killed before the DB write
    (bundle / "report" / "report.json").write_text(json.dumps({"steps": 30, "losses": [[30, 5.9]]}))
    (bundle / "manifest.json").write_text(json.dumps({"audit": {"head": "ab" * 32}}))
    assert svc.tick() == "recovered: nightly-2026-11-21"
    assert runner.ids == []
    row = svc.db.get("nightly-2026-11-21")  # the row carries what the bundle says, not an empty record
    assert (row.status, row.metrics["steps"], row.audit_head) == ("succeeded", 30, "ab" * 32)


# --- lock (cases 42, 43) ---------------------------------------------------------------------------------


def test_case42_second_thread_is_skipped_locked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(tmp_path)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with run_lock(cfg.output.dir):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    try:
        outcome: list[str] = []
        other = threading.Thread(target=lambda: outcome.append(serve(cfg, once=True, progress=lambda _m: None)))
        other.start()
        other.join(10)
        assert outcome == ["skipped: locked"]
        assert "skipped: locked" in caplog.text
        with pytest.raises(Locked):
            with run_lock(cfg.output.dir):
                pass
    finally:
        release.set()
        t.join()
    assert not RunDB(cfg.output.dir).recent()  # the skipped one wrote nothing


# --- rollback anchor (case 41) and health ------------------------------------------------------------------


def test_case41_volume_rolled_back_behind_the_anchor_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    sent: list[dict] = []
    monkeypatch.setattr(alerts, "send", lambda settings, event, output: sent.append(dict(event)) or True)
    anchor = tmp_path / "elsewhere" / "anchor.json"
    clock = FakeClock(datetime(2026, 11, 20, 2, 0, tzinfo=UTC))
    cfg = Config.model_validate({"output": {"dir": str(tmp_path / "out")}, "state": {"rollback_anchor": str(anchor)}})
    svc = Service(cfg, clock=clock, runner=Runner(clock))
    assert svc.tick() == "succeeded: nightly-2026-11-20"
    svc.db.close()
    shutil.copytree(tmp_path / "out", tmp_path / "snapshot")  # yesterday's disk image
    svc = Service(cfg, clock=clock, runner=Runner(clock))
    clock.advance(days=1)
    assert svc.tick() == "succeeded: nightly-2026-11-21"
    svc.db.close()
    assert json.loads(anchor.read_text())["counter"] == 2
    shutil.rmtree(tmp_path / "out")
    shutil.copytree(tmp_path / "snapshot", tmp_path / "out")  # the host restores the old image
    clock.advance(days=1)
    runner = Runner(clock)
    svc = Service(cfg, clock=clock, runner=runner)
    outcome = svc.tick()
    assert outcome == "refused: rollback detected: the anchor has run counter 2, the volume 1"
    assert runner.ids == [] and sent[-1]["event"] == "rollback"
    ok, why = health(cfg, now=clock.now())
    assert not ok and "rollback detected" in why


def test_health_policy(tmp_path: Path) -> None:
    svc, clock, runner = _service(tmp_path, datetime(2026, 11, 20, 2, 0, tzinfo=UTC), max_attempts=1)
    cfg = svc.cfg
    assert health(cfg) == (False, "no heartbeat (the service is not running on this volume)")
    svc.tick()
    assert health(cfg)[0] is True
    late = datetime.now(UTC) + timedelta(seconds=cfg.schedule.health_max_age_s + 5)
    ok, why = health(cfg, now=late)
    assert not ok and "heartbeat is" in why
    runner.behaviour = lambda **_kw: (_ for _ in ()).throw(StateError("disk full"))
    clock.advance(days=1)
    svc.tick()
    ok, why = health(cfg)
    assert not ok and why == "nightly-2026-11-21 failed and will not be retried: StateError: disk full"


# --- alerts -------------------------------------------------------------------------------------------------


class _Hook(BaseHTTPRequestHandler):
    codes: list[int] = []
    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(self.codes.pop(0) if self.codes else 200)
        self.end_headers()

    def log_message(self, *_a: Any) -> None:
        pass


@pytest.fixture
def webhook():
    _Hook.codes, _Hook.bodies = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", _Hook
    server.shutdown()


def test_alert_retries_then_delivers_metadata_only(webhook: Any, tmp_path: Path) -> None:
    url, hook = webhook
    hook.codes = [503, 429]
    waits: list[float] = []
    settings = AlertSettings(retries=3, retry_backoff_s=0.5)
    long_reason = "line one\nline two " + "x" * 1000
    ok = alerts.send(settings, {"event": "failed", "run_id": "nightly-2026-11-20", "reason": long_reason, "attempt": 2,
                                "rows": ["must not be sent"]},
                     output=tmp_path, env={"CVM_TUNE_ALERT_WEBHOOK": url}, sleep=waits.append)
    assert ok and waits == [0.5, 1.0] and len(hook.bodies) == 3
    body = json.loads(hook.bodies[-1])
    assert set(body) == {"schema", "time", "output", "host", "event", "run_id", "reason", "attempt"}
    assert body["reason"].startswith("line one line two") and len(body["reason"]) == 300 and body["attempt"] == 2


def test_alert_gives_up_on_4xx_and_without_url(webhook: Any, tmp_path: Path) -> None:
    url, hook = webhook
    hook.codes = [404]
    assert not alerts.send(AlertSettings(), {"event": "failed"}, output=tmp_path, env={"CVM_TUNE_ALERT_WEBHOOK": url},
                           sleep=lambda _s: None)
    assert len(hook.bodies) == 1
    assert not alerts.send(AlertSettings(), {"event": "failed"}, output=tmp_path, env={}, sleep=lambda _s: None)
    assert not alerts.send(AlertSettings(retries=1), {"event": "failed"}, output=tmp_path,  # nobody listening
                           env={"CVM_TUNE_ALERT_WEBHOOK": "http://127.0.0.1:9/"}, sleep=lambda _s: None)


# --- with the real pipeline -----------------------------------------------------------------------------------

CANARY = "CANARY-7f3a-row-content-must-not-be-alerted"


def test_failed_real_run_alerts_without_dataset_content(tmp_path: Path, webhook: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataset with a bad row (holding a canary) fails the run: recorded, alerted, retried; no content leaks."""
    from app.dataset import encrypt_file, write_key_file

    url, hook = webhook
    plain = tmp_path / "d.jsonl"
    plain.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": CANARY, "extra": CANARY}) + "\n")
    write_key_file(tmp_path / "k", bytes(range(32)))
    encrypt_file(plain, tmp_path / "d.cvmds", bytes(range(32)), dataset_id="canary")
    cfg = Config.model_validate({
        "output": {"dir": str(tmp_path / "out")}, "alerts": {"webhook_url_env": "CVM_TUNE_TEST_WEBHOOK"},
        "dataset": {"source": "encrypted-file", "path": str(tmp_path / "d.cvmds"),
                    "key": {"source": "file", "file": str(tmp_path / "k")}}})
    monkeypatch.setenv("CVM_TUNE_TEST_WEBHOOK", url)
    svc = Service(cfg, clock=FakeClock(datetime(2026, 11, 20, 2, 0, tzinfo=UTC)))
    assert svc.tick() == "failed: nightly-2026-11-20 attempt 1, retry in 60 s"
    row = svc.db.get("nightly-2026-11-20")
    assert row.status == "failed" and row.reason.startswith("RowError: ") and "line 2" in row.reason
    body = json.loads(hook.bodies[-1])
    assert body["event"] == "failed" and body["run_id"] == "nightly-2026-11-20" and body["attempt"] == 1
    everything = b"".join(hook.bodies) + (tmp_path / "out" / "state" / "runs.sqlite").read_bytes()
    assert CANARY.encode() not in everything


def test_disk_full_during_export_fails_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 35 (export side): ENOSPC while staging the bundle -> exit 7, no bundle, no temp dir, checkpoints kept."""
    import errno

    from app.export import report
    from app.cli import main
    from app.training.checkpoints import latest_name

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({"output": {"dir": str(tmp_path / "out")}, "training": {"max_steps": 4, "save_steps": 2}}))

    def full(*_a: Any, **_k: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "write", full)
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 7
    assert list((tmp_path / "out" / "exports").iterdir()) == []  # nothing that looks complete, no .tmp- left
    assert latest_name(tmp_path / "out" / "runs" / "r1" / "checkpoints") == "checkpoint-4"
    monkeypatch.undo()
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 0  # space freed: resumes and exports
    manifest = json.loads((tmp_path / "out" / "exports" / "r1" / "manifest.json").read_text())
    assert manifest["training"]["resumed_from_step"] == 4


def test_status_command_prints_a_table_and_health(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(json.dumps({"output": {"dir": str(tmp_path / "out")}}))
    assert main(["status", "--health", "--config", str(cfg_file)]) == 1
    assert "no heartbeat" in capsys.readouterr().out
    clock = FakeClock(datetime(2026, 11, 20, 3, 0, tzinfo=UTC))
    svc = Service(Config.model_validate({"output": {"dir": str(tmp_path / "out")}}), clock=clock, runner=Runner(clock))
    svc.tick()
    clock.advance(days=2)
    svc.tick()
    assert main(["status", "--config", str(cfg_file)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("cvm-tune service on ") and out[1].startswith("heartbeat: ") and out[2].startswith("next slot: ")
    assert out[4].split() == ["RUN", "ID", "SLOT", "(UTC)", "STATUS", "TRY", "FINISHED", "(UTC)", "STEPS", "LOSS", "REASON", "/", "BUNDLE"]
    assert out[5].split()[:4] == ["nightly-2026-11-22", "2026-11-22", "02:00:00", "succeeded"]
    assert out[5].split()[-3:] == ["3", "1.2500", "/exports/nightly-2026-11-22"]
    assert "skipped" in out[6] and "missed (service not running)" in out[6]
    assert main(["status", "--health", "--config", str(cfg_file)]) == 0
    doc = json.loads((main(["status", "--json", "--config", str(cfg_file)]), capsys.readouterr().out)[1].split("\n", 1)[1])
    assert doc["schema"] == "cvm-tune/status/v1" and [r["status"] for r in doc["runs"]] == ["succeeded", "skipped", "succeeded"]
