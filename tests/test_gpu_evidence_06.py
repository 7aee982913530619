"""dstack 0.6's GPU evidence in the run and the bundle (``app/run/gpu.py``; verifier spec §12, §12a).

A run on a 0.6 guest whose boot gate attested a GPU (the embedded simulator with ``tee.simulator.gpu``) asks
``AttestGpu`` with the run's nonce (recorded in ``gpu-evidence.json``) and ``Attest(include_boottime_gpu_evidence)``
(written as ``gpu-boot-evidence.json``, exact bytes); the bundle verifies with ``gpu.boot_evidence: pass``. The
agent's answers are parsed against the real 0.6 boot log of ``tests/data/dstack-0.6/`` with dstack's real H100
boot-time evidence; a malformed answer is a ``TeeError`` before anything is recorded. A 0.5 guest and a 0.6 guest
without a GPU record what they recorded before.
Run: ``python -m pytest tests/test_gpu_evidence_06.py -q``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from app.cli import main
from app.config import TeeSettings
from app.errors import TeeError
from app.run import gpu as collect_mod
from app.run.pipeline import gpu_stage
from app.tee import open_guest_agent
from attestation.tdx.eventlog import boot_info, parse_event_log
from tests.test_dstack06_verify import GPU_EVIDENCE, GPU_LOG, LOG

NONCE = "5a" * 32
SMI = ["query-gpu", "cc-status", "cc-devtools", "cc-environment", "cc-query"]  # no nvidia-smi here: all "missing"


def _collect_evidence(nonce: str) -> bytes:
    """nvattest collect-evidence's JSON shape (dstack-0.6.md §4) for one GPU and ``nonce``."""
    return json.dumps({"evidences": [{"version": "1.0", "arch": "HOPPER", "nonce": nonce, "vbios_version": "v",
                                      "driver_version": "d", "evidence": "", "certificate": ""}],
                       "result_code": 0, "result_message": "Ok"}).encode()


def _bundle(fmt: str, evidence: bytes) -> dict[str, str]:
    return {"vendor": "nvidia", "format": fmt, "evidence": evidence.hex()}


BOOT = _bundle(collect_mod.BOOT_FORMAT, GPU_EVIDENCE)
FRESH = _bundle(collect_mod.FRESH_FORMAT, _collect_evidence(NONCE))


class _Agent:
    """A 0.6 guest agent whose Info log is the real 0.6 boot (with a gate-attested H100) and whose v1 answers are
    given; records the calls."""

    def __init__(self, attest: Any = None, attest_gpu: Any = None, log: list[dict[str, Any]] = GPU_LOG) -> None:
        self.answers = {"Attest": {"attestation": "00", "boottime_gpu_evidence": [BOOT]} if attest is None else attest,
                        "AttestGpu": {"bundles": [FRESH]} if attest_gpu is None else attest_gpu}
        self.log, self.calls = log, []  # type: list[tuple[str, dict[str, Any]]]

    def boot_info(self) -> Any:
        return boot_info(parse_event_log(self.log))

    def v1(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((method, body))
        return self.answers[method]


def test_the_agents_gpu_evidence_is_recorded_with_the_runs_nonce() -> None:
    agent = _Agent()
    ev = collect_mod.collect(NONCE, agent=agent)  # type: ignore[arg-type]
    assert ev.boot == GPU_EVIDENCE  # exact bytes: their SHA-256 is the measured evidence_sha256
    assert agent.calls == [("AttestGpu", {"nonce": NONCE}),
                           ("Attest", {"report_data": NONCE, "include_boottime_gpu_evidence": True})]
    doc = json.loads(ev.data)
    entry = doc["commands"][-1]
    assert doc["nonce"] == NONCE and [c["name"] for c in doc["commands"]] == [*SMI, "dstack-attest-gpu"]
    assert (entry["status"], entry["argv"], json.loads(entry["stdout"])) == ("ok", ["/v1/AttestGpu", NONCE], {"bundles": [FRESH]})
    assert ev.info.evidence_sha256 == hashlib.sha256(ev.data).hexdigest()


def test_no_gpu_and_dstack_05_record_what_they_did_before(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    before = collect_mod.collect(NONCE).data  # no agent: today's captures only
    quiet = _Agent(log=LOG)  # the real 0.6 boot without a GPU: nothing to ask
    assert collect_mod.collect(NONCE, agent=quiet).data == before and quiet.calls == []  # type: ignore[arg-type]
    for dstack in ("0.5", "0.6"):  # the simulators: 0.5 with a GPU setting (0.5 has no gate), 0.6 without a GPU
        settings = TeeSettings.model_validate({"mode": "embedded-simulator",
                                               "simulator": {"dstack": dstack, "gpu": dstack == "0.5"}})
        with open_guest_agent(settings) as agent:
            ev = collect_mod.collect(NONCE, agent=agent)
        assert (ev.data, ev.boot) == (before, None), dstack


MALFORMED = {  # name -> (Attest answer, AttestGpu answer, phrase of the TeeError)
    "no bundle list": ({"attestation": "00"}, None, "answered Attest without a boottime_gpu_evidence list"),
    "a bundle without evidence": ({"boottime_gpu_evidence": [{"vendor": "nvidia", "format": collect_mod.BOOT_FORMAT}]},
                                  None, "malformed GPU evidence bundle"),
    "evidence not hex": ({"boottime_gpu_evidence": [{**BOOT, "evidence": "zz"}]}, None, "malformed GPU evidence bundle"),
    "no boot evidence": ({"boottime_gpu_evidence": []}, None, "0 nvidia-nvattest-boottime-json-v1 evidence bundles"),
    "two boot evidences": ({"boottime_gpu_evidence": [BOOT, BOOT]}, None, "2 nvidia-nvattest-boottime-json-v1"),
    "other boot evidence": ({"boottime_gpu_evidence": [_bundle(collect_mod.BOOT_FORMAT, GPU_EVIDENCE + b"\n")]}, None,
                            "does not hash to the evidence_sha256 of its RTMR3 gpu-attestation event"),
    "bundles not a list": (None, {"bundles": {"0": FRESH}}, "answered AttestGpu without a bundles list"),
    "a bundle that is a string": (None, {"bundles": ["nvidia"]}, "malformed GPU evidence bundle"),
    "fresh evidence for another nonce": (None, {"bundles": [_bundle(collect_mod.FRESH_FORMAT, _collect_evidence("77" * 32))]},
                                         "for another nonce than this run's"),
    "fresh evidence not JSON": (None, {"bundles": [_bundle(collect_mod.FRESH_FORMAT, b"{")]},
                                "not nvattest's collect-evidence JSON"),
}


@pytest.mark.parametrize("attest, attest_gpu, phrase", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_answer_is_a_tee_error_and_nothing_is_recorded(attest: Any, attest_gpu: Any, phrase: str) -> None:
    recorded: list[str] = []
    audit = SimpleNamespace(log=SimpleNamespace(head=NONCE),
                            recorder=SimpleNamespace(record=lambda run_id, kind, data: recorded.append(kind)))
    cfg = SimpleNamespace(tee=SimpleNamespace(gpu_evidence="auto"))
    with pytest.raises(TeeError, match=phrase):
        gpu_stage(cfg, SimpleNamespace(agent=_Agent(attest, attest_gpu)), audit, SimpleNamespace(run_id="r"),  # type: ignore[arg-type]
                  print)
    assert recorded == []


# --- a run on the 0.6 simulator with a GPU, verified ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(bundle, simulator policy) of one short run on the embedded 0.6 simulator with a gate-attested GPU."""
    root = tmp_path_factory.mktemp("gpu06")
    cfg = {"output": {"dir": str(root / "out")}, "training": {"max_steps": 2, "save_steps": 2},
           "tee": {"simulator": {"dstack": "0.6", "gpu": True}}}
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", "--config", str(root / "cfg.yaml")]) == 0
    return next((root / "out" / "exports").iterdir()), root / "out" / "simulator-test-policy.yaml"


def _verify(capsys: pytest.CaptureFixture[str], bundle: Path, policy: Path) -> tuple[int, dict[str, Any]]:
    rc = main(["verify", str(bundle), "--policy", str(policy), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_the_bundle_carries_the_boot_evidence_and_verifies(gpu_run: tuple[Path, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    bundle, policy = gpu_run
    assert (bundle / "gpu-boot-evidence.json").read_bytes() == GPU_EVIDENCE  # dstack's bytes, never re-serialised
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert "gpu-boot-evidence.json" not in manifest["files"]  # a platform file: bound by RTMR3, like mr-config.json
    evidence = json.loads((bundle / "gpu-evidence.json").read_bytes())
    fresh = json.loads(evidence["commands"][-1]["stdout"])["bundles"][0]
    assert json.loads(bytes.fromhex(fresh["evidence"]))["evidences"][0]["nonce"] == evidence["nonce"]
    audit = [json.loads(line) for line in (bundle / "audit.jsonl").read_text().splitlines()]
    gpu_entry = next(e for e in audit if e["type"] == "gpu.evidence")
    assert gpu_entry["prev"] == evidence["nonce"]  # the nonce AttestGpu got is the chain head, as in spec §12
    rc, verdict = _verify(capsys, bundle, policy)
    checks = {c["name"]: c for c in verdict["checks"]}
    assert rc == 0 and checks["gpu.boot_evidence"]["status"] == "pass", checks["gpu.boot_evidence"]
    assert checks["gpu.evidence"]["status"] == "pass" and verdict["gpu"]["status"] == "verified"


def test_a_tampered_boot_evidence_fails_exactly_that_check(gpu_run: tuple[Path, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    bundle = shutil.copytree(gpu_run[0], tmp_path / "b")
    doc = json.loads(GPU_EVIDENCE)
    doc["result_message"] = "Ok, and then some"
    (bundle / "gpu-boot-evidence.json").write_text(json.dumps(doc))
    rc, verdict = _verify(capsys, bundle, gpu_run[1])
    failed = [c for c in verdict["checks"] if c["status"] == "fail"]
    assert rc == 1 and [c["name"] for c in failed] == ["gpu.boot_evidence"], failed
    assert "is not the measured evidence_sha256" in failed[0]["reason"]


def test_the_standalone_simulator_takes_gpu(tmp_path: Path) -> None:
    assert main(["simulator", "--gpu", "--write-policy", str(tmp_path / "p.yaml")]) == 0
    assert main(["simulator", "--dstack", "0.5", "--gpu", "--write-policy", str(tmp_path / "q.yaml")]) == 0  # no effect
