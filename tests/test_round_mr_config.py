"""A federated round on dstack 0.6 with ``key_provider_id`` (MRCONFIGID v3): the round bundle carries the MrConfigV3
document as ``mr-config.json``, like an export bundle, and ``compose.hash`` checks it (verifier spec §3a, §13).

One client trains for round 1 (``run_once`` with the round's terms) and the aggregator exports the round
(``export_round``), both on one v3 simulated CVM; no Flower. The page (``web/src/rounds.js``) gives the same checks.
Run: ``python -m pytest tests/test_round_mr_config.py -q``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from attestation.bundle import manifest as B
from attestation.io.hashing import sha256_file
from attestation.policy import Policy, policy_file_text, simulator_policy
from attestation.rounds import manifest as R
from attestation.rounds.verify import verify_round, verify_round_head
from tests.test_federated import NOW, _client_config
from tests.test_web_verify import drive, packed_cases, pytestmark as web_test, same_checks, site  # noqa: F401
from tests.test_web_verify import web_copy  # noqa: F401  (the fixture: web/ rebuilt in a scratch directory)

NONCE = "ab" * 32


@pytest.fixture(scope="module")
def v3_round(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str, Policy]]:
    """(round bundle, simulator policy file, the MrConfigV3 document, the policy) of a one-client round on a v3
    CVM."""
    from app.config import TeeSettings, load_config
    from app.federated.admission import Admitted
    from app.federated.round_export import Aggregator, RoundRecord, export_round
    from app.federated.round_input import RoundInput
    from app.federated.transport import safetensors_to_arrays
    from app.run.pipeline import RunHooks, run_once
    from app.simulator import GuestAgentSimulator, SimulatorServer, SimulatorSettings
    from app.tee import open_guest_agent

    root = tmp_path_factory.mktemp("v3round")
    base = GuestAgentSimulator()
    compose = {**json.loads(base.app_compose), "key_provider_id": json.loads(base.key_provider_info)["id"]}
    sim = GuestAgentSimulator(SimulatorSettings(app_compose=json.dumps(compose, separators=(",", ":"))))
    assert sim.mr_config is not None
    policy = simulator_policy(sim.test_root_ca_der)
    with tempfile.TemporaryDirectory(prefix="s-", dir="/tmp") as short, \
            SimulatorServer(sim, socket_path=Path(short) / "v3.sock") as srv:  # a socket path that fits sun_path
        path = _client_config(root, 0, "clinic-a")
        doc = yaml.safe_load(path.read_text())
        doc["tee"] = {"mode": "dstack", "endpoint": srv.endpoint}
        path.write_text(yaml.safe_dump(doc))
        client = run_once(load_config(path), run_id="fed-r1-v3",
                          hooks=RunHooks(federation=RoundInput(1, NONCE, None, None, 0.0))).bundle_dir
        assert (client / B.MR_CONFIG).read_text() == sim.mr_config  # an export bundle carried it already
        manifest = json.loads((client / B.MANIFEST).read_bytes())
        adapter = client / B.WEIGHTS
        admitted = Admitted(client="clinic-a", node_id=1, bundle=client, run_id=manifest["run_id"],
                            manifest_sha256=sha256_file(client / B.MANIFEST),
                            quote_sha256=R.quote_identity((client / B.QUOTE_BIN).read_bytes()),
                            adapter_sha256=sha256_file(adapter),
                            trainable_tokens=manifest["dataset"]["validation"]["trainable_tokens"],
                            arrays=safetensors_to_arrays(adapter))
        with open_guest_agent(TeeSettings(mode="dstack", endpoint=srv.endpoint)) as agent:
            agg = Aggregator(agent=agent, ident=agent.identity(), simulated=True, tee_mode="dstack", collateral="auto",
                             pccs_url="https://pccs.invalid", timeout_s=30.0, client_policy=policy)
            rec = RoundRecord("fed-v3", 1, NONCE, {"name": "fedavg", "weighted_by": "trainable_tokens", "params": {}},
                              1, None, None)
            round_dir, _ = export_round(root / "rounds", agg, rec, admitted.arrays, [admitted], [])  # self-verified
    (root / "policy.yaml").write_text(policy_file_text(policy))
    yield round_dir, root / "policy.yaml", sim.mr_config, policy


def _checks(verdict: Any) -> dict[str, Any]:
    return {c.name: c for c in verdict.checks}


def test_a_v3_round_carries_its_mr_config_document_and_verifies(v3_round: tuple[Path, Path, str, Policy]) -> None:
    from app.federated.round_export import head_files

    round_dir, _, document, policy = v3_round
    assert (round_dir / B.MR_CONFIG).read_text() == document  # the host's bytes, never re-serialised
    assert (round_dir / B.QUOTE_BIN).read_bytes()[232] == 3  # MRCONFIGID v3
    verdict = verify_round(round_dir, policy=policy, now=NOW)
    check = _checks(verdict)["compose.hash"]
    assert verdict.accepted, [(c.name, c.detail) for c in verdict.failed]
    assert check.status == "pass" and "MRCONFIGID v3 is the hash of the MrConfigV3 document" in check.detail, check
    assert B.MR_CONFIG in head_files(round_dir)  # what a client of the next round is sent with the round's head
    head = round_dir.parent / "head"
    head.mkdir()
    for name in head_files(round_dir):
        shutil.copyfile(round_dir / name, head / name)
    head_verdict, _ = verify_round_head(head, policy=policy, now=NOW)
    assert head_verdict.accepted and _checks(head_verdict)["compose.hash"].status == "pass"


def test_a_v3_round_without_its_mr_config_document_fails_compose_hash(v3_round: tuple[Path, Path, str, Policy],
                                                                       tmp_path: Path) -> None:
    copy = shutil.copytree(v3_round[0], tmp_path / "round")
    (copy / B.MR_CONFIG).unlink()
    verdict = verify_round(copy, policy=v3_round[3], now=NOW)
    failed = {c.name: c.detail for c in verdict.failed}
    assert "compose.hash" in failed and "none was given" in failed["compose.hash"], failed
    assert _checks(verdict)["round.files"].status == "pass"  # the file is optional; what needs it says so


CASES = [("v3", "as exported", None), ("v3", "mr-config.json removed", lambda r: (r / B.MR_CONFIG).unlink()),
         ("v3", "mr-config.json changed", lambda r: (r / B.MR_CONFIG).write_text(json.dumps({"version": 3})))]


@web_test
def test_the_page_checks_a_v3_round_as_cvm_tune_verify_does(v3_round: tuple[Path, Path, str, Policy], site: Any,  # noqa: F811
                                                             web_copy: Path, tmp_path: Path) -> None:  # noqa: F811
    pages, pythons = packed_cases(CASES, {"v3": v3_round[:2]}, site, tmp_path, "v3round")
    for (_, name, _), page, py in zip(CASES, drive(web_copy, pages), pythons, strict=True):
        same_checks(page, py, name)
        assert py["verdict"] == ("accepted" if name == "as exported" else "rejected"), name
