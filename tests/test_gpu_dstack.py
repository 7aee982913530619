"""dstack's own GPU attestation (the RTMR3 ``gpu-attestation`` boot event of newer dstack OS images), read by the verifier."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from attestation.bundle.verify import _gpu
from attestation.tdx.eventlog import RUNTIME_EVENT_TYPE, parse_event_log
from attestation.tdx.gpu_dstack import boot_gpu_attestation
from attestation.verdict import QuoteFindings

SUMMARY = {"version": 1, "provider": "nvidia", "devices": 1, "cc_mode": "on", "devtools": False,
           "evidence_sha256": "ab" * 32}  # the shape dstack-util's attestation_event serialises


def _log(*names: tuple[str, bytes]) -> tuple:
    return parse_event_log([{"imr": 3, "event_type": RUNTIME_EVENT_TYPE, "digest": "", "event": n, "event_payload": p.hex()}
                            for n, p in names])


def _boot(gpu: bytes, *, after_ready: bool = False) -> tuple:
    before = [("system-preparing", b""), ("compose-hash", bytes(32))]
    ready = [("system-ready", b"")]
    return _log(*before, *ready, ("gpu-attestation", gpu)) if after_ready else _log(*before, ("gpu-attestation", gpu), *ready)


def test_measured_summary_is_read() -> None:
    ok, detail = boot_gpu_attestation(_boot(json.dumps(SUMMARY).encode()))
    assert ok and "1 GPU(s), CC on, DevTools off" in detail and "not in the bundle" in detail
    assert boot_gpu_attestation(_log(("system-ready", b""))) is None and boot_gpu_attestation(None) is None


@pytest.mark.parametrize(("events", "reason"), [
    (_boot(json.dumps({**SUMMARY, "devtools": True}).encode()), "DevTools on"),
    (_boot(json.dumps(SUMMARY).encode(), after_ready=True), "after system-ready"),
    (_boot(b"not json"), "not the expected summary"),
    (_boot(json.dumps({**SUMMARY, "provider": "other"}).encode()), "not the expected summary"),
    (_boot(json.dumps({k: v for k, v in SUMMARY.items() if k != "evidence_sha256"}).encode()), "not the expected summary"),
])
def test_bad_or_late_summaries_fail(events: tuple, reason: str) -> None:
    ok, detail = boot_gpu_attestation(events)
    assert not ok and reason in detail


def test_bundle_gpu_step_reports_dstack_evidence() -> None:
    f = QuoteFindings()
    _gpu(f, None, SimpleNamespace(gpu=None), _boot(json.dumps(SUMMARY).encode()))  # type: ignore[arg-type]
    assert (f.checks[0].name, f.checks[0].status) == ("gpu.evidence", "pass") and "dstack measured" in f.checks[0].detail
    f = QuoteFindings()
    _gpu(f, None, SimpleNamespace(gpu=None), _boot(json.dumps({**SUMMARY, "cc_mode": "off"}).encode()))  # type: ignore[arg-type]
    assert f.checks[0].status == "fail"
