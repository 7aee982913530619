"""GPU evidence: what a run recorded about its GPUs, parsed the same way by the exporter and the verifier.

dstack OS <= 0.5.x attaches NVIDIA GPUs to a CVM without verifying them (dstack #751), so cvm-tune
collects the evidence itself at the start of every run and binds it into the manifest. The bundle
file ``gpu-evidence.json`` (schema ``cvm-tune/gpu-evidence/v1``, canonical JSON) holds the raw
captures::

    {"schema": ..., "nonce": <hex64>, "commands": [{"name", "argv", "status", "returncode", "stdout", "stderr"}, ...]}

``status`` is ``ok`` (exit 0), ``error`` (non-zero exit), ``missing`` (tool not installed) or
``timeout``. Commands: ``query-gpu`` (``nvidia-smi --query-gpu=...``), ``cc-status``
(``conf-compute -f``), ``cc-devtools`` (``-d``), ``cc-environment`` (``-e``), ``cc-query``
(``-q``), and ``nvattest`` (NVIDIA's attestation CLI with the local verifier, only when installed).

The **nonce** is the hash of the audit entry recorded just before the collection (``run.start`` or
``run.resume``), so the evidence is fresh for this run; the ``gpu.evidence`` audit entry that follows
commits to ``sha256(gpu-evidence.json)`` and has that same hash as its ``prev``.

:func:`summarize` derives the manifest's ``gpu`` object from the file; the verifier recomputes it and
compares (:func:`check`). What this does and does not prove: nvidia-smi output is reported by the
driver inside the CVM and is not signed; the nvattest local verifier's EAT is an unsigned JWT
(``alg: none``), self-consistent but not verifiable offline. Both are bound to the TDX quote through
report_data, so they say what the attested code observed, not more.

Stdlib + pydantic only (no torch): the verifier runs on small machines.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA = "cvm-tune/gpu-evidence/v1"
FILE = "gpu-evidence.json"
QUERY_FIELDS = ("index", "name", "uuid", "pci.bus_id", "driver_version", "vbios_version")
CcMode = Literal["on", "devtools", "ppcie", "off", "unknown", "n/a"]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuDevice(_Closed):
    """One GPU as ``nvidia-smi --query-gpu`` listed it."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    driver_version: str
    vbios_version: str


class NvidiaReport(_Closed):
    """Summary of NVIDIA's attestation result (nvattest, local verifier)."""

    tool: Literal["nvattest"]
    status: Literal["ok", "error", "timeout", "unparseable"]
    result_code: int | None = None
    result_message: str | None = None
    overall: bool | None = Field(None, description="x-nvidia-overall-att-result of the detached EAT")
    measres: dict[str, str] = Field(default_factory=dict, description="per GPU submodule: measres claim")
    nonce_match: bool | None = None
    consistent: bool | None = Field(None, description="EAT submodule digests and listed claims match the GPU tokens")
    signed: bool | None = Field(None, description="False for local-mode EATs (alg none)")
    versions: dict[str, list[str]] = Field(default_factory=dict, description="GPU -> [driver, VBIOS] per the report")


class GpuInfo(_Closed):
    """The manifest's ``gpu`` object (derived from gpu-evidence.json by :func:`summarize`)."""

    present: bool
    nvidia_smi: Literal["ok", "missing", "error"]
    devices: list[GpuDevice]
    cc_mode: CcMode
    cc_environment: str | None
    ready_state: str | None
    nvidia_report: NvidiaReport | None
    nonce: str = Field(pattern=r"^[0-9a-f]{64}$")
    evidence_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class GpuEvidenceError(ValueError):
    """gpu-evidence.json is not a cvm-tune GPU evidence document."""


def evidence_bytes(doc: dict[str, Any]) -> bytes:
    """Canonical bytes of an evidence document (what is hashed and written)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def load(data: bytes) -> dict[str, Any]:
    """Parse and shape-check gpu-evidence.json.

    Raises:
        GpuEvidenceError: not JSON, wrong schema, or malformed command entries.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GpuEvidenceError("gpu-evidence.json is not JSON") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or set(doc) != {"schema", "nonce", "commands"}:
        raise GpuEvidenceError(f"gpu-evidence.json is not a {SCHEMA} document")
    if not isinstance(doc["nonce"], str) or not re.fullmatch(r"[0-9a-f]{64}", doc["nonce"]):
        raise GpuEvidenceError("gpu-evidence.json has a malformed nonce")
    commands = doc["commands"]
    keys = {"name", "argv", "status", "returncode", "stdout", "stderr"}
    if not isinstance(commands, list) or not all(isinstance(c, dict) and set(c) == keys for c in commands):
        raise GpuEvidenceError("gpu-evidence.json has malformed command entries")
    names = [c["name"] for c in commands]
    if len(set(names)) != len(names):
        raise GpuEvidenceError("gpu-evidence.json lists a command twice")
    return doc


# --- nvidia-smi text ------------------------------------------------------------------------------------


def parse_query_gpu(text: str) -> list[GpuDevice]:
    """``nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,vbios_version --format=csv,noheader``.

    Raises:
        GpuEvidenceError: a line does not have the six fields.
    """
    devices = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(QUERY_FIELDS) or not re.fullmatch(r"[0-9]+", parts[0]):  # ASCII digits only (not '²')
            raise GpuEvidenceError(f"unexpected nvidia-smi --query-gpu line with {len(parts)} fields")
        devices.append(GpuDevice(index=int(parts[0]), name=parts[1], uuid=parts[2], pci_bus_id=parts[3],
                                 driver_version=parts[4], vbios_version=parts[5]))
    return devices


def parse_fields(text: str) -> dict[str, str]:
    """``Label : value`` / ``Label: value`` lines (conf-compute -f/-d/-e/-q) -> {lower-case label: value}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        label, sep, value = line.partition(":")
        if sep and label.strip() and not label.strip().startswith("="):
            out[" ".join(label.split()).lower()] = value.strip()
    return out


def cc_state(fields: dict[str, dict[str, str]], present: bool) -> tuple[CcMode, str | None, str | None]:
    """``(cc_mode, cc_environment, ready_state)`` from the conf-compute captures.

    ``conf-compute -f`` prints ``CC status: ON|OFF`` (driver 535+); ``-q`` prints ``CC State : ON``,
    ``Multi-GPU Mode``, ``CC GPUs Ready State`` (newer drivers; protected-PCIe systems report
    ``CC State : OFF`` with ``Multi-GPU Mode : Protected PCIe``); ``-d`` prints ``DevTools Mode: ON|OFF``;
    ``-e`` prints ``CC Environment: PRODUCTION``.
    """
    if not present:
        return "n/a", None, None
    q = fields.get("cc-query", {})
    state = (fields.get("cc-status", {}).get("cc status") or q.get("cc state") or "").upper()
    devtools = (fields.get("cc-devtools", {}).get("devtools mode") or q.get("devtools mode") or "").upper()
    multi = q.get("multi-gpu mode", "")
    env = fields.get("cc-environment", {}).get("cc environment") or None
    ready = q.get("cc gpus ready state")
    mode: CcMode
    if "protected pcie" in multi.lower():
        mode = "ppcie"
    elif state == "ON":
        mode = "devtools" if devtools == "ON" else "on"
    elif state == "OFF":
        mode = "off"
    else:
        mode = "unknown"
    return mode, env, ready.lower() if ready else None


# --- nvattest (NVIDIA attestation CLI, local verifier) --------------------------------------------------


def _jwt(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    parts = token.split(".")
    if len(parts) != 3:
        raise GpuEvidenceError("EAT token is not a JWT")
    try:
        header, claims = (json.loads(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4))) for p in parts[:2])
    except (ValueError, UnicodeDecodeError) as exc:
        raise GpuEvidenceError("EAT token is not base64url JSON") from exc
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise GpuEvidenceError("EAT token parts are not JSON objects")
    return header, claims


def parse_nvattest(text: str, nonce: str) -> NvidiaReport:
    """Summarise nvattest's ``--format json`` output (the shape of dstack's real H100 sample).

    ``{"claims": [...], "detached_eat": [["JWT", <overall EAT>], {"GPU-0": <GPU EAT>, ...}],
    "result_code": 0, "result_message": "Ok"}``: the overall EAT's ``submods`` name each GPU token by
    ``["DIGEST", ["SHA256", sha256(token)]]``; ``claims`` lists each GPU token's claims.
    """
    try:
        doc = json.loads(text)
        overall_token = doc["detached_eat"][0][1]
        gpu_tokens = doc["detached_eat"][1]
        listed = doc.get("claims", [])
        if not isinstance(gpu_tokens, dict) or not isinstance(overall_token, str) or not isinstance(listed, list):
            raise TypeError("detached_eat layout")
        header, overall = _jwt(overall_token)
        gpus = {name: _jwt(tok) for name, tok in sorted(gpu_tokens.items())}
    except (ValueError, KeyError, IndexError, TypeError):
        return NvidiaReport(tool="nvattest", status="unparseable")
    submods = overall.get("submods") or {}
    digests_ok = set(submods) == set(gpu_tokens) and all(
        submods[name] == ["DIGEST", ["SHA256", hashlib.sha256(tok.encode()).hexdigest()]] for name, tok in gpu_tokens.items())
    tokens = [g for _, g in gpus.values()]
    claims_ok = len(listed) == len(gpus) and all(
        isinstance(c, dict) and any(all(g.get(k) == v for k, v in c.items()) for g in tokens) for c in listed)
    nonces = [overall.get("eat_nonce")] + [g.get("eat_nonce") for _, g in gpus.values()]
    return NvidiaReport(
        tool="nvattest", status="ok",
        result_code=doc.get("result_code") if isinstance(doc.get("result_code"), int) else None,
        result_message=doc.get("result_message") if isinstance(doc.get("result_message"), str) else None,
        overall=overall.get("x-nvidia-overall-att-result") if isinstance(overall.get("x-nvidia-overall-att-result"), bool) else None,
        measres={name: str(g.get("measres")) for name, (_, g) in gpus.items()},
        nonce_match=all(n == nonce for n in nonces),
        consistent=digests_ok and claims_ok,
        signed=not (header.get("alg") == "none" and all(h.get("alg") == "none" for h, _ in gpus.values())),
        versions={name: [str(g.get("x-nvidia-gpu-driver-version")), str(g.get("x-nvidia-gpu-vbios-version"))]
                  for name, (_, g) in gpus.items()},
    )


# --- the summary ---------------------------------------------------------------------------------------


def summarize(data: bytes) -> GpuInfo:
    """The manifest ``gpu`` object of an evidence file (deterministic; the verifier recomputes it).

    Raises:
        GpuEvidenceError: the file is not an evidence document, or nvidia-smi printed an unexpected line.
    """
    doc = load(data)
    by_name = {c["name"]: c for c in doc["commands"]}
    query = by_name.get("query-gpu")
    smi: Literal["ok", "missing", "error"]
    if query is None or query["status"] == "missing":
        smi, devices = "missing", []
    elif query["status"] == "ok":
        smi, devices = "ok", parse_query_gpu(query["stdout"])
    else:
        smi, devices = "error", []
    fields = {name: parse_fields(c["stdout"]) for name, c in by_name.items()
              if name.startswith("cc-") and c["status"] in ("ok", "error")}
    mode, env, ready = cc_state(fields, bool(devices))
    report = None
    att = by_name.get("nvattest")
    if att is not None and att["status"] != "missing":
        if att["status"] == "timeout":
            report = NvidiaReport(tool="nvattest", status="timeout")
        else:
            report = parse_nvattest(att["stdout"], doc["nonce"])
            if att["status"] == "error" and report.status == "unparseable":
                report = NvidiaReport(tool="nvattest", status="error")
    return GpuInfo(present=bool(devices), nvidia_smi=smi, devices=devices, cc_mode=mode, cc_environment=env,
                   ready_state=ready, nvidia_report=report, nonce=doc["nonce"],
                   evidence_sha256=hashlib.sha256(data).hexdigest())


def problems(info: GpuInfo) -> list[str]:
    """Why this evidence does not show attested, confidential GPUs (empty: it does).

    Used by ``tee.gpu_evidence: required`` before training, and shown by the verifier.
    """
    out = []
    if not info.present:
        out.append("no NVIDIA GPU visible (nvidia-smi " + ("not installed" if info.nvidia_smi == "missing" else "failed") + ")"
                   if info.nvidia_smi != "ok" else "nvidia-smi lists no GPU")
        return out
    if info.cc_mode != "on":
        out.append(f"GPU confidential-compute mode is {info.cc_mode}, not on")
    if info.ready_state not in (None, "ready"):
        out.append(f"GPU ready state is {info.ready_state!r}")
    r = info.nvidia_report
    if r is not None:
        if r.status != "ok":
            out.append(f"NVIDIA attestation {r.status}")
        else:
            if not (r.result_code == 0 and r.overall is True and all(v == "success" for v in r.measres.values())):
                out.append("NVIDIA attestation did not succeed")
            if not r.nonce_match:
                out.append("NVIDIA attestation report carries another nonce (not fresh for this run)")
            if not r.consistent:
                out.append("NVIDIA attestation report is internally inconsistent")
            smi = sorted([d.driver_version, d.vbios_version.lower()] for d in info.devices)
            rep = sorted([v[0], v[1].lower()] for v in r.versions.values())
            if smi != rep:
                out.append("NVIDIA report's driver/VBIOS versions differ from nvidia-smi's")
    return out


def unattested(info: GpuInfo) -> list[str]:
    """``tee.gpu_evidence: attested``: what is missing for NVIDIA's own report to back the CC mode (empty: nothing)."""
    if info.present and info.nvidia_report is None:
        return ["no NVIDIA attestation report for this run (nvattest is not installed in the image; "
                "nvidia-smi's CC flag alone is unsigned)"]
    return []


def describe(info: GpuInfo) -> str:
    """One line for humans (the verifier's ``gpu.evidence`` detail)."""
    if not info.present:
        return f"no GPU (nvidia-smi {info.nvidia_smi})"
    names = sorted({d.name for d in info.devices})
    d0 = info.devices[0]
    text = (f"{len(info.devices)} x {', '.join(names)} (driver {d0.driver_version}, VBIOS {d0.vbios_version}); "
            f"CC mode {info.cc_mode}" + (f", {info.ready_state}" if info.ready_state else "")
            + (f", {info.cc_environment}" if info.cc_environment else ""))
    r = info.nvidia_report
    if r is None:
        text += ("; no NVIDIA attestation report (nvattest not installed): the CC mode is nvidia-smi's word only "
                 "(reported by the driver inside the CVM, unsigned)")
    elif r.status != "ok":
        text += f"; NVIDIA attestation {r.status}"
    else:
        text += (f"; NVIDIA local verifier: overall {r.overall}, measres {','.join(sorted(set(r.measres.values())))}"
                 + ("" if r.signed else " (unsigned local-mode EAT: self-reported, not checkable offline)"))
    return text


def check(data: bytes | None, recorded: GpuInfo, audit_entries: list[Any]) -> tuple[Literal["pass", "fail"], str]:
    """The verifier's ``gpu.evidence`` step: the file, the manifest and the audit chain agree.

    Args:
        data: gpu-evidence.json bytes (None: missing or unreadable).
        recorded: The manifest's ``gpu`` object.
        audit_entries: The bundle's audit slice (``attestation.bundle.audit.AuditEntry`` objects).

    Returns:
        ``(status, detail)``: fail when the file is missing or altered, the manifest's summary is not
        what the file says, the last ``gpu.evidence`` audit entry does not commit to this file, the
        nonce is not that entry's ``prev`` (the run.start/run.resume entry before it), or an NVIDIA
        report is inconsistent or carries another nonce. A GPU outside CC mode is not a failure here:
        the detail says so plainly and a policy decides.
    """
    if data is None:
        return "fail", f"{FILE} missing or unreadable"
    try:
        info = summarize(data)
    except GpuEvidenceError as exc:
        return "fail", str(exc)
    if info != recorded:
        return "fail", f"the manifest's gpu summary is not what {FILE} says"
    entries = [e for e in audit_entries if e.type == "gpu.evidence"]
    if not entries:
        return "fail", "no gpu.evidence audit entry"
    last = entries[-1]
    if last.data.get("evidence_sha256") != info.evidence_sha256:
        return "fail", f"the last gpu.evidence audit entry commits to another {FILE}"
    if last.prev != info.nonce:
        return "fail", "the evidence nonce is not the audit chain head it was collected at (not fresh for this run)"
    r = info.nvidia_report
    if r is not None and r.status == "ok" and not (r.consistent and r.nonce_match):
        return "fail", "the NVIDIA attestation report " + ("carries another nonce" if r.consistent else "is inconsistent")
    issues = problems(info)
    detail = describe(info) + (f"; NOT attested confidential GPUs: {'; '.join(issues)}" if issues else "")
    return "pass", detail
