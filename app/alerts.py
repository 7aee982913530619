"""Failure alerts: a JSON POST to an optional webhook, with retries. Never raises, never carries data.

The URL comes from the environment variable named by ``alerts.webhook_url_env`` (a dstack
encrypted env var: webhook URLs usually embed a token), so it is neither in the config nor in any
bundle. The payload is built here from a fixed set of fields — event, run id, slot, attempt,
reason (the app's own one-line error message, which by construction names files, lines and
classes but never row content), times and the service identity — and every string is cut to one
line of at most 300 characters. Delivery: up to ``1 + retries`` POSTs; 2xx is delivered; 429, 5xx
and network errors are retried with exponential backoff; other 4xx are not.

Payload (``cvm-tune/alert/v1``)::

    {"schema": "cvm-tune/alert/v1", "event": "failed" | "skipped" | "rollback" | "service.error" | "state.inconsistent" | …,
     "run_id": ..., "reason": ..., "attempt": ..., "retry_at": ..., "time": ..., "output": ..., "host": ...}
"""

from __future__ import annotations

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

from app.config import AlertSettings

logger = logging.getLogger(__name__)
SCHEMA = "cvm-tune/alert/v1"
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
    import requests

    for attempt in range(settings.retries + 1):
        if attempt:
            sleep(settings.retry_backoff_s * 2 ** (attempt - 1))
        try:
            resp = requests.post(url, json=body, timeout=settings.timeout_s)
        except requests.RequestException as exc:
            logger.warning("alert POST failed (%s), attempt %d", type(exc).__name__, attempt + 1)
            continue
        if 200 <= resp.status_code < 300:
            return True
        logger.warning("alert POST answered HTTP %d, attempt %d", resp.status_code, attempt + 1)
        if resp.status_code != 429 and resp.status_code < 500:
            return False
    return False
