"""The browser verifier against ``cvm-tune verify --json`` on federated round bundles (tests/test_web_verify.py has
the harness): the second round of a FedAvg federation (its clients started from the first round's global adapter) and
a round with secure aggregation (the updates and the global adapter age ciphertext; no identity given, so the
aggregate is not recomputed), both made by ``cvm-tune federated simulate``, and a tampered copy for every field of the
round manifest and every file of the round: the aggregator's attestation, the global adapter, the client bundles.
For each, the page's verdict and every check's name and status equal the Python verifier's.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from attestation.outputs import confidential as C
from tests.test_web_verify import (NOW, pytestmark, drive, packed_cases, python_verdict, same_checks, site,  # noqa: F401
                                   web_copy)

PLAIN, SECURE = "fedavg round 2", "secure aggregation"
AGE = "adapter/adapter_model.safetensors.age"
OTHER_RECIPIENT = C.recipient_of(C.identity_from_secret(bytes(range(32))))


def _simulate(out: Path, *extra: str) -> None:
    from app.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["federated", "simulate", "--out", str(out), "--clients", "2", "--max-steps", "1", *extra]) == 0


@pytest.fixture(scope="module")
def rounds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each kind of round bundle: name -> (round bundle, simulator policy)."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (requirements/test.txt)")
    made = {}
    for kind, args in ((PLAIN, ("--rounds", "2")), (SECURE, ("--rounds", "1", "--secure-aggregation"))):
        out = tmp_path_factory.mktemp("fed") / "sim"
        _simulate(out, *args)
        made[kind] = (sorted((out / "aggregator" / "output" / "rounds" / "simulation").glob("round-*"))[-1],
                      out / "simulator-test-policy.yaml")
    return made


def _manifest(change: Callable[[dict[str, Any]], None], rel: str = "round-manifest.json") -> Callable[[Path], None]:
    def edit(r: Path) -> None:
        m = json.loads((r / rel).read_bytes())
        change(m)
        (r / rel).write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    return edit


def _flip(rel: str, at: int, bit: int = 1) -> Callable[[Path], None]:
    def edit(r: Path) -> None:
        data = bytearray((r / rel).read_bytes())
        data[at] ^= bit
        (r / rel).write_bytes(bytes(data))
    return edit


def _weights(rel: str, at: int, bit: int) -> Callable[[Path], None]:
    """Flip a bit of the first tensor's data in a safetensors file (``at`` counts from the data's first byte)."""
    def edit(r: Path) -> None:
        header = struct.unpack("<Q", (r / rel).read_bytes()[:8])[0]
        _flip(rel, 8 + header + at, bit)(r)
    return edit


def _client_quote_padding(r: Path) -> None:
    q = r / "clients" / "owner-a"
    raw = (q / "quote.bin").read_bytes() + b"\0"
    (q / "quote.bin").write_bytes(raw)
    (q / "quote.hex").write_text(raw.hex() + "\n")


def _replace(rel: str, old: bytes, new: bytes) -> Callable[[Path], None]:
    def edit(r: Path) -> None:
        (r / rel).write_bytes((r / rel).read_bytes().replace(old, new, 1))
    return edit


def _first_admitted(**values: Any) -> Callable[[Path], None]:
    return _manifest(lambda m: m["admitted"][0].update(values))


def _symlink(r: Path) -> None:
    (r / "app-compose.json").unlink()
    (r / "app-compose.json").symlink_to("round-manifest.json")


def _plaintext_name(r: Path) -> None:
    (r / AGE).rename(r / AGE.removesuffix(".age"))
    _manifest(lambda m: m["files"].update({AGE.removesuffix(".age"): m["files"].pop(AGE)}))(r)


Z = "0" * 64
CASES: list[tuple[str, str, Callable[[Path], None] | None]] = [
    (PLAIN, "as exported", None),
    (PLAIN, "admitted weight", _manifest(lambda m: m["admitted"][0].update(weight=m["admitted"][0]["weight"] * 0.9))),
    (PLAIN, "trainable tokens", _manifest(lambda m: m["admitted"][0].update(
        trainable_tokens=m["admitted"][0]["trainable_tokens"] + 1))),
    (PLAIN, "client manifest hash", _first_admitted(manifest_sha256=Z)),
    (PLAIN, "client quote hash", _first_admitted(quote_sha256=Z)),
    (PLAIN, "client adapter hash", _first_admitted(adapter_sha256=Z)),
    (PLAIN, "client privacy", _first_admitted(privacy_epsilon=1.0, privacy_delta=1e-5)),
    (PLAIN, "client run id", _first_admitted(run_id="another-run")),
    (PLAIN, "client admitted twice", _manifest(lambda m: m["admitted"].append(m["admitted"][0]))),
    (PLAIN, "rejected list", _manifest(lambda m: m["rejected"].append({"client": "x", "node_id": 1, "reason": "y"}))),
    (PLAIN, "nonce", _manifest(lambda m: m.update(nonce="ab" * 32))),
    (PLAIN, "round number", _manifest(lambda m: m.update(round=3))),
    (PLAIN, "federation", _manifest(lambda m: m.update(federation_id="other"))),
    (PLAIN, "global adapter hash", _manifest(lambda m: m.update(global_adapter_sha256=Z))),
    (PLAIN, "global adapter in", _manifest(lambda m: m.update(global_adapter_in_sha256=Z))),
    (PLAIN, "previous round", _manifest(lambda m: m.update(previous_round_sha256=Z))),
    (PLAIN, "proximal mu", _manifest(lambda m: m["strategy"].update(params={"proximal_mu": 0.1}))),
    (PLAIN, "strategy fedyogi", _manifest(lambda m: m["strategy"].update(name="fedyogi"))),
    (PLAIN, "files map", _manifest(lambda m: m["files"].update({"app-compose.json": Z}))),
    (PLAIN, "files map entry added", _manifest(lambda m: m["files"].update({"extra.txt": Z}))),
    (PLAIN, "unknown member", _manifest(lambda m: m.update(extra=1))),
    (PLAIN, "global adapter weights", _weights("adapter/adapter_model.safetensors", 3, 0x40)),
    (PLAIN, "global adapter lowest bit", _weights("adapter/adapter_model.safetensors", 0, 1)),
    (PLAIN, "global adapter header", _replace("adapter/adapter_model.safetensors", b'"dtype":"F32"', b'"dtype":"F64"')),
    (PLAIN, "app-compose", _flip("app-compose.json", 3)),
    (PLAIN, "quote report_data", _flip("quote.bin", 600)),
    (PLAIN, "quote.hex", _flip("quote.hex", 8)),
    (PLAIN, "event log", _replace("event_log.json", b'"system-ready"', b'"system-ready2"')),
    (PLAIN, "collateral removed", lambda r: (r / "collateral.json").unlink()),
    (PLAIN, "client adapter", _weights("clients/owner-a/adapter/adapter_model.safetensors", 3, 0x40)),
    (PLAIN, "client manifest field", _manifest(lambda m: m["dataset"].update(rows=m["dataset"]["rows"] + 1),
                                               "clients/owner-a/manifest.json")),
    (PLAIN, "client quote padding", _client_quote_padding),
    (PLAIN, "client quote", _flip("clients/owner-b/quote.bin", 650)),
    (PLAIN, "client file added", lambda r: (r / "clients" / "owner-a" / "extra.bin").write_bytes(b"x")),
    (PLAIN, "client removed", lambda r: shutil.rmtree(r / "clients" / "owner-b")),
    (PLAIN, "client added", lambda r: shutil.copytree(r / "clients" / "owner-a", r / "clients" / "owner-z")),
    (PLAIN, "file added", lambda r: (r / "extra.txt").write_bytes(b"x")),
    (PLAIN, "global adapter removed", lambda r: (r / "adapter" / "adapter_model.safetensors").unlink()),
    (PLAIN, "empty folder", lambda r: (r / "extra").mkdir()),
    (PLAIN, "symlink", _symlink),
    (SECURE, "as exported", None),
    (SECURE, "global ciphertext stanza", _replace(AGE, b"-> X25519 ", b"-> X25518 ")),
    (SECURE, "global ciphertext body", _flip(AGE, -20)),
    (SECURE, "recipients", _manifest(lambda m: m["confidentiality"].update(
        recipients=sorted([*m["confidentiality"]["recipients"], OTHER_RECIPIENT])))),
    (SECURE, "aggregator recipient", _manifest(lambda m: m.update(aggregator_recipient=OTHER_RECIPIENT))),
    (SECURE, "plaintext hash", _manifest(lambda m: m["confidentiality"].update(plaintext_sha256=Z))),
    (SECURE, "global adapter under its plaintext name", _plaintext_name),
    (SECURE, "client ciphertext", _flip(f"clients/owner-a/{AGE}", -20)),
    (SECURE, "client confidentiality", _manifest(lambda m: m["confidentiality"].update(
        cvm_recipient=OTHER_RECIPIENT), "clients/owner-b/manifest.json")),
]
ACCEPTED = {f"{PLAIN}: as exported", f"{SECURE}: as exported", f"{PLAIN}: client quote padding"}


@pytest.fixture(scope="module")
def shown(rounds: dict[str, tuple[Path, Path]], site: Any, web_copy: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, dict[str, Any]]:
    """Each case as the page showed it (with the text of its round summary), and cvm-tune's verdict (``python``)."""
    pages, pythons = packed_cases(CASES, rounds, site, tmp_path_factory.mktemp("rounds"), "round")
    pages = [{**p, "text": "#result"} for p in pages]
    names = [f"{kind}: {name}" for kind, name, _ in CASES]
    return {n: {**p, "python": py} for n, p, py in zip(names, drive(web_copy, pages), pythons, strict=True)}


@pytest.mark.parametrize("case", [f"{kind}: {name}" for kind, name, _ in CASES])
def test_the_page_agrees_with_cvm_tune_verify(shown: dict[str, dict[str, Any]], case: str) -> None:
    page = shown[case]
    same_checks(page, page["python"], case)
    assert page["verdict"]["verdict"] == ("accepted" if case in ACCEPTED else "rejected")


def test_the_aggregate_is_recomputed_in_the_page_and_encrypted_updates_are_not_opened(
        shown: dict[str, dict[str, Any]]) -> None:
    def check(case: str, name: str) -> dict[str, str]:
        return next(c for c in shown[case]["verdict"]["checks"] if c["name"] == name)

    assert check(f"{PLAIN}: as exported", "round.aggregate")["status"] == "pass"
    assert check(f"{PLAIN}: global adapter weights", "round.aggregate")["status"] == "fail"
    assert check(f"{PLAIN}: global adapter lowest bit", "round.aggregate")["status"] == "pass"  # within allclose
    assert check(f"{PLAIN}: strategy fedyogi", "round.aggregate")["status"] == "skip"
    sealed = check(f"{SECURE}: as exported", "round.aggregate")
    assert sealed["status"] == "skip" and "does not decrypt" in sealed["reason"]
    assert check(f"{SECURE}: as exported", "round.confidential")["status"] == "pass"


def test_the_page_shows_the_round_admitted_rejected_and_aggregate(shown: dict[str, dict[str, Any]]) -> None:
    plain, secure = shown[f"{PLAIN}: as exported"]["text"], shown[f"{SECURE}: as exported"]["text"]
    assert "What the round says" in plain and "round2 of federation simulation" in plain
    assert "admitted2: owner-" in plain and "rejected0" in plain, plain
    assert "aggregatefedavg of 2 update(s) weighted by trainable tokens; global adapter sha256 " in plain
    assert "stored as age ciphertext to" in secure and "(secure aggregation)" in secure


def test_random_bit_flips_get_the_same_checks(rounds: dict[str, tuple[Path, Path]], web_copy: Path,
                                              tmp_path: Path) -> None:
    """One flipped bit in a file of either round or of a client bundle in it: the page's verifier, run by node on the
    modules it bundles, and cvm-tune verify give every check the same status (a fixed seed: reproducible)."""
    import random
    import subprocess

    rnd = random.Random(13)
    for kind, (bundle, policy) in rounds.items():
        every = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
        parsed = [p for p in every if p.rsplit("/", 1)[-1] in ("round-manifest.json", "manifest.json", "quote.bin",
                                                                "event_log.json", "adapter_model.safetensors")]
        flips = []
        for i in range(24):
            name = rnd.choice(parsed if i % 3 else every)
            flips.append((name, rnd.randrange((bundle / name).stat().st_size), 1 << rnd.randrange(8)))
        proc = subprocess.run(["node", str(web_copy / "test" / "mutate.mjs")], capture_output=True, text=True,
                              timeout=600, check=True, input=json.dumps(
                                  {"bundle": str(bundle), "policy": policy.read_text(), "now": NOW, "flips": flips}))
        for (name, at, bit), page in zip(flips, json.loads(proc.stdout), strict=True):
            copy = tmp_path / f"{name.replace('/', '-')}-{at}-{bit}" / bundle.name
            shutil.copytree(bundle, copy)
            _flip(name, at, bit)(copy)
            assert page == [[c["name"], c["status"]] for c in python_verdict(copy, policy)[0]["checks"]], (
                kind, name, at, bit)
            shutil.rmtree(copy.parent)
