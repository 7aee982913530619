"""dstack's own GPU attestation, when the OS made one: the RTMR3 ``gpu-attestation`` boot event.

Released dstack (<= 0.5.11) attaches GPUs without verifying them (dstack issue #751). Newer dstack OS images run
``nvattest`` at boot, refuse to start the app unless the GPU policy accepts the result, and measure a summary into
RTMR3 before ``system-ready`` (``dstack-util/src/system_setup.rs``, ``attestation_event``, at dstack 312dc605)::

    {"version": 1, "provider": "nvidia", "devices": N, "cc_mode": "on", "devtools": false,
     "evidence_sha256": "<sha256 of nvattest's stdout>"}

The event is measured (the quote's RTMR3 replay covers it), so it is dstack's word, not the app's. Its nvattest output
itself is served by dstack 0.6's ``Attest(include_boottime_gpu_evidence)``; a bundle may carry it as
``gpu-boot-evidence.json`` (exact bytes), which must hash to the event's ``evidence_sha256`` (check
``gpu.boot_evidence``). The measured ``gpu-policy-hash`` is compared with the policy's ``expected_gpu_policy_hashes``
(``gpu.policy``), and :func:`gpu_status` says whether anything cryptographic checked the GPU at all. Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

from attestation.tdx.eventlog import Event

EVENT = "gpu-attestation"
SYSTEM_READY = "system-ready"
PROVIDER = "nvidia"  # the summary's provider and the vendor of dstack 0.6's GpuEvidenceBundle
BOOT_FORMAT = "nvidia-nvattest-boottime-json-v1"  # Attest(include_boottime_gpu_evidence): nvattest's attestation.out
FRESH_FORMAT = "nvidia-nvattest-collect-evidence-json-v1"  # AttestGpu(nonce): nvattest collect-evidence


def _attestation_events(events: Iterable[Event] | None) -> list[tuple[Event, bool]]:
    """Each RTMR3 ``gpu-attestation`` event, and whether it came after ``system-ready``."""
    found, ready = [], False
    for ev in (e for e in events or () if e.imr == 3 and e.is_runtime):
        if ev.event == SYSTEM_READY:
            ready = True
        elif ev.event == EVENT:
            found.append((ev, ready))
    return found


def boot_gpu_attestation(events: Iterable[Event] | None) -> tuple[bool, str] | None:
    """(ok, what dstack measured) for the ``gpu-attestation`` boot event; None when there is none (dstack 0.5.x).

    Not ok: more than one, one after ``system-ready`` (an app could append it), a payload that is not the summary
    above, or a summary that does not say CC on without DevTools.
    """
    found = _attestation_events(events)
    if not found:
        return None
    if len(found) > 1 or found[0][1]:
        return False, f"dstack GPU attestation event {'repeated' if len(found) > 1 else 'after system-ready'}: not dstack's"
    try:
        doc = json.loads(found[0][0].payload)
        devices, cc, devtools, digest = doc["devices"], doc["cc_mode"], doc["devtools"], doc["evidence_sha256"]
    except (ValueError, TypeError, KeyError) as exc:
        return False, f"dstack GPU attestation event is not the expected summary: {exc}"
    if not (doc.get("provider") == PROVIDER and isinstance(devices, int) and devices >= 1
            and isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        return False, "dstack GPU attestation event is not the expected summary"
    ok = cc == "on" and devtools is False
    return ok, (f"dstack measured a boot-time NVIDIA attestation: {devices} GPU(s), CC {cc}, DevTools "
                f"{'on' if devtools else 'off'}, nvattest output sha256 {digest[:16]}… (read from RTMR3; the report "
                "itself is not in the bundle)")


# ---- dstack 0.6: the GPU policy hash, the boot-time evidence, and whether anything cryptographic checked the GPU ----

POLICY_EVENT = "gpu-policy-hash"
EMPTY_POLICY_HASH = "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"  # SHA-256("{}"): no gpu_policy


def policy_step(measured_hex: str | None, allowed: tuple[str, ...]) -> tuple[str, str]:
    """``gpu.policy``: the measured ``gpu-policy-hash`` is one the policy lists (skip when it lists none)."""
    shown = measured_hex or "(absent: dstack 0.5.x measures none)"
    if not allowed:
        return "skip", f"policy lists no gpu-policy-hash values (measured {shown})"
    ok = measured_hex is not None and measured_hex in allowed
    return ("pass" if ok else "fail"), f"gpu-policy-hash {shown} {'is' if ok else 'is not'} allowed" + (
        " (the empty GPU policy {})" if measured_hex == EMPTY_POLICY_HASH else "")


def _attestation_event(events: Iterable[Event] | None) -> dict | None:
    """The payload of the one ``gpu-attestation`` event before ``system-ready`` (None: none, several, or not JSON)."""
    found = _attestation_events(events)
    if len(found) != 1 or found[0][1]:
        return None
    try:
        doc = json.loads(found[0][0].payload)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def boot_evidence_step(events: Iterable[Event] | None, data: bytes | None) -> tuple[str, str]:
    """``gpu.boot_evidence``: ``gpu-boot-evidence.json`` (nvattest's boot-time output, exact bytes) hashes to the
    ``evidence_sha256`` of the measured ``gpu-attestation`` event (skip when the bundle has no such file)."""
    if data is None:
        return "skip", "no gpu-boot-evidence.json: dstack's boot-time GPU evidence is not in the bundle"
    doc = _attestation_event(events)
    want = doc.get("evidence_sha256") if doc else None
    if not isinstance(want, str):
        return "fail", ("gpu-boot-evidence.json is in the bundle but RTMR3 has no single gpu-attestation event before "
                        "system-ready to bind it")
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        return "fail", f"gpu-boot-evidence.json sha256 {got[:16]}… is not the measured evidence_sha256 {want[:16]}…"
    return "pass", (f"gpu-boot-evidence.json is the nvattest output dstack's boot gate measured ({doc.get('devices')} "
                    "GPU(s)): authenticated by RTMR3, a statement about the boot, not bound to this run's report_data")


def gpu_status(events: Iterable[Event] | None, gpu_recorded: bool, checks: Iterable[Any]) -> tuple[str, str]:
    """(status, reason) for the verdict: ``verified`` only when dstack's measured boot gate attested the GPUs (an
    RTMR3 ``gpu-attestation`` event that passes, and no GPU check failed); ``not_verified`` when a GPU is recorded
    or claimed and nothing cryptographic checked it; ``none`` when the run recorded no GPU."""
    dstack = boot_gpu_attestation(events)
    status = {c.name: c.status for c in checks}
    failed = [n for n in ("gpu.evidence", "gpu.boot_evidence", "gpu.policy") if status.get(n) == "fail"]
    if dstack is not None and dstack[0] and not failed:
        extra = "; its boot-time evidence is in the bundle and matches" if status.get("gpu.boot_evidence") == "pass" else ""
        return "verified", ("dstack's boot gate attested the GPU(s) with NVIDIA's verifier inside the TD and measured "
                            "the result into RTMR3 (gpu-attestation)" + extra)
    if dstack is None and not gpu_recorded:
        return "none", "no GPU recorded"
    if failed:
        return "not_verified", f"GPU not verified: {', '.join(failed)} failed"
    if dstack is not None:
        return "not_verified", f"GPU not verified: {dstack[1]}"
    return "not_verified", ("GPU not verified: RTMR3 has no dstack gpu-attestation event (dstack 0.5.x, or "
                            "requirements.gpu_policy.attest_gpu false): the GPU facts are the CVM's own report, which "
                            "nothing cryptographic checked")
