"""The rules docs/verifier-spec.md states for a second implementation, each with its vector, run against the
product: the files a manifest must list (§2), MRCONFIGID forms (§3, its ``rule-vectors`` block), the audit entries'
run id and op-chain member (§4), null accuracies (§7), ``--parent`` without a manifest (§8), the prv mesh and PLD
interval formulas (§10), field labels (§12), ``round.parent`` (§13), the dataset file's clear header (§14).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
SPEC = ROOT / "docs" / "verifier-spec.md"


def _rule_vectors() -> list[dict[str, Any]]:
    text = SPEC.read_text(encoding="utf-8")
    blocks = re.findall(r"^```rule-vectors\n(.*?)^```", text, flags=re.S | re.M)
    return [json.loads(line) for block in blocks for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("v", _rule_vectors(), ids=lambda v: v["rule"])
def test_mr_config_id_rule_vectors(v: dict[str, Any]) -> None:
    from attestation.compose.app_compose import check_mr_config_id

    event = json.dumps(v["key_provider"]).encode() if v["key_provider"] is not None else None
    ok, why = check_mr_config_id(bytes.fromhex(v["mr_config_id"]), v["compose_hash"], v["app_id"], event)
    assert ("pass" if ok else "fail") == v["expect"], why


def test_the_rule_vectors_are_there() -> None:
    assert {v["rule"].split(".")[0] for v in _rule_vectors()} == {"3"} and len(_rule_vectors()) >= 5


def _required(m: dict[str, Any]) -> set[str]:
    """Section 2's formula, written from the spec alone."""
    def w(f: str) -> str:  # an encrypted weight file is listed as f.age (section 14)
        return f + ".age" if m.get("confidentiality") is not None and re.fullmatch(
            r"(adapter|merged)/[^/]+\.safetensors", f) else f

    out = {"adapter/adapter_config.json", w("adapter/adapter_model.safetensors"), "config.json", "app-compose.json",
           "README.md", "audit.jsonl"}
    if m.get("gpu") is not None:
        out.add("gpu-evidence.json")
    if {"report/report.json", "report/loss.png"} & set(m["files"]):
        out |= {"report/report.json", "report/loss.png"}
    out |= {f"{d}/model.sig" for d in ((m.get("signing") or {}).get("signed") or [])}
    out |= {k for k in m["files"] if re.fullmatch(r"(adapter|merged)/[A-Za-z0-9_][A-Za-z0-9._-]{0,199}", k)}
    return out


@pytest.mark.parametrize("bundle", ["bundle", "api-bundle"])
def test_the_files_a_manifest_must_list(bundle: str) -> None:
    from attestation.bundle import manifest as B

    doc = json.loads((DATA / bundle / "manifest.json").read_text())
    m = B.Manifest.model_validate(doc)
    assert _required(doc) == set(B.hashed_files(m)) == set(doc["files"])
    for extra in ("extra.txt", "adapter/sub/x", "report/other.png"):
        grown = {**doc, "files": {**doc["files"], extra: "0" * 64}}
        assert set(grown["files"]) != set(B.hashed_files(B.Manifest.model_validate(grown)))  # manifest.schema fails


def _confidential(doc: dict[str, Any], *, age: bool) -> dict[str, Any]:
    """The sample manifest as a confidential bundle's: a ``confidentiality`` block, the weights listed as ``.age``
    (``age=False``: under the plaintext name, as bundles made before the ``.age`` names were)."""
    recipient = "age13aqvttdk3ujkyjh9kg2w5an6dmy5mq5a84a4uxk3hfhnugfc9p0sy5p2wh"  # section 14's vector
    files = dict(doc["files"])
    weights = "adapter/adapter_model.safetensors"
    if age:
        files[weights + ".age"] = files.pop(weights)
    return {**doc, "files": files, "confidentiality": {"recipients": [recipient], "cvm_recipient": recipient,
                                                       "plaintext_sha256": {weights: "1" * 64}}}


def test_an_encrypted_bundle_lists_its_weights_as_age_and_an_older_layout_is_named() -> None:
    from attestation.bundle import manifest as B

    doc = _confidential(json.loads((DATA / "bundle" / "manifest.json").read_text()), age=True)
    m = B.Manifest.model_validate(doc)
    assert _required(doc) == set(B.hashed_files(m)) == set(doc["files"]) and B.files_problem(m) is None
    assert "adapter/adapter_model.safetensors.age" in doc["files"] and B.weights_file(m) == "adapter/adapter_model.safetensors.age"
    old = B.Manifest.model_validate(_confidential(json.loads((DATA / "bundle" / "manifest.json").read_text()), age=False))
    assert B.files_problem(old) == (
        "adapter/adapter_model.safetensors is listed under its plaintext name, but the weights are encrypted "
        "(confidentiality): a confidential bundle holds that file as age ciphertext named "
        "adapter/adapter_model.safetensors.age")
    both = B.Manifest.model_validate({**doc, "files": {**doc["files"], "adapter/adapter_model.safetensors": "0" * 64}})
    assert "is listed under its plaintext name" in (B.files_problem(both) or "")
    plain = B.Manifest.model_validate({k: v for k, v in doc.items() if k != "confidentiality"})
    assert B.files_problem(plain) == ("adapter/adapter_model.safetensors.age is an age ciphertext name, but the "
                                      "manifest has no confidentiality")


def _api_audit() -> tuple[list[Any], Any, bytes]:
    from attestation.bundle import manifest as B
    from attestation.bundle.audit import parse_lines

    root = DATA / "api-bundle"
    m = B.Manifest.model_validate(json.loads((root / "manifest.json").read_text()))
    return parse_lines((root / "audit.jsonl").read_bytes()), m, (root / "config.json").read_bytes()


def test_the_run_start_entry_commits_to_the_op_chain_block() -> None:
    import dataclasses

    from attestation.bundle.commitments import commitment_problems

    entries, m, config = _api_audit()
    assert commitment_problems(entries, m, config) == []
    start = entries[0]
    for change in ({"ops": 5}, {"head": "0" * 64}, {"lora": {**start.data["op_chain"]["lora"], "rank": 8}},
                   {"determinism": None, "dp": {"epsilon": 0.0}}):
        data = {**start.data, "op_chain": {**start.data["op_chain"], **change}}
        forged = [dataclasses.replace(start, data=data), *entries[1:]]
        assert any("another op chain" in p for p in commitment_problems(forged, m, config)), change
    none = [dataclasses.replace(start, data={k: v for k, v in start.data.items() if k != "op_chain"}), *entries[1:]]
    assert any("another op chain" in p for p in commitment_problems(none, m, config))
    # an op chain named by a run bundle's entry
    plain = m.model_copy(update={"op_chain": None})
    assert any("does not have" in p for p in commitment_problems(entries, plain, config))


def test_every_entry_carries_the_manifest_run_id(tmp_path: Path) -> None:
    from attestation import load_policy, verify_bundle
    from attestation.bundle import manifest as B

    doc = json.loads((DATA / "bundle" / "manifest.json").read_text())
    m = B.Manifest.model_validate(doc)
    copy = shutil.copytree(DATA / "bundle", tmp_path / "b")
    verdict = verify_bundle(copy, policy=load_policy(DATA / "bundle-policy.yaml"), now=1_900_000_000)
    assert next(c for c in verdict.checks if c.name == "audit.chain").status == "pass"
    from attestation.bundle.verify import _audit
    from attestation.verdict import QuoteFindings
    from attestation.bundle.audit import parse_lines
    import dataclasses

    entries = parse_lines((copy / "audit.jsonl").read_bytes())
    f = QuoteFindings()
    _audit(f, [entries[0], dataclasses.replace(entries[1], run_id="another-run"), *entries[2:]], (copy / "config.json").read_bytes(),
           m, load_policy(DATA / "bundle-policy.yaml"))
    assert "an entry belongs to another run" in f.checks[0].detail


def test_null_accuracies_mean_not_measured() -> None:
    from attestation.bundle.manifest import EvaluationInfo

    sft = EvaluationInfo(metric="loss", rows=4, candidate_loss=1.0, parent_loss=1.1, candidate_accuracy=None,
                         parent_accuracy=None, parent="the base model", max_regression=0.0, promote=True)
    assert sft.candidate_accuracy is None and EvaluationInfo.model_validate(
        {k: v for k, v in sft.model_dump().items() if "accuracy" not in k}).parent_accuracy is None


@pytest.mark.parametrize("kind", ["bundle", "round"])
def test_parent_without_a_manifest_is_exit_2_and_a_damaged_one_exit_1(tmp_path: Path, kind: str) -> None:
    from app.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    if kind == "bundle":
        child = DATA / "bundle"
        damaged = shutil.copytree(DATA / "bundle", tmp_path / "damaged")
        (damaged / "manifest.json").write_text("{")
    else:
        child = tmp_path / "round-2"
        child.mkdir()
        (child / "round-manifest.json").write_text("{}")
        damaged = tmp_path / "round-1"
        damaged.mkdir()
        (damaged / "round-manifest.json").write_text("{")
    common = ["--policy", str(DATA / "bundle-policy.yaml"), "--now", "1900000000"]
    assert main(["verify", str(child), *common, "--parent", str(empty)]) == 2
    assert main(["verify", str(child), *common, "--parent", str(damaged)]) == 1


@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), [(1.0, 0.01, 1000, 1e-5), (0.8, 0.1, 100, 1e-5),
                                                          (2.0, 0.001, 30000, 1e-9)])
def test_the_prv_mesh_and_pld_interval_formulas(sigma: float, q: float, steps: int, delta: float) -> None:
    """§10's formulas, written out from the spec with the product's RDP figure, equal the product's sizes."""
    from attestation.privacy.dp import prv_mesh_points
    from attestation.privacy.epsilon import PLD_INTERVAL, PLD_MAX_POINTS, prv_half_width, rdp_epsilon

    h = [(sigma, q, steps)]

    def half(d_err: float, e_err: float) -> float:
        return max(rdp_epsilon(h, d_err / 4), rdp_epsilon([(sigma, q, 1)], d_err / (8 * steps)), e_err) + 3

    d_err = delta / 1000
    assert half(d_err, 0.01) == prv_half_width(h, d_err, 0.01)
    mesh = 0.01 / math.sqrt(steps * math.log(12 / d_err) / 2)
    assert 2 * half(d_err, 0.01) / mesh + 1 == pytest.approx(prv_mesh_points(h, delta), rel=1e-12)
    assert max(1e-4, 2 * half(d_err, 0.01) / 2**21) == max(PLD_INTERVAL, 2 * prv_half_width(h, d_err, 0.01) / PLD_MAX_POINTS)


def test_field_labels_fold_whitespace() -> None:
    from attestation.tdx.gpu import parse_fields

    text = "  CC   Status :ON\n\tCC\u00a0State: off \n==== :x\n: nothing\nCC Status: OFF\nno colon here\n"
    assert parse_fields(text) == {"cc status": "OFF", "cc state": "off"}
    assert parse_fields("  CC   Status :ON") == {"cc status": "ON"}


def test_round_parent_rule(tmp_path: Path) -> None:
    from attestation.rounds.verify import check_round_link, round_digest

    base = json.loads((DATA / "bundle" / "manifest.json").read_text())

    def write(name: str, **fields: Any) -> Path:
        d = tmp_path / name
        d.mkdir()
        doc = {"schema": "cvm-tune/round-manifest/v1", "federation_id": "fed", "round": 1, "nonce": "1" * 64,
               "created_at": "2026-01-01T00:00:00Z", "code": base["code"], "tee": base["tee"],
               "strategy": {"name": "fedavg", "params": {}}, "min_clients": 1, "global_adapter_in_sha256": None,
               "global_adapter_sha256": "a" * 64, "previous_round_sha256": None,
               "admitted": [{"client": "c1", "run_id": "r1", "manifest_sha256": "2" * 64, "quote_sha256": "3" * 64,
                             "adapter_sha256": "4" * 64, "trainable_tokens": 10, "weight": 1.0}],
               "rejected": [], "files": {}, **fields}
        (d / "round-manifest.json").write_text(json.dumps(doc))
        return d

    prev = write("r1")
    digest = round_digest((prev / "round-manifest.json").read_bytes())
    good = write("r2", round=2, previous_round_sha256=digest, global_adapter_in_sha256="a" * 64)
    assert check_round_link(good, prev) == []
    for name, change in (("hash", {"previous_round_sha256": "9" * 64}), ("number", {"round": 3}),
                         ("federation", {"federation_id": "other"}), ("start", {"global_adapter_in_sha256": "b" * 64})):
        bad = write(f"bad-{name}", **{"round": 2, "previous_round_sha256": digest, "global_adapter_in_sha256": "a" * 64,
                                      **change})
        assert check_round_link(bad, prev) != [], name


def test_the_dataset_clear_header_is_as_the_spec_lays_it_out(tmp_path: Path) -> None:
    import hashlib
    import io

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from app.dataset.format import encrypt_stream

    out = io.BytesIO()
    owner = Ed25519PrivateKey.generate()
    recipient = "age1" + "q" * 58
    encrypt_stream(io.BytesIO(b'{"text": "x"}\n'), out, bytes(32), dataset_id="d", dataset_version=3,
                   metadata={"cvm-tune.recipients": recipient}, owner_key=owner)
    raw = out.getvalue()
    assert raw[:8] == b"CVMTDS\x00\x02"
    n = int.from_bytes(raw[8:12], "big")
    header = json.loads(raw[12:12 + n])
    assert raw[12:12 + n] == json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert set(header) == {"alg", "chunk_size", "salt", "content_type", "dataset_id", "dataset_version", "metadata"}
    assert header["alg"] == "AES-256-GCM/HKDF-SHA256/STREAM-v1" and header["metadata"]["cvm-tune.recipients"] == recipient
    trailer = raw[-176:]
    assert trailer[:8] == b"CVMTDSIG" and trailer[80:112].hex() == hashlib.sha256(raw[:-176]).hexdigest()
    assert int.from_bytes(trailer[40:48], "big") == 14 and trailer[48:80] == hashlib.sha256(b'{"text": "x"}\n').digest()
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    assert trailer[8:40] == owner.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    owner.public_key().verify(trailer[112:], b"cvm-tune/dataset-signature/v2\x00" + trailer[:112])
