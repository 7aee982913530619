"""A run never publishes a bundle that fails its own verification; a resume after a change outside
``training``/``base_model`` stays verifiable; a resume after a change that shapes the adapter is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

import app.training
from app.cli import main
from app.config import Config
from app.tee import GuestAgent
from attestation import bundle as B


def _cfg(tmp: Path, **output: object) -> Path:
    data = {"output": {"dir": str(tmp / "out"), **output}, "training": {"max_steps": 8, "save_steps": 4}}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _stop_after(monkeypatch: pytest.MonkeyPatch, step: int):
    real = app.training.train
    monkeypatch.setattr(app.training, "train", lambda req: real(dataclasses.replace(req, stop_after_step=step)))
    return real


def _exports(tmp: Path) -> list[Path]:
    return sorted((tmp / "out" / "exports").iterdir())


def _policy(tmp: Path) -> list[str]:
    return ["--policy", str(tmp / "out" / "simulator-test-policy.yaml")]


def test_training_config_hash_is_recomputable_from_the_bundle_config() -> None:
    cfg = Config()
    assert B.training_config_sha256(cfg.canonical_json()) == __import__("hashlib").sha256(cfg.training_json()).hexdigest()
    assert B.training_config_sha256(b"{not json") == "invalid"


def test_resume_after_a_change_outside_training_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _stop_after(monkeypatch, 4)
    assert main(["run", "--config", str(_cfg(tmp_path)), "--run-id", "r1"]) == 6
    monkeypatch.setattr(app.training, "train", real)
    assert main(["run", "--config", str(_cfg(tmp_path, keep_checkpoints=7)), "--run-id", "r1"]) == 0
    (bundle,) = _exports(tmp_path)
    entries = [json.loads(line) for line in (bundle / B.AUDIT).read_text().splitlines()]
    start, resume = (e for e in entries if e["type"] in ("run.start", "run.resume"))
    assert start["data"]["config_sha256"] != resume["data"]["config_sha256"]
    assert start["data"]["training_config_sha256"] == resume["data"]["training_config_sha256"]
    assert main(["verify", str(bundle), *_policy(tmp_path)]) == 0


def test_resume_after_a_training_change_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _stop_after(monkeypatch, 4)
    cfg = _cfg(tmp_path)
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 6
    doc = yaml.safe_load(cfg.read_text())
    doc["training"]["learning_rate"] = 1e-3
    cfg.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 7
    assert "started with other inputs" in capsys.readouterr().err
    assert _exports(tmp_path) == []


def test_a_bundle_failing_its_own_verification_is_not_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    real_quote = GuestAgent.quote
    # A broken agent: the quote is over other report_data than the manifest's.
    monkeypatch.setattr(GuestAgent, "quote", lambda self, rd: real_quote(self, bytes(64)))
    cfg = _cfg(tmp_path)
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 7
    err = capsys.readouterr().err
    assert "fails its own verification" in err and "report_data" in err
    assert _exports(tmp_path) == []  # nothing published, no temp left
    state = json.loads((tmp_path / "out" / "runs" / "r1" / "state.json").read_text())
    assert state["status"] == "running"  # resumable
    monkeypatch.setattr(GuestAgent, "quote", real_quote)
    assert main(["run", "--config", str(cfg), "--run-id", "r1"]) == 0
    (bundle,) = _exports(tmp_path)
    types = [json.loads(line)["type"] for line in (bundle / B.AUDIT).read_text().splitlines()]
    assert types.count("export") == 2 and types[-1] == "export" and "run.abort" in types
    assert main(["verify", str(bundle), *_policy(tmp_path)]) == 0


def test_lock_survives_removal_of_the_state_directory(tmp_path: Path) -> None:
    import shutil

    from app.state import Locked, run_lock

    out = tmp_path / "out"
    out.mkdir()
    with run_lock(out) as info:
        assert info.read_text().strip() == str(__import__("os").getpid())
        shutil.rmtree(out / "state")  # a stray rm cannot hand out a second lock
        with pytest.raises(Locked):
            with run_lock(out):
                pass
    with run_lock(out):  # released on exit
        pass
