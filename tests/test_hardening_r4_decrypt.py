"""`cvm-tune adapter decrypt` verifies the bundle exactly as `cvm-tune verify BUNDLE --identity KEY` does before it
writes any plaintext: a forged bundle (weights re-encrypted to the bundle's public recipients, their hashes rewritten
in the manifest, the model signature removed) is refused and nothing is written; an identity that is a FIFO or a
device is a clear error at once (no read that blocks or never ends); `-o` naming a symlink is a usage error."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from app.cli import main
from app.errors import CiphertextRejected
from app.run.pipeline import RunHooks, run_once
from attestation.outputs import confidential as C
from tests.test_confidential import EVAL, OWNER_ID, SAMPLE, SEALED, STRANGER_ID, WEIGHTS, _cfg, _encrypt, _key_file


@pytest.fixture(scope="module")
def night(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One night on a dataset whose owner names a recipient: its weights are age ciphertext."""
    root = tmp_path_factory.mktemp("r4-decrypt")
    (root / "data").mkdir()
    _encrypt(root / "data" / "tickets-v1.cvmds", SAMPLE[:60] + EVAL, 1, (C.recipient_of(OWNER_ID),))
    result = run_once(_cfg(root), hooks=RunHooks(service=True))
    return {"bundle": result.bundle_dir, "policy": root / "out" / "simulator-test-policy.yaml",
            "owner_key": _key_file(root, OWNER_ID, "owner-age.txt"),
            "stranger_key": _key_file(root, STRANGER_ID, "stranger-age.txt")}


def _decrypt(night: dict[str, Any], out: Path, *, bundle: Path | None = None, key: Path | None = None,
             policy: bool = True) -> int:
    return main(["adapter", "decrypt", str(bundle or night["bundle"]), "--identity", str(key or night["owner_key"]),
                 "-o", str(out), *(("--policy", str(night["policy"])) if policy else ())])


def _forge(night: dict[str, Any], dest: Path) -> Path:
    """The bundle with other adapter weights: encrypted to its public recipients, hashes rewritten, no signature."""
    bundle = Path(shutil.copytree(night["bundle"], dest))
    m = json.loads((bundle / "manifest.json").read_bytes())
    plain = bytearray(C.decrypt((bundle / SEALED).read_bytes(), C.load_identities(night["owner_key"])) or b"")
    assert plain
    plain[-8:] = b"\x7f" * 8  # the forger's weights
    cipher = C.encrypt(bytes(plain), tuple(m["confidentiality"]["recipients"]))
    (bundle / SEALED).write_bytes(cipher)
    m["files"][SEALED] = hashlib.sha256(cipher).hexdigest()
    m["confidentiality"]["plaintext_sha256"][WEIGHTS] = hashlib.sha256(plain).hexdigest()
    for rel in [r for r in m["files"] if r.endswith("model.sig")]:
        (bundle / rel).unlink()
        del m["files"][rel]
    m["signing"] = None
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    return bundle


def test_the_genuine_bundle_verifies_and_decrypts(night: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "adapter"
    assert _decrypt(night, out) == 0
    want = json.loads((night["bundle"] / "manifest.json").read_bytes())["confidentiality"]["plaintext_sha256"][WEIGHTS]
    assert hashlib.sha256((out / "adapter_model.safetensors").read_bytes()).hexdigest() == want
    assert "the bundle verified with this identity" in capsys.readouterr().out


@pytest.mark.parametrize("policy", [True, False], ids=["simulator-policy", "default-policy"])
def test_a_forged_bundle_is_refused_and_nothing_is_written(night: dict[str, Any], tmp_path: Path, policy: bool,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _forge(night, tmp_path / "forged")
    out = tmp_path / "out"
    assert _decrypt(night, out, bundle=bundle, policy=policy) == CiphertextRejected.exit_code == 1
    stdout, err = capsys.readouterr()
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert "model signature verified" not in stdout and stdout.startswith("REJECTED"), stdout
    assert "FAIL report_data" in stdout or not policy, stdout  # the manifest the quote binds is not this one
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "does not verify" in errors[0] and "\nfix: " in err and "Traceback" not in err, err
    # verify --identity gives the same verdict
    verify = ["verify", str(bundle), "--identity", str(night["owner_key"]),
              *(("--policy", str(night["policy"])) if policy else ())]
    assert main(verify) == 1
    assert [x for x in capsys.readouterr().out.splitlines() if x.startswith("FAIL ")] == stdout.splitlines()[1:]


def test_a_stranger_is_told_it_is_not_a_recipient(night: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """An identity the manifest does not name is refused before anything is verified or written (exit 4, key error),
    with the recipients listed; no advice to pass another --policy."""
    from app.errors import NotARecipientError

    out = tmp_path / "out"
    assert _decrypt(night, out, key=night["stranger_key"]) == NotARecipientError.exit_code == 4 and not out.exists()
    printed = capsys.readouterr()
    assert "is not among the recipients" in printed.err and "--policy" not in printed.err and "FAIL" not in printed.out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
@pytest.mark.parametrize("command", ["decrypt", "verify"])
def test_an_identity_that_is_not_a_regular_file_is_refused_at_once(night: dict[str, Any], tmp_path: Path, kind: str,
                                                                  command: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "key"
    if kind == "fifo":
        os.mkfifo(key)
    elif kind == "directory":
        key.mkdir()
    else:
        key = Path("/dev/zero")
    out = tmp_path / "out"
    if command == "decrypt":
        code = _decrypt(night, out, key=key)
    else:
        code = main(["verify", str(night["bundle"]), "--identity", str(key), "--policy", str(night["policy"])])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "is not a regular file" in err and "Traceback" not in err, err


@pytest.mark.parametrize("target", ["empty-dir", "dangling"])
def test_out_naming_a_symlink_is_a_usage_error(night: dict[str, Any], tmp_path: Path, target: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = tmp_path / "elsewhere"
    if target == "empty-dir":
        elsewhere.mkdir()
    out = tmp_path / "out"
    out.symlink_to(elsewhere)
    assert _decrypt(night, out, policy=False) == 2  # refused before the bundle is verified
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "symlink" in err and "Traceback" not in err, err
    assert out.is_symlink() and (list(elsewhere.iterdir()) == [] if target == "empty-dir" else not elsewhere.exists())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out"] + (["elsewhere"] if target == "empty-dir" else []))
