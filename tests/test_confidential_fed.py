"""Secure aggregation through the TEE on Flower's simulation engine: the aggregator attests its age key, two data
owners' CVMs (one whose owner also names a recipient) encrypt their updates to it, the aggregator decrypts them in
memory, and the round bundles hold no client plaintext and no plaintext global adapter; anyone verifies the rounds
(the aggregate then rests on the aggregator's attested code), a party that can decrypt recomputes it.

Note: every simulated CVM here runs the same compose under the simulator's public test secret, so they all derive
the same GetKey material (one CVM key); distinct keys per CVM are what a real dstack deployment gives.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from attestation.bundle import manifest as B
from attestation.outputs import confidential as C
from attestation.rounds import manifest as R
from attestation.io.hashing import sha256_hex
from attestation.policy import simulator_policy
from attestation.rounds.verify import verify_round
from tests.owner_fixtures import KEY, jsonl, owner_key

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = [json.loads(line) for line in (ROOT / "app" / "data" / "sample.jsonl").read_text().splitlines() if line.strip()]
CLIENTS = ("lab-a", "lab-b")
SEALED = C.ciphertext_name(B.WEIGHTS)  # a client bundle's encrypted adapter: adapter/adapter_model.safetensors.age
OWNER_ID = C.identity_from_secret(bytes(range(32)))


def _sim() -> Any:
    from app.simulator import GuestAgentSimulator

    return GuestAgentSimulator()


def _owner(i: int) -> Any:
    return owner_key(bytes([0x60 + i]) * 32)


def _pub(i: int) -> str:
    return _owner(i).public_key().public_bytes_raw().hex()


def _client_config(root: Path, i: int, name: str) -> Path:
    from app.dataset import encrypt_stream

    d = root / name
    (d / "data").mkdir(parents=True)
    meta = {C.DATASET_META_KEY: C.recipient_of(OWNER_ID)} if i == 0 else None  # lab-a's owner reads its weights
    with open(d / "data" / "set-v1.cvmds", "wb") as out:
        encrypt_stream(io.BytesIO(jsonl(SAMPLE[i * 15:(i + 1) * 15 + 3 * i])), out, KEY, dataset_id=f"set-{name}",
                       dataset_version=1, chunk_size=4096, metadata=meta, owner_key=_owner(i))
    (d / "dataset.key").write_bytes(KEY)
    (d / "dataset.key").chmod(0o600)
    cfg = {"output": {"dir": str(d / "out")},
           "dataset": {"source": "encrypted-file", "path": str(d / "data"), "dataset_id": f"set-{name}",
                       "owner_public_key": _pub(i), "key": {"source": "file", "file": str(d / "dataset.key")}},
           "training": {"max_steps": 2, "save_steps": 2},
           "alerts": {"webhook_url_env": "CVM_TUNE_TEST_NO_WEBHOOK"},
           "federation": {"client_name": name, "aggregator_compose_hashes": [_sim().compose_hash.hex()]}}
    path = d / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _server_config(root: Path) -> Path:
    cfg = {"output": {"dir": str(root / "aggregator")}, "alerts": {"webhook_url_env": "CVM_TUNE_TEST_NO_WEBHOOK"},
           "federation": {"rounds": 2, "min_clients": 2, "strategy": "fedavg", "secure_aggregation": True,
                          "client_compose_hashes": [_sim().compose_hash.hex()],
                          "clients": {n: {"owner_public_keys": [_pub(i)]} for i, n in enumerate(CLIENTS)}}}
    path = root / "aggregator.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class ConfigByPartition:
    """Simulation: SuperNode partition i is data owner i (picklable for Ray's actors)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __call__(self, context: Any) -> Path:
        return self.paths[int(context.node_config["partition-id"])]


@pytest.fixture(scope="module")
def secure_fed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (requirements/test.txt)")
    from flwr.simulation import run_simulation

    from app.federated.client_app import make_client_app
    from app.federated.server_app import make_server_app

    root = tmp_path_factory.mktemp("securefed")
    clients = [_client_config(root, i, n) for i, n in enumerate(CLIENTS)]
    pythonpath = os.environ.get("PYTHONPATH")  # Flower's ray backend sets it to this process's sys.path
    try:
        run_simulation(server_app=make_server_app(_server_config(root)), client_app=make_client_app(
            ConfigByPartition(clients)), num_supernodes=len(clients),
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                            "init_args": {"num_cpus": 2, "include_dashboard": False}})
    finally:
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
    rounds = sorted((root / "aggregator" / "rounds").glob("*/round-*"))
    return {"root": root, "rounds": rounds, "clients": clients}


def _cvm_identities(config: Path) -> list[Any]:
    """The simulated CVM's age identity (what only code inside that CVM can derive)."""
    import pyrage

    from app.config import load_config
    from app.export.confidential import cvm_identity
    from app.tee import open_guest_agent

    with open_guest_agent(load_config(config).tee) as agent:
        return [pyrage.x25519.Identity.from_str(cvm_identity(agent.get_key))]


def _needles(plaintext: bytes) -> list[bytes]:
    header_len = int.from_bytes(plaintext[:8], "little")
    header = json.loads(plaintext[8:8 + header_len])
    out = []
    for name, t in header.items():
        if name != "__metadata__":
            start, end = (8 + header_len + o for o in t["data_offsets"])
            window = plaintext[(start + end) // 2:(start + end) // 2 + 32]
            if end - start >= 64 and window.strip(b"\x00"):
                out.append(window)
    return out


def _policy() -> Any:
    return simulator_policy(_sim().test_root_ca_der)


def test_round_bundles_hold_no_plaintext_update_and_verify(secure_fed: dict[str, Any]) -> None:
    rounds = secure_fed["rounds"]
    assert [p.name for p in rounds] == ["round-0001", "round-0002"]
    ids = _cvm_identities(secure_fed["clients"][0])
    needles = []
    for rd in rounds:
        m = json.loads((rd / R.ROUND_MANIFEST).read_bytes())
        assert sorted(a["client"] for a in m["admitted"]) == list(CLIENTS) and m["rejected"] == []
        assert m["aggregator_recipient"] in m["confidentiality"]["recipients"]
        sealed = (rd / R.GLOBAL_ADAPTER_AGE).read_bytes()
        assert sealed.startswith(C.AGE_MAGIC)
        plain = C.decrypt(sealed, ids)  # the admitted clients' CVM keys open it
        assert plain is not None and sha256_hex(plain) == m["global_adapter_sha256"] == m["confidentiality"]["plaintext_sha256"]
        needles += _needles(plain)
        for name in CLIENTS:
            cm = json.loads((rd / R.CLIENTS_DIR / name / B.MANIFEST).read_bytes())
            assert m["aggregator_recipient"] in cm["confidentiality"]["recipients"]
            update = (rd / R.CLIENTS_DIR / name / SEALED).read_bytes()
            assert update.startswith(C.AGE_MAGIC)
            needles += _needles(C.decrypt(update, ids))
        lab_a = json.loads((rd / R.CLIENTS_DIR / "lab-a" / B.MANIFEST).read_bytes())["confidentiality"]
        assert lab_a["dataset_recipients"] == [C.recipient_of(OWNER_ID)]  # the owner can read lab-a's update too
        assert C.decrypt((rd / R.CLIENTS_DIR / "lab-a" / SEALED).read_bytes(),
                         C.load_identities(_key(secure_fed["root"]))) is not None
        # anyone: every attestation checks; the aggregate rests on the aggregator's attested code
        verdict = verify_round(rd, policy=_policy(), now=int(time.time()))
        checks = {c.name: c for c in verdict.checks}
        assert verdict.accepted, [f"{c.name}: {c.detail}" for c in verdict.failed]
        assert checks["round.aggregate"].status == "skip" and "attested code" in checks["round.aggregate"].detail
        assert checks["round.confidential"].status == "pass"
        # a party that can decrypt every update recomputes it
        verdict = verify_round(rd, policy=_policy(), now=int(time.time()), identities=ids)
        assert verdict.accepted and {c.name: c for c in verdict.checks}["round.aggregate"].status == "pass"
    assert len(needles) > 10
    ray = [Path(os.environ["RAY_TMPDIR"])] if os.environ.get("RAY_TMPDIR") else []  # ray's session folders
    ram = [d for p in secure_fed["clients"] for d in _ram_dirs(p.parent / "out")]
    for where in (secure_fed["root"] / "aggregator", *(p.parent / "out" for p in secure_fed["clients"]), *ray, *ram):
        for path in where.rglob("*"):
            if path.is_file() and not path.is_symlink() and "models" not in path.parts:
                try:
                    data = path.read_bytes()
                except OSError:  # a file of ray's that went away while it was read
                    continue
                assert not any(n in data for n in needles), f"plaintext adapter bytes in {path}"


def _ram_dirs(out: Path) -> list[Path]:
    """The RAM directories of an output volume (its scratch and what sits beside it)."""
    from app.config import Config
    from app.run.inputs import scratch_dir

    ram = scratch_dir(Config(), out.resolve())
    return [d for d in ram.parent.iterdir() if d.name.startswith(ram.name)]


def _key(root: Path) -> Path:
    path = root / "owner-age.txt"
    path.write_text(OWNER_ID + "\n")
    return path


def test_cli_verifies_the_secure_round_with_and_without_an_identity(secure_fed: dict[str, Any], tmp_path: Path) -> None:
    from app.cli import main

    rd = secure_fed["rounds"][-1]
    policy = tmp_path / "policy.yaml"
    from attestation.policy import policy_file_text

    policy.write_text(policy_file_text(_policy()))
    assert main(["verify", str(rd), "--policy", str(policy)]) == 0
    owner = _key(tmp_path)  # the owner of lab-a's dataset cannot read lab-b's update: no recomputation
    out = tmp_path / "v.json"
    with open(out, "w") as fh, contextlib.redirect_stdout(fh):
        assert main(["verify", str(rd), "--policy", str(policy), "--json", "--identity", str(owner)]) == 0
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks["round.aggregate"]["status"] == "skip" and "lab-b" in checks["round.aggregate"]["reason"]


def test_a_secure_round_names_every_ciphertext_weight_file_age(secure_fed: dict[str, Any]) -> None:
    """The global adapter and each client update are on disk and listed only as ``adapter_model.safetensors.age``;
    the round lists each client update by its ciphertext's hash."""
    rd = secure_fed["rounds"][-1]
    m = json.loads((rd / R.ROUND_MANIFEST).read_bytes())
    assert set(m["files"]) == {B.APP_COMPOSE, R.GLOBAL_ADAPTER_AGE} == {B.APP_COMPOSE, "adapter/adapter_model.safetensors.age"}
    weights = sorted(p.relative_to(rd).as_posix() for p in rd.rglob("*.safetensors*"))
    assert weights == [R.GLOBAL_ADAPTER_AGE, *(f"{R.CLIENTS_DIR}/{c}/{SEALED}" for c in CLIENTS)], weights
    for a in m["admitted"]:
        assert a["adapter_sha256"] == sha256_hex((rd / R.CLIENTS_DIR / a["client"] / SEALED).read_bytes())


def test_a_round_with_its_global_ciphertext_under_the_plain_name_is_rejected(secure_fed: dict[str, Any],
                                                                            tmp_path: Path) -> None:
    """A round laid out as before ``.age`` names fails closed: ``round.schema`` names the expected ``.age`` file."""
    rd = Path(shutil.copytree(secure_fed["rounds"][-1], tmp_path / "round"))
    (rd / R.GLOBAL_ADAPTER_AGE).rename(rd / R.GLOBAL_ADAPTER)
    m = json.loads((rd / R.ROUND_MANIFEST).read_bytes())
    m["files"][R.GLOBAL_ADAPTER] = m["files"].pop(R.GLOBAL_ADAPTER_AGE)
    (rd / R.ROUND_MANIFEST).write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")
    checks = {c.name: c for c in verify_round(rd, policy=_policy(), now=int(time.time())).checks}
    assert checks["round.schema"].status == "fail" and checks["round.schema"].detail.endswith(
        "adapter/adapter_model.safetensors is listed under its plaintext name, but the weights are encrypted "
        "(confidentiality): a confidential bundle holds that file as age ciphertext named "
        "adapter/adapter_model.safetensors.age"), checks["round.schema"]
    assert checks["round.files"].status == "pass"  # the one adapter file present: the schema names what is wrong


def test_a_tampered_global_ciphertext_or_recipient_list_is_rejected(secure_fed: dict[str, Any], tmp_path: Path) -> None:
    rd = tmp_path / "round"
    shutil.copytree(secure_fed["rounds"][-1], rd)
    data = bytearray((rd / R.GLOBAL_ADAPTER_AGE).read_bytes())
    data[len(data) // 2] ^= 1
    (rd / R.GLOBAL_ADAPTER_AGE).write_bytes(bytes(data))
    verdict = verify_round(rd, policy=_policy(), now=int(time.time()))
    assert "round.file_hashes" in {c.name for c in verdict.failed}
    rd2 = tmp_path / "round2"
    shutil.copytree(secure_fed["rounds"][-1], rd2)
    m = json.loads((rd2 / R.ROUND_MANIFEST).read_bytes())
    m["confidentiality"]["recipients"] = [C.recipient_of(OWNER_ID)]  # claim someone else can read it
    (rd2 / R.ROUND_MANIFEST).write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")
    failed = {c.name for c in verify_round(rd2, policy=_policy(), now=int(time.time())).failed}
    assert {"report_data", "round.file_hashes", "round.confidential"} <= failed


def test_admission_refuses_plaintext_weights_in_a_secure_round(secure_fed: dict[str, Any], tmp_path: Path) -> None:
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, Metadata, RecordDict

    from app.config import load_config
    from app.federated.admission import Admission, Rejected, RoundTerms
    from app.federated.secure import SecureKey
    from app.federated.transport import pack_bundle

    fed = load_config(_server_config(tmp_path)).federation
    bundle = secure_fed["rounds"][0] / R.CLIENTS_DIR / "lab-a"
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.ones((2, 2), np.float32))}),
                          "bundle": ConfigRecord({"client": "lab-a", "tar": pack_bundle(bundle)})})
    meta = Metadata(run_id=1, message_id="", src_node_id=7, dst_node_id=0, reply_to_message_id="r", group_id="",
                    created_at=0.0, ttl=60.0, message_type=MessageType.TRAIN)
    msg = Message(content=content, metadata=meta)
    key = SecureKey(C.recipient_of(OWNER_ID), b"", OWNER_ID)
    got = Admission(fed, _policy(), tmp_path / "work", key).check(msg, RoundTerms(1, "00" * 32, None, 0.0), set())
    assert isinstance(got, Rejected) and "plaintext adapter weights" in got.reason
    assert not [p for p in (tmp_path / "work").rglob("*") if p.is_file()]


def test_a_client_refuses_an_unattested_aggregator_key(tmp_path: Path) -> None:
    from app.config import load_config
    from app.errors import TeeError
    from app.federated.aggregator_check import aggregator_recipient
    from app.federated.transport import pack_bundle

    cfg = load_config(_client_config(tmp_path, 1, "lab-b"))
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / R.KEY_DOC).write_text(json.dumps({"schema": R.KEY_SCHEMA, "recipient": C.recipient_of(OWNER_ID)}))
    with pytest.raises(TeeError, match="the aggregator's key is not attested"):
        aggregator_recipient(cfg, {"aggregator-key": pack_bundle(fake)}, 1, tmp_path / "work")
    assert aggregator_recipient(cfg, {}, 1, tmp_path / "work2") is None


def test_without_secure_aggregation_an_encrypted_update_is_rejected_with_the_fix(secure_fed: dict[str, Any],
                                                                                  tmp_path: Path) -> None:
    from flwr.app import Message, MessageType, Metadata

    from app.config import load_config
    from app.federated.admission import Admission, Rejected, RoundTerms
    from app.federated.client_app import reply_content

    bundle = secure_fed["rounds"][0] / R.CLIENTS_DIR / "lab-a"
    content = reply_content("lab-a", bundle)  # what a client sends for a bundle whose weights are encrypted
    assert all(len(r) == 0 for r in content.array_records.values())
    meta = Metadata(run_id=1, message_id="", src_node_id=3, dst_node_id=0, reply_to_message_id="r", group_id="",
                    created_at=0.0, ttl=60.0, message_type=MessageType.TRAIN)
    fed = load_config(_server_config(tmp_path)).federation
    got = Admission(fed, _policy(), tmp_path / "work").check(Message(content=content, metadata=meta),
                                                             RoundTerms(1, "00" * 32, None, 0.0), set())
    assert isinstance(got, Rejected) and "federation.secure_aggregation" in got.reason


def test_a_secure_round_whose_aggregate_is_not_its_clients_average_fails_round_aggregate(
        secure_fed: dict[str, Any], tmp_path: Path) -> None:
    """The global adapter re-encrypted to the same recipients after a change to one weight, its hashes rewritten:
    a party that decrypts every update recomputes the average and fails round.aggregate (with the round's other
    checks it would otherwise pass: the quote no longer binds the rewritten manifest either)."""
    import numpy as np
    from safetensors.numpy import load, save

    rd = shutil.copytree(secure_fed["rounds"][-1], tmp_path / "round")
    ids = _cvm_identities(secure_fed["clients"][0])
    m = json.loads((rd / R.ROUND_MANIFEST).read_bytes())
    tensors = load(C.decrypt((rd / R.GLOBAL_ADAPTER_AGE).read_bytes(), ids))
    name = next(k for k, v in tensors.items() if v.size > 4)
    tensors[name] = (tensors[name] + np.float32(0.5)).astype(tensors[name].dtype)
    plain = save(dict(sorted(tensors.items())))
    sealed = C.encrypt(plain, tuple(m["confidentiality"]["recipients"]))
    (rd / R.GLOBAL_ADAPTER_AGE).write_bytes(sealed)
    m["files"][R.GLOBAL_ADAPTER_AGE] = sha256_hex(sealed)
    m["global_adapter_sha256"] = m["confidentiality"]["plaintext_sha256"] = sha256_hex(plain)
    (rd / R.ROUND_MANIFEST).write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")
    checks = {c.name: c for c in verify_round(rd, policy=_policy(), now=int(time.time()), identities=ids).checks}
    assert checks["round.aggregate"].status == "fail" and name in checks["round.aggregate"].detail
    assert checks["round.confidential"].status == "pass"  # the stanzas and recipients are right: only the sum is not


def test_a_swapped_encrypted_update_is_rejected(secure_fed: dict[str, Any], tmp_path: Path) -> None:
    """lab-a's update replaced by lab-b's ciphertext (both to the aggregator and valid age files): the client bundle's
    own file hashes and the round's admitted adapter hash fail."""
    rd = shutil.copytree(secure_fed["rounds"][-1], tmp_path / "round")
    a, b = (rd / R.CLIENTS_DIR / n / SEALED for n in ("lab-a", "lab-b"))
    a.write_bytes(b.read_bytes())
    verdict = verify_round(rd, policy=_policy(), now=int(time.time()))
    failed = {c.name: c.detail for c in verdict.failed}
    assert not verdict.accepted and set(failed) == {"client.lab-a"}, failed
    assert "adapter/adapter_model.safetensors.age changed" in failed["client.lab-a"]
    assert "does not hash to the round manifest's value" in failed["client.lab-a"]
