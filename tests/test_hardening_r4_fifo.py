"""A FIFO, device or socket planted in an export bundle, or named as an identity, is refused at once: verify never
waits on it (it would hang until someone writes into the pipe) and gives the rejection or input error it should."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"
MEMBERS = ["quote.bin", "quote.hex", "event_log.json", "collateral.json", "app-compose.json", "audit.jsonl",
           "config.json", "gpu-evidence.json", "adapter/adapter_model.safetensors", "README.md"]


def _verify(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", "verify", *args, "--now", "1900000000", "--json"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize("member", MEMBERS)
def test_a_fifo_in_a_bundle_is_a_rejection_not_a_hang(tmp_path: Path, member: str) -> None:
    bundle = shutil.copytree(DATA / "bundle", tmp_path / "bundle")
    (bundle / member).unlink()
    os.mkfifo(bundle / member)
    done = _verify(str(bundle), "--policy", str(DATA / "bundle-policy.yaml"))
    assert done.returncode == 1, done.stderr[-2000:]
    failed = {c["name"]: c["reason"] for c in json.loads(done.stdout)["checks"] if c["status"] == "fail"}
    assert member in failed.get("bundle.files", ""), failed


def test_a_fifo_as_the_identity_is_an_input_error(tmp_path: Path) -> None:
    from attestation.outputs.confidential import IdentityError, load_identities

    fifo = tmp_path / "id.txt"
    os.mkfifo(fifo)
    with pytest.raises(IdentityError, match="not a regular file"):
        load_identities(fifo)
    done = _verify(str(DATA / "bundle"), "--policy", str(DATA / "bundle-policy.yaml"), "--identity", str(fifo))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
