"""The product against both simulated dstack lines (``tee.simulator.dstack``): the demo run and a federated client
round, each verified. 0.5.11 measures the audit chain into RTMR3 with EmitEvent; 0.6.7 refuses EmitEvent (400) and
the run goes on with ``audit.rtmr3: unsupported``, each checkpoint anchored by a quote. (The API on both: ``test_key_epochs_api.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from app.cli import main

VERSIONS = {"0.5": ("0.5.11", "emit_event"), "0.6": ("0.6.7", "unsupported")}


@pytest.mark.parametrize("dstack", sorted(VERSIONS))
def test_demo_run_verifies_on_both(tmp_path: Path, dstack: str) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"output": {"dir": str(tmp_path / "out")}, "tee": {"simulator": {"dstack": dstack}},
                                   "training": {"max_steps": 2, "save_steps": 2}}))
    assert main(["run", "--config", str(cfg)]) == 0
    bundle = next((tmp_path / "out" / "exports").glob("run-*"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert (manifest["tee"]["agent_version"], manifest["audit"]["rtmr3"]) == VERSIONS[dstack]
    assert manifest["audit"].get("anchors") == (None if dstack == "0.5" else 1)  # 0.6: its one checkpoint, anchored
    assert main(["verify", str(bundle), "--policy", str(tmp_path / "out" / "simulator-test-policy.yaml")]) == 0


@pytest.mark.parametrize("dstack", sorted(VERSIONS))
def test_federated_client_round_verifies_on_both(tmp_path: Path, dstack: str) -> None:
    from attestation import verify_bundle

    from app.config import load_config
    from app.federated.round_input import RoundInput
    from app.run.pipeline import RunHooks, run_once
    from tests.test_federated import NOW, _client_config, _policy

    path = _client_config(tmp_path, 0, "clinic-a")
    doc = yaml.safe_load(path.read_text())
    doc["tee"] = {"simulator": {"dstack": dstack}}
    path.write_text(yaml.safe_dump(doc))
    res = run_once(load_config(path), run_id=f"fed-r1-{dstack.replace('.', '')}",
                   hooks=RunHooks(federation=RoundInput(1, "ab" * 32, None, None, 0.0)))
    manifest = json.loads((res.bundle_dir / "manifest.json").read_bytes())
    assert manifest["federation"]["round"] == 1 and manifest["tee"]["agent_version"] == VERSIONS[dstack][0]
    assert verify_bundle(res.bundle_dir, policy=_policy(), now=NOW).accepted


def test_a_v3_mrconfigid_run_carries_its_mr_config_document_and_verifies(tmp_path: Path, sock_dir: Path) -> None:
    """dstack 0.6 with ``key_provider_id``: MRCONFIGID v3; the bundle carries the MrConfigV3 document it hashes."""
    from app.simulator import GuestAgentSimulator, SimulatorServer, SimulatorSettings

    base = GuestAgentSimulator()
    compose = {**json.loads(base.app_compose), "key_provider_id": json.loads(base.key_provider_info)["id"]}
    sim = GuestAgentSimulator(SimulatorSettings(app_compose=json.dumps(compose, separators=(",", ":"))))
    with SimulatorServer(sim, socket_path=sock_dir / "v3.sock") as srv:
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(yaml.safe_dump({"output": {"dir": str(tmp_path / "out")},
                                       "tee": {"mode": "dstack", "endpoint": srv.endpoint},
                                       "training": {"max_steps": 2, "save_steps": 2}}))
        assert main(["run", "--config", str(cfg)]) == 0
    bundle = next((tmp_path / "out" / "exports").glob("run-*"))
    assert (bundle / "mr-config.json").read_text() == sim.mr_config
    assert main(["verify", str(bundle), "--policy", str(tmp_path / "out" / "simulator-test-policy.yaml")]) == 0
