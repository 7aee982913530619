"""docs/verifier-spec.md's test vectors, recomputed from the committed sample bundle.

An independent implementation of each formula as the spec states it (hashlib and json only; nothing from
``attestation``), so a wrong sentence or a wrong vector in the spec fails here; then the same values are checked
against the quote and the verifier, so the spec cannot drift from the product.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "verifier-spec.md"
BUNDLE = ROOT / "tests" / "data" / "bundle"
RUNTIME_EVENT_TYPE = 0x08000001
ARTIFACTS = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "config.json", "app-compose.json",
             "README.md")
BODY = 48  # TD report body offset in a v4 quote


def spec_vectors() -> dict[str, str]:
    text = SPEC.read_text(encoding="utf-8")
    out: dict[str, str] = {}
    for block in re.findall(r"^```vectors\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            name, sep, value = line.partition(" = ")
            assert sep, f"bad vector line {line!r}"
            assert name not in out, f"vector {name} given twice"
            out[name] = value.strip()
    return out


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def read(rel: str) -> bytes:
    return (BUNDLE / rel).read_bytes()


def recompute() -> dict[str, str]:
    manifest = read("manifest.json")
    m = json.loads(manifest)
    lines = read("audit.jsonl").split(b"\n")
    assert lines[-1] == b"", "audit.jsonl ends with a newline"
    lines = lines[:-1]
    artifacts = {p: hashlib.sha256(read(p)).hexdigest() for p in ARTIFACTS}
    compose = hashlib.sha256(read("app-compose.json")).digest()

    def runtime_digest(e: dict) -> bytes:
        payload = bytes.fromhex(e["event_payload"])
        if e.get("version", 1) == 2:
            return hashlib.sha384(canonical({"name": e["event"], "payload": payload.hex(), "type": RUNTIME_EVENT_TYPE})).digest()
        return hashlib.sha384(RUNTIME_EVENT_TYPE.to_bytes(4, "little") + b":" + e["event"].encode() + b":" + payload).digest()

    rtmr3, export_digest = bytes(48), None
    for e in json.loads(read("event_log.json")):
        if e["imr"] != 3:
            continue
        assert e["event_type"] == RUNTIME_EVENT_TYPE
        d = runtime_digest(e)
        if e["event"] == "cvm-tune.export":
            export_digest = d
        rtmr3 = hashlib.sha384(rtmr3 + d).digest()
    return {
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        "report_data": hashlib.sha512(b"cvm-tune-manifest-v1:" + manifest).hexdigest(),
        "config_json_sha256": hashlib.sha256(read("config.json")).hexdigest(),
        "compose_hash": compose.hex(),
        "mr_config_id": (b"\x01" + compose + bytes(15)).hex(),
        "audit_first_seq": str(json.loads(lines[0])["seq"]),
        "audit_start_prev": json.loads(lines[0])["prev"],
        "audit_line0_sha256": hashlib.sha256(lines[0]).hexdigest(),
        "audit_line0_with_newline_sha256": hashlib.sha256(lines[0] + b"\n").hexdigest(),
        "audit_head": hashlib.sha256(lines[-1]).hexdigest(),
        "export_artifacts_input": canonical(dict(sorted(artifacts.items()))).decode(),
        "export_artifacts_sha256": hashlib.sha256(canonical(dict(sorted(artifacts.items())))).hexdigest(),
        "export_event_digest": export_digest.hex() if export_digest else "",
        "rtmr3": rtmr3.hex(),
    }


def test_every_vector_is_recomputed() -> None:
    assert spec_vectors() == recompute()


@pytest.fixture(scope="module")
def v() -> dict[str, str]:
    return spec_vectors()


def test_vectors_agree_with_the_bundle_and_quote(v) -> None:
    m = json.loads(read("manifest.json"))
    quote = read("quote.bin")
    lines = read("audit.jsonl").split(b"\n")[:-1]
    entries = [json.loads(x) for x in lines]
    assert quote[BODY + 520:BODY + 584].hex() == v["report_data"]
    assert quote[BODY + 472:BODY + 520].hex() == v["rtmr3"]
    assert quote[BODY + 184:BODY + 232].hex() == v["mr_config_id"]
    assert m["tee"]["compose_hash"] == v["compose_hash"]
    assert m["files"]["config.json"] == v["config_json_sha256"]
    assert m["audit"]["start_prev"] == v["audit_start_prev"] != "0" * 64  # a slice, not the chain's start
    assert str(m["audit"]["first_seq"]) == v["audit_first_seq"]
    assert m["audit"]["head"] == v["audit_head"] and m["audit"]["entries"] == len(entries)
    assert entries[1]["prev"] == v["audit_line0_sha256"] != v["audit_line0_with_newline_sha256"]
    assert all(b["prev"] == hashlib.sha256(a).hexdigest() for a, b in zip(lines, entries[1:]))
    assert entries[-1]["type"] == "export" and entries[-1]["data"]["artifacts_sha256"] == v["export_artifacts_sha256"]
    assert all(canonical(e) == line for e, line in zip(entries, lines))  # one byte form per entry


def test_files_list_is_exactly_the_spec_list() -> None:
    m = json.loads(read("manifest.json"))
    on_disk = {p.relative_to(BUNDLE).as_posix() for p in BUNDLE.rglob("*") if p.is_file()}
    unhashed = {"manifest.json", "quote.bin", "quote.hex", "event_log.json", "collateral.json"}
    assert set(m["files"]) == on_disk - unhashed
    assert all(m["files"][p] == hashlib.sha256(read(p)).hexdigest() for p in m["files"])
    assert read("quote.hex").decode().strip() == read("quote.bin").hex()


def test_product_verifier_agrees_with_the_spec() -> None:
    from attestation.bundle import manifest_report_data
    from attestation.eventlog import parse_event_log, replay
    from attestation.hashing import files_digest

    v = spec_vectors()
    assert manifest_report_data(read("manifest.json")).hex() == v["report_data"]
    assert files_digest({p: hashlib.sha256(read(p)).hexdigest() for p in ARTIFACTS}) == v["export_artifacts_sha256"]
    assert replay(parse_event_log(read("event_log.json"))).rtmrs[3].hex() == v["rtmr3"]


def test_a_wrong_vector_is_caught() -> None:
    vectors = spec_vectors()
    for name in vectors:
        bad = dict(vectors, **{name: vectors[name][:-1] + ("0" if vectors[name][-1] != "0" else "1")})
        assert bad != recompute()
