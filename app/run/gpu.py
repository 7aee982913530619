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

Nothing is interpreted here beyond :func:`attestation.tdx.gpu.summarize`; every raw output goes into
``gpu-evidence.json`` so that a verifier can re-derive the manifest's ``gpu`` object.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from attestation.tdx import gpu as G

from app.errors import TeeError

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


@dataclass(frozen=True)
class GpuEvidence:
    """A collected evidence file and its summary.

    Attributes:
        data: ``gpu-evidence.json`` bytes (canonical JSON).
        info: The manifest's ``gpu`` object (``attestation.tdx.gpu.summarize(data)``).
    """

    data: bytes
    info: G.GpuInfo

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


def collect(nonce: str, *, timeout_s: float = 30.0, attest_timeout_s: float = 300.0) -> GpuEvidence:
    """Run the captures and summarise them.

    Args:
        nonce: 64 hex characters; the audit chain head (hash of the entry just recorded).
        timeout_s: Per nvidia-smi call.
        attest_timeout_s: For nvattest (it contacts NVIDIA's RIM and OCSP services).

    Raises:
        TeeError: nvidia-smi answered with output cvm-tune cannot parse (the evidence would not verify).
    """
    commands = [_run(name, [NVIDIA_SMI, *args], timeout_s) for name, args in SMI_COMMANDS]
    query = commands[0]
    if query["status"] == "ok" and query["stdout"].strip() and shutil.which(NVATTEST) is not None:
        argv = [NVATTEST, "attest", "--device", "gpu", "--verifier", "local", "--nonce", nonce, "--format", "json"]
        commands.append(_run("nvattest", argv, attest_timeout_s))
    data = G.evidence_bytes({"schema": G.SCHEMA, "nonce": nonce, "commands": commands})
    try:
        info = G.summarize(data)
    except G.GpuEvidenceError as exc:
        raise TeeError(f"cannot read the GPU state: {exc}", fix="check the NVIDIA driver and nvidia-smi in the container") from exc
    return GpuEvidence(data, info)


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
