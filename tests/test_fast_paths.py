"""The verifier's fast paths give the same answers as the slow ones they replaced: libyaml vs the
pure-Python loader on every YAML the project ships and on YAML's odd corners, the one file-hashing
path vs hashlib, and the single dcap-qvl call vs ``dcap_qvl.verify`` on the real quotes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import dcap_qvl
import pytest
import yaml

from attestation.io import safe_yaml
from attestation.tdx.dcap import dcap_verify, parse_collateral
from attestation.errors import PolicyError
from attestation.io.hashing import sha256_file

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "tests" / "data" / "attestation"

ODD_YAML = {
    "anchors-merge": "base: &b {x: 1, y: [1, 2]}\nderived:\n  <<: *b\n  y: 3\nlist: [*b, *b]\n",
    "yaml-1.1-scalars": "a: yes\nb: off\nc: 0o17\nd: 017\ne: 0x1f\nf: 1_000\ng: .inf\nh: -.Inf\ni: ~\nj: 2026-11-25\n"
                        "k: 2026-11-25T10:00:00Z\nl: 1e3\nm: 12:30:00\n",
    "strings": "a: 'it''s'\nb: \"tab\\tnew\\nline \\u00e9\"\nc: |\n  two\n  lines\nd: >\n  folded\n  text\n",
    "tags": "a: !!str 12\nb: !!float 3\nc: !!binary aGVsbG8=\nd: !!set {x, y}\ne: !!omap [a: 1, b: 2]\n",
    "unicode": "名前: 値\nemoji: \"\\U0001F600\"\n",
    "bytes-utf16": "a: 1\n".encode("utf-16"),
    "empty": "",
    "comments-only": "# nothing\n",
    "multi-key": "? [a, b]\n: complex key\n",
}


def _outcome(loader: type, text: str | bytes) -> tuple[str, object]:
    try:
        return "ok", yaml.load(text, Loader=loader)  # noqa: S506 - SafeLoader subclasses
    except yaml.YAMLError:
        return "error", None


def _corpus() -> dict[str, str | bytes]:
    files = {p.relative_to(REPO).as_posix(): p.read_bytes() for p in REPO.rglob("*.y*ml") if ".venv" not in p.parts}
    return {**files, **ODD_YAML}


@pytest.mark.skipif(safe_yaml._UniqueKeyCLoader is None, reason="PyYAML without libyaml")
@pytest.mark.parametrize("name", sorted(_corpus()))
def test_libyaml_reads_what_the_pure_loader_reads(name: str) -> None:
    text = _corpus()[name]
    fast = _outcome(safe_yaml._UniqueKeyCLoader, text)
    assert fast == _outcome(safe_yaml._UniqueKeyLoader, text)
    if fast[0] == "ok":
        assert safe_yaml.parse_yaml(text, name, PolicyError, max_depth=64) == fast[1]
    else:
        with pytest.raises(PolicyError):
            safe_yaml.parse_yaml(text, name, PolicyError, max_depth=64)


@pytest.mark.parametrize("text", ["a: 1\na: 2\n", "a: {b: 1, b: 2}\n", "a: [1, 2\n", "a: *missing\n",
                                  "[" * 200_000 + "]" * 200_000, "a: " + "[" * 33 + "]" * 33])
def test_bad_yaml_is_one_error(text: str) -> None:
    with pytest.raises(PolicyError) as err:
        safe_yaml.parse_yaml(text, "policy x", PolicyError)
    assert type(err.value) is PolicyError


@pytest.mark.parametrize("size", [0, 1, 4095, 1 << 20, (1 << 20) + 3, (64 << 20) + 5])
def test_sha256_file_is_hashlib(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_sha256_file_refuses_links_and_fifos(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    os.mkfifo(tmp_path / "fifo")
    for name in ("link", "fifo"):
        with pytest.raises(ValueError):
            sha256_file(tmp_path / name)


@pytest.mark.parametrize(("quote", "collateral", "now"), [
    ("dstack_nearmpc_quote.bin", "dstack_nearmpc_collateral.json", 1787894484),
    ("dcapqvl_sgx_quote", "dcapqvl_sgx_quote_collateral.json", None),
    ("dcapqvl_tdx_quote", "dcapqvl_tdx_quote_collateral.json", None),
    ("dcapqvl_tdx_quote_outdated", "dcapqvl_tdx_quote_outdated_collateral.json", None),
    ("dstack_nearmpc_quote.bin", "dstack_nearmpc_collateral.json", 1789171031 + 1),  # CRL expired
])
def test_one_dcap_call_answers_as_verify(quote: str, collateral: str, now: int | None) -> None:
    raw = (SAMPLES / quote).read_bytes()
    coll = parse_collateral((SAMPLES / collateral).read_text())
    now = now if now is not None else coll.not_before + 10
    got = dcap_verify(raw, coll, root_der=None, now=now)
    try:
        rep = dcap_qvl.verify(raw, coll.qvl, now)
    except ValueError as exc:
        assert not got.ok and got.error == " | ".join(x.strip() for x in str(exc).splitlines() if x.strip())
    else:
        assert got.ok and (got.status, got.advisory_ids) == (rep.status, tuple(rep.advisory_ids))


def test_help_and_usage_errors_load_no_verifier_and_no_pydantic() -> None:
    import subprocess
    import sys

    code = ("import sys\nfrom app.cli import main\n"
            "for argv in (['--help'], ['verify', '--help'], ['no-such-command']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "loaded = sorted(m for m in ('attestation', 'pydantic', 'dcap_qvl', 'yaml', 'cryptography', 'torch', 'logging')"
            " if m in sys.modules)\n"
            "print('LOADED', loaded)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "LOADED []" in out.stdout, out.stdout[-500:]
