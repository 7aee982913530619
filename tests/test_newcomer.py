"""A newcomer needs no other tool: an age identity from cvm-tune itself, a public key given as the private key named as
such, the API's help telling the truth, and the files the docs create kept out of git."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from app.cli import _parser, main
from app.dataset.owner import load_owner_key, new_age_identity
from app.errors import KeySourceError
from attestation.outputs.confidential import decrypt, encrypt, load_identities

ROOT = Path(__file__).resolve().parent.parent
AGE_KEYGEN = re.compile(r"# created: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(Z|[+-]\d\d:\d\d)\n"
                        r"# public key: (age1[02-9ac-hj-np-z]{58})\n(AGE-SECRET-KEY-1[02-9AC-HJ-NP-Z]{58})\n")


# ---- keys age ------------------------------------------------------------------------------------------------------

def test_keys_age_writes_an_identity_file_as_age_keygen_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "key.txt"
    assert main(["keys", "age", "-o", str(key)]) == 0
    out = capsys.readouterr().out
    m = AGE_KEYGEN.fullmatch(key.read_text())
    assert m is not None, key.read_text()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert f"recipient: {m.group(2)}" in out.splitlines() and m.group(3) not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.txt"]  # no temporary file left beside it
    # what --identity reads, and a round trip to the printed recipient
    ids = load_identities(key)
    assert [str(i.to_public()) for i in ids] == [m.group(2)]
    assert decrypt(encrypt(b"weights", (m.group(2),)), ids) == b"weights"
    assert main(["keys", "age", "-y", str(key)]) == 0
    assert capsys.readouterr().out == m.group(2) + "\n"


def test_keys_age_never_overwrites_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "key.txt"
    key.write_text("the user's identity\n")
    before = key.stat()
    with pytest.raises(KeySourceError) as exc:
        new_age_identity(key)
    assert type(exc.value) is KeySourceError and "already exists" in exc.value.message
    assert main(["keys", "age", "-o", str(key)]) == 4
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: ") and "refusing to overwrite" in err[0] and err[1].startswith("fix: ")
    assert key.read_text() == "the user's identity\n" and key.stat().st_mtime_ns == before.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.txt"]


def test_no_page_requires_age_keygen() -> None:
    """Every page that mentions age-keygen offers `cvm-tune keys age` in the same breath (the verifier specification
    names age-keygen as the reference for the format it specifies: an implementer's page, not a how-to)."""
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "verifier-spec.md")]
    needing = [p.name for p in pages if "age-keygen" in (text := p.read_text()) and "cvm-tune keys age" not in text]
    assert needing == []
    assert "cvm-tune keys age" in (ROOT / "docs" / "data-owner.md").read_text()


# ---- a public key given where the private key belongs ----------------------------------------------------------------

def test_owner_public_key_given_as_the_private_key_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "new", "-o", str(tmp_path / "acme")]) == 0
    pub = tmp_path / "acme.pub"
    assert stat.S_IMODE(pub.stat().st_mode) & 0o044  # readable by others, as a public key is
    with pytest.raises(KeySourceError) as exc:
        load_owner_key(pub)
    assert type(exc.value) is KeySourceError
    assert "public key" in exc.value.message and "chmod" not in exc.value.fix and "acme.key" in exc.value.fix
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "hello"}\n')
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["dataset", "encrypt", str(rows), "-o", str(tmp_path / "rows.cvmds"), "--owner-key", str(pub),
                 "--key-file", str(tmp_path / "rows.key"), "--dataset-id", "d", "--dataset-version", "1"])
    err = capsys.readouterr().err
    assert code == 4 and "acme.pub holds the owner's public key" in err and "chmod" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no dataset, no dataset key written


def test_a_private_key_readable_by_others_still_gets_chmod(tmp_path: Path) -> None:
    assert main(["keys", "new", "-o", str(tmp_path / "acme")]) == 0
    (tmp_path / "acme.key").chmod(0o644)
    with pytest.raises(KeySourceError) as exc:
        load_owner_key(tmp_path / "acme.key")
    assert type(exc.value) is KeySourceError and exc.value.fix == f"chmod 600 {tmp_path / 'acme.key'}"


# ---- api serve --help ----------------------------------------------------------------------------------------------

def test_api_serve_help_says_tls_is_the_default() -> None:
    api = next(a for a in _parser()._actions if a.dest == "command").choices["api"]
    serve = next(a for a in api._actions if a.dest == "api_command").choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "over TLS" in text and "plain HTTP, loopback only" not in text
    assert "--plain-http serves plain HTTP instead" in text


# ---- .gitignore ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["fed-sim/simulator-test-policy.yaml", "ops.jsonl", "trust.pem",
                                  "dpo-demo/out/exports/run-1/manifest.json"])
def test_files_the_docs_create_are_ignored_by_git(path: str) -> None:
    proc = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "-q", path], env={
        **os.environ, "GIT_CONFIG_GLOBAL": os.devnull}, capture_output=True)
    assert proc.returncode == 0, f"{path} is not ignored by .gitignore"
