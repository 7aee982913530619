"""The engine's one worker thread and its queue: jobs run one after another, each model's in the order they were
accepted; forward_backward jobs of different models that are waiting together run as one packed pass.

A job names the model it acts on (None: it acts on none, e.g. a sample of a saved checkpoint). When the worker takes
a forward_backward job, it also takes every later forward_backward job in the queue that is the first job of its
model (no earlier job of that model is waiting), up to the pass's memory budget, and hands them to ``batch`` at once;
then it runs each taken job, whose result is ready. Jobs of one model never overtake each other, and no model has
two ops in a pass.
"""

from __future__ import annotations

import collections
import logging
import threading
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


class Worker:
    def __init__(self, batch: Callable[[list[Any]], None], budget: int) -> None:
        """``batch(ops)``: run the ops as one pass and keep each op's result for its job."""
        self.batch, self.budget = batch, budget
        self.stats = {"passes": 0, "packed_ops": 0, "largest": 0}  # packed passes of more than one op
        self._jobs: collections.deque[Job | None] = collections.deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="api-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._jobs.append(None)
            self._cv.notify()

    def _take(self) -> list[Job] | None:
        """The next job, and the packed-pass companions it takes along (None: stop)."""
        with self._cv:
            while not self._jobs:
                self._cv.wait()
            first = self._jobs.popleft()
            if first is None:
                return None
            taken = [first]
            if first.op is None or first.cost > self.budget:
                return taken
            seen, cost = {first.model}, first.cost
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
            return taken

    def _work(self) -> None:
        while (taken := self._take()) is not None:
            if len(taken) > 1:
                self.stats["passes"] += 1
                self.stats["packed_ops"] += len(taken)
                self.stats["largest"] = max(self.stats["largest"], len(taken))
                try:
                    self.batch([job.op for job in taken])
                except Exception:  # each job then runs its op alone and reports its own failure
                    logger.exception("packed pass failed; its ops run one at a time")
            for job in taken:
                try:
                    job.run()
                except Exception:  # a job reports its own failure; this only keeps the worker alive
                    logger.exception("engine job failed")


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
