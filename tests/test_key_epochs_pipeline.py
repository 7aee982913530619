"""A KMS key rotation between two nights, through the real pipeline on the embedded simulator (``app.keys_epoch``):
a run killed mid-way resumes from its sealed checkpoint after the rotation; a confidential promoted adapter is the
warm start of the next night; a guest that ignores GetKey's epoch selectors stops the run with nothing changed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pyrage
import pytest
import yaml

import app.training
from app.cli import main
from app.keys_epoch import KeyEpochs, read_epochs


def _cfg(tmp: Path, *, sim: dict | None = None, **sections: object) -> Path:
    data: dict = {"output": {"dir": str(tmp / "out")}, "training": {"max_steps": 8, "save_steps": 4}}
    data.update(sections)
    if sim is not None:
        data["tee"] = {"simulator": sim}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def killed_night(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Night 1 under key epochs (0, 0), stopped after its step-4 checkpoint was sealed."""
    real_train = app.training.train
    monkeypatch.setattr(app.training, "train", lambda req: real_train(dataclasses.replace(req, stop_after_step=4)))
    assert main(["run", "--config", str(_cfg(tmp_path))]) == 6
    monkeypatch.setattr(app.training, "train", real_train)
    ckpts = next((tmp_path / "out" / "runs").glob("*/checkpoints"))
    assert read_epochs(ckpts) == KeyEpochs(0, 0) and (ckpts / "checkpoint-4").is_dir()
    return ckpts


def test_rotation_between_two_nights_resumes_from_the_sealed_checkpoint(tmp_path: Path, killed_night: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["run", "--config", str(_cfg(tmp_path, sim={"root_epoch": 1, "app_epoch": 1}))]) == 0
    assert "re-sealed 1 checkpoint(s)" in capsys.readouterr().out
    bundle = next((tmp_path / "out" / "exports").glob("run-*"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["training"]["resumed_from_step"] == 4 and manifest["training"]["global_step"] == 8
    assert read_epochs(killed_night) == KeyEpochs(1, 1)
    assert main(["verify", str(bundle), "--policy", str(tmp_path / "out" / "simulator-test-policy.yaml")]) == 0


def test_a_guest_ignoring_the_selectors_stops_the_run_with_nothing_changed(tmp_path: Path, killed_night: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    before = _tree(killed_night)
    capsys.readouterr()
    assert main(["run", "--config", str(_cfg(tmp_path, sim={"dstack": "0.5", "app_epoch": 1}))]) != 0
    err = capsys.readouterr().err
    assert "reports no key epochs" in err and "0.6.6" in err
    assert _tree(killed_night) == before
    assert not list((tmp_path / "out" / "exports").iterdir())


def test_confidential_warm_start_across_a_rotation(tmp_path: Path) -> None:
    owner = pyrage.x25519.Identity.generate()
    common = {"export": {"recipients": [str(owner.to_public())]}}
    night1 = _cfg(tmp_path, **common, training={"max_steps": 2, "save_steps": 2, "init": "previous"})
    assert main(["run", "--config", str(night1)]) == 0
    first = next((tmp_path / "out" / "exports").glob("run-*"))
    m1 = json.loads((first / "manifest.json").read_text())
    night2 = _cfg(tmp_path, sim={"app_epoch": 1}, **common,
                  training={"max_steps": 3, "save_steps": 3, "init": "previous"})
    assert main(["run", "--config", str(night2)]) == 0
    second = next(p for p in (tmp_path / "out" / "exports").glob("run-*") if p != first)
    m2 = json.loads((second / "manifest.json").read_text())
    assert m2["lineage"]["parent_run_id"] == m1["run_id"]  # warm-started from the parent encrypted to the old key
    # the CVM's new age recipient is announced in the new bundle's quoted manifest
    assert m2["confidentiality"]["cvm_recipient"] != m1["confidentiality"]["cvm_recipient"]
