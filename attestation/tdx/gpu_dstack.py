"""dstack's own GPU attestation, when the OS made one: the RTMR3 ``gpu-attestation`` boot event.

Released dstack (<= 0.5.11) attaches GPUs without verifying them (dstack issue #751). Newer dstack OS images run
``nvattest`` at boot, refuse to start the app unless the GPU policy accepts the result, and measure a summary into
RTMR3 before ``system-ready`` (``dstack-util/src/system_setup.rs``, ``attestation_event``, at dstack 312dc605)::

    {"version": 1, "provider": "nvidia", "devices": N, "cc_mode": "on", "devtools": false,
     "evidence_sha256": "<sha256 of nvattest's stdout>"}

The event is measured (the quote's RTMR3 replay covers it), so it is dstack's word, not the app's. Its nvattest output
itself is served by the guest agent (``/GpuInfo``), not carried in a cvm-tune bundle, so a verifier here reads the
measured summary; it does not re-check NVIDIA's report. Stdlib only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from attestation.tdx.eventlog import Event

EVENT = "gpu-attestation"
SYSTEM_READY = "system-ready"


def boot_gpu_attestation(events: Iterable[Event] | None) -> tuple[bool, str] | None:
    """(ok, what dstack measured) for the ``gpu-attestation`` boot event; None when there is none (dstack 0.5.x).

    Not ok: more than one, one after ``system-ready`` (an app could append it), a payload that is not the summary
    above, or a summary that does not say CC on without DevTools.
    """
    found, ready = [], False
    for ev in (e for e in events or () if e.imr == 3 and e.is_runtime):
        if ev.event == SYSTEM_READY:
            ready = True
        elif ev.event == EVENT:
            found.append((ev, ready))
    if not found:
        return None
    if len(found) > 1 or found[0][1]:
        return False, f"dstack GPU attestation event {'repeated' if len(found) > 1 else 'after system-ready'}: not dstack's"
    try:
        doc = json.loads(found[0][0].payload)
        devices, cc, devtools, digest = doc["devices"], doc["cc_mode"], doc["devtools"], doc["evidence_sha256"]
    except (ValueError, TypeError, KeyError) as exc:
        return False, f"dstack GPU attestation event is not the expected summary: {exc}"
    if not (doc.get("provider") == "nvidia" and isinstance(devices, int) and devices >= 1
            and isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        return False, "dstack GPU attestation event is not the expected summary"
    ok = cc == "on" and devtools is False
    return ok, (f"dstack measured a boot-time NVIDIA attestation: {devices} GPU(s), CC {cc}, DevTools "
                f"{'on' if devtools else 'off'}, nvattest output sha256 {digest[:16]}… (read from RTMR3; the report "
                "itself is not in the bundle)")
