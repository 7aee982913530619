"""Deployment files parse and keep their invariants; the README's commands are what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from app.config import load_config

REPO = Path(__file__).resolve().parent.parent


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())


def test_compose_service_invariants() -> None:
    svc = _compose()["services"]["cvm-tune"]
    assert svc["init"] is True, "PID 1 must forward SIGTERM (init: true)"
    vols = svc["volumes"]
    assert "/var/run/dstack.sock:/var/run/dstack.sock" in vols
    assert any(v.startswith("dataset:") and v.endswith(":ro") for v in vols), "dataset volume must be read-only"
    assert any(v.startswith("models:") and v.endswith(":ro") for v in vols), "model volume must be read-only"
    assert any(v.startswith("output:") and not v.endswith(":ro") for v in vols)
    assert svc["restart"] in ("on-failure", "unless-stopped", "always")
    gpu = svc["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


def test_compose_has_no_secrets_in_clear() -> None:
    svc = _compose()["services"]["cvm-tune"]
    for item in svc.get("environment", []):
        name, _, value = item.partition("=")
        assert not re.search(r"KEY|TOKEN|SECRET|PASSWORD", name, re.I), f"{name} must come from encrypted env"


def test_dstack_config_matches_compose_mounts() -> None:
    cfg = load_config(REPO / "configs" / "dstack.yaml")
    assert cfg.tee.mode == "dstack"
    mounts = {v.split(":")[1] for v in _compose()["services"]["cvm-tune"]["volumes"]}
    assert any(str(cfg.dataset.path).startswith(m) for m in mounts)
    assert any(str(cfg.base_model.path).startswith(m) for m in mounts)
    assert str(cfg.output.dir) in mounts


def test_dockerfile_invariants() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "requirements/cpu.txt" in text, "the image installs from the same lock as CI"
    assert re.search(r"^USER\s+(?!root|0\b)", text, re.M), "non-root user"
    for var in ("HF_HUB_OFFLINE=1", "UNSLOTH_DISABLE_STATISTICS=1"):
        assert var in text
    assert "configs/dstack.yaml" in text


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```(?:sh|bash)?\n(.*?)```", text, re.S)
    assert block, "README must start with a code block of set-up commands"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_starts_with_two_commands_and_ci_runs_the_second() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    ci = (REPO / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()
    assert "cvm-tune run" in commands[0]
