"""A federated round bundle with a member missing, a directory in a file's place, or a FIFO, symlink or device
among its files: `cvm-tune verify` gives a rejected verdict naming it (exit 1), never an internal error (70) and
never a read that blocks; it writes nothing into the bundle. The round here is synthetic (no quote): what matters is
that every damaged member ends as a reason in the verdict."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from app.cli import main
from attestation.outputs import confidential as C
from attestation.rounds import manifest as R

H = "0" * 64
RECIPIENT = C.recipient_of(C.identity_from_secret(bytes(32)))
MEMBERS = (R.GLOBAL_ADAPTER, "adapter",  # the global adapter: its .age name in a secure round "app-compose.json", "quote.bin", "quote.hex", "event_log.json",
           R.CLIENTS_DIR, f"{R.CLIENTS_DIR}/lab-a", f"{R.CLIENTS_DIR}/lab-a/manifest.json")


def _round(root: Path, *, secure: bool) -> Path:
    rd = root / "round"
    (rd / "adapter").mkdir(parents=True)
    (rd / R.CLIENTS_DIR / "lab-a").mkdir(parents=True)
    adapter = b"\0" * 64
    (rd / R.global_adapter(secure)).write_bytes(adapter)
    (rd / "app-compose.json").write_text("{}")
    (rd / R.CLIENTS_DIR / "lab-a" / "manifest.json").write_text("{}")
    for name in ("quote.bin", "quote.hex", "event_log.json"):
        (rd / name).write_bytes(b"x")
    m = {"schema": R.ROUND_SCHEMA, "federation_id": "fed-1", "round": 1, "nonce": H, "created_at": "2026-01-01T00:00:00Z",
         "code": {"package": "cvm-tune", "version": "0", "source_sha256": H},
         "tee": {"mode": "embedded-simulator", "app_id": "0" * 40, "instance_id": "i", "compose_hash": H,
                 "agent_version": "0", "agent_rev": "0"},
         "strategy": {"name": "fedavg"}, "min_clients": 1, "global_adapter_sha256": hashlib.sha256(adapter).hexdigest(),
         "admitted": [{"client": "lab-a", "run_id": "run-1", "manifest_sha256": H, "quote_sha256": H,
                       "adapter_sha256": H, "trainable_tokens": 1, "weight": 1.0}],
         "rejected": [], "files": {"app-compose.json": H, R.global_adapter(secure): hashlib.sha256(adapter).hexdigest()}}
    if secure:  # secure aggregation: the global adapter is read as age ciphertext (adapter_model.safetensors.age)
        m |= {"aggregator_recipient": RECIPIENT, "confidentiality": {"recipients": [RECIPIENT], "plaintext_sha256": H}}
    (rd / R.ROUND_MANIFEST).write_text(json.dumps(m))
    return rd


def _damage(path: Path, kind: str) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-to-device":
        path.symlink_to("/dev/zero")


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(root).as_posix(): (p.lstat().st_mode, p.lstat().st_size) for p in root.rglob("*")}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "symlink-to-device"])
@pytest.mark.parametrize("member", MEMBERS)
def test_a_damaged_round_member_is_a_rejected_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      member: str, kind: str, secure: bool) -> None:
    rd = _round(tmp_path, secure=secure)
    member = R.global_adapter(secure) if member == R.GLOBAL_ADAPTER else member
    _damage(rd / member, kind)
    before = _tree(rd)
    assert main(["verify", str(rd)]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "internal error" not in err, err
    assert out.startswith("REJECTED"), out
    name = member.rsplit("/", 1)[-1]  # the verdict names what is wrong
    assert any(line.startswith("FAIL ") and name in line for line in out.splitlines()), out
    if kind in ("fifo", "symlink-to-device"):
        assert f"{member} is not a plain file or directory" in out
    assert _tree(rd) == before


def test_a_secure_round_without_its_global_adapter_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rd = _round(tmp_path, secure=True)
    (rd / R.GLOBAL_ADAPTER_AGE).unlink()
    assert main(["verify", str(rd)]) == 1
    out, err = capsys.readouterr()
    assert f"missing {R.GLOBAL_ADAPTER_AGE}" in out and f"{R.GLOBAL_ADAPTER_AGE} missing or unreadable" in out, out
    assert "Traceback" not in err
