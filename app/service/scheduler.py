"""The nightly service (``cvm-tune serve``): one attested run per calendar day, never two at once.

``schedule`` drives the loop (a periodic tick plus a wake-up at the configured time), but it keeps
no state, forgets missed runs and knows no time zone without pytz, so every decision is made by
:meth:`Service.tick` from the run database and slot arithmetic on an injectable clock:

* **Slots** (:class:`DailySchedule`): one per local calendar date in ``schedule.timezone``; its
  instant is ``date + schedule.time`` in that zone (a spring-gap time maps to the first valid instant
  after it, an autumn-fold time to its first occurrence), so DST never doubles or drops a day.
  The run id ``nightly-YYYY-MM-DD`` names the slot, and a slot runs at most once ever.
* **Due slot**: the newest slot whose instant has passed. Missed older slots are recorded
  ``skipped`` and coalesced into the due one (one catch-up run after any downtime). A clock that
  went backwards never reopens a slot older than the newest one recorded.
* **Attempts**: an exception never escapes a tick; a failed run is retried with capped exponential
  backoff, at most ``schedule.max_attempts`` times, and only while its slot is the due one.
  A crash (row still ``running`` at the next start) counts as an attempt; a SIGTERM stop does not.
* **Overrun**: a slot whose instant passed while a run was going is recorded ``skipped`` (overlap),
  never run late; the watchdog (``schedule.max_run_hours``, monotonic clock) checkpoints and stops
  a run that is still training.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from datetime import time as dtime
from pathlib import Path
from typing import Any, Protocol
from zoneinfo import ZoneInfo

from app import alerts
from app.audit import AuditLog
from app.config import Config
from app.errors import (CvmTuneError, DatasetRollbackError, InputsUnchanged, PrivacyBudgetError, PrivacyLedgerError,
                        PromotionStateError)
from app.state import (
    Locked,
    RollbackDetected,
    RunDB,
    RunRow,
    check_anchor,
    iso,
    parse_iso,
    publish_anchor,
    read_heartbeat,
    run_lock,
    write_heartbeat,
)

logger = logging.getLogger(__name__)
RUN_ID_PREFIX = "nightly-"
MAX_SKIP_ROWS = 62  # missed slots recorded one by one after downtime; a longer gap is one summary row


class Clock(Protocol):
    """Wall time (aware, UTC) for slots; monotonic time for durations."""

    def now(self) -> datetime: ...

    def monotonic(self) -> float: ...


class SystemClock:
    """The real clocks."""

    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    def monotonic(self) -> float:
        return time.monotonic()


@dataclass(frozen=True)
class Slot:
    """One scheduled run: a local calendar date and its UTC instant."""

    day: date
    at: datetime

    @property
    def run_id(self) -> str:
        return f"{RUN_ID_PREFIX}{self.day.isoformat()}"


class DailySchedule:
    """Slot arithmetic for ``HH:MM`` in an IANA zone."""

    def __init__(self, hhmm: str, zone: str) -> None:
        hour, minute = (int(x) for x in hhmm.split(":"))
        self.time = dtime(hour, minute)
        self.zone = ZoneInfo(zone)

    def slot(self, day: date) -> Slot:
        # fold=0: a nonexistent (gap) time takes the offset before the transition, which lands on the
        # first valid instant after it; an ambiguous (fold) time means its first occurrence.
        local = datetime.combine(day, self.time, tzinfo=self.zone)
        return Slot(day, local.astimezone(timezone.utc))

    def due(self, now: datetime) -> Slot:
        """The newest slot whose instant is <= ``now``."""
        today = now.astimezone(self.zone).date()
        slot = self.slot(today)
        return slot if slot.at <= now else self.slot(today - timedelta(days=1))

    def next(self, now: datetime) -> Slot:
        """The first slot whose instant is > ``now``."""
        return self.slot(self.due(now).day + timedelta(days=1))

    def between(self, after: date, upto: date) -> list[Slot]:
        """Slots for the dates strictly after ``after`` and strictly before ``upto``."""
        days = (upto - after).days
        return [self.slot(after + timedelta(days=i)) for i in range(1, max(days, 0))]


class Service:
    """Decides and runs what is due. ``tick()`` is the whole policy; ``serve()`` loops it."""

    def __init__(self, cfg: Config, *, clock: Clock | None = None, runner: Callable[..., Any] | None = None,
                 progress: Callable[[str], None] = lambda _m: None) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output.dir).resolve()
        self.clock = clock or SystemClock()
        self.schedule = DailySchedule(cfg.schedule.time, cfg.schedule.timezone)
        self.db = RunDB(self.out)
        self.runner = runner or self._run_pipeline
        self.progress = progress
        self.stop_event = threading.Event()
        self.stop_reason: str | None = None
        self.current: dict[str, Any] = {"state": "idle"}
        self._deadline: float | None = None

    # --- signals, heartbeat ------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Stop scheduling; a run in progress checkpoints at its next step boundary (signal-safe)."""
        self.stop_reason = reason
        self.stop_event.set()

    def _should_stop(self) -> str | None:
        if self.stop_event.is_set():
            return f"{self.stop_reason or 'stop'} received"
        if self._deadline is not None and self.clock.monotonic() > self._deadline:
            return f"watchdog: the run exceeded schedule.max_run_hours ({self.cfg.schedule.max_run_hours:g} h)"
        return None

    def heartbeat(self) -> None:
        try:
            write_heartbeat(self.out, next_slot=iso(self.schedule.next(self.clock.now()).at), **self.current)
        except OSError as exc:
            logger.warning("cannot write the heartbeat: %s", exc.strerror)

    # --- the policy --------------------------------------------------------------------------------

    def tick(self) -> str:
        """Run whatever is due (at most one attempt); returns what happened. Never raises."""
        try:
            outcome = self._tick()
        except Exception as exc:  # G7: nothing inside a tick kills the service
            logger.exception("service tick failed")
            outcome = f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._alert("service.error", reason=outcome)
        self.current = {"state": "idle", "last_outcome": outcome}
        self.heartbeat()
        return outcome

    def _tick(self) -> str:
        now = self.clock.now()
        try:
            self._check_rollback()
        except RollbackDetected as exc:
            self._alert("rollback", reason=exc.message)
            return f"refused: {exc.message}"
        due = self.schedule.due(now)
        for row in self.db.unfinished():  # older unfinished slots are superseded by the due one
            if row.slot < due.day.isoformat():
                self._finish(row.id, row, "skipped", f"superseded by {due.run_id} (coalesced catch-up)")
        row = self.db.get(due.run_id)
        if row is None:
            newest = self.db.newest_slot()
            if newest is not None and due.day.isoformat() < newest:
                return f"idle: the clock ({iso(now)}) is behind the newest slot {newest}; not reopening old slots"
            self._record_missed(date.fromisoformat(newest) if newest else None, due)
        elif row.final:
            return f"idle: {row.id} {row.status}"
        elif row.status == "failed" and row.next_attempt_at and now < parse_iso(row.next_attempt_at):
            return f"waiting: {row.id} retry at {row.next_attempt_at}"
        return self._attempt(due, row)

    def _record_missed(self, newest: date | None, due: Slot) -> None:
        if newest is None:
            return
        missed = self.schedule.between(newest, due.day)
        for slot in missed[-MAX_SKIP_ROWS:]:
            self.db.upsert(slot.run_id, slot=slot.day.isoformat(), slot_time=iso(slot.at), status="skipped",
                           reason=f"missed (service not running); coalesced into {due.run_id}")
        if missed:
            self._alert("skipped", run_id=due.run_id, reason=f"{len(missed)} missed slot(s) coalesced into {due.run_id}")

    def _attempt(self, slot: Slot, row: RunRow | None) -> str:
        from app.training import TrainingStopped

        run_id, sched = slot.run_id, self.cfg.schedule
        if (self.out / "exports" / run_id).is_dir():  # exported, but the process died before recording it
            refused = self._record_outcome(self.out / "exports" / run_id)  # the pointers may lag the export
            if (run := self.db.run(run_id)) is not None and run.status != "exported":  # so may the runs ledger
                self.db.finish_run(run_id, bundle=str(self.out / "exports" / run_id), finished_at=iso(self.clock.now()))
            self._finish(run_id, row, "succeeded", "recovered: the bundle was already exported"
                         + (f"; {refused}" if refused else ""),
                         bundle=str(self.out / "exports" / run_id), **_bundle_record(self.out / "exports" / run_id))
            return f"recovered: {run_id}"
        recovered_crash = row is not None and row.status == "running"
        attempts = (row.attempts if row else 0) + 1
        if attempts > sched.max_attempts:
            self._finish(run_id, row, "failed", f"gave up after {sched.max_attempts} attempts"
                         + (" (the last one died: kill -9 or power loss)" if recovered_crash else ""))
            self._alert("failed", run_id=run_id, reason="gave up", attempt=attempts - 1)
            return f"failed: {run_id} gave up"
        start = self.clock.now()
        self.db.upsert(run_id, slot=slot.day.isoformat(), slot_time=iso(slot.at), status="running", attempts=attempts,
                       reason=None, next_attempt_at=None, started_at=row.started_at if row and row.started_at else iso(start))
        self.current = {"state": "running", "run_id": run_id, "attempt": attempts, "step": None}
        self.heartbeat()
        self.progress(f"service: {run_id} attempt {attempts}/{sched.max_attempts}"
                      + (" (resuming after a crash)" if recovered_crash else ""))
        self._deadline = self.clock.monotonic() + sched.max_run_hours * 3600
        try:
            result = self.runner(run_id=run_id, slot=slot, should_stop=self._should_stop, on_step=self._on_step)
        except InputsUnchanged as exc:
            self._finish(run_id, None, "skipped", exc.message)
            outcome = f"skipped: {run_id} {exc.message}"
        except TrainingStopped as exc:
            if self.stop_event.is_set():  # SIGTERM: not a failure, not an attempt
                self.db.upsert(run_id, slot=slot.day.isoformat(), slot_time=iso(slot.at), status="pending",
                               attempts=attempts - 1, reason=f"stopped: {exc.message}")
                outcome = f"stopped: {run_id}"
            else:
                outcome = self._failed(slot, attempts, exc)
        except Exception as exc:
            outcome = self._failed(slot, attempts, exc)
        else:
            refused = getattr(result, "promotion_refused", None)
            reason = "; ".join(r for r in (refused, getattr(result, "note", None)) if r) or None
            self._finish(run_id, None, "succeeded", reason, bundle=str(result.bundle_dir), metrics=result.report,
                         audit_head=result.audit_head)
            outcome = f"succeeded: {run_id}" + (f" ({refused})" if refused else "")
            if refused:
                self._alert("promotion_refused", run_id=run_id, reason=refused)
        finally:
            self._deadline = None
        self._skip_overrun(slot, start)
        return outcome

    def _record_outcome(self, bundle: Path) -> str | None:
        from app.run.continual import init_mode, record_outcome

        try:
            return record_outcome(self.out, bundle, lineage=init_mode(self.cfg, service=True) == "previous")[1]
        except (OSError, ValueError, KeyError, TypeError, CvmTuneError) as exc:
            logger.warning("%s: cannot read its promotion decision (%s); exports/PROMOTED left as it was",
                           bundle.name, type(exc).__name__)
            return None

    def _on_step(self, step: int) -> None:
        self.current["step"] = step

    def _failed(self, slot: Slot, attempts: int, exc: BaseException) -> str:
        sched, now = self.cfg.schedule, self.clock.now()
        kind = type(exc).__name__
        message = exc.message if isinstance(exc, CvmTuneError) else f"internal error ({kind})"
        logger.warning("%s failed: %s", slot.run_id, message)
        # A rolled-back dataset stays rolled back within the night, a spent privacy budget spent, state that disagrees
        # with the audit chain disagrees: never retried.
        retry = (attempts < sched.max_attempts and self.schedule.due(now) == slot
                 and not isinstance(exc, (DatasetRollbackError, PrivacyBudgetError,  # refused for the whole night
                                          PrivacyLedgerError, PromotionStateError)))
        backoff = min(sched.retry_backoff_s * 2 ** (attempts - 1), sched.retry_backoff_max_s)
        self._finish(slot.run_id, None, "failed", f"{kind}: {message}",
                     next_attempt_at=iso(now + timedelta(seconds=backoff)) if retry else None)
        self._alert("failed", run_id=slot.run_id, reason=f"{kind}: {message}", attempt=attempts,
                    retry_at=iso(now + timedelta(seconds=backoff)) if retry else None)
        return f"failed: {slot.run_id} attempt {attempts}" + (f", retry in {backoff:g} s" if retry else ", final")

    def _skip_overrun(self, slot: Slot, start: datetime) -> None:
        """Slots whose instant passed while this run was going are skipped, never run late (case 48)."""
        end = self.clock.now()
        for later in self.schedule.between(slot.day, self.schedule.due(end).day + timedelta(days=1)):
            if start < later.at <= end and self.db.get(later.run_id) is None:
                reason = f"overlap: {slot.run_id} was still running at this slot's time"
                self.db.upsert(later.run_id, slot=later.day.isoformat(), slot_time=iso(later.at), status="skipped",
                               reason=reason)
                self._alert("skipped", run_id=later.run_id, reason=reason)

    def _finish(self, run_id: str, row: RunRow | None, status: str, reason: str | None, **fields: Any) -> None:
        slot = self.schedule.slot(date.fromisoformat(run_id.removeprefix(RUN_ID_PREFIX)))
        self.db.upsert(run_id, slot=slot.day.isoformat(), slot_time=iso(slot.at), status=status, reason=reason,
                       finished_at=iso(self.clock.now()), next_attempt_at=fields.pop("next_attempt_at", None), **fields)
        publish_anchor(self.cfg.state.rollback_anchor, counter=self.db.counter(), audit_head=self._audit().head)

    def _audit(self) -> AuditLog:
        return AuditLog(self.out / "state" / "audit.jsonl")

    def _check_rollback(self) -> None:
        if self.cfg.state.rollback_anchor is None:
            return
        check_anchor(self.cfg.state.rollback_anchor, counter=self.db.counter(),
                     audit_hashes={e.hash for e in self._audit().entries})

    def _alert(self, event: str, **fields: Any) -> None:
        alerts.send(self.cfg.alerts, {"event": event, **fields}, output=self.out)

    def _run_pipeline(self, *, run_id: str, slot: Slot, should_stop: Callable[[], str | None],
                      on_step: Callable[[int], None]) -> Any:
        from app.run.pipeline import RunHooks, run_once

        hooks = RunHooks(should_stop=should_stop, on_step=on_step, slot=iso(slot.at), service=True)
        return run_once(self.cfg, progress=self.progress, run_id=run_id, hooks=hooks)


def serve(cfg: Config, *, once: bool, progress: Callable[[str], None], clock: Clock | None = None) -> str:
    """``cvm-tune serve``: hold the volume's lock and run what is due (once, or until SIGTERM).

    Returns:
        ``"skipped: locked"`` when another process or thread holds the lock, else the last outcome.
    """
    import signal

    import schedule as schedule_lib

    out = Path(cfg.output.dir).resolve()
    try:
        with run_lock(out):
            service = Service(cfg, clock=clock, progress=progress)
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGINT):  # a handler makes SIGTERM work for PID 1 too
                    signal.signal(sig, lambda signum, _f: service.request_stop(signal.Signals(signum).name))
            if once:
                return service.tick()
            beat = threading.Thread(target=_beat, args=(service,), name="cvm-tune-heartbeat", daemon=True)
            beat.start()
            jobs = schedule_lib.Scheduler()
            jobs.every(cfg.schedule.tick_s).seconds.do(service.tick)
            jobs.every().day.at(cfg.schedule.time, cfg.schedule.timezone).do(service.tick)  # wake-up at the slot
            outcome = service.tick()  # at start: catch up at once
            progress(f"service: {outcome}; next slot {iso(service.schedule.next(service.clock.now()).at)}")
            while not service.stop_event.is_set():
                jobs.run_pending()
                idle = jobs.idle_seconds
                service.stop_event.wait(timeout=max(0.2, min(cfg.schedule.tick_s, idle if idle is not None else 1.0)))
            progress(f"service: stopping ({service.stop_reason})")
            return "stopped"
    except Locked as exc:
        logger.warning("skipped: locked (%s is held by another cvm-tune process)", exc)
        return "skipped: locked"


def _beat(service: Service) -> None:
    """Heartbeat thread: proves the process is alive even while a run holds the main thread (model loading)."""
    while not service.stop_event.wait(service.cfg.schedule.tick_s):
        try:
            service.heartbeat()
        except Exception:  # never let the heartbeat thread die silently
            logger.exception("heartbeat failed")


def _bundle_record(bundle: Path) -> dict[str, Any]:
    """Metrics and audit head of an exported bundle, for a run whose database row was lost (kill -9 between the
    export's rename and the row update, or a deleted run database): the bundle holds the same report."""
    record: dict[str, Any] = {}
    try:
        record["metrics"] = json.loads((bundle / "report" / "report.json").read_bytes())
    except (OSError, ValueError):
        pass
    try:
        record["audit_head"] = json.loads((bundle / "manifest.json").read_bytes())["audit"]["head"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return record


def health(cfg: Config, *, now: datetime | None = None) -> tuple[bool, str]:
    """``cvm-tune status --health``: fresh heartbeat and the newest slot not finally failed."""
    out = Path(cfg.output.dir).resolve()
    beat = read_heartbeat(out)
    now = now or datetime.now(timezone.utc)
    if beat is None:
        return False, "no heartbeat (the service is not running on this volume)"
    age = now.timestamp() - float(beat["unix"])
    if age > cfg.schedule.health_max_age_s:
        return False, f"heartbeat is {age:.0f} s old (limit {cfg.schedule.health_max_age_s:g} s)"
    if "refused" in str(beat.get("last_outcome", "")):
        return False, str(beat["last_outcome"])
    db = RunDB.existing(out)
    rows = db.recent(1) if db is not None else []
    if rows and rows[0].status == "failed" and rows[0].next_attempt_at is None:
        return False, f"{rows[0].id} failed and will not be retried: {rows[0].reason}"
    return True, f"healthy: heartbeat {age:.0f} s old, {beat.get('state')}"
