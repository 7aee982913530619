"""Completion queues behind ``POST /api/v1/retrieve_futures``: how SDK 0.38's session poller learns which samples
finished (``ClientConfigResponse.sample_use_retrieve_futures``).

One queue per (sampling session, cloned sampler id): each finished or failed sample is appended with the next
cursor value. A poll names the cursor it has seen (``prev_cursor``) and the request ids whose results it has fetched
(``retrieved_request_ids``); both are dropped from the queue, so a queue holds only what its client has not yet
acknowledged (and at most :data:`MAX_PENDING`, oldest dropped first). An empty queue nobody waits on is removed.
The poll answers at once when there is something newer than its cursor or ``timeout`` is 0, else it waits for a
completion up to ``timeout`` (capped by the server's long poll). The caller checks ownership first.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from tinker.types.future_completion import FutureCompletion, FutureFailed, FutureFinished
from tinker.types.futures_retrieve_request import FuturesRetrieveRequest
from tinker.types.futures_retrieve_response import FuturesRetrieveResponse

from app.api.errors import BadRequest

MAX_PENDING = 4096  # unacknowledged completions kept per queue (a client that never polls cannot grow it further)
CLONE_BLOCK = 1_000_000_000  # the SDK's seq ids: cloned_sampler_id * 1e9 + n


@dataclass
class _Queue:
    pending: dict[str, tuple[int, FutureCompletion]] = field(default_factory=dict)  # request id -> (cursor, it)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)


class Completions:
    def __init__(self, long_poll_s: float) -> None:
        self.long_poll_s = long_poll_s
        self._queues: dict[tuple[str, int], _Queue] = {}
        self._cursor = 0  # one sequence over all queues: a queue dropped while idle and made anew never goes back
        self._lock = threading.Lock()

    def finished(self, session: str, seq_id: int | None, request_id: str, ok: bool) -> None:
        """Record a sample's outcome (any thread: the engine's worker calls it once the result is committed)."""
        completion: FutureCompletion = FutureFinished(request_id=request_id) if ok else FutureFailed(
            request_id=request_id)
        with self._lock:
            q = self._queues.setdefault((session, (seq_id or 0) // CLONE_BLOCK), _Queue())
            self._cursor += 1
            q.pending[request_id] = (self._cursor, completion)
            while len(q.pending) > MAX_PENDING:
                del q.pending[next(iter(q.pending))]
            waiting, q.waiters = q.waiters, []
        for loop, event in waiting:
            loop.call_soon_threadsafe(event.set)

    async def poll(self, req: FuturesRetrieveRequest) -> FuturesRetrieveResponse:
        key = (req.target.sampling_session_id, req.target.cloned_sampler_id)
        wait = self.long_poll_s if req.timeout is None else max(0.0, min(req.timeout, self.long_poll_s))
        event = asyncio.Event()
        with self._lock:
            if req.prev_cursor > self._cursor:
                raise BadRequest(f"prev_cursor {req.prev_cursor} is ahead of the server's cursor {self._cursor}")
            q = self._queues.setdefault(key, _Queue())
            done = set(req.retrieved_request_ids)
            q.pending = {r: (c, x) for r, (c, x) in q.pending.items() if c > req.prev_cursor and r not in done}
            park = not q.pending and wait > 0
            if park:
                q.waiters.append((asyncio.get_running_loop(), event))
        if park:
            try:
                await asyncio.wait_for(event.wait(), wait)
            except asyncio.TimeoutError:
                pass
        with self._lock:
            q.waiters = [w for w in q.waiters if w[1] is not event]
            q = self._queues.get(key, q)  # made anew by a completion after another poll dropped it idle
            out = FuturesRetrieveResponse(completions=[x for _c, x in q.pending.values()], cursor=self._cursor)
            self._drop_if_idle(key, q)
        return out

    def _drop_if_idle(self, key: tuple[str, int], q: _Queue) -> None:
        if not q.pending and not q.waiters and self._queues.get(key) is q:
            del self._queues[key]
