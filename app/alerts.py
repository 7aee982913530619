"""Failure alerts: a JSON POST to an optional webhook, with retries. Never raises, never carries data.

The URL comes from the environment variable named by ``alerts.webhook_url_env`` (a dstack
encrypted env var: webhook URLs usually embed a token), so it is neither in the config nor in any
bundle. The payload is built here from a fixed set of fields — event, run id, slot, attempt,
reason (the app's own one-line error message, which by construction names files, lines and
classes but never row content), times and the service identity — and every string is cut to one
line of at most 300 characters. Delivery goes through the HTTP edge (:mod:`attestation.io.http_edge`): the URL
must be https (or http on loopback), no redirect is followed and no proxy used; up to ``1 + retries`` POSTs; 2xx is
delivered; 429, 5xx and network errors are retried with the edge's exponential backoff (``Retry-After`` honoured
up to ``MAX_BACKOFF_S``); anything else is not; the whole delivery has a deadline.

Payload (``cvm-tune/alert/v1``)::

    {"schema": "cvm-tune/alert/v1", "event": "failed" | "skipped" | "rollback" | "service.error" | "state.inconsistent" | …,
     "run_id": ..., "reason": ..., "attempt": ..., "retry_at": ..., "time": ..., "output": ..., "host": ...}
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# ``state.inconsistent``: the output volume's state disagrees with the audit chain (exports/PROMOTED or the
# privacy ledger edited, deleted or replaced); the night stops with a state error (exit 7) and is not retried.

from attestation.io.http_edge import Edge, EdgeError, Transient, budget_s, retry

from app.config import AlertSettings, check_url

logger = logging.getLogger(__name__)
SCHEMA = "cvm-tune/alert/v1"
MAX_BACKOFF_S = 300.0  # the longest wait between POSTs (alerts.retry_backoff_s is at most this)
FIELDS = ("event", "run_id", "reason", "attempt", "retry_at")
MAX_TEXT = 300


def payload(event: Mapping[str, Any], *, output: Path) -> dict[str, Any]:
    """The alert body: only the known fields, each a short single-line string or an int."""
    body: dict[str, Any] = {"schema": SCHEMA, "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                            "output": str(output), "host": socket.gethostname()}
    for key in FIELDS:
        value = event.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            body[key] = value
        elif value is not None:
            body[key] = " ".join(str(value).split())[:MAX_TEXT]
    return body


def send(settings: AlertSettings, event: Mapping[str, Any], *, output: Path, env: Mapping[str, str] | None = None,
         sleep: Callable[[float], None] = time.sleep) -> bool:
    """POST one alert; True when a 2xx came back. No URL configured: logged only, False."""
    url = (env if env is not None else os.environ).get(settings.webhook_url_env, "").strip()
    body = payload(event, output=output)
    logger.warning("alert: %s %s %s", body["event"], body.get("run_id", ""), body.get("reason", ""))
    if not url:
        return False
    check = functools.partial(check_url, what="the alert webhook URL")
    try:
        check(url)
    except ValueError as exc:
        logger.warning("alert not sent: %s", exc)  # never the URL itself: it usually embeds a token
        return False

    def post(attempt: int) -> int:
        with edge.request("POST", url, check=check, json=body) as resp:
            if not 200 <= resp.status < 300:
                logger.warning("alert POST answered HTTP %d, attempt %d", resp.status, attempt + 1)
            return resp.status

    def failed(attempt: int, exc: Transient) -> None:
        logger.warning("alert POST failed (%s), attempt %d", exc.status or exc.kind, attempt + 1)

    attempts = settings.retries + 1
    deadline_s = budget_s(requests=1, attempts=attempts, timeout_s=settings.timeout_s,
                          backoff_s=settings.retry_backoff_s, cap_s=MAX_BACKOFF_S)
    try:
        with Edge(deadline_s=deadline_s, timeout_s=settings.timeout_s) as edge:
            status = retry(post, attempts=attempts, backoff_s=settings.retry_backoff_s, cap_s=MAX_BACKOFF_S,
                           deadline=edge.deadline, sleep=sleep, on_failure=failed)
    except EdgeError as exc:  # retries spent, deadline, a redirect (never followed: the body goes nowhere else), TLS
        logger.warning("alert not delivered: %s", exc.reason)
        return False
    return 200 <= status < 300
