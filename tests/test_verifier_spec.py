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


def keccak256(data: bytes) -> bytes:
    """Original Keccak-256 (pycryptodome's, not hashlib's SHA3-256)."""
    from Crypto.Hash import keccak

    return keccak.new(digest_bits=256, data=data).digest()


def collateral_window(c: dict) -> str:
    """Section 11's window, with the cryptography package's X.509 parsers only."""
    from datetime import datetime, timezone

    from cryptography import x509

    def ts(text: str) -> int:
        return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp())

    starts, ends = [], []
    for key in ("tcb_info", "qe_identity"):
        inner = json.loads(c[key])
        starts.append(ts(inner["issueDate"]))
        ends.append(ts(inner["nextUpdate"]))
    for key in ("root_ca_crl", "pck_crl"):
        crl = x509.load_der_x509_crl(bytes.fromhex(c[key]))
        starts.append(int(crl.last_update_utc.timestamp()))
        if crl.next_update_utc is not None:
            ends.append(int(crl.next_update_utc.timestamp()))
    for key in ("pck_crl_issuer_chain", "tcb_info_issuer_chain", "qe_identity_issuer_chain", "pck_certificate_chain"):
        for cert in x509.load_pem_x509_certificates(c[key].encode()) if c.get(key) else []:
            starts.append(int(cert.not_valid_before_utc.timestamp()))
            ends.append(int(cert.not_valid_after_utc.timestamp()))

    def iso(t: int) -> str:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    return f"{iso(max(starts))}..{iso(min(ends))}"


def read(rel: str, root: Path = BUNDLE) -> bytes:
    return (root / rel).read_bytes()


def recompute(root: Path = BUNDLE) -> dict[str, str]:
    def read(rel: str) -> bytes:  # noqa: F811  (the bundle at ``root``)
        return (root / rel).read_bytes()

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
    boot = {e["event"]: bytes.fromhex(e["event_payload"]) for e in json.loads(read("event_log.json"))
            if e["imr"] == 3 and e["event"] in ("app-id", "key-provider")}
    provider = json.loads(boot["key-provider"])
    kind = {"none": 0, "local": 1, "local-sgx": 1, "kms": 2, "tpm": 3}[provider["name"]]
    v2 = keccak256(compose + boot["app-id"] + bytes([kind]) + bytes.fromhex(provider.get("id") or ""))
    gpu_entry = [json.loads(x) for x in lines if json.loads(x)["type"] == "gpu.evidence"][-1]
    return {
        "collateral_window": collateral_window(json.loads(read("collateral.json"))),
        "gpu_evidence_sha256": hashlib.sha256(read("gpu-evidence.json")).hexdigest(),
        "gpu_nonce": gpu_entry["prev"] if json.loads(read("gpu-evidence.json"))["nonce"] == gpu_entry["prev"] else "",
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        "mr_config_id_v2_kms": (b"\x02" + v2 + bytes(15)).hex(),
        "base_model_tree": hashlib.sha256(canonical(m["base_model"]["files"])).hexdigest(),
        "owner_key_id_of_bytes_0_to_31": hashlib.sha256(bytes(range(32))).hexdigest(),
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
    from attestation.bundle.manifest import manifest_report_data
    from attestation.tdx.eventlog import parse_event_log, replay
    from attestation.io.hashing import files_digest

    v = spec_vectors()
    assert manifest_report_data(read("manifest.json")).hex() == v["report_data"]
    assert files_digest({p: hashlib.sha256(read(p)).hexdigest() for p in ARTIFACTS}) == v["export_artifacts_sha256"]
    assert replay(parse_event_log(read("event_log.json"))).rtmrs[3].hex() == v["rtmr3"]


@pytest.mark.parametrize("rel", ["manifest.json", "audit.jsonl", "app-compose.json", "event_log.json", "config.json",
                                 "gpu-evidence.json", "collateral.json", "adapter/adapter_model.safetensors"])
def test_the_vectors_depend_on_every_file_they_are_computed_from(tmp_path: Path, rel: str) -> None:
    """The vector test can fail: one changed byte in any input file changes at least one recomputed vector, so a
    spec whose vectors drifted from the sample would be caught."""
    import shutil

    copy = shutil.copytree(BUNDLE, tmp_path / "bundle")
    f = copy / rel
    raw = bytearray(f.read_bytes())
    if rel == "collateral.json":  # what its vector reads: the validity window
        raw = bytearray(bytes(raw).replace(b"2099-01-01", b"2098-01-01"))
    elif rel.endswith(".json") or rel.endswith(".jsonl"):  # still valid JSON: change one digit of a hash or number
        i = next(i for i in range(len(raw) - 1, 0, -1) if chr(raw[i]) in "0123456789abcdef" and chr(raw[i - 1]) in "0123456789abcdef")
        raw[i] = ord("1") if raw[i] != ord("1") else ord("2")
    else:
        raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    try:
        changed = recompute(copy)
    except (ValueError, KeyError, StopIteration):
        return  # no longer parses: a mismatch by any standard
    assert changed != spec_vectors(), rel


def test_keccak_is_not_sha3() -> None:
    """The MRCONFIGID v2 vector would also fail with NIST SHA3-256 (a common slip)."""
    assert keccak256(b"").hex() == "c5d2460186f7233c927e7db2dcc703c0e500b653ca82273b7bfad8045d85a470"
    assert keccak256(b"") != hashlib.sha3_256(b"").digest()


def test_product_agrees_on_mr_config_id_v2_and_the_tree() -> None:
    from attestation.compose.app_compose import check_mr_config_id
    from attestation.tdx.eventlog import boot_info, parse_event_log
    from attestation.io.hashing import files_digest

    v = spec_vectors()
    boot = boot_info(parse_event_log(read("event_log.json"))).values
    ok, _ = check_mr_config_id(bytes.fromhex(v["mr_config_id_v2_kms"]), v["compose_hash"], boot["app-id"].hex(),
                               boot["key-provider"])
    assert ok
    assert files_digest(json.loads(read("manifest.json"))["base_model"]["files"]) == v["base_model_tree"]
    from attestation.tdx.dcap import parse_collateral
    from attestation.tdx.gpu import summarize
    from attestation.verdict import iso_utc

    c = parse_collateral(read("collateral.json"))
    assert f"{iso_utc(c.not_before)}..{iso_utc(c.not_after)}" == v["collateral_window"]
    gpu = summarize(read("gpu-evidence.json")).model_dump(mode="json")
    assert gpu == json.loads(read("manifest.json"))["gpu"] and gpu["evidence_sha256"] == v["gpu_evidence_sha256"]


@pytest.mark.parametrize("member, value, accepted", [("dataset_id", "cvm-tune-sample", True),
                                                     ("dataset_version", 1, True),
                                                     ("dataset_id", "another-dataset", False),
                                                     ("dataset_version", 2, False)])
def test_an_opening_entry_naming_another_dataset_version_is_refused(member: str, value: object, accepted: bool) -> None:
    from attestation.bundle.audit import parse_entry
    from attestation.bundle.manifest import Manifest
    from attestation.bundle.commitments import commitment_problems

    m = Manifest.model_validate_json(read("manifest.json"))
    entries = [parse_entry(line) for line in read("audit.jsonl").split(b"\n")[:-1]]
    assert commitment_problems(entries, m, read("config.json")) == []
    entries[0].data[member] = value
    assert (commitment_problems(entries, m, read("config.json")) == []) == accepted


def test_td_attributes_rule_matches_the_sample_quotes_and_the_product() -> None:
    from attestation.tdx.quote import Quote

    q = Quote.from_bytes(read("quote.bin"))
    assert q.td.td_attributes_u64 & 0x7FFFFFFF3FFFFFFF == 0x10000000 and q.td.attribute_problems() == []
    for bit in (0, 1, 7):  # what cvm-tune checks itself
        assert (q.td.td_attributes_u64 | 1 << bit) & 0x7FFFFFFF3FFFFFFF != 0x10000000
