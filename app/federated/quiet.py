"""Flower's console output, summarised: without debug logging, its strategy banner and per-round progress (about 40
lines) give way to one line per round of ours (:func:`round_line`), and it writes colour codes only to a terminal.
Used by ``cvm-tune federated simulate`` and by the ServerApp that ``flwr run`` starts. Light at import (no Flower)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OURS = {"cvm_tune": True}  # ``extra=`` of the lines we log through Flower's logger: always shown
EXPECTED = ("fraction_evaluate is set to 0.0",)  # warnings about what we set on purpose (no federated evaluation)


def quiet_flower(record: logging.LogRecord) -> bool:
    """Whether to hide this record of Flower's logger when debug logging is off."""
    if getattr(record, "cvm_tune", False):
        return False
    return record.levelno < logging.WARNING or any(text in record.getMessage() for text in EXPECTED)


def colours(flwr_log: logging.Logger) -> None:
    """Flower's console handler colours its level names whatever the stream: only on a terminal."""
    for h in flwr_log.handlers:
        if hasattr(h, "colored"):
            h.colored = sys.stderr.isatty()


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not quiet_flower(record)


@contextlib.contextmanager
def summarised(debug: bool | None = None) -> Iterator[logging.Logger]:
    """Flower's logger, summarised as the module docstring says unless ``debug`` (default: Flower's own debug
    switch, ``FLWR_LOG_LEVEL=DEBUG``); yields it, for the lines of ours (``flwr_log.info(line, extra=OURS)``)."""
    flwr_log = logging.getLogger("flwr")
    colours(flwr_log)
    if debug is None:
        debug = os.environ.get("FLWR_LOG_LEVEL", "").upper() == "DEBUG"
    drop = None if debug else _Drop()
    if drop is not None:
        flwr_log.addFilter(drop)
    try:
        yield flwr_log
    finally:
        if drop is not None:
            flwr_log.removeFilter(drop)


def round_line(n: int, bundle: Path) -> str:
    """``round 2: 3 admitted, 0 rejected: /abs/…/round-0002``: where a round bundle went and its client counts."""
    m = round_manifest(bundle)
    return f"round {n}: {len(m.admitted)} admitted, {len(m.rejected)} rejected: {bundle.resolve()}"


def round_manifest(bundle: Path) -> Any:
    """The round bundle's manifest (``RoundManifest``), read as it is: not verified.

    Raises:
        OSError: unreadable; ValueError (pydantic's ValidationError): not a round manifest.
    """
    from attestation.rounds import manifest as R

    return R.RoundManifest.model_validate_json((bundle / R.ROUND_MANIFEST).read_bytes())
