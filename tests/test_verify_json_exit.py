"""``--json`` says what the exit code says, on every path of ``cvm-tune verify`` and ``verify-quote``: a relying
party that reads only the JSON must never accept what the exit code rejects (and the reverse).

The bundles are the committed samples (a nightly run's and a training-API checkpoint's with its ops record), their
tampered copies, and the same under the default policy.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).resolve().parent / "data"
POLICY = DATA / "bundle-policy.yaml"
NOW = "1900000000"


def _run(*argv: str) -> tuple[int, Any]:
    from app.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(list(argv))
    return code, json.loads(buf.getvalue())


def _says_accepted(doc: dict[str, Any]) -> bool:
    return doc["verdict"] == "accepted" if "verdict" in doc else doc["accepted"] is True


def _copy(src: Path, dest: Path, tamper: bool) -> Path:
    shutil.copytree(src, dest)
    if tamper:
        f = dest / "config.json"
        f.write_bytes(f.read_bytes().replace(b"{", b"{ ", 1))
    return dest


def _ops(tmp: Path, *, bad: bool) -> Path:
    lines = (DATA / "api-bundle-ops.jsonl").read_text().splitlines()
    if bad:
        lines = lines[:-1]
    f = tmp / "ops.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return f


PATHS = ["bundle", "tampered bundle", "bundle, default policy", "ops", "ops, one missing", "ops, tampered bundle",
         "parent", "parent, tampered", "chain", "chain, tampered", "round, damaged", "quote", "quote, other report_data"]


@pytest.mark.parametrize("path", PATHS)
def test_json_and_exit_code_agree(tmp_path: Path, path: str) -> None:
    tampered = "tampered" in path
    policy = [] if "default policy" in path else ["--policy", str(POLICY)]
    common = [*policy, "--now", NOW, "--json"]
    if path.startswith("ops"):
        bundle = _copy(DATA / "api-bundle", tmp_path / "exports" / "api", tampered)
        argv = ["verify", str(bundle), *common, "--ops", str(_ops(tmp_path, bad="missing" in path))]
    elif path.startswith("parent"):
        parent = _copy(DATA / "bundle", tmp_path / "parent", tampered)
        argv = ["verify", str(DATA / "bundle"), *common, "--parent", str(parent)]
    elif path.startswith("chain"):
        _copy(DATA / "bundle", tmp_path / "exports" / "run", tampered)
        argv = ["verify", "--chain", str(tmp_path / "exports"), *common]
    elif path.startswith("round"):
        round_dir = tmp_path / "round-1"
        round_dir.mkdir()
        (round_dir / "round-manifest.json").write_text("{}")
        argv = ["verify", str(round_dir), *common]
    elif path.startswith("quote"):
        argv = ["verify-quote", str(DATA / "bundle" / "quote.bin"), "--collateral", str(DATA / "bundle" / "collateral.json"),
                "--event-log", str(DATA / "bundle" / "event_log.json"), *common]
        if "other" in path:
            argv += ["--report-data", "00" * 64]
    else:
        argv = ["verify", str(_copy(DATA / "bundle", tmp_path / "exports" / "run", tampered)), *common]
    code, doc = _run(*argv)
    assert code in (0, 1), (code, doc)
    assert (code == 0) == _says_accepted(doc), (path, code, doc)
    expect_ok = path in ("bundle", "ops", "quote", "chain")
    assert code == (0 if expect_ok else 1), (path, code, doc)


def test_an_exports_directory_given_as_bundle_suggests_chain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    shutil.copytree(DATA / "bundle", tmp_path / "exports" / "run-1")
    assert main(["verify", str(tmp_path / "exports"), "--policy", str(POLICY), "--now", NOW]) == 2
    err = capsys.readouterr().err
    assert "is a directory of 1 export bundle(s)" in err and f"cvm-tune verify --chain {tmp_path / 'exports'}" in err


def test_ops_on_a_round_bundle_is_an_input_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    round_dir = tmp_path / "round-1"
    round_dir.mkdir()
    (round_dir / "round-manifest.json").write_text("{}")
    assert main(["verify", str(round_dir), "--policy", str(POLICY), "--ops", str(DATA / "api-bundle-ops.jsonl")]) == 2
    assert "--ops checks a training-API checkpoint, not a federated round bundle" in capsys.readouterr().err
