"""The engine's one worker thread and its queue: jobs run one after another, each model's in the order they were
accepted; forward_backward jobs of different models that are waiting together run as one packed pass.

A job names the model it acts on (None: it acts on none, e.g. a sample of a saved checkpoint). When the worker takes
a forward_backward job, it also takes every later forward_backward job in the queue that is the first job of its
model (no earlier job of that model is waiting), up to the pass's memory budget, and hands them to ``batch`` at once;
then it runs each taken job, whose result is ready. Jobs of one model never overtake each other, and no model has
two ops in a pass.

A job marked ``ahead`` (an optimizer step: quick, and its model's barrier) that is its model's first waiting job is
taken before a waiting pass: while it runs, other models' forward_backward jobs gather for that pass, which then
serves more models at once (tenants stepping together fall into step with each other).

A sample job that may decode with others (``sample`` set: the engine decides which) takes along every other such
job waiting anywhere in the queue, up to :data:`SAMPLE_JOBS` (samples act on no model, so nothing they pass can
depend on them), and hands their requests to ``decode`` at once: one batch whose rows are all their sequences.

With a gather window (``wait_s`` > 0), a pass also waits for the next forward_backward of every model whose last
pass ended in the last :data:`ACTIVE_S` and that has no job waiting (its client is between two steps): until they
all came, a stop is queued, the window passed, or as long as the previous pass took, whichever comes first. A lone
model never waits; a pass of many models costs less than its models' passes one by one. A sample batch waits the
same way (its own window, ``sample_wait_s``) for every sampler (``sample.who``: a tenant's sampling session) whose last decode ended in the last
:data:`ACTIVE_S`, as long as the previous decode took at most.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.api.errors import ApiError

logger = logging.getLogger(__name__)


@dataclass
class Job:
    run: Callable[[], None]
    model: str | None = None
    op: Any = None  # a forward_backward op (app.api.wire.Op) that may join a packed pass; None: runs alone
    cost: int = 0  # what the op's pass takes (bytes), against the budget
    ahead: bool = False  # taken before a waiting pass, once it is its model's first waiting job
    sample: Any = None  # a sample request that may decode in one batch with other waiting ones; None: runs alone


ACTIVE_S = 0.1  # a model whose pass ended this recently is waited for by the next pass (gather window)
FLOOR_FRACTION = 16  # the pass budget never drops under 1/16 of its start, and climbs back by as much a pass
SAMPLE_JOBS = 8  # sample requests decoded in one batch at most (each its own adapter: the engine keeps 8 loaded)


class Worker:
    def __init__(self, batch: Callable[[list[Any]], None], budget: int, wait_s: float = 0.0,
                 decode: Callable[[list[Any]], None] | None = None, sample_wait_s: float = 0.0) -> None:
        """``batch(ops)``: run the ops as one pass and keep each op's result for its job; ``wait_s``: the gather
        window (0: a pass takes what is waiting, never waits); ``decode(requests)``: decode sample requests as one
        batch and keep each one's result for its job; ``sample_wait_s``: the sample batches' gather window."""
        self.batch, self.budget, self.wait_s, self.decode = batch, budget, wait_s, decode
        self.sample_wait_s = sample_wait_s
        self.initial = budget  # what a pass may hold at start; out-of-memory lowers ``budget`` for a while
        self._active: dict[str, float] = {}  # model -> when its last pass ended (time.monotonic)
        self._last_pass = 0.0  # how long the last pass took (s)
        self._samplers: dict[str, float] = {}  # sampler (SampleItem.who) -> when its last decode ended
        self._last_decode = 0.0  # how long the last decode of joinable sample requests took (s)
        self.stats = {"passes": 0, "packed_ops": 0, "largest": 0,  # packed passes of more than one op
                      "sample_batches": 0, "batched_samples": 0, "largest_sample_batch": 0}  # and sample batches
        self._jobs: collections.deque[Job | None] = collections.deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="api-engine", daemon=True)
        self._thread.start()

    def lower(self, tried: int, ops: int, device: str) -> None:
        """A packed pass of ``ops`` ops that held ``tried`` bytes ran out of memory (the allocator's error, in the
        pass itself: an op's own failure fails that op alone): later passes hold half of it, never more than before,
        and never under :data:`FLOOR_FRACTION` of the start budget (one pass, however small, must not turn packing
        off)."""
        self.budget = max(self.initial // FLOOR_FRACTION, min(self.budget, tried // 2))
        logger.warning("a packed pass of %d ops ran out of memory on %s; passes now hold at most %d MiB", ops, device,
                       self.budget >> 20)

    def recover(self) -> None:
        """A packed pass fit: the budget climbs back by a :data:`FLOOR_FRACTION` of the start, up to the start (a
        device whose memory was short for a while packs as before some passes later)."""
        self.budget = min(self.initial, self.budget + max(self.initial // FLOOR_FRACTION, 1))

    def submit(self, job: Job) -> None:
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()

    def stop(self, wait_s: float = 0.0) -> None:
        """Stop after the job running, if any (waiting up to ``wait_s`` for it); jobs still queued never run: their
        futures stay pending, and the next start fails them, as after a kill."""
        with self._cv:
            self._jobs.appendleft(None)
            self._cv.notify()
        if wait_s > 0 and threading.current_thread() is not self._thread:
            self._thread.join(wait_s)

    def _take(self) -> list[Job] | None:
        """The next job, and the packed-pass companions it takes along (None: stop)."""
        with self._cv:
            while not self._jobs:
                self._cv.wait()
            first = self._first()
            if first is None:
                return None
            taken = [first]
            if first.sample is not None:
                return self._samples(taken)
            if first.op is None or first.cost > self.budget:
                return taken
            now = time.monotonic()
            deadline = now + min(self.wait_s, self._last_pass)
            self._active = {m: t for m, t in self._active.items() if now - t < ACTIVE_S}
            while True:
                self._gather(taken)
                left = deadline - time.monotonic()
                if left <= 0 or None in self._jobs or not self._awaited(taken):
                    return taken
                self._cv.wait(left)  # a job's arrival wakes it

    def _samples(self, taken: list[Job]) -> list[Job]:
        """Move every waiting sample job that may join into ``taken``, up to :data:`SAMPLE_JOBS`, waiting for the
        active samplers that have none queued (called holding the lock)."""
        now = time.monotonic()
        deadline = now + min(self.sample_wait_s, self._last_decode)
        self._samplers = {who: t for who, t in self._samplers.items() if now - t < ACTIVE_S}
        while True:
            more = [j for j in self._jobs if j is not None and j.sample is not None][:SAMPLE_JOBS - len(taken)]
            for job in more:
                self._jobs.remove(job)
            taken += more
            awaited = self._samplers.keys() - {j.sample.who for j in taken}
            left = deadline - time.monotonic()
            if left <= 0 or len(taken) >= SAMPLE_JOBS or None in self._jobs or not awaited:
                return taken
            self._cv.wait(left)  # a job's arrival wakes it

    def _awaited(self, taken: list[Job]) -> set[str]:
        """The active models a pass of ``taken`` still waits for: neither in it nor with a job waiting (called
        holding the lock, no stop queued)."""
        return self._active.keys() - {j.model for j in self._jobs} - {j.model for j in taken}  # type: ignore[union-attr]

    def _gather(self, taken: list[Job]) -> None:
        """Move into ``taken`` every waiting forward_backward job that is its model's first waiting job, no model
        twice, within the budget (called holding the lock)."""
        seen, cost = {j.model for j in taken}, sum(j.cost for j in taken)
        for job in list(self._jobs):
            if job is None:
                break
            if job.model is None:
                continue
            if job.model not in seen and job.op is not None and cost + job.cost <= self.budget:
                taken.append(job)
                cost += job.cost
                self._jobs.remove(job)
            seen.add(job.model)  # a model's later jobs wait behind this one

    def _first(self) -> Job | None:
        """The queue's head, or the first ``ahead`` job that is its model's first waiting job (called holding the
        lock, the queue not empty)."""
        seen: set[str | None] = set()
        for job in self._jobs:
            if job is None or job.op is None and not job.ahead:
                break  # a stop, or a job that is neither a pass nor ahead: nothing overtakes it
            if job.ahead and job.model not in seen:
                self._jobs.remove(job)
                return job
            seen.add(job.model)
        return self._jobs.popleft()

    def _work(self) -> None:
        while (taken := self._take()) is not None:
            start = time.monotonic()
            if len(taken) > 1 and taken[0].sample is not None and self.decode is not None:
                self._count("sample_batches", "batched_samples", "largest_sample_batch", len(taken))
                try:
                    self.decode([job.sample for job in taken])
                except Exception:  # each job then decodes alone and reports its own failure
                    logger.exception("a batch of %d sample requests failed; they decode one at a time", len(taken))
            elif len(taken) > 1:
                self._count("passes", "packed_ops", "largest", len(taken))
                try:
                    self.batch([job.op for job in taken])
                except Exception:  # each job then runs its op alone and reports its own failure
                    logger.exception("packed pass failed; its ops run one at a time")
            for job in taken:
                try:
                    job.run()
                except Exception:  # a job reports its own failure; this only keeps the worker alive
                    logger.exception("engine job failed")
            if taken[0].op is not None:  # a pass: its models are active, and its length bounds the next wait
                end = time.monotonic()
                self._last_pass = end - start
                self._active.update((j.model, end) for j in taken if j.model is not None)
            elif taken[0].sample is not None:  # a decode: its samplers are active, its length bounds the next wait
                end = time.monotonic()
                self._last_decode = end - start
                self._samplers.update((j.sample.who, end) for j in taken)

    def _count(self, batches: str, jobs: str, largest: str, n: int) -> None:
        self.stats[batches] += 1
        self.stats[jobs] += n
        self.stats[largest] = max(self.stats[largest], n)


def run_job(fn: Callable[[], tuple[bool, str, bytes]], finish: Callable[[bool, str, bytes], None]) -> Callable[[], None]:
    """A worker job: ``fn``'s result, or its refusal (category user) or failure (category server), is recorded."""
    import json

    def job() -> None:
        try:
            ok, ctype, body = fn()
        except ApiError as exc:
            ok, ctype, body = False, "application/json", json.dumps({"error": str(exc), "category": "user"}).encode()
        except Exception as exc:  # an engine failure fails this future only; the server keeps serving
            logger.exception("operation failed")
            ok, ctype, body = False, "application/json", json.dumps(
                {"error": f"{type(exc).__name__}: {exc}", "category": "server"}).encode()
        finish(ok, ctype, body)

    return job
