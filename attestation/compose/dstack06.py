"""The app-compose fields dstack 0.6 added, judged: what runs outside the containers and how the GPU was admitted.

``shared/reference/dstack-0.6.md`` §4-§5 (``dstack-types/src/lib.rs: AppCompose``, ``docs/security/cvm-boundaries.md``):

* **findings** a relying party must accept by name (policy ``allowed_compose_findings``; ``cvm-tune compose-hash``
  exits 1 on any): ``init_script`` (one to five bash scripts run as root **before dockerd on every boot**: nothing
  the docker-compose audit sees), and a ``requirements.gpu_policy`` that weakens dstack's GPU gate:
  ``attest_gpu: false`` (no GPU attestation at all), ``allow_devtools``, ``allow_debug``, ``allow_insecure_boot``;
* **problems** no policy waives: a 0.6 field of the wrong type or an unknown value (the guest would refuse it, or
  this audit cannot judge it), an unknown ``gpu_policy`` member (dstack denies unknown fields), a manifest version
  over 3;
* **notes**, read and reported, never a failure: ``manifest_version`` (``"3"`` as a string is what 0.6 asks for),
  ``key_provider`` (``tpm``: keys sealed to this machine's vTPM), ``secure_time: false`` (the CVM takes the host's
  clock), ``event_log_version`` 2, ``verity_volumes``, a GPU policy's Rego and the other ``requirements``.

Stdlib only; the page's ``web/src/compose.js`` (``dstack06Audit``) gives the same three lists.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

GPU_POLICY_FIELDS = ("attest_gpu", "rego", "allow_devtools", "allow_debug", "allow_insecure_boot")
REQUIREMENTS_FIELDS = ("os_version", "platforms", "tdx_measure_acpi_tables", "launch_token_hash", "gpu_policy")
KEY_PROVIDERS = ("none", "kms", "local", "tpm")
MAX_INIT_SCRIPTS = 5
WEAKENING = {  # gpu_policy member -> (the value that weakens the gate, what it means)
    "attest_gpu": (False, "no GPU attestation at all: dstack admits any GPU, or none, unchecked"),
    "allow_devtools": (True, "a GPU in CC DevTools mode (its memory readable by the host) is accepted"),
    "allow_debug": (True, "a GPU whose debug status (dbgstat) is enabled is accepted"),
    "allow_insecure_boot": (True, "a GPU that did not boot securely (secboot) is accepted"),
}


def gpu_policy_hash(app_compose: dict[str, Any]) -> str:
    """dstack's ``gpu-policy-hash``: SHA-256 of the JCS of ``requirements.gpu_policy`` as written (``{}`` when absent)."""
    req = app_compose.get("requirements")
    pol = req.get("gpu_policy") if isinstance(req, dict) else None
    text = json.dumps({} if pol is None else pol, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _scripts(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    return None


def audit06(app_compose: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(findings as (name, message), problems, notes) for dstack 0.6's app-compose fields."""
    findings: list[tuple[str, str]] = []
    problems: list[str] = []
    notes: list[str] = []
    if "init_script" in app_compose:
        scripts = _scripts(app_compose["init_script"])
        if scripts is None or len(scripts) > MAX_INIT_SCRIPTS:
            problems.append(f"init_script is not a bash script or a list of at most {MAX_INIT_SCRIPTS} (dstack refuses it)")
        elif scripts:
            findings.append(("init_script", f"init_script runs {len(scripts)} bash script(s) as root before dockerd on "
                             "every boot (dstack 0.6), outside anything the docker-compose audit sees: read them"))
    _requirements(app_compose.get("requirements"), findings, problems, notes)
    mv = app_compose.get("manifest_version")
    if mv is not None:
        n = mv if type(mv) is int else int(mv) if isinstance(mv, str) and mv in ("1", "2", "3") else None
        if n is None or not 1 <= n <= 3:
            problems.append(f"manifest_version {mv!r:.20} is not 1, 2 or 3 (a dstack 0.6 guest refuses more than 3)")
        elif n == 3:
            notes.append(f"manifest_version {mv!r}: dstack 0.6 format (init_script_hashes enter MrConfigV3)"
                         + ("" if isinstance(mv, str) else "; write it as the string \"3\" so older guests fail closed"))
    kp = app_compose.get("key_provider")
    if kp is not None:
        if kp not in KEY_PROVIDERS:
            problems.append(f"key_provider {kp!r:.40} is not one of {', '.join(KEY_PROVIDERS)}")
        elif kp == "tpm":
            notes.append("key_provider tpm: keys come from this machine's vTPM, not a KMS (no rotation, no migration)")
        else:
            notes.append(f"key_provider {kp}")
    st = app_compose.get("secure_time")
    if st is not None and not isinstance(st, bool):
        problems.append(f"secure_time {st!r:.20} is not true or false")
    elif st is False:
        notes.append("secure_time false: the CVM takes the host's clock (collateral and certificate times inside it are "
                     "the host's word)")
    ev = app_compose.get("event_log_version")
    if ev is not None:
        if type(ev) is not int or ev not in (1, 2):
            problems.append(f"event_log_version {ev!r:.20} is not 1 or 2")
        else:
            notes.append(f"event_log_version {ev}" + (": RTMR3 events are V2 (digest over canonical JSON; preimages "
                                                      "checked)" if ev == 2 else ""))
    _verity(app_compose.get("verity_volumes"), problems, notes)
    return findings, problems, notes


def _requirements(req: Any, findings: list[tuple[str, str]], problems: list[str], notes: list[str]) -> None:
    if req is None:
        return
    if not isinstance(req, dict):
        problems.append("requirements is not a mapping")
        return
    if unknown := sorted(set(req) - set(REQUIREMENTS_FIELDS)):
        problems.append(f"requirements.{unknown[0]} is not a field dstack 0.6 knows (the guest refuses it)")
    others = [k for k in REQUIREMENTS_FIELDS if k in req and k != "gpu_policy"]
    if others:
        notes.append("requirements " + ", ".join(f"{k}={json.dumps(req[k], sort_keys=True, separators=(',', ':'))[:80]}"
                                                 for k in others))
    pol = req.get("gpu_policy")
    if pol is None:
        return
    if not isinstance(pol, dict):
        problems.append("requirements.gpu_policy is not a mapping")
        return
    if unknown := sorted(set(pol) - set(GPU_POLICY_FIELDS)):
        problems.append(f"requirements.gpu_policy.{unknown[0]} is not a field dstack knows (deny_unknown_fields)")
    for key, (weak, why) in WEAKENING.items():
        value = pol.get(key)
        if value is not None and not isinstance(value, bool):
            problems.append(f"requirements.gpu_policy.{key} {value!r:.20} is not true or false")
        elif value is weak:
            findings.append((f"gpu_policy.{key}", f"requirements.gpu_policy.{key}: {str(weak).lower()}: {why}"))
    rego = pol.get("rego")
    if rego is not None and not isinstance(rego, str):
        problems.append("requirements.gpu_policy.rego is not a string")
    elif rego:
        notes.append(f"requirements.gpu_policy.rego: a Rego relying-party policy ({len(rego)} characters) narrows "
                     "which GPUs dstack admits")


def _verity(vols: Any, problems: list[str], notes: list[str]) -> None:
    if vols is None:
        return
    ok = isinstance(vols, list) and all(isinstance(v, dict) and set(v) == {"source", "verity_root", "target"}
                                        and all(isinstance(x, str) and x for x in v.values()) for v in vols)
    if not ok:
        problems.append("verity_volumes is not a list of {source, verity_root, target} strings")
        return
    for v in vols:
        notes.append(f"verity volume {v['source']} -> {v['target']} (dm-verity root {v['verity_root'][:16]}…): "
                     "read-only, measured through the compose-hash")
