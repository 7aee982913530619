"""Confidential weights: a dataset whose owner names age recipients yields bundles whose weight files are age
ciphertext only (to those recipients, export.recipients and the CVM's key), verifiable by anyone, readable by a
recipient; warm start, the evaluation gate and resume work on encrypted parents; tampering is rejected."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pyrage
import pytest

import app.training
from app.cli import main as cli_main
from app.config import Config
from app.dataset import encrypt_stream
from app.dataset.format_header import read_header
from app.errors import CiphertextRejected, ConfigError, DatasetFormatError, NotARecipientError
from app.run.inputs import scratch_dir
from app.run.pipeline import RunHooks, run_once
from attestation.outputs import confidential as C
from attestation.bundle.confidential import dataset_recipients
from tests.owner_fixtures import KEY, jsonl, owner_key

SAMPLE = [json.loads(line) for line in (Path(__file__).resolve().parent.parent / "app" / "data" / "sample.jsonl")
          .read_text().splitlines() if line.strip()]
EVAL = [dict(r, split="eval") for r in SAMPLE[150:170]]
OWNER = owner_key()
# Fixed identities (spec §14 test vector: the first one's secret is bytes 0..31).
OWNER_ID = C.identity_from_secret(bytes(range(32)))
OPERATOR_ID = C.identity_from_secret(bytes(range(32, 64)))
STRANGER_ID = C.identity_from_secret(b"\x55" * 32)
WEIGHTS = "adapter/adapter_model.safetensors"  # the plaintext name: confidentiality.plaintext_sha256's key
SEALED = WEIGHTS + ".age"  # where a confidential bundle holds it: age ciphertext, named as age's tools name it


def _encrypt(path: Path, rows: list[dict], version: int, recipients: tuple[str, ...] = ()) -> Path:
    meta = {C.DATASET_META_KEY: " ".join(sorted(recipients))} if recipients else None
    with open(path, "wb") as out:
        encrypt_stream(io.BytesIO(jsonl(rows)), out, KEY, dataset_id="tickets", dataset_version=version,
                       chunk_size=4096, metadata=meta, owner_key=OWNER)
    return path


def _cfg(root: Path, *, merged: bool = False, recipients: tuple[str, ...] = (), gate: str = "loss") -> Config:
    key = root / "dataset.key"
    if not key.exists():
        key.write_bytes(KEY)
        key.chmod(0o600)
    return Config.model_validate({
        "output": {"dir": str(root / "out")},
        "dataset": {"source": "encrypted-file", "dataset_id": "tickets", "path": str(root / "data"),
                    "owner_public_key": OWNER.public_key().public_bytes_raw().hex(),
                    "key": {"source": "file", "file": str(key)}},
        "evaluation": {"gate": gate}, "export": {"merged": merged, "recipients": list(recipients)},
        "training": {"max_steps": 4, "save_steps": 2, "init": "previous"},
        "alerts": {"webhook_url_env": "CVM_TUNE_TEST_NO_WEBHOOK"}})


def _key_file(root: Path, identity: str, name: str) -> Path:
    path = root / name
    path.write_text(f"# created: test\n# public key: {C.recipient_of(identity)}\n{identity}\n")
    path.chmod(0o600)
    return path


def _manifest(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / "manifest.json").read_bytes())


def _needles(plaintext: bytes) -> list[bytes]:
    """32-byte windows from the middle of every tensor of a safetensors file (those not all zero)."""
    header_len = int.from_bytes(plaintext[:8], "little")
    header = json.loads(plaintext[8:8 + header_len])
    out = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        start, end = (8 + header_len + o for o in t["data_offsets"])
        mid = (start + end) // 2
        window = plaintext[mid:mid + 32]
        if end - start >= 64 and window.strip(b"\x00"):
            out.append(window)
    return out


def _tree_bytes(root: Path) -> list[tuple[Path, bytes]]:
    return [(p, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()]


@pytest.fixture(scope="module")
def night(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Night 1 on a dataset naming the owner as recipient, export.recipients adding the operator, merged export."""
    root = tmp_path_factory.mktemp("confidential")
    (root / "data").mkdir()
    owner_r, operator_r = C.recipient_of(OWNER_ID), C.recipient_of(OPERATOR_ID)
    _encrypt(root / "data" / "tickets-v1.cvmds", SAMPLE[:60] + EVAL, 1, (owner_r,))
    cfg = _cfg(root, merged=True, recipients=(operator_r,))
    result = run_once(cfg, hooks=RunHooks(service=True))
    return {"root": root, "cfg": cfg, "result": result, "bundle": result.bundle_dir, "owner": owner_r,
            "operator": operator_r, "owner_key": _key_file(root, OWNER_ID, "owner-age.txt"),
            "operator_key": _key_file(root, OPERATOR_ID, "operator-age.txt"),
            "stranger_key": _key_file(root, STRANGER_ID, "stranger-age.txt")}


def test_identity_test_vector_matches_age_keygen(tmp_path: Path) -> None:
    assert OWNER_ID == "AGE-SECRET-KEY-1QQQSYQCYQ5RQWZQFPG9SCRGWPUGPZYSNZS23V9CCRYDPK8QARC0SWRYDWG"
    assert C.recipient_of(OWNER_ID) == "age13aqvttdk3ujkyjh9kg2w5an6dmy5mq5a84a4uxk3hfhnugfc9p0sy5p2wh"
    if shutil.which("age-keygen") is None:
        pytest.skip("age-keygen (Debian package age) is not installed")
    key = _key_file(tmp_path, OWNER_ID, "k.txt")
    assert subprocess.run(["age-keygen", "-y", str(key)], capture_output=True, text=True, check=True).stdout.strip() \
        == C.recipient_of(OWNER_ID)


def test_weights_are_ciphertext_only_and_no_plaintext_tensor_bytes_remain(night: dict[str, Any]) -> None:
    bundle, m = night["bundle"], _manifest(night["bundle"])
    conf = m["confidentiality"]
    cvm = conf["cvm_recipient"]
    assert conf["recipients"] == sorted([night["owner"], night["operator"], cvm])
    assert conf["dataset_recipients"] == [night["owner"]]
    weight_files = sorted(conf["plaintext_sha256"])
    assert WEIGHTS in weight_files and any(f.startswith("merged/") for f in weight_files)
    ids = C.load_identities(night["owner_key"])
    needles = []
    for rel in weight_files:
        data = (bundle / (rel + ".age")).read_bytes()
        assert data.startswith(C.AGE_MAGIC) and m["files"][rel + ".age"] == hashlib.sha256(data).hexdigest()
        plain = C.decrypt(data, ids)
        assert plain is not None and hashlib.sha256(plain).hexdigest() == conf["plaintext_sha256"][rel]
        needles += _needles(plain)
    out = night["root"] / "out"
    base = b"".join(data for _p, data in _tree_bytes(out / "models"))  # merged: the tensors LoRA left alone are the base's
    needles = [n for n in needles if n not in base]
    assert len(needles) > 10
    scratch = scratch_dir(night["cfg"], out)
    for where in (out, scratch, scratch.with_name(scratch.name + "-plain")):
        for path, data in (_tree_bytes(where) if where.exists() else []):
            assert not any(n in data for n in needles), f"plaintext weight bytes in {path}"
    assert not (out / "runs" / night["result"].run_id / "adapter").exists()  # the trainer's adapter lived in RAM
    card = (bundle / "README.md").read_text()
    assert "## Who can read the weights" in card and night["owner"] in card and night["operator"] in card


def test_age_cli_decrypts_to_the_bound_plaintext(night: dict[str, Any]) -> None:
    if shutil.which("age") is None:
        pytest.skip("the age CLI (Debian package age) is not installed")
    got = subprocess.run(["age", "-d", "-i", str(night["owner_key"]), str(night["bundle"] / SEALED)],
                         capture_output=True, check=True).stdout
    assert hashlib.sha256(got).hexdigest() == _manifest(night["bundle"])["confidentiality"]["plaintext_sha256"][WEIGHTS]


def _verify(night: dict[str, Any], *extra: str, bundle: Path | None = None) -> tuple[int, dict[str, Any]]:
    policy = night["root"] / "out" / "simulator-test-policy.yaml"
    out = night["root"] / f"verdict-{len(list(night['root'].glob('verdict-*')))}.json"
    import contextlib

    with open(out, "w") as fh, contextlib.redirect_stdout(fh):
        code = cli_main(["verify", str(bundle or night["bundle"]), "--policy", str(policy), "--json", *extra])
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    return code, checks


def test_verify_for_anyone_and_for_a_recipient(night: dict[str, Any]) -> None:
    code, checks = _verify(night)
    assert code == 0
    assert checks["confidential.outputs"]["status"] == "pass"
    assert checks["confidential.plaintext"]["status"] == "skip" and checks["model.signature"]["status"] == "skip"
    dataset = next((night["root"] / "data").iterdir())
    for key in ("owner_key", "operator_key"):
        code, checks = _verify(night, "--identity", str(night[key]), "--dataset", str(dataset))
        assert code == 0, checks
        assert checks["confidential.plaintext"]["status"] == "pass" and checks["model.signature"]["status"] == "pass"
    code, checks = _verify(night, "--identity", str(night["stranger_key"]))
    assert code == 1 and checks["confidential.plaintext"]["status"] == "fail"
    assert "does not decrypt" in checks["confidential.plaintext"]["reason"]


def _policy_file(night: dict[str, Any]) -> str:
    """The simulator's test policy the run wrote (adapter decrypt verifies the bundle under a policy first)."""
    return str(night["root"] / "out" / "simulator-test-policy.yaml")


def _plain_hashes(bundle: Path, d: str) -> dict[str, str]:
    return {rel[len(d) + 1:]: h for rel, h in _manifest(bundle)["confidentiality"]["plaintext_sha256"].items()
            if rel.startswith(d + "/")}


def test_model_signing_verifies_the_encrypted_dir_with_plaintext_digests(night: dict[str, Any], tmp_path: Path) -> None:
    """The library's own verifier, each ``<name>.age`` counted as ``<name>`` by its plaintext hash: passes; as the
    file on disk: not (the signature names the plaintext files)."""
    from attestation.bundle.model_sig import verify_dir

    key = tmp_path / "key.pem"
    key.write_text(_manifest(night["bundle"])["signing"]["public_key_pem"])
    for d in ("adapter", "merged"):
        assert verify_dir(night["bundle"] / d, key, _plain_hashes(night["bundle"], d)) is None
        why = verify_dir(night["bundle"] / d, key) or ""
        assert why.startswith("Signature mismatch: ") and ".safetensors.age" in why and "Missing files" in why, why


def test_a_signature_without_key_hint_verifies_and_keeps_json_clean(night: dict[str, Any], tmp_path: Path) -> None:
    """The library's older signature format (no public-key hint: not part of what is signed) still verifies; the
    library's print()ed warning about it must not land in the --json verdict on stdout."""
    bundle = Path(shutil.copytree(night["bundle"], tmp_path / "bundle"))
    for d in ("adapter", "merged"):
        sig = json.loads((bundle / d / "model.sig").read_text())
        del sig["verificationMaterial"]["publicKey"]["hint"]
        (bundle / d / "model.sig").write_text(json.dumps(sig))
    code, checks = _verify(night, "--identity", str(night["owner_key"]), bundle=bundle)  # parses stdout as JSON
    assert checks["model.signature"]["status"] == "pass" and checks["manifest.files"]["status"] == "fail"


SIG_CASES = ["another-key", "added-file", "changed-config", "removed-file", "garbage-sig", "missing-sig"]


@pytest.mark.parametrize("case", SIG_CASES)
def test_signature_tampering_is_rejected_for_a_recipient(night: dict[str, Any], tmp_path: Path, case: str) -> None:
    """Under --identity the weights decrypt to their bound plaintext, but ``model.signature`` fails: an attacker's
    own signature over the very same plaintext, or any added, changed or removed non-weight file of the signed dir."""
    from cryptography.hazmat.primitives.asymmetric import ec

    from app.export.signing import public_key_pem, sign_dir
    from attestation.bundle.model_sig import verify_dir

    bundle = Path(shutil.copytree(night["bundle"], tmp_path / "bundle"))
    adapter = bundle / "adapter"
    if case == "another-key":  # a recipient decrypts the weights and signs them with a key of its own
        plain = tmp_path / "plain"
        assert cli_main(["adapter", "decrypt", str(bundle), "--identity", str(night["owner_key"]), "-o", str(plain),
                         "--policy", _policy_file(night)]) == 0
        (plain / "model.sig").unlink()
        other = ec.generate_private_key(ec.SECP256R1())
        sign_dir(other, plain)
        shutil.copyfile(plain / "model.sig", adapter / "model.sig")
        (tmp_path / "other.pem").write_text(public_key_pem(other))
        assert verify_dir(adapter, tmp_path / "other.pem", _plain_hashes(bundle, "adapter")) is None  # valid, but...
    elif case == "added-file":
        (adapter / "notes.txt").write_text("added after signing\n")
    elif case == "changed-config":
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        cfg["r"] = cfg["r"] * 2
        (adapter / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    elif case == "removed-file":
        next(p for p in sorted(adapter.iterdir()) if p.name not in ("model.sig", "adapter_model.safetensors")).unlink()
    elif case == "garbage-sig":
        (adapter / "model.sig").write_text('{"not": "a sigstore bundle"}')
    else:
        (adapter / "model.sig").unlink()
    code, checks = _verify(night, "--identity", str(night["owner_key"]), bundle=bundle)
    assert code == 1 and checks["confidential.plaintext"]["status"] == "pass"
    sig = checks["model.signature"]
    assert sig["status"] == "fail" and sig["reason"].startswith("adapter/model.sig: ") and "\n" not in sig["reason"], sig
    if case == "missing-sig":
        assert sig["reason"] == "adapter/model.sig: missing"


def test_publish_says_the_staged_weights_are_ciphertext(night: dict[str, Any], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    policy = night["root"] / "out" / "simulator-test-policy.yaml"
    assert cli_main(["publish", str(night["bundle"]), "--repo", "owner/adapter", "--policy", str(policy),
                     "--stage-only", str(repo)]) == 0
    assert "note: the weight files are age ciphertext to 3 recipient(s)" in capsys.readouterr().out
    assert (repo / "adapter_model.safetensors.age").read_bytes().startswith(C.AGE_MAGIC)
    weights = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if ".safetensors" in p.name)
    assert weights and all(w.endswith(".safetensors.age") for w in weights), weights  # no file the Hub would parse
    assert any(w.startswith("merged/") for w in weights)


def test_adapter_decrypt_writes_a_peft_directory_that_loads(night: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    assert cli_main(["adapter", "decrypt", str(night["bundle"]), "--identity", str(night["owner_key"]), "-o", str(out),
                     "--policy", _policy_file(night)]) == 0
    want = _manifest(night["bundle"])["confidentiality"]["plaintext_sha256"][WEIGHTS]
    assert hashlib.sha256((out / "adapter_model.safetensors").read_bytes()).hexdigest() == want
    assert sorted(p.name for p in out.iterdir()) == _original_names(night["bundle"] / "adapter")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from app.run.stages import base_model_stage

    base = base_model_stage(night["cfg"], night["root"] / "out", lambda _m: None)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base.dir)), str(out))
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())
    merged = tmp_path / "merged"
    assert cli_main(["adapter", "decrypt", str(night["bundle"]), "--identity", str(night["operator_key"]), "-o",
                     str(merged), "--dir", "merged", "--policy", _policy_file(night)]) == 0
    assert AutoModelForCausalLM.from_pretrained(str(merged)) is not None
    assert sorted(p.name for p in merged.iterdir()) == _original_names(night["bundle"] / "merged")


def _original_names(directory: Path) -> list[str]:
    """The names a decrypted copy of a bundle's model directory has: each weight file's without its ``.age``."""
    names = sorted(p.name.removesuffix(".age") for p in directory.iterdir())
    assert any(n.endswith(".safetensors") for n in names) and names != sorted(p.name for p in directory.iterdir())
    return names


@pytest.mark.parametrize("case", ["non-empty", "stranger", "altered", "truncated"])
def test_adapter_decrypt_refuses_and_writes_nothing(night: dict[str, Any], tmp_path: Path, case: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bundle, key, out = night["bundle"], night["owner_key"], tmp_path / "out"
    if case == "non-empty":
        out.mkdir()
        (out / "keep").write_text("x")
    elif case == "stranger":
        key = night["stranger_key"]
    else:
        bundle = tmp_path / "bundle"
        shutil.copytree(night["bundle"], bundle)
        data = bytearray((bundle / SEALED).read_bytes())
        if case == "altered":
            data[len(data) // 2] ^= 1
        else:
            del data[-100:]
        (bundle / SEALED).write_bytes(bytes(data))
    code = cli_main(["adapter", "decrypt", str(bundle), "--identity", str(key), "-o", str(out), "--policy",
                     _policy_file(night)])
    want = {"non-empty": ConfigError, "stranger": NotARecipientError}.get(case, CiphertextRejected)
    assert code == want.exit_code and code == {"non-empty": 2, "stranger": 4}.get(case, 1)
    printed = capsys.readouterr()
    err = printed.err
    says = {"non-empty": "is not an empty directory", "stranger": "is not among the recipients"}
    assert err.startswith("error: ") and says.get(case, "does not verify with this identity") in err, err
    if case == "stranger":  # named, with every recipient the manifest lists; no --policy advice
        info = json.loads((bundle / "manifest.json").read_bytes())["confidentiality"]
        assert all(r in err for r in info["recipients"]) and "(the CVM's own)" in err and "--policy" not in err
    elif case != "non-empty":
        assert "FAIL manifest.files" in printed.out, printed.out
    if case == "non-empty":
        assert [p.name for p in out.iterdir()] == ["keep"]
    else:
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    if case in ("altered", "truncated"):
        code, checks = _verify(night, bundle=bundle)
        assert code == 1 and checks["manifest.files"]["status"] == "fail"


def test_tampered_recipients_are_rejected(night: dict[str, Any], tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(night["bundle"], bundle)
    m = _manifest(bundle)
    m["confidentiality"]["dataset_recipients"] = []  # claim the owner named nobody
    m["confidentiality"]["recipients"].remove(night["owner"])
    (bundle / "manifest.json").write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")
    code, checks = _verify(night, bundle=bundle)
    assert code == 1 and checks["report_data"]["status"] == "fail"
    assert checks["confidential.outputs"]["status"] == "fail" and "stanzas" in checks["confidential.outputs"]["reason"]
    # The dataset file names the owner: a manifest whose dataset_recipients differ fails against it.
    dataset = next((night["root"] / "data").iterdir())
    code, checks = _verify(night, "--dataset", str(dataset), bundle=bundle)
    assert "other recipients" in checks["confidential.outputs"]["reason"]


def test_recipients_in_the_header_are_signed_and_checked(tmp_path: Path) -> None:
    r = C.recipient_of(OWNER_ID)
    path = _encrypt(tmp_path / "d.cvmds", SAMPLE[:5], 1, (r,))
    with open(path, "rb") as fh:
        assert read_header(fh).recipients == (r,)
    assert dataset_recipients(path) == (r,)
    with pytest.raises(ConfigError, match="cvm-tune.recipients must list age X25519 recipients"):
        with open(tmp_path / "bad.cvmds", "wb") as out:
            encrypt_stream(io.BytesIO(jsonl(SAMPLE[:5])), out, KEY, dataset_id="t", metadata={C.DATASET_META_KEY: "age1xyz"})
    raw = bytearray(path.read_bytes())
    i = raw.index(r.encode()) + 10
    raw[i] = ord("q") if raw[i] != ord("q") else ord("p")  # another valid-looking recipient in the signed header
    (tmp_path / "t.cvmds").write_bytes(bytes(raw))
    from app.dataset import open_encrypted
    from app.errors import HeaderIntegrityError

    with open(tmp_path / "t.cvmds", "rb") as fh, pytest.raises(HeaderIntegrityError, match="header was modified"):
        open_encrypted(fh, KEY, owner_public_key=OWNER.public_key().public_bytes_raw()).read()
    with pytest.raises(DatasetFormatError, match="must list age X25519 recipients"):  # read without the key too
        from app.dataset.format_header import _parse_header

        _parse_header(b'{"alg":"AES-256-GCM/HKDF-SHA256/STREAM-v1","chunk_size":4096,"content_type":"application/jsonl",'
                      b'"dataset_id":"t","dataset_version":1,"metadata":{"cvm-tune.recipients":"age1nope"},"salt":"'
                      + b"0" * 64 + b'"}')


def test_dataset_encrypt_recipient_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "rows.jsonl"
    src.write_bytes(jsonl(SAMPLE[:5]))
    assert cli_main(["keys", "new", "-o", str(tmp_path / "owner")]) == 0
    base = ["dataset", "encrypt", str(src), "--owner-key", str(tmp_path / "owner.key"), "--key-file",
            str(tmp_path / "k.key"), "--dataset-id", "t", "--dataset-version", "1"]
    a, b = C.recipient_of(OPERATOR_ID), C.recipient_of(OWNER_ID)
    assert cli_main([*base, "-o", str(tmp_path / "t.cvmds"), "--recipient", a, "--recipient", b]) == 0
    assert "age ciphertext to 2 recipient(s)" in capsys.readouterr().out
    with open(tmp_path / "t.cvmds", "rb") as fh:
        assert read_header(fh).recipients == tuple(sorted((a, b)))
    assert cli_main([*base, "-o", str(tmp_path / "u.cvmds"), "--recipient", "age1notakey"]) == 2
    assert not (tmp_path / "u.cvmds").exists()


def test_warm_start_gate_and_resume_on_an_encrypted_parent(night: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    root, first = night["root"], night["result"]
    _encrypt(root / "data" / "tickets-v2.cvmds", SAMPLE[:120] + EVAL, 2, (night["owner"],))
    cfg = _cfg(root, recipients=(night["operator"],))
    real_train = app.training.train
    monkeypatch.setattr(app.training, "train", lambda req: real_train(dataclasses.replace(req, stop_after_step=2)))
    with pytest.raises(app.training.TrainingInterrupted):
        run_once(cfg, hooks=RunHooks(service=True))
    runs = root / "out" / "runs"
    assert not [p for p in runs.rglob("adapter_model.safetensors")]  # nothing but sealed checkpoints on the volume
    monkeypatch.setattr(app.training, "train", real_train)
    second = run_once(cfg, hooks=RunHooks(service=True))
    m = _manifest(second.bundle_dir)
    assert m["training"]["resumed_from_step"] == 2 and m["training"]["global_step"] == 4
    assert m["lineage"]["parent_run_id"] == first.run_id
    assert m["lineage"]["parent_adapter_sha256"] == _manifest(first.bundle_dir)["files"][SEALED]  # the ciphertext's
    assert m["evaluation"]["parent"] == f"run {first.run_id}" and m["evaluation"]["parent_loss"] > 0
    assert m["confidentiality"]["dataset_recipients"] == [night["owner"]]
    code, checks = _verify(night, "--identity", str(night["owner_key"]), bundle=second.bundle_dir)
    assert code == 0 and checks["model.signature"]["status"] == "pass"
    assert not (runs / second.run_id / "adapter").exists()


def _bech32(hrp: str, data: bytes) -> str:
    """BIP-173 Bech32, written out again from the BIP (independent of attestation.outputs.confidential)."""
    charset, gen = "qpzry9x8gf2tvdw0s3jn54khce6mua7l", (0x3B6A57B2, 0x26508E6D, 0x1EA119FA, 0x3D4233DD, 0x2A1462B3)
    bits = "".join(f"{b:08b}" for b in data)
    words = [int(bits[i:i + 5].ljust(5, "0"), 2) for i in range(0, len(bits), 5)]
    chk = 1
    for v in [ord(c) >> 5 for c in hrp] + [0] + [ord(c) & 31 for c in hrp] + words + [0] * 6:
        b, chk = chk >> 25, (chk & 0x1FFFFFF) << 5 ^ v
        for i, g in enumerate(gen):
            if (b >> i) & 1:
                chk ^= g
    return hrp + "1" + "".join(charset[w] for w in words + [((chk ^ 1) >> 5 * (5 - i)) & 31 for i in range(6)])


def test_spec_section_14_vectors_are_recomputed() -> None:
    import re

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    text = (Path(__file__).resolve().parent.parent / "docs" / "verifier-spec.md").read_text()
    block = re.search(r"^```confidential-vectors\n(.*?)^```", text, flags=re.S | re.M).group(1)
    v = dict(line.split(" = ") for line in block.splitlines())

    def recipient(secret: bytes) -> str:
        pub = X25519PrivateKey.from_private_bytes(secret).public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return _bech32("age", pub)

    secret = bytes.fromhex(v["secret"])
    cvm = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"cvm-tune/outputs/v1 age-x25519").derive(
        bytes.fromhex(v["getkey"]))
    assert v == {"secret": secret.hex(), "identity": _bech32("age-secret-key-", secret).upper(),
                 "recipient": recipient(secret), "getkey": v["getkey"], "cvm_secret": cvm.hex(),
                 "cvm_identity": _bech32("age-secret-key-", cvm).upper(), "cvm_recipient": recipient(cvm)}
    # ... and the product derives the same from the same GetKey bytes
    from app.export.confidential import cvm_identity

    assert cvm_identity(lambda path, purpose: bytes.fromhex(v["getkey"])) == v["cvm_identity"]
    assert C.recipient_of(v["identity"]) == v["recipient"]


@pytest.mark.parametrize("change, reason", [
    ("key_path", "is not this run's"),
    ("unsigned_merged", "merged/ is exported but not signed"),
])
def test_a_recipient_gets_the_plaintext_bundles_signing_checks_too(night: dict[str, Any], change: str,
                                                                   reason: str) -> None:
    """The signing block itself is checked as for a plaintext bundle: another run's key path, or a merged model left
    out of the signed directories, fails ``model.signature`` even when every signature verifies (here on a manifest
    edited in memory: on disk the quote's binding of the manifest would fail first)."""
    from attestation.bundle import manifest as B
    from attestation.bundle import confidential as confidential_verify
    from attestation.verdict import QuoteFindings

    doc = _manifest(night["bundle"])
    if change == "key_path":
        doc["signing"]["key_path"] = doc["signing"]["key_path"].rsplit("/", 1)[0] + "/nightly-2020-01-01"
    else:
        doc["signing"]["signed"] = ["adapter"]
    f = QuoteFindings()
    ids = C.load_identities(night["owner_key"])
    confidential_verify.check(f, night["bundle"], B.Manifest.model_validate(doc), ids)
    check = next(c for c in f.checks if c.name == "model.signature")
    assert check.status == "fail" and reason in check.detail, check
    genuine = QuoteFindings()
    confidential_verify.check(genuine, night["bundle"], B.Manifest.model_validate(_manifest(night["bundle"])), ids)
    assert next(c for c in genuine.checks if c.name == "model.signature").status == "pass"


@pytest.mark.parametrize("case", ["wrong plaintext hash", "unencrypted weight file", "not age", "dataset recipient missing",
                                  "plaintext hash for an unlisted file", "plaintext bundle of a dataset with recipients"])
def test_each_confidential_failure_names_its_reason(night: dict[str, Any], tmp_path: Path, case: str) -> None:
    """Every failure branch of confidential.outputs / confidential.plaintext, each with its own reason (the quote no
    longer binds the edited manifest either: report_data fails too, but each check still says what it found)."""
    bundle = shutil.copytree(night["bundle"], tmp_path / "bundle")
    m = _manifest(bundle)
    conf = m["confidentiality"]
    weight = next(iter(conf["plaintext_sha256"]))
    extra: tuple[str, ...] = ()
    check, reason = "confidential.outputs", ""
    if case == "wrong plaintext hash":
        conf["plaintext_sha256"][weight] = "0" * 64
        extra, check, reason = ("--identity", str(night["owner_key"])), "confidential.plaintext", "decrypts to bytes of SHA-256"
    elif case == "unencrypted weight file":
        plain = C.decrypt((bundle / (weight + ".age")).read_bytes(), C.load_identities(night["owner_key"]))
        (bundle / (weight + ".age")).unlink()
        (bundle / weight).write_bytes(plain)  # written in the clear, its plaintext hash dropped (another one stays)
        del m["files"][weight + ".age"]
        m["files"][weight] = hashlib.sha256(plain).hexdigest()
        assert len(conf["plaintext_sha256"]) > 1
        del conf["plaintext_sha256"][weight]
        check, reason = "manifest.schema", f"{weight} is listed under its plaintext name"
    elif case == "not age":
        junk = b"age-encryption.org/v2\n" + b"x" * 200
        (bundle / (weight + ".age")).write_bytes(junk)
        m["files"][weight + ".age"] = hashlib.sha256(junk).hexdigest()
        reason = "is not an age v1 file"
    elif case == "dataset recipient missing":
        conf["recipients"].remove(night["owner"])
        reason = "dataset recipient(s) missing"
    elif case == "plaintext hash for an unlisted file":
        conf["plaintext_sha256"]["adapter/extra.safetensors"] = "1" * 64
        reason = "plaintext hashes for files the manifest does not list"
    else:
        del m["confidentiality"]
        for age in [f for f in m["files"] if f.endswith(".age")]:  # a plaintext bundle's names (bytes unchanged)
            (bundle / age).rename(bundle / age.removesuffix(".age"))
            m["files"][age.removesuffix(".age")] = m["files"].pop(age)
        extra, reason = ("--dataset", str(next((night["root"] / "data").iterdir()))), "weights are in plaintext"
    (bundle / "manifest.json").write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")
    code, checks = _verify(night, *extra, bundle=bundle)
    assert code == 1 and checks[check]["status"] == "fail", checks.get(check)
    assert reason in checks[check]["reason"], checks[check]


def test_the_run_says_who_can_read_its_weights(tmp_path: Path) -> None:
    from app.export.confidential import Plan
    from app.run.confidential import describe

    owner, operator, cvm = C.recipient_of(OWNER_ID), C.recipient_of(OPERATOR_ID), C.recipient_of(STRANGER_ID)
    line = describe(Plan(tuple(sorted((owner, operator, cvm))), (owner,), cvm, tmp_path, STRANGER_ID))
    assert line.startswith("weights: exported only as age ciphertext to 3 recipient(s): 1 named by the dataset's "
                           "owner, 1 by the operator") and all(r in line for r in (owner, operator, cvm))
    assert STRANGER_ID not in line  # the CVM's identity never
    assert describe(None).startswith("weights: exported in the clear")


def test_the_bundle_lists_encrypted_weights_only_under_their_age_names(night: dict[str, Any]) -> None:
    """Every weight file is on disk and in ``files`` only as ``<name>.age`` (its ciphertext's hash); the plaintext
    hashes keep the original names; the audit's export entry commits to the ``.age`` file."""
    from attestation.bundle import manifest as B

    bundle, m = night["bundle"], _manifest(night["bundle"])
    plain = m["confidentiality"]["plaintext_sha256"]
    on_disk = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*.safetensors*"))
    assert on_disk == sorted(f for f in m["files"] if ".safetensors" in f) == sorted(r + ".age" for r in plain)
    assert SEALED in on_disk and WEIGHTS not in m["files"] and not list(bundle.rglob("*.safetensors"))
    assert all(C.is_weight_file(r) for r in plain)
    parsed = B.Manifest.model_validate(m)
    assert B.weights_file(parsed) == SEALED and SEALED in B.hashed_files(parsed) and B.files_problem(parsed) is None
    assert B.artifact_files(True)[1] == SEALED and B.artifact_files(False)[1] == WEIGHTS


def _old_layout(night: dict[str, Any], dest: Path) -> Path:
    """The bundle as made before ciphertext was named ``.age``: the same age files under the plaintext names."""
    bundle = Path(shutil.copytree(night["bundle"], dest))
    m = _manifest(bundle)
    for age in [f for f in m["files"] if f.endswith(".safetensors.age")]:
        (bundle / age).rename(bundle / age.removesuffix(".age"))
        m["files"][age.removesuffix(".age")] = m["files"].pop(age)
    (bundle / "manifest.json").write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")
    return bundle


def test_ciphertext_under_the_plaintext_name_is_rejected_naming_the_age_name(night: dict[str, Any], tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """An older bundle's layout fails closed: ``manifest.schema`` says which ``.age`` name the file must have, and
    ``adapter decrypt`` writes nothing."""
    bundle = _old_layout(night, tmp_path / "old")
    code, checks = _verify(night, "--identity", str(night["owner_key"]), bundle=bundle)
    schema = checks["manifest.schema"]
    assert code == 1 and schema["status"] == "fail"
    assert schema["reason"].startswith(
        "manifest.json is not a valid cvm-tune/manifest/v1 manifest: adapter/adapter_model.safetensors is listed under "
        "its plaintext name, but the weights are encrypted (confidentiality): a confidential bundle holds that file as "
        "age ciphertext named adapter/adapter_model.safetensors.age; merged/"), schema
    out = tmp_path / "out"
    assert cli_main(["adapter", "decrypt", str(bundle), "--identity", str(night["owner_key"]), "-o", str(out),
                     "--policy", _policy_file(night)]) == CiphertextRejected.exit_code
    assert "FAIL manifest.schema" in capsys.readouterr().out and not out.exists()


@pytest.mark.parametrize("listed", [False, True])
def test_a_bundle_never_holds_both_names(night: dict[str, Any], tmp_path: Path, listed: bool) -> None:
    """A copy under the plaintext name beside the ``.age`` file: unlisted, ``bundle.files`` names it; listed in the
    manifest, ``manifest.schema`` rejects the plaintext name."""
    bundle = Path(shutil.copytree(night["bundle"], tmp_path / "both"))
    shutil.copyfile(bundle / SEALED, bundle / WEIGHTS)
    if listed:
        m = _manifest(bundle)
        m["files"][WEIGHTS] = m["files"][SEALED]
        (bundle / "manifest.json").write_text(json.dumps(m, sort_keys=True, indent=2) + "\n")
    code, checks = _verify(night, bundle=bundle)
    assert code == 1
    if listed:
        assert checks["manifest.schema"]["status"] == "fail"
        assert f"{WEIGHTS} is listed under its plaintext name" in checks["manifest.schema"]["reason"]
    else:
        assert checks["manifest.schema"]["status"] == "pass"
        assert checks["bundle.files"] == {**checks["bundle.files"], "status": "fail",
                                          "reason": f"unexpected file {WEIGHTS}"}


def test_an_age_name_in_a_plaintext_manifest_is_rejected(night: dict[str, Any]) -> None:
    from attestation.bundle import manifest as B

    doc = _manifest(night["bundle"])
    del doc["confidentiality"]
    assert B.files_problem(B.Manifest.model_validate(doc)).startswith(
        f"{SEALED} is an age ciphertext name, but the manifest has no confidentiality")


def test_decrypt_dir_restores_the_original_names_and_wants_every_bound_file(night: dict[str, Any],
                                                                           tmp_path: Path) -> None:
    from app.export.confidential import decrypt_dir

    plain = _manifest(night["bundle"])["confidentiality"]["plaintext_sha256"]
    ids = C.load_identities(night["operator_key"])
    out = decrypt_dir(night["bundle"] / "merged", tmp_path / "merged", ids, plain, "merged")
    assert sorted(p.name for p in out.iterdir()) == _original_names(night["bundle"] / "merged")
    for rel in (r for r in plain if r.startswith("merged/")):
        assert hashlib.sha256((out / rel.split("/", 1)[1]).read_bytes()).hexdigest() == plain[rel]
    adapter = Path(shutil.copytree(night["bundle"] / "adapter", tmp_path / "adapter"))
    (adapter / "adapter_model.safetensors.age").unlink()
    with pytest.raises(CiphertextRejected, match=r"adapter/adapter_model\.safetensors\.age is missing"):
        decrypt_dir(adapter, tmp_path / "d", ids, plain, "adapter")
