"""End to end, the data owner's side: owner keys -> encrypt and sign -> the CVM (simulator) asks for
the key -> the owner verifies the quote under their policy and releases it -> the run trains and
exports a bundle whose manifest names the dataset commitment and the owner key. The same flow with
a compose-hash the owner's policy does not list gets no key. Also: a restart needs no new release
(sealed key), grants cannot be tampered with, an older dataset version is refused after a real
run, and a forged env-var key cannot smuggle in another dataset.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import app.training
from app.cli import main
from app.config import Config, TeeSettings
from app.dataset import open_encrypted, parse_jsonl
from app.dataset.keys import EnvKeySource
from app.dataset.owner import load_owner_key, new_owner_key
from app.dataset.key_request import CvmIdentity, ReleasedKeySource
from app.dataset.release import release_key
from app.errors import (
    ConfigError,
    DatasetRollbackError,
    DatasetSignatureError,
    KeyGrantError,
    KeyReleasePendingError,
    KeyReleaseRefusedError,
)
from app.run.pipeline import run_once
from app.simulator import GuestAgentSimulator, SimulatorServer, SimulatorSettings
from app.tee import open_guest_agent
from attestation import DEFAULT_POLICY
from attestation.bundle.dataset_sig import owner_key_id
from attestation.io.hashing import canonical_json
from attestation.policy import policy_file_text, simulator_policy
from tests.owner_fixtures import CANARY, INJECTION, all_logs, chat_row, encrypt_to, files_containing, jsonl, tiny_model_dir

SIM = GuestAgentSimulator()
COMPOSE_HASH = SIM.compose_hash.hex()
LONG = 6  # rows longer than max_length: truncated and counted
DUPES = 10


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(list(argv))
    return rc, out.getvalue()


def _owner_policy(path: Path, compose_hashes: tuple[str, ...] = (COMPOSE_HASH,), root: bytes | None = SIM.test_root_ca_der) -> Path:
    base = simulator_policy(root) if root is not None else DEFAULT_POLICY
    path.write_text(policy_file_text(base.model_copy(update={"name": "acme-release", "compose_hashes": compose_hashes})))
    return path


def _config(root: Path, out: Path, **tee: object) -> Config:
    return Config.model_validate({
        "tee": {"mode": "embedded-simulator", **tee},
        "dataset": {"source": "encrypted-file", "path": str(root / "volume" / "data.cvmds"),
                    "owner_public_key": (root / "owner" / "acme.pub").read_text().strip(),
                    "key": {"source": "release", "grant_file": str(root / "volume" / "grant.json")}},
        "base_model": {"source": "local-dir", "path": str(tiny_model_dir())},
        "training": {"max_steps": 3, "save_steps": 3},
        "output": {"dir": str(out)},
    })


@pytest.fixture(scope="module")
def flow(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("release")
    (root / "owner").mkdir()
    (root / "volume").mkdir()
    # -- owner: keys, plaintext (on the owner's machine only), encrypt + sign
    rc, said = _cli("keys", "new", "-o", str(root / "owner" / "acme"))
    assert rc == 0 and "owner_public_key" in said
    rows = [chat_row(i) for i in range(40)] + [chat_row(100 + i, words=80) for i in range(LONG)]
    rows += rows[:DUPES] + [{"messages": [{"role": "user", "content": INJECTION}, {"role": "assistant", "content": "no"}]}]
    (root / "owner" / "rows.jsonl").write_bytes(jsonl(rows))
    rc, said = _cli("dataset", "encrypt", str(root / "owner" / "rows.jsonl"), "-o", str(root / "volume" / "data.cvmds"),
                    "--owner-key", str(root / "owner" / "acme.key"), "--key-file", str(root / "owner" / "data.key"),
                    "--dataset-id", "acme-support", "--dataset-version", "3", "--chunk-size", "4096")
    assert rc == 0, said
    # -- CVM: no key yet -> key request
    cfg = _config(root, root / "out")
    progress: list[str] = []
    with all_logs() as logs:
        with pytest.raises(KeyReleasePendingError) as pending:
            run_once(cfg, progress=progress.append)
        request = root / "out" / "key-release" / "request.json"
        assert request.is_file() and str(request) in pending.value.message
        # -- owner: verify the quote under their policy, release
        policy = _owner_policy(root / "owner" / "policy.yaml")
        rc, released = _cli("dataset", "release", str(request), "--policy", str(policy), "--dataset",
                            str(root / "volume" / "data.cvmds"), "--key-file", str(root / "owner" / "data.key"),
                            "--owner-key", str(root / "owner" / "acme.key"), "-o", str(root / "volume" / "grant.json"))
        assert rc == 0, released
        # -- CVM: run with the grant
        result = run_once(cfg, progress=progress.append)
    return SimpleNamespace(root=root, cfg=cfg, result=result, progress=progress, logs=logs, released=released,
                           pub=bytes.fromhex((root / "owner" / "acme.pub").read_text()),
                           manifest=json.loads((result.bundle_dir / "manifest.json").read_text()))


def test_released_key_trains_and_the_manifest_names_commitment_and_owner(flow: SimpleNamespace) -> None:
    assert "TEST CA (simulator): NOT evidence of a TEE" in flow.released
    assert flow.result.verdicts[0][1].accepted  # the simulator test-CA policy
    ds = flow.manifest["dataset"]
    rc, inspected = _cli("dataset", "inspect", str(flow.root / "volume" / "data.cvmds"), "--json")
    info = json.loads(inspected)
    assert ds["format"] == "cvm-tune encrypted dataset v2" and ds["dataset_version"] == 3
    assert ds["owner_public_key"] == flow.pub.hex() and ds["owner_key_id"] == owner_key_id(flow.pub) == info["owner_key_id"]
    assert ds["commitment"] == info["commitment"] and ds["encrypted_sha256"] == info["file_sha256"]
    assert ds["key_source"].startswith("owner-release (grant for request ")
    v = ds["validation"]
    assert (v["rows_read"], v["duplicates_dropped"], v["rows_in"]) == (40 + LONG + DUPES + 1, DUPES, 40 + LONG + 1)
    long_rows = LONG + 1  # the injection row is over 128 tokens too
    assert (v["too_long"], v["truncated"], v["dropped_too_long"], v["max_length"]) == (long_rows, long_rows, 0, 128)  # case 19
    assert ds["rows"] == v["rows_out"] == 40 + LONG + 1 and v["trainable_tokens"] > 0
    said = "\n".join(flow.progress)  # positions of the policy decisions, by line number (never content)
    assert f"{long_rows} longer than 128 tokens (truncate (lines 41, 42, 43, 44, 45, 46, 57))" in said
    assert f"{DUPES} duplicates dropped (lines 47, 48, 49, 50, 51, 52, 53, 54, 55, 56)" in said


def test_verify_rechecks_the_dataset_signature_without_the_key(flow: SimpleNamespace) -> None:
    bundle, policy = flow.result.bundle_dir, flow.result.policy_file
    rc, out = _cli("verify", str(bundle), "--policy", str(policy), "--dataset", str(flow.root / "volume" / "data.cvmds"), "--json")
    assert rc == 0, out
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["dataset.owner"]["status"] == "pass" and "signature, commitment and hashes match" in checks["dataset.owner"]["reason"]
    other = flow.root / "other.cvmds"
    encrypt_to(other, jsonl([chat_row(1)]), signer=load_owner_key(flow.root / "owner" / "acme.key"), dataset_id="acme-support")
    rc, out = _cli("verify", str(bundle), "--policy", str(policy), "--dataset", str(other), "--json")
    assert rc == 1
    assert {c["name"] for c in json.loads(out)["checks"] if c["status"] == "fail"} == {"dataset.file", "dataset.owner"}


def test_no_plaintext_on_the_cvm_side(flow: SimpleNamespace) -> None:
    """Case 22 on a successful run: canary and injected text never reach logs or the CVM's disk."""
    said = "\n".join([*flow.logs, *flow.progress, flow.released])
    assert CANARY not in said and "hunter2" not in said
    for d in ("out", "volume"):
        assert files_containing(flow.root / d, CANARY.encode()) == []


def test_a_restart_unseals_the_key_without_a_new_release(flow: SimpleNamespace) -> None:
    with open_guest_agent(TeeSettings()) as agent:  # a new boot of the same app
        ident = agent.identity()
        src = ReleasedKeySource(agent=agent, identity=CvmIdentity(ident.app_id, ident.compose_hash, ident.instance_id),
                                out_dir=flow.root / "out", dataset=flow.root / "volume" / "data.cvmds",
                                grant_file=flow.root / "nowhere.json", owner_public_key=flow.pub)
        key = src.dataset_key()
    assert key == bytes.fromhex((flow.root / "owner" / "data.key").read_text())
    assert src.describe() == "owner-release (sealed)"
    assert not (flow.root / "out" / "key-release" / "request.json").exists()
    sealed = next((flow.root / "out" / "state" / "key-release").glob("dataset-*.json"))
    assert sealed.stat().st_mode & 0o077 == 0 and key.hex().encode() not in sealed.read_bytes() and key not in sealed.read_bytes()


def test_case_08_rollback_refused_after_a_real_run(flow: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    older = flow.root / "volume-old" / "data.cvmds"
    older.parent.mkdir()
    key = bytes.fromhex((flow.root / "owner" / "data.key").read_text())
    encrypt_to(older, jsonl([chat_row(i) for i in range(20)]), key, signer=load_owner_key(flow.root / "owner" / "acme.key"),
               dataset_id="acme-support", dataset_version=2)
    trained: list[object] = []
    monkeypatch.setattr(app.training, "train", lambda req: trained.append(req))
    cfg = flow.cfg.model_copy(update={"dataset": flow.cfg.dataset.model_copy(update={"path": older})})
    with pytest.raises(DatasetRollbackError, match="v2 is older than v3"):
        run_once(cfg)
    assert trained == []


def test_compose_hash_not_in_the_owners_policy_gets_no_key(tmp_path: Path, sock_dir: Path, flow: SimpleNamespace,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    compose = json.loads(SIM.app_compose)
    compose["docker_compose_file"] = compose.get("docker_compose_file", "") + "\n# patched by the operator\n"
    other = SimulatorServer(GuestAgentSimulator(SimulatorSettings(app_compose=json.dumps(compose))),
                            socket_path=sock_dir / "agent.sock").start()
    monkeypatch.setenv("DSTACK_SIMULATOR_ENDPOINT", other.endpoint)
    try:
        with pytest.raises(KeyReleasePendingError):
            run_once(_config(flow.root, tmp_path / "out", mode="dstack"))
    finally:
        other.stop()
    request = tmp_path / "out" / "key-release" / "request.json"
    grant = tmp_path / "grant.json"
    args = ["dataset", "release", str(request), "--policy", str(flow.root / "owner" / "policy.yaml"), "--dataset",
            str(flow.root / "volume" / "data.cvmds"), "--key-file", str(flow.root / "owner" / "data.key"),
            "--owner-key", str(flow.root / "owner" / "acme.key"), "-o", str(grant)]
    rc, said = _cli(*args)
    assert rc == 1 and "policy.compose_hash" in said and "key NOT released" in said
    assert not grant.exists()
    with pytest.raises(KeyReleaseRefusedError, match="is not allowed"):
        release_key(request.read_bytes(), policy=_load(flow.root / "owner" / "policy.yaml"), now=_now(),
                    dataset=flow.root / "volume" / "data.cvmds", dataset_key=_key(flow),
                    owner_key=load_owner_key(flow.root / "owner" / "acme.key"))


def _load(path: Path):
    from attestation import load_policy

    return load_policy(path)


def _now() -> int:
    import time

    return int(time.time())


def _key(flow: SimpleNamespace) -> bytes:
    return bytes.fromhex((flow.root / "owner" / "data.key").read_text())


@pytest.fixture
def pending(tmp_path: Path, flow: SimpleNamespace) -> SimpleNamespace:
    """A fresh CVM output volume with a pending key request (embedded simulator)."""
    cfg = _config(flow.root, tmp_path / "out")
    with pytest.raises(KeyReleasePendingError):
        run_once(cfg)
    request = (tmp_path / "out" / "key-release" / "request.json").read_bytes()
    return SimpleNamespace(out=tmp_path / "out", request=request, flow=flow)


def _release(p: SimpleNamespace, **kw: object) -> bytes:
    f = p.flow
    request = kw.pop("request", p.request)
    args = {"policy": _load(f.root / "owner" / "policy.yaml"), "now": _now(), "dataset": f.root / "volume" / "data.cvmds",
            "dataset_key": _key(f), "owner_key": load_owner_key(f.root / "owner" / "acme.key"), **kw}
    return release_key(request, **args).grant  # type: ignore[arg-type]


def _key_source(p: SimpleNamespace, grant: bytes, agent) -> ReleasedKeySource:
    (p.out / "grant.json").write_bytes(grant)
    ident = agent.identity()
    return ReleasedKeySource(agent=agent, identity=CvmIdentity(ident.app_id, ident.compose_hash, ident.instance_id),
                             out_dir=p.out, dataset=p.flow.root / "volume" / "data.cvmds", grant_file=p.out / "grant.json",
                             owner_public_key=p.flow.pub)


def _resign(grant: bytes, signer, **changes: object) -> bytes:
    from app.dataset.release import GRANT_DOMAIN

    obj = json.loads(grant)
    obj.pop("signature")
    obj.update(changes)
    obj["signature"] = signer.sign(GRANT_DOMAIN + canonical_json(obj)).hex()
    return json.dumps(obj).encode()


def test_tampered_or_foreign_grants_are_refused(pending: SimpleNamespace) -> None:
    from tests.owner_fixtures import owner_key

    good = _release(pending)
    mallory = owner_key(b"\x66" * 32)
    obj = json.loads(good)
    flipped = dict(obj, ciphertext=obj["ciphertext"][:-2] + ("00" if obj["ciphertext"][-2:] != "00" else "01"))
    cases = {
        "signature does not verify": json.dumps(flipped).encode(),
        "another owner key": _resign(good, mallory, owner_public_key=mallory.public_key().public_bytes_raw().hex()),
        "for another key request": _resign(good, load_owner_key(pending.flow.root / "owner" / "acme.key"),
                                           dataset_version=4),
        "not a cvm-tune key grant": b"{}",
    }
    with open_guest_agent(TeeSettings()) as agent:
        for words, grant in cases.items():
            with pytest.raises(KeyGrantError, match=words):
                _key_source(pending, grant, agent).dataset_key()
        assert len(_key_source(pending, good, agent).dataset_key()) == 32  # the pending request survived


def test_the_quote_binds_the_request(pending: SimpleNamespace) -> None:
    obj = json.loads(pending.request)
    obj["request"]["public_key"] = "11" * 32  # a host swapping in its own key
    with pytest.raises(KeyReleaseRefusedError, match="report_data"):
        _release(pending, request=json.dumps(obj).encode())


def test_release_needs_a_policy_with_compose_hashes_and_the_right_root(pending: SimpleNamespace, tmp_path: Path) -> None:
    from attestation import load_policy

    with pytest.raises(ConfigError, match="lists no compose_hashes"):
        _release(pending, policy=load_policy(_owner_policy(tmp_path / "open.yaml", compose_hashes=())))
    with pytest.raises(KeyReleaseRefusedError, match="quote.signature"):  # Intel root: the simulator's quote fails
        _release(pending, policy=load_policy(_owner_policy(tmp_path / "intel.yaml", root=None)))


def test_release_refuses_a_request_for_another_owner_or_dataset(pending: SimpleNamespace, tmp_path: Path) -> None:
    from tests.owner_fixtures import owner_key

    with pytest.raises(KeyReleaseRefusedError, match="pins owner key"):
        _release(pending, owner_key=owner_key(b"\x55" * 32))
    other = tmp_path / "other.cvmds"
    encrypt_to(other, jsonl([chat_row(1)]), _key(pending.flow), dataset_id="acme-support", dataset_version=9,
               signer=load_owner_key(pending.flow.root / "owner" / "acme.key"))
    with pytest.raises(KeyReleaseRefusedError, match="asks for dataset 'acme-support' v3, not 'acme-support' v9"):
        _release(pending, dataset=other)


def test_env_key_forged_by_the_host_cannot_bring_its_own_dataset(tmp_path: Path, flow: SimpleNamespace,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """dstack encrypted env vars are forgeable (threats §0.15): the pinned owner signature catches it."""
    from tests.owner_fixtures import owner_key

    poisoned, host_key = tmp_path / "poisoned.cvmds", hashlib.sha256(b"host").digest()
    encrypt_to(poisoned, jsonl([chat_row(i) for i in range(20)]), host_key, signer=owner_key(b"\x13" * 32),
               dataset_id="acme-support", dataset_version=99)
    monkeypatch.setenv("CVM_TUNE_DATASET_KEY", host_key.hex())
    trained: list[object] = []
    monkeypatch.setattr(app.training, "train", lambda req: trained.append(req))
    cfg = _config(flow.root, tmp_path / "out").model_dump(mode="json")
    cfg["dataset"].update(path=str(poisoned), key={"source": "env"})
    with pytest.raises(DatasetSignatureError, match="not by the pinned key"):
        run_once(Config.model_validate(cfg))
    assert trained == []
    # the genuine owner's key in the env opens the genuine dataset (confidentiality from the env var)
    monkeypatch.setenv("CVM_TUNE_DATASET_KEY", _key(flow).hex())
    with open(flow.root / "volume" / "data.cvmds", "rb") as fh:
        rows, _ = parse_jsonl(open_encrypted(fh, EnvKeySource("CVM_TUNE_DATASET_KEY").dataset_key(), owner_public_key=flow.pub),
                              source="d", max_row_bytes=1 << 20)
    assert len(rows) == 40 + LONG + DUPES + 1


def test_env_and_release_need_a_pinned_owner_key() -> None:
    for source in ("env", "release"):
        with pytest.raises(ValueError, match="needs an encrypted dataset .* and dataset.owner_public_key"):
            Config.model_validate({"dataset": {"source": "encrypted-file", "path": "x", "key": {"source": source}}})


def test_keys_new_never_overwrites_and_the_private_key_is_0600(tmp_path: Path) -> None:
    key_path, pub_path, pub = new_owner_key(tmp_path / "k")
    assert key_path.stat().st_mode & 0o777 == 0o600 and pub_path.read_text() == pub.hex() + "\n"
    assert _cli("keys", "new", "-o", str(tmp_path / "k"))[0] == 4
    key_path.chmod(0o644)
    assert _cli("dataset", "encrypt", str(pub_path), "-o", str(tmp_path / "x"), "--owner-key", str(key_path),
                "--key-file", str(tmp_path / "dk"), "--dataset-id", "x", "--dataset-version", "1")[0] == 4
    assert not (tmp_path / "x").exists() and not (tmp_path / "dk").exists()




def test_inspect_shows_header_and_signer_but_no_plaintext(flow: SimpleNamespace, tmp_path: Path) -> None:
    ds = flow.root / "volume" / "data.cvmds"
    rc, out = _cli("dataset", "inspect", str(ds), "--owner-public-key", str(flow.root / "owner" / "acme.pub"))
    assert rc == 0 and "dataset_id: acme-support" in out and f"owner_key_id: {owner_key_id(flow.pub)}" in out
    assert CANARY not in out
    bad = tmp_path / "bad.cvmds"
    bad.write_bytes(ds.read_bytes()[:300] + bytes([ds.read_bytes()[300] ^ 1]) + ds.read_bytes()[301:])
    rc, out = _cli("dataset", "inspect", str(bad))
    assert rc == 3 and "differs from what the owner signed" in out
    unsigned = tmp_path / "v1.cvmds"
    encrypt_to(unsigned, jsonl([chat_row(1)]))
    rc, out = _cli("dataset", "inspect", str(unsigned), "--owner-public-key", flow.pub.hex())
    assert rc == 3 and "no owner signature" in out


def test_a_new_dataset_key_needs_a_new_release(pending: SimpleNamespace, tmp_path: Path) -> None:
    """A grant for v3 does not unlock v4 encrypted under another key: a new request is written for v4."""
    f = pending.flow
    grant = _release(pending)
    newer = tmp_path / "v4.cvmds"
    encrypt_to(newer, jsonl([chat_row(i) for i in range(5)]), hashlib.sha256(b"new key").digest(), dataset_id="acme-support",
               dataset_version=4, signer=load_owner_key(f.root / "owner" / "acme.key"))
    (pending.out / "grant.json").write_bytes(grant)
    with open_guest_agent(TeeSettings()) as agent:
        ident = agent.identity()
        src = ReleasedKeySource(agent=agent, identity=CvmIdentity(ident.app_id, ident.compose_hash, ident.instance_id),
                                out_dir=pending.out, dataset=newer, grant_file=pending.out / "grant.json",
                                owner_public_key=f.pub)
        with pytest.raises(KeyReleasePendingError, match="for 'acme-support' v4"):
            src.dataset_key()
    request = json.loads((pending.out / "key-release" / "request.json").read_text())["request"]
    assert request["dataset_version"] == 4
