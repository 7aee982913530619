"""A bundle is published only after it passes its own verification under the run's policy, and a run
resumed after a training-irrelevant config change exports a bundle that verifies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import app.tee
from app.cli import main
from app.config import load_config
from app.pipeline import RunHooks, run_once
from app.training import TrainingStopped


def _write_cfg(tmp: Path, **output: object) -> Path:
    data = {"output": {"dir": str(tmp / "out"), **output}, "training": {"max_steps": 6, "save_steps": 2}}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _policy(tmp: Path) -> list[str]:
    return ["--policy", str(tmp / "out" / "simulator-test-policy.yaml")]


def _stop_after(step: int) -> RunHooks:
    seen: list[int] = []
    return RunHooks(should_stop=lambda: "SIGTERM received" if seen and seen[-1] >= step else None,
                    on_step=seen.append)


def test_resume_after_a_training_irrelevant_config_change_verifies(tmp_path: Path) -> None:
    cfg_path = _write_cfg(tmp_path, keep_checkpoints=3)
    with pytest.raises(TrainingStopped):  # what SIGTERM does in `cvm-tune run`: checkpoint, stop
        run_once(load_config(cfg_path), run_id="r-change", hooks=_stop_after(2))
    assert not list((tmp_path / "out" / "exports").iterdir())
    cfg_path = _write_cfg(tmp_path, keep_checkpoints=5)  # changes config.json, not the training fingerprint
    assert main(["run", "--config", str(cfg_path), "--run-id", "r-change"]) == 0
    bundle = tmp_path / "out" / "exports" / "r-change"
    entries = [json.loads(line) for line in (bundle / "audit.jsonl").read_text().splitlines()]
    start, resume = entries[0], next(e for e in entries if e["type"] == "run.resume")
    assert start["data"]["config_sha256"] != resume["data"]["config_sha256"]  # the change is on the record
    assert main(["verify", str(bundle), *_policy(tmp_path)]) == 0


def test_resume_entry_cannot_swap_the_dataset(tmp_path: Path) -> None:
    """The verifier still ties the dataset plaintext of every start/resume entry to the manifest."""
    from attestation.audit import parse_lines
    from attestation.bundle_verify import _entry_contents
    from attestation import bundle as B

    cfg_path = _write_cfg(tmp_path)
    with pytest.raises(TrainingStopped):
        run_once(load_config(cfg_path), run_id="r-ds", hooks=_stop_after(2))
    assert main(["run", "--config", str(cfg_path), "--run-id", "r-ds"]) == 0
    bundle = tmp_path / "out" / "exports" / "r-ds"
    m = B.Manifest.model_validate_json((bundle / "manifest.json").read_bytes())
    entries = parse_lines((bundle / "audit.jsonl").read_bytes())
    assert _entry_contents(entries, m) == []
    other = m.model_copy(update={"dataset": m.dataset.model_copy(update={"plaintext_sha256": "0" * 64})})
    problems = _entry_contents(entries, other)
    assert any("run.start entry" in p for p in problems) and any("run.resume entry" in p for p in problems)


def test_a_bundle_that_fails_its_own_verification_is_not_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    real_quote = app.tee.GuestAgent.quote
    # A faulty agent: the quote binds other report_data than the manifest's (the verifier's report_data check fails).
    monkeypatch.setattr(app.tee.GuestAgent, "quote", lambda self, rd: real_quote(self, bytes(64)))
    cfg_path = _write_cfg(tmp_path)
    assert main(["run", "--config", str(cfg_path), "--run-id", "r-gate"]) == 7
    err = capsys.readouterr().err
    assert "fails its own verification" in err and "report_data" in err
    exports = tmp_path / "out" / "exports"
    assert list(exports.iterdir()) == []  # nothing published, no temp left
    state = json.loads((tmp_path / "out" / "runs" / "r-gate" / "state.json").read_text())
    assert state["status"] == "running"  # resumable
    monkeypatch.setattr(app.tee.GuestAgent, "quote", real_quote)
    assert main(["run", "--config", str(cfg_path), "--run-id", "r-gate"]) == 0
    types = [json.loads(x)["type"] for x in (exports / "r-gate" / "audit.jsonl").read_text().splitlines()]
    assert "run.abort" in types and "run.resume" in types
    assert main(["verify", str(exports / "r-gate"), *_policy(tmp_path)]) == 0
