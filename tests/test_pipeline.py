"""Pipeline behaviour beyond the happy path: resume after a crash, agents without EmitEvent, an
encrypted dataset with a key file, the audit chain, and no plaintext on disk or in the output."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

import app.training
from app.audit import AuditLog, AuditRecorder
from app.cli import main
from app.config import TeeSettings
from app.dataset import encrypt_file, write_key_file
from app.errors import StateError, TeeError
from app.simulator import GuestAgentSimulator, SimulatorServer, SimulatorSettings
from app.tee import open_guest_agent
from attestation.bundle.audit import GENESIS

CANARY = "CANARY-4e1d-plaintext-must-not-leak"


def _cfg(tmp: Path, **sections: object) -> Path:
    data = {"output": {"dir": str(tmp / "out")}, "training": {"max_steps": 8, "save_steps": 4}}
    data.update(sections)
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _bundle(tmp: Path) -> Path:
    return next((tmp / "out" / "exports").iterdir())


def _policy_args(tmp: Path) -> list[str]:
    return ["--policy", str(tmp / "out" / "simulator-test-policy.yaml")]


def test_resume_after_crash_continues_the_run_and_its_audit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_train = app.training.train
    monkeypatch.setattr(app.training, "train", lambda req: real_train(dataclasses.replace(req, stop_after_step=4)))
    cfg = _cfg(tmp_path)
    assert main(["run", "--config", str(cfg)]) == 6  # TrainingInterrupted is a TrainingError
    assert not list((tmp_path / "out" / "exports").iterdir())
    monkeypatch.setattr(app.training, "train", real_train)
    assert main(["run", "--config", str(cfg)]) == 0  # a new process = a new simulator boot
    bundle = _bundle(tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["training"]["resumed_from_step"] == 4
    assert manifest["training"]["global_step"] == 8
    types = [json.loads(line)["type"] for line in (bundle / "audit.jsonl").read_text().splitlines()]
    assert types == ["run.start", "gpu.evidence", "checkpoint", "run.abort", "run.resume", "gpu.evidence", "checkpoint", "train.done", "export"]
    entries = [json.loads(line) for line in (bundle / "audit.jsonl").read_text().splitlines()]
    assert entries[3]["data"] == {"category": "training", "error": "TrainingInterrupted"}
    assert [e["data"]["global_step"] for e in entries if e["type"] == "checkpoint"] == [4, 8]
    assert main(["verify", str(bundle), *_policy_args(tmp_path)]) == 0


@pytest.fixture
def external_simulator(sock_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """A `cvm-tune simulator` that rejects EmitEvent (like dstack simulator >= 0.5.9 / dstack 0.6)."""
    server = SimulatorServer(GuestAgentSimulator(SimulatorSettings(emit_event="reject")),
                             socket_path=sock_dir / "agent.sock").start()
    monkeypatch.setenv("DSTACK_SIMULATOR_ENDPOINT", server.endpoint)
    yield server
    server.stop()


def test_agent_without_emit_event_is_recorded_and_policy_can_require_it(tmp_path: Path, external_simulator,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--config", str(_cfg(tmp_path, tee={"mode": "dstack"}))]) == 0
    assert "audit events not measured into RTMR3 (" in capsys.readouterr().out
    bundle = _bundle(tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["audit"]["rtmr3"] == "unsupported"
    assert manifest["tee"]["mode"] == "dstack" and manifest["tee"]["agent_rev"].startswith("cvm-tune-simulator")
    assert main(["verify", str(bundle), *_policy_args(tmp_path)]) == 0
    strict = yaml.safe_load((tmp_path / "out" / "simulator-test-policy.yaml").read_text())
    strict["require_rtmr3_audit"] = True
    (tmp_path / "strict.yaml").write_text(yaml.safe_dump(strict))
    capsys.readouterr()
    assert main(["verify", str(bundle), "--policy", str(tmp_path / "strict.yaml")]) == 1
    assert "FAIL audit.rtmr3" in capsys.readouterr().out


def test_emit_event_required_fails_closed(tmp_path: Path, external_simulator) -> None:
    cfg = _cfg(tmp_path, tee={"mode": "dstack", "emit_events": "required"})
    assert main(["run", "--config", str(cfg)]) == 5
    assert not list((tmp_path / "out" / "exports").iterdir())


@pytest.mark.parametrize(("dstack", "mode"), [("0.5", "accept"), ("0.5", "noop"), ("0.5", "reject"), ("0.6", "accept")])
def test_emit_support_detection(tmp_path: Path, sock_dir: Path, dstack: str, mode: str) -> None:
    """noop agents (dstack simulator 0.5.3-0.5.8) say OK but measure nothing: detected, not trusted. dstack 0.6
    always answers EmitEvent with 400: unsupported, and the run goes on."""
    settings = SimulatorSettings(emit_event=mode, dstack=dstack)  # type: ignore[arg-type]
    with SimulatorServer(GuestAgentSimulator(settings), socket_path=sock_dir / "s.sock") as srv:
        with open_guest_agent(TeeSettings(mode="dstack", endpoint=srv.endpoint)) as agent:
            rec = AuditRecorder(AuditLog(tmp_path / "audit.jsonl"), agent, require_emit=False)
            rec.record("r1", "run.start", {})
            rec.record("r1", "train.done", {})
    assert rec.rtmr3 == ("emit_event" if (dstack, mode) == ("0.5", "accept") else "unsupported")
    assert len(rec.log.entries) == 2 and rec.log.entries[0].prev == GENESIS


def test_audit_log_survives_a_torn_append_and_refuses_edits(tmp_path: Path, sock_dir: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with SimulatorServer(GuestAgentSimulator(), socket_path=sock_dir / "s.sock") as srv:
        with open_guest_agent(TeeSettings(mode="dstack", endpoint=srv.endpoint)) as agent:
            rec = AuditRecorder(AuditLog(path), agent, require_emit=False)
            for t in ("run.start", "train.done", "export"):
                rec.record("r1", t, {"n": 1})
    good = path.read_bytes()
    path.write_bytes(good + b'{"data":{},"prev":"ab')  # crash in the middle of an append
    log = AuditLog(path)
    assert log.repaired and len(log.entries) == 3 and path.read_bytes() == good
    path.write_bytes(good.replace(b'"n":1', b'"n":2', 1))
    with pytest.raises(StateError):
        AuditLog(path)


def test_no_agent_configured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DSTACK_SIMULATOR_ENDPOINT", raising=False)
    monkeypatch.setattr("app.tee.SOCKET_PATHS", (str(tmp_path / "nope.sock"),))
    with pytest.raises(TeeError) as err:
        with open_guest_agent(TeeSettings(mode="dstack")):
            pass
    assert "DSTACK_SIMULATOR_ENDPOINT" in err.value.message
    (tmp_path / "dir.sock").mkdir()  # what docker creates when the host socket is missing
    with pytest.raises(TeeError, match="not a unix socket"):
        with open_guest_agent(TeeSettings(mode="dstack", endpoint=str(tmp_path / "dir.sock"))):
            pass


def test_encrypted_file_with_key_file_and_no_plaintext_anywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An owner-encrypted dataset (key file source): trains, and the canary row never reaches disk or output."""
    owner = tmp_path / "owner"
    owner.mkdir()
    plain = owner / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{CANARY} question {i}?"},
                          {"role": "assistant", "content": f"answer {i} {CANARY}"}]} for i in range(40)]
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    key = bytes(range(32))
    write_key_file(owner / "dataset.key", key)
    data_dir = tmp_path / "volume"
    data_dir.mkdir()
    encrypt_file(plain, data_dir / "data.cvmds", key, dataset_id="owner-set", dataset_version=3)
    cfg = _cfg(tmp_path, dataset={"source": "encrypted-file", "path": str(data_dir / "data.cvmds"),
                                  "key": {"source": "file", "file": str(owner / "dataset.key")}})
    assert main(["run", "--config", str(cfg)]) == 0
    captured = capsys.readouterr()
    assert CANARY not in captured.out + captured.err
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert CANARY.encode() not in path.read_bytes(), f"plaintext leaked into {path}"
    manifest = json.loads((_bundle(tmp_path) / "manifest.json").read_text())
    assert manifest["dataset"]["dataset_id"] == "owner-set" and manifest["dataset"]["dataset_version"] == 3
    assert manifest["dataset"]["key_source"].startswith("file:")


def test_wrong_key_is_a_key_error_and_nothing_trains(tmp_path: Path) -> None:
    plain = tmp_path / "d.jsonl"
    plain.write_text(json.dumps({"text": "hello"}) + "\n")
    encrypt_file(plain, tmp_path / "d.cvmds", bytes(32), dataset_id="x")
    write_key_file(tmp_path / "k", b"\x01" * 32)
    cfg = _cfg(tmp_path, dataset={"source": "encrypted-file", "path": str(tmp_path / "d.cvmds"),
                                  "key": {"source": "file", "file": str(tmp_path / "k")}})
    assert main(["run", "--config", str(cfg)]) == 4
    assert not (tmp_path / "out" / "runs").exists() or not list((tmp_path / "out" / "runs").iterdir())


@pytest.mark.parametrize("bad", ["..", "../escape", "a/b", ".hidden", "-x", "x" * 101])
def test_run_id_must_be_a_safe_name(tmp_path: Path, bad: str) -> None:
    assert main(["run", "--config", str(_cfg(tmp_path)), f"--run-id={bad}"]) == 2
    assert not (tmp_path / "escape").exists()
