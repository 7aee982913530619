"""The answers docs/verifier-spec.md gives where a third implementation found it silent or loose, each pinned in the
product: ``null`` optional members (§2, §4), GPU evidence without ``gpu`` (§2, §12), the key-provider id's hex
(§3: its vectors are in the spec's rule-vector blocks), hex case in event_log.json (§6), a ``--parent`` that is not a
directory (§8), the prv mesh bound (§10), field labels, line breaks and digits of GPU evidence (§12), the round
manifest's members (§13) and a malformed dataset header under ``--dataset`` (§14). Where the page can differ, the
same input goes through the page's own module (web/test/units.mjs) too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.cli import main
from tests.test_web_verify import web_copy  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
POLICY = DATA / "bundle-policy.yaml"
NOW = "1900000000"

web_test = pytest.mark.skipif(shutil.which("node") is None, reason="needs node (sh requirements/test-tools.sh)")


def _verify(bundle: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, tuple[str, str]]]:
    """``cvm-tune verify BUNDLE --json`` under the sample's policy: (exit code, {check: (status, reason)})."""
    capsys.readouterr()
    rc = main(["verify", str(bundle), "--policy", str(POLICY), "--now", NOW, "--json", *extra])
    doc = json.loads(capsys.readouterr().out)
    return rc, {c["name"]: (c["status"], c["reason"]) for c in doc["checks"]}


def _sample(tmp_path: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A copy of the sample bundle, its manifest edited (report_data then fails: the quote binds the old bytes)."""
    copy = shutil.copytree(DATA / "bundle", tmp_path / "b")
    if edit is not None:
        m = json.loads((copy / "manifest.json").read_text())
        edit(m)
        (copy / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    return copy


# --- §2, §4: an optional member that is null is an absent one -------------------------------------------------------

@pytest.mark.parametrize("member", ["confidentiality", "op_chain", "signing", "lineage", "privacy", "evaluation"])
def test_a_null_optional_member_is_an_absent_one(tmp_path: Path, member: str, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _sample(tmp_path, lambda m: m.update({member: None}))
    _, checks = _verify(bundle, capsys=capsys)
    assert checks["manifest.schema"][0] == checks["bundle.files"][0] == checks["manifest.files"][0] == "pass"
    assert checks["audit.chain"][0] == "pass"  # op_chain null: no opening entry may name an op chain, none does
    from attestation.bundle import manifest as B

    m = B.Manifest.model_validate(json.loads((bundle / "manifest.json").read_text()))
    assert B.weights_file(m) == "adapter/adapter_model.safetensors" and getattr(m, member) is None


# --- §2, §12: GPU evidence without gpu ------------------------------------------------------------------------------

def _no_gpu(listed: bool) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m.pop("gpu")
        if not listed:
            m["files"].pop("gpu-evidence.json")
    return edit


def test_gpu_evidence_without_gpu_is_an_unexpected_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, checks = _verify(_sample(tmp_path, _no_gpu(listed=False)), capsys=capsys)
    assert rc == 1 and checks["bundle.files"] == ("fail", "unexpected file gpu-evidence.json")
    assert checks["manifest.schema"][0] == "pass" and checks["gpu.evidence"][0] == "skip"


def test_gpu_evidence_listed_without_gpu_fails_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, checks = _verify(_sample(tmp_path, _no_gpu(listed=True)), capsys=capsys)
    assert rc == 1 and checks["manifest.schema"][0] == "fail"


# --- §6: event_log.json hex ----------------------------------------------------------------------------------------

def _log_edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def edit(bundle: Path) -> None:
        log = json.loads((bundle / "event_log.json").read_text())
        for e in log:
            change(e)
        (bundle / "event_log.json").write_text(json.dumps(log))
    return edit


def test_event_log_hex_of_either_case_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _sample(tmp_path)
    _log_edit(lambda e: e.update(digest=e["digest"].upper(), event_payload=e["event_payload"].upper()))(bundle)
    rc, checks = _verify(bundle, capsys=capsys)
    assert rc == 0 and checks["event_log.replay"][0] == "pass"


LOG_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "0x prefix": lambda e: e.update(event_payload="0x" + e["event_payload"]),
    "whitespace": lambda e: e.update(event_payload=" ".join(e["event_payload"][i:i + 2] for i in range(0, len(e["event_payload"]), 2)) + " "),
    "imr true": lambda e: e.update(imr=True) if e["imr"] == 1 else None,
    "version 1.0": lambda e: e.update(version=1.0),
}


@pytest.mark.parametrize("name", sorted(LOG_CHANGES))
def test_event_log_fields_are_exactly_typed(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _sample(tmp_path)
    _log_edit(LOG_CHANGES[name])(bundle)
    rc, checks = _verify(bundle, capsys=capsys)
    assert rc == 1 and checks["event_log.parse"][0] == "fail", checks.get("event_log.parse")


@web_test
def test_the_page_reads_event_log_fields_alike(web_copy: Path) -> None:  # noqa: F811
    from attestation.errors import EventLogError
    from attestation.tdx.eventlog import parse_event_log
    from tests.test_web_units import call

    log = json.loads((DATA / "bundle" / "event_log.json").read_text())
    texts = [json.dumps([{**e, "digest": e["digest"].upper(), "event_payload": e["event_payload"].upper()} for e in log])]
    for change in LOG_CHANGES.values():
        edited = [dict(e) for e in log]
        for e in edited:
            change(e)
        texts.append(json.dumps(edited))
    for text, page in zip(texts, call(web_copy, *(("eventLog", [t]) for t in texts)), strict=True):
        try:
            parse_event_log(text)
        except EventLogError as exc:
            assert page == {"error": str(exc)}
        else:
            assert "error" not in page and page["replay"] == []


# --- §8: --parent that is not a directory ----------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--parent", "--chain"])
def test_a_parent_that_is_not_a_directory_is_an_input_error(tmp_path: Path, flag: str) -> None:
    archive = tmp_path / "parent.tar.gz"
    archive.write_bytes(b"\x1f\x8b")
    for parent in (archive, tmp_path / "missing"):
        args = ["verify", "--policy", str(POLICY), "--now", NOW]
        args += [flag, str(parent)] if flag == "--chain" else [str(DATA / "bundle"), flag, str(parent)]
        assert main(args) == 2, (flag, parent)


# --- §10: the prv mesh bound is "at most 2^22" -----------------------------------------------------------------------

def test_the_prv_mesh_may_have_exactly_2_to_the_22_points(monkeypatch: pytest.MonkeyPatch) -> None:
    from attestation.privacy import dp

    assert dp.PRV_MAX_POINTS == 2**22 == 4_194_304
    for points, refused in ((2.0**22, False), (2.0**22 + 0.5, True)):
        monkeypatch.setattr(dp, "prv_mesh_points", lambda _h, _d, points=points: points)
        assert bool(dp.history_problems("prv", [(1.0, 0.01, 100)], 1e-5)) is refused


# --- §12: labels, line breaks, whitespace and digits of the GPU evidence --------------------------------------------

def test_field_labels_and_line_breaks() -> None:
    from attestation.tdx.gpu import parse_fields

    assert parse_fields("==== :x\n  = x: y\na=b: c\n: none\nno colon\n") == {"a=b": "c"}
    # Python's str.splitlines(): \x85, \x1c and \u2028 end a line; \r\n is one break
    assert parse_fields("CC State: ON\x85CC Status: OFF\r\nDevTools Mode: on\u2028x\x1cEnv: P") == {
        "cc state": "ON", "cc status": "OFF", "devtools mode": "on", "env": "P"}
    # Python's str.isspace(): \x1f and \u3000 are whitespace; \ufeff is not
    assert parse_fields("\x1fCC\u3000 State\x1f:\u3000ON\x1f") == {"cc state": "ON"}
    assert parse_fields("\ufeffCC State: ON\ufeff") == {"\ufeffcc state": "ON\ufeff"}


def test_a_device_index_is_ascii_digits() -> None:
    from attestation.tdx.gpu import GpuEvidenceError, parse_query_gpu

    row = ", H100, GPU-1, 00000000:01:00.0, 550.54, 96.00"
    assert parse_query_gpu("0" + row)[0].index == 0
    for index in ("\u00b2", "\u0661", "-1", " "):
        with pytest.raises(GpuEvidenceError):
            parse_query_gpu(index + row)


def _odd_evidence() -> list[bytes]:
    """An H100's evidence with the CC captures written with the line breaks and whitespace JavaScript reads apart."""
    from tests import test_gpu_evidence as T

    out = []
    for status, devtools, query in (("CC status: OFF\x85CC status: ON\n", "DevTools Mode:\u3000OFF\x1f\n", None),
                                    ("\ufeffCC status: ON\n", "DevTools Mode: OFF\n", "CC State: ON\u2028Multi-GPU Mode : None\n"),
                                    ("CC status: ON\x1cCC status: OFF\n", " =DevTools Mode: ON\n", None)):
        cmds = [c for c in T._h100() if c["name"] not in ("cc-status", "cc-devtools", "cc-query")]
        cmds += [T._cmd("cc-status", status), T._cmd("cc-devtools", devtools),
                 T._cmd("cc-query", query) if query else T._cmd("cc-query", "", "error", 2)]
        out.append(T._evidence(cmds))
    out.append(T._evidence([T._cmd("query-gpu", "\u00b2, H100, GPU-1, 00000000:01:00.0, 550.54, 96.00\n")]))
    return out


def test_odd_gpu_captures_are_summarised_by_the_rule() -> None:
    from attestation.tdx import gpu as G

    first, bom, fs, digit = _odd_evidence()
    assert G.summarize(first).cc_mode == "on"  # the second line replaced the first; DevTools OFF after stripping
    assert G.summarize(bom).cc_mode == "on"  # "\ufeffcc status" is not "cc status": cc-query's state decides
    assert G.summarize(fs).cc_mode == "off"  # \x1c broke the line; " =DevTools" is skipped
    with pytest.raises(G.GpuEvidenceError):
        G.summarize(digit)


@web_test
def test_the_page_summarises_odd_gpu_captures_alike(web_copy: Path) -> None:  # noqa: F811
    from attestation.tdx import gpu as G
    from tests.test_web_units import call

    evidence = _odd_evidence()
    for data, page in zip(evidence, call(web_copy, *(("gpu", [d.decode()]) for d in evidence)), strict=True):
        try:
            info = G.summarize(data)
        except G.GpuEvidenceError as exc:
            assert page == {"error": str(exc)}
        else:
            assert page["summary"] == info.model_dump(mode="json")


# --- §13: the round manifest ---------------------------------------------------------------------------------------

def _round_doc(**fields: Any) -> dict[str, Any]:
    base = json.loads((DATA / "bundle" / "manifest.json").read_text())
    client = {"client": "c1", "run_id": "r1", "manifest_sha256": "2" * 64, "quote_sha256": "3" * 64,
              "adapter_sha256": "4" * 64, "trainable_tokens": 10, "weight": 1.0}
    return {"schema": "cvm-tune/round-manifest/v1", "federation_id": "fed", "round": 1, "nonce": "1" * 64,
            "created_at": "2026-01-01T00:00:00Z", "code": base["code"], "tee": base["tee"],
            "strategy": {"name": "fedavg", "params": {}}, "min_clients": 1, "global_adapter_in_sha256": None,
            "global_adapter_sha256": "a" * 64, "previous_round_sha256": None, "admitted": [client],
            "rejected": [], "files": {}, **fields}


ROUND_CASES: dict[str, tuple[dict[str, Any], bool]] = {
    "as written": ({}, True),
    "min_clients above admitted": ({"min_clients": 2}, False),
    "created_at any string": ({"created_at": "yesterday"}, True),
    "created_at not a string": ({"created_at": 1767225600}, False),
    "federation_id a path": ({"federation_id": "a/b"}, False),
    "federation_id dot first": ({"federation_id": ".fed"}, False),
    "federation_id 100 characters": ({"federation_id": "f" * 100}, True),
    "federation_id 101 characters": ({"federation_id": "f" * 101}, False),
    "tee without agent_rev": ({"tee": {k: v for k, v in _round_doc()["tee"].items() if k != "agent_rev"}}, False),
    "code with a member more": ({"code": {**_round_doc()["code"], "commit": "x"}}, False),
}


@pytest.mark.parametrize("name", sorted(ROUND_CASES))
def test_round_manifest_members(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    fields, valid = ROUND_CASES[name]
    round_dir = tmp_path / "round-1"
    round_dir.mkdir()
    (round_dir / "round-manifest.json").write_text(json.dumps(_round_doc(**fields)))
    rc, checks = _verify(round_dir, capsys=capsys)
    assert rc == 1 and checks["round.schema"][0] == ("pass" if valid else "fail"), checks["round.schema"]
    if name == "min_clients above admitted":
        assert "fewer than min_clients 2" in checks["round.schema"][1]


@web_test
def test_the_page_judges_round_manifests_alike(web_copy: Path) -> None:  # noqa: F811
    from tests.test_web_units import call

    names = sorted(ROUND_CASES)
    got = call(web_copy, *(("roundManifestProblem", [json.dumps(_round_doc(**ROUND_CASES[n][0]))]) for n in names))
    assert {n: p is None for n, p in zip(names, got, strict=True)} == {n: ROUND_CASES[n][1] for n in names}


def test_round_1_has_no_parent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from attestation.rounds.verify import check_round_link

    first, second = tmp_path / "round-1", tmp_path / "other-round-1"
    for d in (first, second):
        d.mkdir()
        (d / "round-manifest.json").write_text(json.dumps(_round_doc()))
    problems = check_round_link(second, first)
    assert any("previous_round_sha256" in p for p in problems) and any("does not follow" in p for p in problems)
    capsys.readouterr()
    assert main(["verify", str(second), "--policy", str(POLICY), "--now", NOW, "--parent", str(first)]) == 1


# --- §14: a malformed dataset header under --dataset ----------------------------------------------------------------

def _dataset(header: bytes | None = None, *, magic: bytes = b"CVMTDS\x00\x01", size: int | None = None) -> bytes:
    header = b'{"alg":"AES-256-GCM/HKDF-SHA256/STREAM-v1"}' if header is None else header
    return magic + (len(header) if size is None else size).to_bytes(4, "big") + header + bytes(64)


DATASETS: dict[str, tuple[bytes, str | None]] = {
    "names no recipients": (_dataset(), None),
    "names a recipient": (_dataset(b'{"metadata":{"cvm-tune.recipients":"age1' + b"q" * 58 + b'"}}'),
                          "the dataset's owner named 1 recipient(s) but the weights are in plaintext"),
    "not a dataset file": (b"PK\x03\x04" + bytes(60), "not a cvm-tune dataset file"),
    "format version 3": (_dataset(magic=b"CVMTDS\x00\x03"), "not a cvm-tune dataset file"),
    "header_len 0": (_dataset(b"", size=0), "header_len 0 is outside 1 to 65536"),
    "header_len past the end": (_dataset(size=1000), "the file ends inside its clear header"),
    "header_len over 64 KiB": (_dataset(size=65537), "header_len 65537 is outside 1 to 65536"),
    "header not JSON": (_dataset(b"{"), "dataset header is not valid JSON"),
    "header a list": (_dataset(b"[]"), "the header is not a JSON object"),
    "metadata a list": (_dataset(b'{"metadata":[]}'), "the header's metadata is not an object"),
    "recipients a list": (_dataset(b'{"metadata":{"cvm-tune.recipients":["age1"]}}'), "is not a string"),
    "recipients not age": (_dataset(b'{"metadata":{"cvm-tune.recipients":"ssh-ed25519 AAAA"}}'),
                           "is not an age X25519 recipient"),
}


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_a_malformed_dataset_header_fails_confidential_outputs(tmp_path: Path, name: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    raw, reason = DATASETS[name]
    dataset = tmp_path / "dataset.cvmds"
    dataset.write_bytes(raw)
    _, checks = _verify(DATA / "bundle", "--dataset", str(dataset), capsys=capsys)
    assert checks["dataset.file"][0] == "fail"  # not the file the run trained on, whatever its header
    if reason is None:
        assert "confidential.outputs" not in checks
    else:
        status, why = checks["confidential.outputs"]
        assert status == "fail" and reason in why, why

