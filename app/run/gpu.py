"""Collect what attests the GPUs at the start of a run (the parsing lives in ``attestation.tdx.gpu``).

``collect(nonce)`` runs, with a timeout each and without a shell:

* ``nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,vbios_version --format=csv,noheader``
* ``nvidia-smi conf-compute -f`` (CC status), ``-d`` (DevTools mode), ``-e`` (CC environment),
  ``-q`` (CC state, multi-GPU mode, ready state; newer drivers)
* ``nvattest attest --device gpu --verifier local --nonce <nonce> --format json`` when NVIDIA's
  attestation CLI is installed and a GPU is present (what dstack HEAD runs at boot). The local
  verifier fetches RIMs and OCSP answers from NVIDIA: it is the only step of a run that may use the
  network, and only if the operator installed it. The deprecated Python ``nv-attestation-sdk`` is not
  used (end of support 2026-09-15; it pins cryptography 43.0.1, which cannot share our environment).

On dstack 0.6 (its boot measured ``gpu-policy-hash``; :meth:`app.tee.GuestAgent.boot_info`) the guest agent attests
the GPUs too (guest API v1, ``shared/reference/dstack-0.6.md`` §4):

* ``AttestGpu(nonce)``, when a GPU is there (nvidia-smi lists one or dstack's boot gate attested one), with the same
  nonce: its answer is recorded in ``gpu-evidence.json`` as the command ``dstack-attest-gpu`` (status ``ok`` with
  ``{"bundles": [{vendor, format, evidence (hex)}]}`` as stdout; ``error`` when it answered no bundle);
* ``Attest(include_boottime_gpu_evidence)``, when RTMR3 holds dstack's ``gpu-attestation`` boot event: the
  ``nvidia-nvattest-boottime-json-v1`` evidence, exact bytes, checked here against the event's ``evidence_sha256``
  (the bundle's ``gpu-boot-evidence.json``, check ``gpu.boot_evidence``).

An answer that is malformed, carries another nonce or does not hash to the measured value is a :class:`TeeError`
and nothing is recorded.

Nothing is interpreted here beyond :func:`attestation.tdx.gpu.summarize`; every raw output goes into
``gpu-evidence.json`` so that a verifier can re-derive the manifest's ``gpu`` object.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from attestation.tdx import gpu as G
from attestation.tdx.gpu_dstack import BOOT_FORMAT, FRESH_FORMAT
from attestation.tdx.gpu_dstack import EVENT as GATE_EVENT  # RTMR3: dstack 0.6's boot gate attested the GPUs
from attestation.tdx.gpu_dstack import PROVIDER as NVIDIA

from app.errors import TeeError
from app.tee import GuestAgent

NVIDIA_SMI = "nvidia-smi"
NVATTEST = "nvattest"
SMI_COMMANDS = (
    ("query-gpu", ["--query-gpu=" + ",".join(G.QUERY_FIELDS), "--format=csv,noheader"]),
    ("cc-status", ["conf-compute", "-f"]),
    ("cc-devtools", ["conf-compute", "-d"]),
    ("cc-environment", ["conf-compute", "-e"]),
    ("cc-query", ["conf-compute", "-q"]),
)
MAX_OUTPUT = 1 << 20
ATTEST_GPU = "dstack-attest-gpu"  # gpu-evidence.json's entry for dstack 0.6's AttestGpu(nonce) answer


@dataclass(frozen=True)
class GpuEvidence:
    """A collected evidence file and its summary.

    Attributes:
        data: ``gpu-evidence.json`` bytes (canonical JSON).
        info: The manifest's ``gpu`` object (``attestation.tdx.gpu.summarize(data)``).
        boot: dstack 0.6's boot-time GPU evidence, bound by RTMR3 (None: no boot gate attested a GPU).
    """

    data: bytes
    info: G.GpuInfo
    boot: bytes | None = None  # gpu-boot-evidence.json: dstack 0.6's boot-time nvattest output (exact bytes)

    def audit_data(self) -> dict[str, Any]:
        """The ``gpu.evidence`` audit entry: the file hash plus what a reader wants at a glance."""
        r = self.info.nvidia_report
        return {"evidence_sha256": self.info.evidence_sha256, "present": self.info.present,
                "devices": len(self.info.devices), "cc_mode": self.info.cc_mode,
                "nvidia_report": None if r is None else {"status": r.status, "overall": r.overall}}


def _run(name: str, argv: list[str], timeout_s: float) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "argv": argv, "status": "missing", "returncode": None, "stdout": "", "stderr": ""}
    if shutil.which(argv[0]) is None:
        return entry
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        entry["status"] = "timeout"
        return entry
    except OSError as exc:
        entry.update(status="error", stderr=f"{type(exc).__name__}: {exc.strerror or exc}")
        return entry
    entry.update(status="ok" if proc.returncode == 0 else "error", returncode=proc.returncode,
                 stdout=proc.stdout[:MAX_OUTPUT].decode("utf-8", "replace"),
                 stderr=proc.stderr[:MAX_OUTPUT].decode("utf-8", "replace"))
    return entry


def collect(nonce: str, *, agent: GuestAgent | None = None, timeout_s: float = 30.0,
            attest_timeout_s: float = 300.0) -> GpuEvidence:
    """Run the captures and summarise them; with ``agent`` on dstack 0.6, also its GPU evidence (module docstring).

    Args:
        nonce: 64 hex characters; the audit chain head (hash of the entry just recorded).
        agent: The guest agent (None: nvidia-smi and nvattest only, as on dstack 0.5).
        timeout_s: Per nvidia-smi call.
        attest_timeout_s: For nvattest (it contacts NVIDIA's RIM and OCSP services).

    Raises:
        TeeError: nvidia-smi answered with output cvm-tune cannot parse (the evidence would not verify), or the
            guest agent's GPU evidence is missing, malformed, for another nonce or not the measured one.
    """
    commands = [_run(name, [NVIDIA_SMI, *args], timeout_s) for name, args in SMI_COMMANDS]
    query = commands[0]
    listed = query["status"] == "ok" and bool(query["stdout"].strip())
    if listed and shutil.which(NVATTEST) is not None:
        argv = [NVATTEST, "attest", "--device", "gpu", "--verifier", "local", "--nonce", nonce, "--format", "json"]
        commands.append(_run("nvattest", argv, attest_timeout_s))
    boot = None
    if agent is not None and (measured := agent.boot_info()).dstack06:
        gate = measured.values.get(GATE_EVENT)
        if listed or gate is not None:
            commands.append(attest_gpu(agent, nonce))
        boot = None if gate is None else boot_evidence(agent, nonce, gate)
    data = G.evidence_bytes({"schema": G.SCHEMA, "nonce": nonce, "commands": commands})
    try:
        info = G.summarize(data)
    except G.GpuEvidenceError as exc:
        raise TeeError(f"cannot read the GPU state: {exc}", fix="check the NVIDIA driver and nvidia-smi in the container") from exc
    return GpuEvidence(data, info, boot)


def attest_gpu(agent: GuestAgent, nonce: str) -> dict[str, Any]:
    """dstack 0.6's ``AttestGpu(nonce)`` as a ``gpu-evidence.json`` command entry (``dstack-attest-gpu``).

    Raises:
        TeeError: the agent refused, or answered malformed bundles or collect-evidence for another nonce.
    """
    bundles = _bundles(agent.v1("AttestGpu", {"nonce": nonce}), "bundles", "AttestGpu")
    for _, fmt, evidence in bundles:
        if fmt == FRESH_FORMAT and _nonces(evidence) != {nonce}:
            raise TeeError(f"guest agent answered AttestGpu with {FRESH_FORMAT} evidence for another nonce than "
                           "this run's (not fresh)")
    answer = {"bundles": [{"vendor": v, "format": f, "evidence": e.hex()} for v, f, e in bundles]}
    return {"name": ATTEST_GPU, "argv": ["/v1/AttestGpu", nonce], "status": "ok" if bundles else "error",
            "returncode": None, "stdout": json.dumps(answer, sort_keys=True, separators=(",", ":")),
            "stderr": "" if bundles else "the guest agent answered no GPU evidence bundle"}


def boot_evidence(agent: GuestAgent, nonce: str, measured: bytes) -> bytes:
    """dstack 0.6's boot-time GPU evidence (``Attest(include_boottime_gpu_evidence)``), exact bytes, once its SHA-256
    is the ``evidence_sha256`` of the measured ``gpu-attestation`` event (``measured``, its payload).

    Raises:
        TeeError: the event is not dstack's summary, or the agent answered no, several, malformed or other evidence.
    """
    try:
        want = json.loads(measured)["evidence_sha256"]
    except (ValueError, TypeError, KeyError) as exc:
        raise TeeError("the RTMR3 gpu-attestation event is not dstack's GPU attestation summary") from exc
    answer = agent.v1("Attest", {"report_data": nonce, "include_boottime_gpu_evidence": True})
    found = [e for v, f, e in _bundles(answer, "boottime_gpu_evidence", "Attest") if (v, f) == (NVIDIA, BOOT_FORMAT)]
    if len(found) != 1:
        raise TeeError(f"guest agent answered Attest with {len(found)} {BOOT_FORMAT} evidence bundles; its RTMR3 "
                       "gpu-attestation event measured one")
    if hashlib.sha256(found[0]).hexdigest() != want:
        raise TeeError("the boot-time GPU evidence the guest agent answered does not hash to the evidence_sha256 of "
                       "its RTMR3 gpu-attestation event")
    return found[0]


def _bundles(answer: dict[str, Any], key: str, method: str) -> list[tuple[str, str, bytes]]:
    """``(vendor, format, evidence bytes)`` of each ``GpuEvidenceBundle`` in ``answer[key]``.

    Raises:
        TeeError: not a list of ``{vendor, format, evidence}`` with strings and hex evidence.
    """
    items = answer.get(key)
    if not isinstance(items, list):
        raise TeeError(f"guest agent answered {method} without a {key} list")
    out = []
    for item in items:
        try:
            vendor, fmt, evidence = item["vendor"], item["format"], item["evidence"]
            if not all(isinstance(x, str) for x in (vendor, fmt, evidence)):
                raise TypeError("not strings")
            out.append((vendor, fmt, binascii.a2b_hex(evidence)))
        except (TypeError, KeyError, ValueError) as exc:  # binascii.Error is a ValueError
            raise TeeError(f"guest agent answered {method} with a malformed GPU evidence bundle (expected vendor, "
                           "format and hex evidence)") from exc
    return out


def _nonces(evidence: bytes) -> set[str]:
    """The ``nonce`` of each device in nvattest's collect-evidence JSON (lower case).

    Raises:
        TeeError: not that JSON.
    """
    try:
        return {str(e["nonce"]).lower() for e in json.loads(evidence)["evidences"]}
    except (ValueError, TypeError, KeyError) as exc:
        raise TeeError(f"guest agent answered AttestGpu with {FRESH_FORMAT} evidence that is not nvattest's "
                       "collect-evidence JSON") from exc


def require_confidential(info: G.GpuInfo, *, attested: bool = False) -> None:
    """``tee.gpu_evidence: required`` / ``attested``: refuse to train unless the evidence shows CC-mode GPUs.

    ``required`` rests on nvidia-smi (CC on, not DevTools, ready: the driver's unsigned word) and on NVIDIA's report
    only when one was made; ``attested`` also demands NVIDIA's report (nvattest local verifier) for this run's nonce.

    Raises:
        TeeError: listing every problem (no GPU, CC off or DevTools, not ready, NVIDIA report failed or absent).
    """
    issues = G.problems(info) + (G.unattested(info) if attested else [])
    if issues:
        mode = "attested" if attested else "required"
        fix = ("install NVIDIA's nvattest CLI in the image (docs/gpu.md) and run on an H100/H200 in CC mode, "
               "or set tee.gpu_evidence: required" if attested and not G.problems(info) else
               "run on an H100/H200 in confidential-computing mode (CC on, ready), or set tee.gpu_evidence: auto")
        raise TeeError(f"GPU evidence {mode} but: {'; '.join(issues)}", fix=fix)
